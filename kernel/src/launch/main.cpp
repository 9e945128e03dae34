// cellblock-kernel: a Jupyter kernel (xeus 2.4.1) that runs Python in a confined, persistent worker.
//
//   cellblock-kernel --config <share>/cellblock/kernel-config.json -f <connection file>
//
// Threads: main runs the kernel server's I/O loop (kernel_server.hpp: every public socket, control
// dispatched there), the interpreter runs shell requests on the server's interpreter thread, the
// supervisor launches workers, the signal router takes SIGINT/SIGTERM, and with a network policy the egress
// client's thread relays the egress helper process (which serves each worker's loopback listener) to IOPub
// through the server's I/O loop.
//
// Exit status: 0 after shutdown_request, SIGTERM or SIGQUIT; 1 when start-up failed; 3
// (lease_expired_exit_status) when the orphan lease ran out (CELLBLOCK_LEASE_S; see kernel/README.md).
#include <fcntl.h>
#include <openssl/crypto.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <iostream>
#include <iterator>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>
#include <xeus/xkernel.hpp>
#include <xeus/xkernel_configuration.hpp>

#include "cellblock/contract/environment.hpp"
#include "cellblock/sandbox/sandbox.hpp"
#include "common/logging.hpp"
#include "egress/egress_client.hpp"
#include "egress/network_approvals.hpp"
#include "launch/heap_policy.hpp"
#include "launch/kernel_config.hpp"
#include "launch/launch_report.hpp"
#include "launch/runtime_dir.hpp"
#include "launch/scheduling.hpp"
#include "launch/signal_router.hpp"
#include "launch/template_service.hpp"
#include "server/connection_info.hpp"
#include "server/history_manager.hpp"
#include "server/kernel_server.hpp"
#include "server/lease.hpp"
#include "server/outbound_record.hpp"
#include "server/python_interpreter.hpp"
#include "worker/worker_supervisor.hpp"

extern char** environ;

namespace cellblock::kernel {
namespace {

constexpr const char* cellblock_version = CELLBLOCK_VERSION;
// No gateway renewed the lease: the kernel stopped itself (and cleaned up). Distinct so that whoever reaps
// the kernel (a gateway that came back too late, systemd) can tell it from a crash or a shutdown.
constexpr int lease_expired_exit_status = 3;

// "3.11.2" from `python --version`.
std::string probe_python_version(const std::filesystem::path& python) {
    std::array<int, 2> pipe_fds{};
    if (::pipe2(pipe_fds.data(), O_CLOEXEC) != 0) {
        return "3";
    }
    UniqueFd read_end(pipe_fds[0]), write_end(pipe_fds[1]);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, write_end.get(), STDOUT_FILENO);
    posix_spawnattr_t attributes;
    posix_spawnattr_init(&attributes);
    sigset_t none;
    sigemptyset(&none);
    posix_spawnattr_setsigmask(&attributes, &none);
    posix_spawnattr_setflags(&attributes, POSIX_SPAWN_SETSIGMASK);
    const std::string program = python.string();
    std::array<char*, 3> argv = {const_cast<char*>(program.c_str()), const_cast<char*>("--version"), nullptr};
    std::array<char*, 1> envp = {nullptr};
    pid_t pid = 0;
    const int failed = posix_spawn(&pid, program.c_str(), &actions, &attributes, argv.data(), envp.data());
    posix_spawn_file_actions_destroy(&actions);
    posix_spawnattr_destroy(&attributes);
    write_end.reset();
    std::string output;
    if (failed == 0) {
        std::array<char, 256> buffer{};
        ssize_t got = 0;
        while ((got = ::read(read_end.get(), buffer.data(), buffer.size())) > 0) {
            output.append(buffer.data(), got);
        }
        int status = 0;
        while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
        }
    }
    // "Python 3.11.2\n"
    const auto space = output.find(' ');
    if (space == std::string::npos) {
        return "3";
    }
    std::string version = output.substr(space + 1);
    while (!version.empty() && (version.back() == '\n' || version.back() == '\r')) {
        version.pop_back();
    }
    return version.empty() ? "3" : version;
}

// The one way out after start-up: it is taken from whichever thread decided it (the server's I/O thread on
// shutdown_request or lease expiry, the signal thread on SIGTERM) while the interpreter thread may be
// inside a cell, so nothing is unwound: the kernel releases the worker and its directories explicitly and
// leaves with _exit.
class ExitPath {
  public:
    ExitPath(WorkerSupervisor& supervisor, std::optional<PrivateDirectory>& workspace,
             PrivateDirectory& runtime)
        : supervisor_(supervisor), workspace_(workspace), runtime_(runtime) {}

    // `also_remove`: a directory tree to remove once the worker is gone (the lease's cleanup directory).
    [[noreturn]] void leave(int code,
                            const std::optional<std::filesystem::path>& also_remove = std::nullopt) {
        std::call_once(once_, [&] {
            supervisor_.shutdown();
            if (workspace_) {
                workspace_->remove();
            }
            runtime_.remove();
            if (also_remove) {
                remove_cleanup_dir(*also_remove);
            }
        });
        ::_exit(code);
    }

  private:
    static void remove_cleanup_dir(const std::filesystem::path& directory) noexcept {
        try {
            sandbox::remove_tree(directory);
            log_event(LogLevel::warning, "lease_cleanup_removed", {{"path", directory.string()}});
        } catch (const std::exception& error) {
            log_event(LogLevel::error, "lease_cleanup_failed",
                      {{"path", directory.string()}, {"error", error.what()}});
        }
    }

    WorkerSupervisor& supervisor_;
    std::optional<PrivateDirectory>& workspace_;
    PrivateDirectory& runtime_;
    std::once_flag once_;
};

// Where the egress proxy listens inside each worker's network namespace (kernel/README.md "Network policy").
constexpr std::uint16_t egress_proxy_port = 3128;

// The egress helper (egress/egress_client.hpp): installed beside this executable, run as the uid just below
// the range the sandbox hands to sessions, so it shares no uid with a worker nor with the kernel.
egress::HelperSpec egress_helper_spec(const KernelConfig& config) {
    egress::HelperSpec helper;
    helper.program = std::filesystem::read_symlink("/proc/self/exe").parent_path() / "cellblock-egress";
    const auto sandbox_policy = sandbox::Policy::load(config.sandbox_policy);
    helper.uid = sandbox_policy.uid_first - 1;
    helper.gid = sandbox_policy.uid_first - 1;
    helper.policy = *config.network_policy;
    if (config.egress_hosts) {
        std::ifstream file(*config.egress_hosts, std::ios::binary);
        helper.hosts.assign(std::istreambuf_iterator<char>(file), std::istreambuf_iterator<char>());
        helper.hosts_origin = config.egress_hosts->string();
    }
    return helper;
}

// The worker's environment with a network policy: every standard client goes through the proxy (names
// are resolved there: there is no resolver inside), and nothing bypasses it.
std::vector<std::string> egress_proxy_environment() {
    const std::string proxy = "http://127.0.0.1:" + std::to_string(egress_proxy_port);
    return {"HTTP_PROXY=" + proxy, "HTTPS_PROXY=" + proxy,
            "http_proxy=" + proxy, "https_proxy=" + proxy,
            "NO_PROXY=",           "no_proxy="};
}

// How long a reported launch waits for the registry to accept its report before the kernel gives up.
constexpr auto launch_report_timeout = std::chrono::seconds(30);

// `report`: no connection file; bind ephemeral TCP ports on the interface towards the registry, serve them
// over CurveZMQ and report them (launch_report.hpp). Otherwise the connection file says everything.
int run_kernel(const std::filesystem::path& config_file, const std::filesystem::path& connection_file,
               const std::optional<ReportTarget>& report) {
    const auto environment = KernelConfig::process_environment();
    const KernelConfig config = KernelConfig::load(config_file, environment);
    const auto variable = [&environment](const char* name) { return environment(name); };
    const auto record_bytes = variable("CELLBLOCK_RECORD_BYTES");
    const auto record_messages = variable("CELLBLOCK_RECORD_MESSAGES");
    const auto lease = variable("CELLBLOCK_LEASE_S");
    ServerOptions server_options;
    server_options.record = RecordLimits::from_environment(
        record_bytes ? record_bytes->c_str() : nullptr, record_messages ? record_messages->c_str() : nullptr);
    server_options.lease = Lease::duration_from_environment(lease ? lease->c_str() : nullptr);
    std::optional<std::filesystem::path> lease_cleanup_dir;
    if (const auto cleanup = variable("CELLBLOCK_LEASE_CLEANUP_DIR"); cleanup && server_options.lease) {
        lease_cleanup_dir = std::filesystem::path(*cleanup);
    }
    std::optional<CurveKeyPair> curve_keys;
    ConnectionInfo connection;
    if (report) {
        connection = ephemeral_connection(local_address_towards(report->endpoint));
        curve_keys = make_curve_keypair();
        server_options.curve_secret_key = curve_keys->secret_key;
    } else {
        connection = ConnectionInfo::load(connection_file);
    }

    std::optional<PrivateDirectory> own_workspace;
    std::filesystem::path workspace;
    if (config.workspace) {
        workspace = *config.workspace;
        std::filesystem::create_directories(workspace);
    } else {
        try {
            std::filesystem::create_directories(config.workspace_root);
            own_workspace.emplace(config.workspace_root, "kernel-");
        } catch (const std::exception& error) {
            log_event(LogLevel::info, "workspace_root_unusable",
                      {{"path", config.workspace_root.string()}, {"error", error.what()}});
            own_workspace.emplace(std::filesystem::temp_directory_path(), "cellblock-workspace-");
        }
        workspace = own_workspace->path();
    }
    server_options.workspace = workspace;  // the files the gateway's file API reaches (workspace_files.hpp)
    // The kernel's runtime directory: its owner marker lets a later kernel clean up after one that was
    // SIGKILLed (sweep_abandoned_kernel_dirs).
    PrivateDirectory runtime("/tmp", "cbk-");

    InterpreterSettings settings;
    settings.limits = config.limits;
    settings.identity = {cellblock_version, "3"};
    settings.probed_python_version =
        std::async(std::launch::async, probe_python_version, config.python).share();
    const auto worker_start_timeout =
        std::chrono::milliseconds(static_cast<long long>(config.worker_start_timeout_s * 1000));
    // An execute waits a little longer than the launch itself, so the launcher's error (with the worker's
    // own output) is the one reported, not a bare "did not start".
    settings.worker_start_timeout = worker_start_timeout + std::chrono::seconds(5);

    // With a network policy: one egress helper process (restarted if it dies), serving each worker's listener
    // in turn (a relaunched worker has a new network namespace, so a new listener). Declared before the
    // supervisor, which hands it listeners from its thread; approvals before the proxy, which calls them.
    NetworkApprovals approvals;
    std::optional<egress::EgressClient> proxy;
    WorkerLaunchSpec spec;
    if (config.network_policy) {
        auto policy = egress::EgressPolicy::parse(*config.network_policy);
        auto pinned =
            config.egress_hosts ? egress::PinnedHosts::load(*config.egress_hosts) : egress::PinnedHosts();
        log_event(LogLevel::info, "egress_policy",
                  {{"allow", policy.describe_allowlist()},
                   {"ceiling", policy.describe_ceiling()},
                   {"ports", policy.describe_ports()},
                   {"ask", policy.ask()}});
        // Parsed here too so that a bad policy or hosts file stops the kernel before anything starts.
        static_cast<void>(pinned);
        proxy.emplace(egress_helper_spec(config), approvals, approvals,
                      [&approvals](const std::string& text) { approvals.on_helper_crashed(text); });
        proxy->start();
        spec.environment = egress_proxy_environment();
        spec.loopback_service = WorkerLaunchSpec::LoopbackService{
            egress_proxy_port, [&proxy](UniqueFd listener) { proxy->serve(std::move(listener)); }};
    }
    spec.python = config.python;
    spec.worker_script = config.worker_script;
    spec.policy_file = config.sandbox_policy;
    spec.workspace = workspace;
    spec.memory_bytes = config.limits.memory_mb * 1024 * 1024;
    spec.ready_timeout = worker_start_timeout;
    if (config.zygote.active()) {
        spec.zygote = WorkerLaunchSpec::Zygote{
            TemplateSpec{config.zygote.tenant, config.zygote.library, config.zygote.template_environment()},
            config.zygote.supervised};
    }
    WorkerSupervisor supervisor(spec);
    ExitPath exit_path(supervisor, own_workspace, runtime);

    auto history = std::make_unique<HistoryManager>();
    HistoryManager& history_ref = *history;
    RequestControls controls;
    auto interpreter = std::make_unique<PythonInterpreter>(supervisor, history_ref, controls, settings);
    PythonInterpreter& interpreter_ref = *interpreter;

    // The public sockets are bound here, before xeus or the worker starts (a port in use fails fast).
    auto owned_server = std::make_unique<KernelServer>(
        connection,
        ServerActions{
            [&controls](const std::vector<std::string>& unanswered) { controls.interrupt(unanswered); },
            [&exit_path] { exit_path.leave(0); },
            [&exit_path, &lease_cleanup_dir](std::chrono::duration<double>) {
                exit_path.leave(lease_expired_exit_status, lease_cleanup_dir);
            },
            [&controls](const std::string& msg_id, const nlohmann::json& metadata) {
                controls.post_options(msg_id, parse_execute_options(metadata));
            },
            proxy ? std::function<nlohmann::json(const nlohmann::json&)>(
                        [&approvals](const nlohmann::json& content) { return approvals.decide(content); })
                  : nullptr},
        server_options);
    KernelServer& server = *owned_server;
    xeus::xconfiguration xeus_config;
    xeus_config.m_transport = connection.transport;
    xeus_config.m_ip = connection.ip;
    xeus_config.m_signature_scheme = connection.signature_scheme;
    xeus_config.m_key = connection.key;
    xeus::xkernel kernel(xeus_config, xeus::get_user_name(),
                         std::make_unique<ServerHandoff>(std::move(owned_server)), std::move(interpreter),
                         ServerHandoff::take, std::move(history), nullptr, xeus::make_null_debugger,
                         nl::json::object(), nl::json::error_handler_t::replace);

    // The proxy's events and approvals go out on IOPub through the server's I/O thread (it owns the
    // public socket). Disconnected before the server goes.
    // Held for its destructor (it disconnects); the analyzer sees only a value that is never read.
    // NOLINTNEXTLINE(clang-analyzer-deadcode.DeadStores)
    const auto published = approvals.connect([&server](std::string msg_type, nlohmann::json content) {
        server.publish_kernel_message(std::move(msg_type), std::move(content));
    });
    interpreter_ref.set_input_releaser([&server] { server.interrupt_pending_input(); });
    // Only now, with every socket bound, start the worker (so a bad port fails fast and leaves nothing).
    supervisor.start();
    SignalRouter signals(
        [&controls, &server] {
            controls.interrupt({});
            server.interrupt_pending_input();
        },
        [&exit_path, &server](int) {
            server.stop();  // first, so that nothing the exit causes (a killed worker's reply) goes out
            exit_path.leave(0);
        });

    // Clean up after kernels that were SIGKILLed (their runtime dir and private workspace stayed behind).
    write_owner_marker(runtime.path(), own_workspace ? own_workspace->path() : std::filesystem::path());
    sweep_abandoned_kernel_dirs("/tmp", "cbk-", runtime.path());
    if (report) {
        const BoundPorts ports = server.bound_ports();
        std::array<char, 256> hostname{};
        ::gethostname(hostname.data(), hostname.size() - 1);
        try {
            send_launch_report(*report,
                               {{"transport", "tcp"},
                                {"ip", connection.ip},
                                {"shell_port", ports.shell},
                                {"control_port", ports.control},
                                {"stdin_port", ports.stdin_channel},
                                {"iopub_port", ports.iopub},
                                {"hb_port", ports.heartbeat},
                                {"key", connection.key},
                                {"signature_scheme", connection.signature_scheme},
                                {"curve_public_key", curve_keys->public_key},
                                {"host", hostname.data()},
                                {"pid", ::getpid()}},
                               launch_report_timeout);
        } catch (const std::exception& error) {
            log_event(LogLevel::error, "launch_report_failed", {{"error", error.what()}});
            exit_path.leave(1);
        }
        log_event(LogLevel::info, "launch_reported",
                  {{"registry", report->endpoint}, {"ip", connection.ip}, {"shell_port", ports.shell}});
    }
    log_event(LogLevel::info, "kernel_started", {{"shell", connection.endpoint(connection.shell_port)}});
    // xeus prints its version on std::clog at start; keep stderr for our structured log lines.
    if (!log_enabled(LogLevel::debug)) {
        std::clog.rdbuf(nullptr);
    }
    kernel.start();  // returns only if the server stops without shutdown_request or lease expiry
    exit_path.leave(0);
}

}  // namespace

// A kernel started as a batch job on another machine gets its environment as a document on stdin (from a
// quoted here-document: slurm_job_script in gateway/src/kernels/provisioner.cpp), never as shell `export`s.
// It then executes itself again with that environment (and stdin on /dev/null, as for any daemon), so that
// the process's environment is what /proc/PID/environ and ps show. Returns only on failure.
std::string exec_with_launch_environment(int argc, char** argv) {
    constexpr std::size_t most = 1 << 20;
    std::string document;
    std::array<char, 4096> buffer{};
    for (;;) {
        const ssize_t got = ::read(STDIN_FILENO, buffer.data(), buffer.size());
        if (got < 0 && errno == EINTR)
            continue;
        if (got < 0)
            return std::string("--environment-stdin: cannot read stdin: ") + std::strerror(errno);
        if (got == 0)
            break;
        document.append(buffer.data(), static_cast<std::size_t>(got));
        if (document.size() > most)
            return "--environment-stdin: the document is over 1 MiB";
    }
    contract::Environment environment;
    try {
        environment = contract::decode_environment(document);
    } catch (const contract::InvalidEnvironment& error) {
        return std::string("--environment-stdin: ") + error.what();
    }
    for (char** entry = environ; entry && *entry; ++entry) {
        const std::string_view line = *entry;
        const auto equals = line.find('=');
        if (equals != std::string_view::npos)
            environment.try_emplace(std::string(line.substr(0, equals)), line.substr(equals + 1));
    }
    std::vector<std::string> lines;
    for (const auto& [name, value] : environment)
        lines.push_back(name + "=" + value);
    std::vector<char*> envp;
    for (std::string& line : lines)
        envp.push_back(line.data());
    envp.push_back(nullptr);
    std::vector<char*> arguments;
    for (int i = 0; i < argc; ++i)
        if (std::string_view(argv[i]) != "--environment-stdin")
            arguments.push_back(argv[i]);
    arguments.push_back(nullptr);
    const int null = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (null < 0 || ::dup2(null, STDIN_FILENO) < 0)
        return std::string("--environment-stdin: cannot open /dev/null: ") + std::strerror(errno);
    ::close(null);
    ::execve("/proc/self/exe", arguments.data(), envp.data());
    return std::string("--environment-stdin: cannot execute /proc/self/exe: ") + std::strerror(errno);
}

}  // namespace cellblock::kernel

int main(int argc, char** argv) {
    cellblock::kernel::schedule_as_batch_work();
    cellblock::kernel::block_kernel_signals();
    cellblock::kernel::keep_large_blocks_on_the_heap();
    // OpenSSL's atexit cleanup would race with the server's I/O thread still signing (xpython crashes in
    // HMAC_Init_ex during exit for this reason); the kernel leaves with _exit and needs no cleanup.
    OPENSSL_init_crypto(OPENSSL_INIT_NO_ATEXIT, nullptr);

    CLI::App app{"cellblock-kernel: a Jupyter kernel running Python in a confined worker"};
    std::string config_file;
    std::string connection_file;
    app.add_option("--config", config_file, "kernel configuration (JSON)")
        ->required()
        ->check(CLI::ExistingFile);
    auto* file_option = app.add_option("-f,--connection-file", connection_file, "Jupyter connection file")
                            ->check(CLI::ExistingFile);
    cellblock::kernel::ReportTarget report;
    auto* report_option =
        app.add_option(
               "--report-to", report.endpoint,
               "no connection file: bind ephemeral TCP ports (CurveZMQ) and report them to this launch "
               "registry (tcp://host:port), with the one-time token from CELLBLOCK_REPORT_TOKEN")
            ->excludes(file_option);
    app.add_option("--report-server-key", report.server_public_key,
                   "the launch registry's Curve public key (Z85); default: CELLBLOCK_REPORT_SERVER_KEY")
        ->needs(report_option);
    bool template_service = false;
    app.add_flag(
           "--template-service", template_service,
           "run the worker zygote template of the tenant CELLBLOCK_ZYGOTE_TENANT names, supervised, until "
           "SIGTERM or the end of the process that started this one (launch/template_service.hpp)")
        ->excludes(file_option)
        ->excludes(report_option);
    bool environment_stdin = false;
    app.add_flag("--environment-stdin", environment_stdin,
                 "read the launch environment document (JSON, contract/include/cellblock/contract/"
                 "environment.hpp) from standard input and set it before anything else");
    CLI11_PARSE(app, argc, argv);
    if (environment_stdin) {
        std::cerr << cellblock::kernel::exec_with_launch_environment(argc, argv) << "\n";
        return 1;
    }
    if (template_service) {
        try {
            return cellblock::kernel::run_template_service(config_file);
        } catch (const std::exception& error) {
            cellblock::kernel::log_event(cellblock::kernel::LogLevel::error, "zygote_service_failed",
                                         {{"error", error.what()}});
            return 1;
        }
    }
    if (!*file_option && !*report_option) {
        std::cerr << "one of --connection-file or --report-to is required\n";
        return 1;
    }
    std::optional<cellblock::kernel::ReportTarget> report_target;
    if (*report_option) {
        // Read once and taken out of the environment: nothing the kernel starts (the worker) sees it.
        if (const char* key = std::getenv("CELLBLOCK_REPORT_SERVER_KEY");
            key && report.server_public_key.empty())
            report.server_public_key = key;
        ::unsetenv("CELLBLOCK_REPORT_SERVER_KEY");
        const char* token = std::getenv("CELLBLOCK_REPORT_TOKEN");
        if (!token || !*token || report.server_public_key.size() != 40) {
            std::cerr << "--report-to needs the registry's key (40 Z85 characters, --report-server-key or "
                         "CELLBLOCK_REPORT_SERVER_KEY) and CELLBLOCK_REPORT_TOKEN\n";
            return 1;
        }
        report.token = token;
        // Scrubbed where exec put it (what /proc/PID/environ shows), then unset.
        std::memset(const_cast<char*>(token), 0, report.token.size());
        ::unsetenv("CELLBLOCK_REPORT_TOKEN");
        report_target = report;
    }

    try {
        return cellblock::kernel::run_kernel(config_file, connection_file, report_target);
    } catch (const std::exception& error) {
        cellblock::kernel::log_event(cellblock::kernel::LogLevel::error, "kernel_start_failed",
                                     {{"error", error.what()}});
        return 1;
    }
}
