// cellblock-gateway: command line, configuration precedence, signal handling and the readiness line.
#include <malloc.h>
#include <sys/stat.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <boost/asio/signal_set.hpp>
#include <boost/asio/steady_timer.hpp>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>

#include "cellblock/gateway/access/auth.hpp"
#include "cellblock/gateway/access/tenant_api.hpp"
#include "cellblock/gateway/access/tenants.hpp"
#include "cellblock/gateway/agent/agent_api.hpp"
#include "cellblock/gateway/common/config.hpp"
#include "cellblock/gateway/common/crypto.hpp"
#include "cellblock/gateway/http/http_server.hpp"
#include "cellblock/gateway/http/rest_handlers.hpp"
#include "cellblock/gateway/http/router.hpp"
#include "cellblock/gateway/kernels/kernel_manager.hpp"
#include "cellblock/gateway/kernels/state_directory.hpp"
#include "cellblock/gateway/observability/log.hpp"
#include "cellblock/gateway/observability/metrics.hpp"
#include "cellblock/gateway/store/store.hpp"
#include "cellblock/gateway/store/store_sealing.hpp"
#include "cellblock/gateway/store/store_writer.hpp"

using namespace cellblock::gateway;

namespace {

bool same_file(int first_fd, int second_fd) {
    struct stat first {
    }, second{};
    return ::fstat(first_fd, &first) == 0 && ::fstat(second_fd, &second) == 0 &&
           first.st_dev == second.st_dev && first.st_ino == second.st_ino;
}

struct CommandLine {
    std::optional<std::string> config_file, ip, token, base_url, certfile, keyfile, client_ca, allow_origin,
        runtime_dir, workspace_root, state_dir, store, log_level, default_kernel_name, provisioner,
        zygote_tenant, launch_registry_ip, slurm_partition, slurm_account, slurm_qos, slurm_constraint,
        network_default, egress_hosts;
    std::optional<int> port, warm_pool, max_kernels;
    std::optional<double> cull_idle_timeout, cull_interval, ws_ping_interval, orphan_timeout, header_timeout,
        network_approval_timeout;
    std::optional<std::size_t> max_unauthenticated_connections, max_unauthenticated_per_address, fd_reserve;
    std::optional<bool> cull_connected, cull_busy, list_kernels;
    bool shutdown_kernels_on_exit = false;
    std::vector<std::string> kernelspec_dirs;
    std::vector<std::string> network_allow;
    std::vector<std::string> egress_deny;
    std::optional<std::string> token_file, store_file, store_key_file;
    bool print_config = false;
};

// A secret from a file (--token-file, --store-file): the file's text without its final line break. A file
// others may read is taken with a warning; an empty one is refused (an empty token would mean no
// authentication).
std::string read_secret_file(const std::string& option, const std::string& path) {
    std::ifstream input(path);
    if (!input)
        throw std::invalid_argument(option + ": cannot read " + path);
    std::string text((std::istreambuf_iterator<char>(input)), std::istreambuf_iterator<char>());
    while (!text.empty() && (text.back() == '\n' || text.back() == '\r'))
        text.pop_back();
    if (text.empty())
        throw std::invalid_argument(option + ": " + path + " is empty");
    struct stat status {};
    if (::stat(path.c_str(), &status) == 0 && (status.st_mode & 077) != 0)
        std::cerr << "[cellblock-gateway] warning: " << path << " (" << option
                  << ") can be read by other users; chmod 600 it\n";
    return text;
}

// What any local user can read in /proc/PID/cmdline: said once on stderr, before anything starts.
void warn_of_secrets_on_the_command_line(const CommandLine& cli) {
    if (cli.token && !cli.token->empty())
        std::cerr
            << "[cellblock-gateway] warning: --token on the command line is readable by every local user "
               "(/proc/PID/cmdline); use --token-file or KG_AUTH_TOKEN\n";
    if (cli.store && masked_store(*cli.store) != *cli.store)
        std::cerr
            << "[cellblock-gateway] warning: the password in --store on the command line is readable by "
               "every local user (/proc/PID/cmdline); use --store-file or CELLBLOCK_GATEWAY_STORE\n";
}

void apply(const CommandLine& cli, GatewayConfig& config) {
    auto set = [](const auto& source, auto& target) {
        if (source)
            target = *source;
    };
    set(cli.ip, config.ip);
    if (cli.port)
        config.port = static_cast<std::uint16_t>(*cli.port);
    if (cli.token)
        config.token = *cli.token;
    if (cli.token_file)
        config.token = read_secret_file("--token-file", *cli.token_file);
    if (cli.store_file)
        config.store = read_secret_file("--store-file", *cli.store_file);
    set(cli.base_url, config.base_url);
    set(cli.certfile, config.certfile);
    set(cli.keyfile, config.keyfile);
    set(cli.client_ca, config.client_ca);
    set(cli.allow_origin, config.allow_origin);
    set(cli.runtime_dir, config.runtime_dir);
    set(cli.workspace_root, config.workspace_root);
    set(cli.state_dir, config.state_dir);
    set(cli.store, config.store);
    set(cli.store_key_file, config.store_key_file);
    set(cli.orphan_timeout, config.orphan_timeout);
    set(cli.zygote_tenant, config.zygote_tenant);
    set(cli.header_timeout, config.header_timeout);
    set(cli.max_unauthenticated_connections, config.max_unauthenticated_connections);
    set(cli.max_unauthenticated_per_address, config.max_unauthenticated_per_address);
    set(cli.fd_reserve, config.fd_reserve);
    if (cli.shutdown_kernels_on_exit)
        config.shutdown_kernels_on_exit = true;
    set(cli.log_level, config.log_level);
    set(cli.default_kernel_name, config.default_kernel_name);
    set(cli.warm_pool, config.warm_pool);
    set(cli.max_kernels, config.max_kernels);
    set(cli.cull_idle_timeout, config.cull_idle_timeout);
    set(cli.cull_interval, config.cull_interval);
    set(cli.ws_ping_interval, config.ws_ping_interval);
    set(cli.cull_connected, config.cull_connected);
    set(cli.cull_busy, config.cull_busy);
    set(cli.list_kernels, config.list_kernels);
    set(cli.provisioner, config.provisioner);
    set(cli.launch_registry_ip, config.launch_registry_ip);
    set(cli.slurm_partition, config.slurm_partition);
    set(cli.slurm_account, config.slurm_account);
    set(cli.slurm_qos, config.slurm_qos);
    set(cli.slurm_constraint, config.slurm_constraint);
    if (!cli.kernelspec_dirs.empty())
        config.kernelspec_dirs = cli.kernelspec_dirs;
    if (!cli.network_allow.empty())
        config.network_allow = cli.network_allow;
    if (!cli.egress_deny.empty())
        config.egress_deny = cli.egress_deny;
    if (cli.network_default) {
        config.network_default = cli.network_default->empty() ? nlohmann::json(nullptr)
                                                              : nlohmann::json::parse(*cli.network_default);
    }
    set(cli.egress_hosts, config.egress_hosts);
    set(cli.network_approval_timeout, config.network_approval_timeout);
}

// Message buffers below 4 MiB come from the heap and stay there once freed (up to 8 MiB at its top): glibc
// would mmap every block over 128 KiB and unmap it on free, so each large output (a 1 MiB stream message is
// copied out of ZMQ and into its WebSocket frame) paid for faulting in fresh pages, 15 ms of gateway CPU per
// MiB against 2.5–4 with this (the kernel sets the same for the same reason,
// kernel/src/launch/heap_policy.cpp). Set here rather than with GLIBC_TUNABLES, which every kernel the
// gateway starts would inherit.
bool keep_message_buffers_on_the_heap() {
    constexpr int mmap_threshold = 4 * 1024 * 1024;
    constexpr int trim_threshold = 8 * 1024 * 1024;
    return ::mallopt(M_MMAP_THRESHOLD, mmap_threshold) == 1 &&
           ::mallopt(M_TRIM_THRESHOLD, trim_threshold) == 1;
}

std::string normalized_base_url(std::string base) {
    if (base.empty() || base.front() != '/')
        base.insert(base.begin(), '/');
    if (base.back() != '/')
        base.push_back('/');
    return base;
}

}  // namespace

int main(int argc, char** argv) {
    const bool heap_policy_set = keep_message_buffers_on_the_heap();
    CLI::App app{"cellblock-gateway: Jupyter Kernel Gateway API (REST + WebSocket) for cellblock kernels"};
    CommandLine cli;
    app.add_option("--config", cli.config_file,
                   "JSON config file (keys as in share/cellblock/gateway-config.json)");
    app.add_option("--ip", cli.ip, "address to bind (KG_IP; default 127.0.0.1)");
    app.add_option("--port", cli.port, "port to bind, 0 = any free port (KG_PORT; default 8888)")
        ->check(CLI::Range(0, 65535));
    auto* token_option = app.add_option(
        "--token", cli.token,
        "auth token, empty = no auth (KG_AUTH_TOKEN; default: generated). On the command line any local user "
        "reads it: prefer --token-file");
    app.add_option("--token-file", cli.token_file, "read the auth token from this file (mode 600)")
        ->excludes(token_option);
    app.add_option("--base-url", cli.base_url, "URL prefix of every route (KG_BASE_URL)");
    app.add_option("--certfile", cli.certfile,
                   "TLS certificate chain (PEM); enables HTTPS/WSS (KG_CERTFILE)");
    app.add_option("--keyfile", cli.keyfile, "TLS private key (PEM) (KG_KEYFILE)");
    app.add_option("--client-ca", cli.client_ca,
                   "CA file; client certificates become mandatory (KG_CLIENT_CA)");
    app.add_option("--allow-origin", cli.allow_origin, "Access-Control-Allow-Origin (KG_ALLOW_ORIGIN)");
    app.add_option("--kernelspec-dir", cli.kernelspec_dirs,
                   "directory holding <name>/kernel.json (repeatable)");
    app.add_option("--default-kernel-name", cli.default_kernel_name,
                   "kernelspec used when none is requested");
    app.add_option("--warm-pool", cli.warm_pool,
                   "pre-started kernels handed out by POST /api/kernels (KG_PRESPAWN_COUNT)")
        ->check(CLI::Range(0, 1000));
    app.add_option("--max-kernels", cli.max_kernels, "0 = unlimited (KG_MAX_KERNELS)")
        ->check(CLI::Range(0, 100000));
    app.add_option("--cull-idle-timeout", cli.cull_idle_timeout,
                   "seconds of inactivity before a kernel is culled, 0 = never");
    app.add_option("--cull-interval", cli.cull_interval, "seconds between cull checks");
    app.add_option("--cull-connected", cli.cull_connected, "cull kernels that have open WebSockets");
    app.add_option("--cull-busy", cli.cull_busy, "cull busy kernels");
    app.add_option("--list-kernels", cli.list_kernels,
                   "allow GET /api/kernels and /api/sessions (KG_LIST_KERNELS)");
    app.add_option("--ws-ping-interval", cli.ws_ping_interval, "seconds between WebSocket pings, 0 = off");
    app.add_option("--runtime-dir", cli.runtime_dir,
                   "private directory for connection files and ipc sockets");
    app.add_option("--workspace-root", cli.workspace_root,
                   "where per-kernel CELLBLOCK_WORKSPACE directories are made");
    app.add_option(
        "--state-dir", cli.state_dir,
        "the store, kernels' sockets and workspaces; kernels survive a gateway restart on the same "
        "one (default $XDG_STATE_HOME/cellblock or ~/.local/state/cellblock)");
    auto* store_option = app.add_option(
        "--store", cli.store,
        "the session store: empty = SQLite in the state directory (default); postgresql://... = "
        "a PostgreSQL store shared by several gateways (CELLBLOCK_GATEWAY_STORE)");
    app.add_option(
        "--store-key-file", cli.store_key_file,
        "the secret (64 hex digits, mode 600) that seals kernels' keys in the store; default: "
        "store-key in the state directory; required for a PostgreSQL store, the same file for every "
        "gateway on it (CELLBLOCK_GATEWAY_STORE_KEY_FILE)");
    app.add_option("--store-file", cli.store_file,
                   "read --store from this file (mode 600), for a PostgreSQL URI that holds a password")
        ->excludes(store_option);
    app.add_option(
           "--orphan-timeout", cli.orphan_timeout,
           "seconds a kernel keeps running without a gateway before it stops itself (default 600; 0 = "
           "forever)")
        ->check(CLI::NonNegativeNumber);
    app.add_option("--zygote-tenant", cli.zygote_tenant,
                   "the worker zygote's tenant of every kernel this gateway starts (CELLBLOCK_ZYGOTE_TENANT; "
                   "used when the kernel config switches the zygote on); sessions of one tenant share a "
                   "template (CELLBLOCK_GATEWAY_ZYGOTE_TENANT)");
    app.add_flag("--shutdown-kernels-on-exit", cli.shutdown_kernels_on_exit,
                 "SIGTERM stops the kernels too (by default they keep running for the next gateway; SIGINT "
                 "always stops them)");
    app.add_option(
           "--provisioner", cli.provisioner,
           "where kernels run: local (default) or slurm (one batch job per kernel; see gateway/README.md)")
        ->check(CLI::IsMember({"local", "slurm"}));
    app.add_option("--launch-registry-ip", cli.launch_registry_ip,
                   "address Slurm-hosted kernels report to (default 127.0.0.1)");
    app.add_option("--slurm-partition", cli.slurm_partition, "sbatch --partition");
    app.add_option("--slurm-account", cli.slurm_account, "sbatch --account");
    app.add_option("--slurm-qos", cli.slurm_qos, "sbatch --qos");
    app.add_option("--slurm-constraint", cli.slurm_constraint, "sbatch --constraint");
    app.add_option("--header-timeout", cli.header_timeout,
                   "seconds a connection that has not authenticated has to send its request headers "
                   "(default 10)")
        ->check(CLI::PositiveNumber);
    app.add_option("--max-unauthenticated-connections", cli.max_unauthenticated_connections,
                   "connections kept before their first authenticated request; more are closed at once "
                   "(default 0 = min(4096, (file limit - fd reserve) / 2))");
    app.add_option("--max-unauthenticated-per-address", cli.max_unauthenticated_per_address,
                   "the same, per client IP address (default 128; 0 = the global cap)");
    app.add_option(
        "--fd-reserve", cli.fd_reserve,
        "file descriptors kept free for kernel starts: accepting pauses below it (default 128; 0 = "
        "off)");
    app.add_option("--network-allow", cli.network_allow,
                   "host pattern a session's network policy may reach (repeatable; the ceiling: none = no "
                   "session gets network; \"pypi.org\", \"*.pythonhosted.org\", \"*\") "
                   "(CELLBLOCK_GATEWAY_NETWORK_ALLOW, comma-separated)");
    app.add_option(
        "--network-default", cli.network_default,
        "network policy of kernels started through the Kernel Gateway API, as JSON "
        "{\"allow\": [...], \"ask\": bool} within the ceiling (a kernelspec's "
        "metadata.cellblock.network overrides it; default none) (CELLBLOCK_GATEWAY_NETWORK_DEFAULT)");
    app.add_option("--egress-hosts", cli.egress_hosts,
                   "hosts(5) file: a name listed there resolves only to its addresses, which are exempt from "
                   "the private-address refusal (CELLBLOCK_GATEWAY_EGRESS_HOSTS)");
    app.add_option("--egress-deny", cli.egress_deny,
                   "address range (CIDR, repeatable) no kernel's egress proxy connects to, whatever a name "
                   "resolves to, besides the private, loopback and metadata ranges always refused "
                   "(config network.egress_deny)");
    app.add_option("--network-approval-timeout", cli.network_approval_timeout,
                   "seconds a held network request waits for an approval before it is denied (default 120) "
                   "(CELLBLOCK_GATEWAY_NETWORK_APPROVAL_TIMEOUT)")
        ->check(CLI::PositiveNumber);
    app.add_option("--log-level", cli.log_level, "debug, info, warning (default), error");
    app.add_flag("--print-config", cli.print_config, "print the effective configuration and exit");
    cellblock::gateway::agent::AgentConfig agent_config;
    cellblock::gateway::agent::add_agent_options(app, agent_config);
    // An option that takes one value may be given again, and the last one counts (as in most command lines):
    // start.sh passes its own --ip, --port and --state-dir before the user's (README: start.sh --port 9999).
    for (CLI::Option* option : app.get_options()) {
        if (option->get_items_expected_max() == 1) {
            option->take_last();
        }
    }
    CLI11_PARSE(app, argc, argv);
    warn_of_secrets_on_the_command_line(cli);
    // The agent API's default limits are the kernel's own, so warm-pool kernels can serve default sessions.
    agent_config.load_kernel_defaults(installed_data_dir() + "/cellblock/kernel-config.json");

    GatewayConfig config;
    try {
        const std::string default_file = installed_data_dir() + "/cellblock/gateway-config.json";
        if (cli.config_file)
            config.merge_file(*cli.config_file);
        else if (std::ifstream probe(default_file); probe.is_open())
            config.merge_file(default_file);
        config.merge_environment([](const std::string& name) -> std::optional<std::string> {
            const char* value = std::getenv(name.c_str());
            return value ? std::optional<std::string>(value) : std::nullopt;
        });
        apply(cli, config);
        config.base_url = normalized_base_url(config.base_url);
        config.check_network();
        config.check_zygote_tenant();
        config.check_durations();
    } catch (const std::exception& error) {
        std::cerr << "cellblock-gateway: " << error.what() << "\n";
        return 2;
    }
    if (cli.print_config) {
        std::cout << config.to_json().dump(2) << "\n";
        return 0;
    }

    LogLevel level;
    try {
        level = Logger::parse_level(config.log_level);
    } catch (const std::exception& error) {
        std::cerr << "cellblock-gateway: " << error.what() << "\n";
        return 2;
    }
    const Logger logger(level);
    if (!heap_policy_set)
        logger.warn("mallopt_failed", {});
    const bool generated_token = !config.token.has_value();
    if (generated_token)
        config.token = random_hex(24);

    // Writing to a vanished client must be an error code, not a process-killing signal.
    std::signal(SIGPIPE, SIG_IGN);

    // The state directory is locked and the store opened before anything listens: a second gateway on the
    // same directory, or a store that cannot be read, stops here with the reason and a non-zero status.
    std::unique_ptr<StateDirectory> state;
    std::unique_ptr<SessionStore> store;
    std::optional<StoreSecret> secret;  // also keys the digests of tenants' tokens (TenantDirectory)
    try {
        state = std::make_unique<StateDirectory>(config.state_dir.empty()
                                                     ? StateDirectory::default_path()
                                                     : std::filesystem::path(config.state_dir));
        config.state_dir = state->path().string();
        if (config.runtime_dir.empty())
            config.runtime_dir = state->runtime_dir().string();
        if (config.workspace_root.empty())
            config.workspace_root = state->workspaces_dir().string();
        // ipc:// endpoints are <runtime_dir>/k-<16 hex>-<port>, and a socket path must fit in sun_path.
        if (config.runtime_dir.size() + 22 > 107)
            throw std::runtime_error("runtime directory path " + config.runtime_dir +
                                     " is too long for ipc sockets (at most 85 characters): choose a shorter "
                                     "--state-dir or --runtime-dir");
        if (auto refusal = config.store.empty() ? std::nullopt : unencrypted_remote_store(config.store))
            throw std::runtime_error(*refusal);
        if (!config.store.empty() && config.store_key_file.empty())
            throw std::runtime_error(
                "a PostgreSQL store needs --store-key-file: one secret, the same for every "
                "gateway on the store, seals the kernels' keys in it (make one with "
                "`openssl rand -hex 32 > FILE; chmod 600 FILE`)");
        secret = config.store_key_file.empty() ? StoreSecret::load(state->path() / "store-key", true)
                                               : StoreSecret::load(config.store_key_file, false);
        store = seal_kernel_keys(
            config.store.empty() ? open_sqlite_store(state->store_file()) : open_postgres_store(config.store),
            *secret);
    } catch (const std::exception& error) {
        logger.error("cannot_start", {{"error", error.what()}});
        std::cerr << "cellblock-gateway: " << error.what() << "\n";
        return 1;
    }

    try {
        boost::asio::io_context io(1);
        GatewayMetrics metrics;  // before every owner that counts in it or samples for it
        StoreWriter writer(io, logger, *store);
        KernelSpecRegistry kernelspecs(config.effective_kernelspec_dirs(), config.kernel_aliases,
                                       config.default_kernel_name);
        if (!kernelspecs.find(config.default_kernel_name))
            logger.warn("default_kernelspec_missing", {{"name", config.default_kernel_name},
                                                       {"searched", config.effective_kernelspec_dirs()}});
        KernelManager kernels(io, logger, config, kernelspecs, writer, metrics);
        JupyterSessionManager sessions(writer);
        TenantDirectory tenants(writer, *secret);
        tenants.load();
        tenants.follow_shared_store(io);
        const TokenAuthenticator auth(*config.token, &tenants);
        const CorsPolicy cors(config);
        TenantQuotas quotas(tenants, kernels, writer,
                            static_cast<std::int64_t>(agent_config.default_limits.memory_mb));
        GatewayServices services{io,     logger, config, kernelspecs, kernels, sessions,
                                 writer, auth,   cors,   metrics,     quotas};
        Router router;
        register_jupyter_api(router, services);
        register_metrics_endpoint(router, services);
        cellblock::gateway::agent::AgentService agent_service(services, agent_config);
        register_tenant_api(router, services, tenants, [&agent_service](const std::string& tenant) {
            agent_service.end_sessions_of(tenant);
        });
        agent_service.register_routes(router);
        HttpServer server(io, logger, config, router, auth, cors, metrics);
        const std::uint16_t port = server.listen(config.ip, config.port);
        kernels.start();
        sessions.load([&kernels](const std::string& kernel_id) { return kernels.known(kernel_id); });
        agent_service.start();

        // SIGTERM (a service manager's stop or restart, an upgrade) leaves the kernels running for the next
        // gateway on this state directory; SIGINT (Ctrl-C at a terminal) stops them, as does SIGTERM with
        // --shutdown-kernels-on-exit. A crash leaves them running; their lease (--orphan-timeout) ends them.
        boost::asio::signal_set stop_signals(io, SIGINT, SIGTERM);
        boost::asio::steady_timer exit_timer(io);
        stop_signals.async_wait([&](const boost::system::error_code& error, int signal_number) {
            if (error)
                return;
            const bool keep_kernels = signal_number == SIGTERM && !config.shutdown_kernels_on_exit;
            logger.info("stopping",
                        {{"signal", signal_number},
                         {"kernels", keep_kernels ? "left running for the next gateway" : "stopped"}});
            server.stop();
            if (keep_kernels)
                kernels.detach_all();
            else
                kernels.shutdown_all();
            // A moment for WebSocket writes already queued: what a client was sent is what the next gateway
            // does not replay.
            exit_timer.expires_after(std::chrono::milliseconds(300));
            exit_timer.async_wait([&io](const boost::system::error_code&) { io.stop(); });
        });

        const std::string scheme = server.tls() ? "https" : "http";
        std::string url = scheme + "://" +
                          (config.ip.find(':') != std::string::npos ? "[" + config.ip + "]" : config.ip) +
                          ":" + std::to_string(port) + config.base_url;
        if (url.ends_with('/'))
            url.pop_back();
        // AutoGen waits for "is available at" on stderr, OpenHands reads stdout: say it on both (once on a
        // terminal, where both are the same file).
        std::string ready_line =
            "[cellblock-gateway] cellblock-gateway " CELLBLOCK_GATEWAY_VERSION " is available at " + url;
        if (generated_token)
            ready_line += "\n[cellblock-gateway] token: " + *config.token + "\n    " + url +
                          "/api?token=" + *config.token;
        std::cout << ready_line << std::endl;
        if (!same_file(STDOUT_FILENO, STDERR_FILENO))
            std::cerr << ready_line << std::endl;

        run_serving(io, logger);
        kernels.shutdown_all();
    } catch (const std::exception& error) {
        logger.error("fatal", {{"error", error.what()}});
        std::cerr << "cellblock-gateway: " << error.what() << "\n";
        return 1;
    }
    return 0;
}
