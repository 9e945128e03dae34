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
#include <stdexcept>
#include <type_traits>
#include <variant>

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

// What the command line gave for one setting, in the type of its field (a JSON field as its text).
using Given = std::variant<std::optional<std::string>, std::optional<bool>, std::optional<int>,
                           std::optional<std::uint16_t>, std::optional<std::size_t>, std::optional<double>,
                           std::vector<std::string>>;

// The storage the flag of a field of type T parses into.
template <typename T>
Given given_for() {
    if constexpr (std::is_same_v<T, std::string> || std::is_same_v<T, std::optional<std::string>> ||
                  std::is_same_v<T, nlohmann::json>)
        return std::optional<std::string>();
    else if constexpr (std::is_same_v<T, std::vector<std::string>>)
        return std::vector<std::string>();
    else if constexpr (std::is_arithmetic_v<T>)
        return std::optional<T>();
    else
        throw std::logic_error("a setting of this type has no flag");
}

// --help's text of a setting: its meaning, default and environment variable (CLI11 names a variable its flag
// reads, after the text as written).
std::string flag_help(const Setting& setting) {
    std::string help(setting.help);
    if (setting.env_read == EnvRead::by_flag)
        return help;
    if (!setting.choices.empty())
        help += "; one of " + std::string(setting.choices);
    if (!setting.switch_only)
        help += " (default " + setting.default_shown() + ")";
    if (!setting.env.empty())
        help += " (" + std::string(setting.env) + ")";
    return help;
}

void add_check(CLI::Option& option, const Setting& setting) {
    switch (setting.check) {
        case FlagCheck::range:
            // Every range is of a whole-number setting: said as whole numbers ("0 to 65535").
            option.check(
                CLI::Range(static_cast<std::int64_t>(setting.low), static_cast<std::int64_t>(setting.high)));
            break;
        case FlagCheck::unsigned_range:
            option.check(CLI::Range(static_cast<std::uint64_t>(setting.low),
                                    static_cast<std::uint64_t>(setting.high)));
            break;
        case FlagCheck::duration:
            option.check(CLI::Range(0.0, longest_duration_s));
            break;
        case FlagCheck::positive_duration:
            option.check(CLI::PositiveNumber & CLI::Range(0.0, longest_duration_s));
            break;
        case FlagCheck::non_negative:
            option.check(CLI::NonNegativeNumber);
            break;
        case FlagCheck::positive:
            option.check(CLI::PositiveNumber);
            break;
        case FlagCheck::none:
            break;
    }
    if (!setting.choices.empty()) {
        std::vector<std::string> choices(1);
        for (const char c : setting.choices)
            if (c == ',')
                choices.emplace_back();
            else
                choices.back() += c;
        option.check(CLI::IsMember(choices));
    }
}

// The flags of gateway_settings(), and what the command line gave: the top of the precedence.
class SettingFlags {
  public:
    explicit SettingFlags(CLI::App& app) {
        for (const Setting& setting : gateway_settings())
            if (!setting.flag.empty())
                entries_.push_back({&setting, storage_for(setting)});
        // The options point into entries_, which does not grow from here on.
        for (Entry& entry : entries_)
            add(app, entry);
    }
    SettingFlags(const SettingFlags&) = delete;
    SettingFlags& operator=(const SettingFlags&) = delete;

    // Sets every setting the command line gave; throws std::invalid_argument naming the flag.
    void apply(GatewayConfig& config) const {
        for (const Entry& entry : entries_) {
            const Setting& setting = *entry.setting;
            const std::string flag(setting.flag);
            if (entry.switched)
                setting.set_from_json(config, true, flag);
            if (entry.from_file) {
                const std::string file_flag(setting.file_flag);
                setting.set_from_text(config, read_secret_file(file_flag, *entry.from_file), file_flag);
            }
            std::visit(
                [&](const auto& value) {
                    using V = std::remove_cvref_t<decltype(value)>;
                    if constexpr (std::is_same_v<V, std::vector<std::string>>) {
                        if (!value.empty())
                            setting.set_from_json(config, value, flag);
                    } else if constexpr (std::is_same_v<V, std::optional<std::string>>) {
                        if (value)
                            setting.set_from_text(config, *value, flag);  // a JSON field's text is parsed
                    } else if (value) {
                        setting.set_from_json(config, *value, flag);
                    }
                },
                entry.value);
        }
    }

    // The text the command line gave for the setting `key` (for the warnings about secrets).
    std::optional<std::string> text(std::string_view key) const {
        for (const Entry& entry : entries_)
            if (entry.setting->key == key)
                if (const auto* text = std::get_if<std::optional<std::string>>(&entry.value))
                    return *text;
        return std::nullopt;
    }

  private:
    // The storage a setting's flag parses into: the text of one of its choices, else its field's type.
    static Given storage_for(const Setting& setting) {
        if (!setting.choices.empty())
            return std::optional<std::string>();
        return std::visit(
            [](auto member) {
                return given_for<
                    std::remove_cvref_t<decltype(field_of(std::declval<GatewayConfig&>(), member))>>();
            },
            setting.field);
    }

    struct Entry {
        const Setting* setting = nullptr;
        Given value = {};
        std::optional<std::string> from_file = {};
        bool switched = false;
    };

    static void add(CLI::App& app, Entry& entry) {
        const Setting& setting = *entry.setting;
        const std::string flag(setting.flag);
        CLI::Option* option =
            setting.switch_only
                ? app.add_flag(flag, entry.switched, flag_help(setting))
                : std::visit([&](auto& value) { return app.add_option(flag, value, flag_help(setting)); },
                             entry.value);
        add_check(*option, setting);
        if (!setting.group.empty())
            option->group(std::string(setting.group));
        if (setting.env_read == EnvRead::by_flag)
            option->envname(std::string(setting.env));
        if (!setting.file_flag.empty())
            app.add_option(std::string(setting.file_flag), entry.from_file,
                           "read " + flag + " from this file (mode 600)")
                ->excludes(option);
    }

    std::vector<Entry> entries_;
};

// What any local user can read in /proc/PID/cmdline: said once on stderr, before anything starts.
void warn_of_secrets_on_the_command_line(const SettingFlags& flags) {
    if (const auto token = flags.text("token"); token && !token->empty())
        std::cerr
            << "[cellblock-gateway] warning: --token on the command line is readable by every local user "
               "(/proc/PID/cmdline); use --token-file or KG_AUTH_TOKEN\n";
    if (const auto store = flags.text("store"); store && masked_store(*store) != *store)
        std::cerr
            << "[cellblock-gateway] warning: the password in --store on the command line is readable by "
               "every local user (/proc/PID/cmdline); use --store-file or CELLBLOCK_GATEWAY_STORE\n";
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

// Declares --config, then hands the app on to SettingFlags, so that --help lists --config before the
// settings' flags.
CLI::App& with_config_option(CLI::App& app, std::optional<std::string>& config_file) {
    app.add_option("--config", config_file,
                   "JSON config file (keys as in docs/configuration.md); default: "
                   "<prefix>/share/cellblock/gateway-config.json when it exists");
    return app;
}

// The command line: --config, every setting's flag and the two print modes, in the order --help lists them
// (the agent API's flags in their own group, after the rest).
struct CommandLine {
    CLI::App app{"cellblock-gateway: Jupyter Kernel Gateway API (REST + WebSocket) for cellblock kernels"};
    std::optional<std::string> config_file;
    const SettingFlags setting_flags{with_config_option(app, config_file)};
    bool print_config = false;
    bool print_reference = false;

    CommandLine() {
        app.add_flag("--print-config", print_config, "print the effective configuration and exit");
        app.add_flag("--print-config-reference", print_reference,
                     "print the settings' reference (the generated part of docs/configuration.md) and exit");
        // An option that takes one value may be given again, and the last one counts (as in most command
        // lines): start.sh passes its own --ip, --port and --state-dir before the user's (README: start.sh
        // --port 9999).
        for (CLI::Option* option : app.get_options()) {
            if (option->get_items_expected_max() == 1) {
                option->take_last();
            }
        }
    }
    CommandLine(const CommandLine&) = delete;
    CommandLine& operator=(const CommandLine&) = delete;

    // Nothing when the command line parsed; else the exit status after CLI11 said why (or printed --help).
    std::optional<int> parse(int argc, char** argv) {
        CLI11_PARSE(app, argc, argv);
        return std::nullopt;
    }
};

// The precedence, lowest first: compiled-in defaults, the config file (--config, else the installed one when
// it exists), the environment, the command line; then the checks of the merged whole, and the agent API's
// default limits, which are the kernel's own so that warm-pool kernels can serve default sessions. Throws
// with the reason.
void merge_configuration(GatewayConfig& config, const CommandLine& command_line) {
    const std::string default_file = installed_data_dir() + "/cellblock/gateway-config.json";
    if (command_line.config_file)
        config.merge_file(*command_line.config_file);
    else if (std::ifstream probe(default_file); probe.is_open())
        config.merge_file(default_file);
    config.merge_environment([](const std::string& name) -> std::optional<std::string> {
        const char* value = std::getenv(name.c_str());
        return value ? std::optional<std::string>(value) : std::nullopt;
    });
    command_line.setting_flags.apply(config);
    config.base_url = normalized_base_url(config.base_url);
    config.check_network();
    config.check_zygote_tenant();
    config.check_durations();
    config.check_every_source();
    config.agent.load_kernel_defaults(installed_data_dir() + "/cellblock/kernel-config.json");
}

// What main() holds from before anything listens until it returns: the locked state directory, the store,
// and the secret sealing the kernels' keys in it.
struct DurableState {
    std::unique_ptr<StateDirectory> state;
    std::unique_ptr<SessionStore> store;
    std::optional<StoreSecret> secret;  // also keys the digests of tenants' tokens (TenantDirectory)
};

// Locks the state directory, puts the paths that default into it in `config`, and opens the sealed store.
// Throws with the reason; what was opened stays in `durable` (main()'s) all the same.
void open_durable_state(GatewayConfig& config, DurableState& durable) {
    durable.state = std::make_unique<StateDirectory>(
        config.state_dir.empty() ? StateDirectory::default_path() : std::filesystem::path(config.state_dir));
    const StateDirectory& state = *durable.state;
    config.state_dir = state.path().string();
    if (config.runtime_dir.empty())
        config.runtime_dir = state.runtime_dir().string();
    if (config.workspace_root.empty())
        config.workspace_root = state.workspaces_dir().string();
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
    durable.secret = config.store_key_file.empty() ? StoreSecret::load(state.path() / "store-key", true)
                                                   : StoreSecret::load(config.store_key_file, false);
    durable.store = seal_kernel_keys(
        config.store.empty() ? open_sqlite_store(state.store_file()) : open_postgres_store(config.store),
        *durable.secret);
}

// SIGTERM (a service manager's stop or restart, an upgrade) leaves the kernels running for the next gateway
// on this state directory; SIGINT (Ctrl-C at a terminal) stops them, as does SIGTERM with
// --shutdown-kernels-on-exit. A crash leaves them running; their lease (--orphan-timeout) ends them.
void stop_on_signal(boost::asio::signal_set& stop_signals, boost::asio::steady_timer& exit_timer,
                    boost::asio::io_context& io, const GatewayConfig& config, const Logger& logger,
                    HttpServer& server, KernelManager& kernels) {
    stop_signals.async_wait([&exit_timer, &io, &config, &logger, &server, &kernels](
                                const boost::system::error_code& error, int signal_number) {
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
        // A moment for WebSocket writes already queued: what a client was sent is what the next gateway does
        // not replay.
        exit_timer.expires_after(std::chrono::milliseconds(300));
        exit_timer.async_wait([&io](const boost::system::error_code&) { io.stop(); });
    });
}

// The readiness line, with the token when the gateway made it up.
void announce_ready(const GatewayConfig& config, bool tls, std::uint16_t port, bool generated_token) {
    const std::string scheme = tls ? "https" : "http";
    std::string url = scheme + "://" +
                      (config.ip.find(':') != std::string::npos ? "[" + config.ip + "]" : config.ip) + ":" +
                      std::to_string(port) + config.base_url;
    if (url.ends_with('/'))
        url.pop_back();
    // AutoGen waits for "is available at" on stderr, OpenHands reads stdout: say it on both (once on a
    // terminal, where both are the same file).
    std::string ready_line =
        "[cellblock-gateway] cellblock-gateway " CELLBLOCK_GATEWAY_VERSION " is available at " + url;
    if (generated_token)
        ready_line +=
            "\n[cellblock-gateway] token: " + *config.token + "\n    " + url + "/api?token=" + *config.token;
    std::cout << ready_line << std::endl;
    if (!same_file(STDOUT_FILENO, STDERR_FILENO))
        std::cerr << ready_line << std::endl;
}

// Builds every part of the gateway (each after the ones it uses), listens, says it is ready and serves until
// a stop signal has been handled. Throws what any part throws.
void serve(const GatewayConfig& config, const Logger& logger, const DurableState& durable,
           bool generated_token) {
    const cellblock::gateway::agent::AgentConfig& agent_config = config.agent;
    boost::asio::io_context io(1);
    GatewayMetrics metrics;  // before every owner that counts in it or samples for it
    StoreWriter writer(io, logger, *durable.store);
    KernelSpecRegistry kernelspecs(config.effective_kernelspec_dirs(), config.kernel_aliases,
                                   config.default_kernel_name);
    if (!kernelspecs.find(config.default_kernel_name))
        logger.warn("default_kernelspec_missing",
                    {{"name", config.default_kernel_name}, {"searched", config.effective_kernelspec_dirs()}});
    KernelManager kernels(io, logger, config, kernelspecs, writer, metrics);
    JupyterSessionManager sessions(writer);
    TenantDirectory tenants(writer, *durable.secret);
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

    boost::asio::signal_set stop_signals(io, SIGINT, SIGTERM);
    boost::asio::steady_timer exit_timer(io);
    stop_on_signal(stop_signals, exit_timer, io, config, logger, server, kernels);
    announce_ready(config, server.tls(), port, generated_token);

    run_serving(io, logger);
    kernels.shutdown_all();
}

}  // namespace

int main(int argc, char** argv) {
    const bool heap_policy_set = keep_message_buffers_on_the_heap();
    CommandLine command_line;
    if (const auto exit_status = command_line.parse(argc, argv))
        return *exit_status;
    if (command_line.print_reference) {
        std::cout << configuration_reference();
        return 0;
    }
    warn_of_secrets_on_the_command_line(command_line.setting_flags);

    GatewayConfig config;
    try {
        merge_configuration(config, command_line);
    } catch (const std::exception& error) {
        std::cerr << "cellblock-gateway: " << error.what() << "\n";
        return 2;
    }
    if (command_line.print_config) {
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
    DurableState durable;
    try {
        open_durable_state(config, durable);
    } catch (const std::exception& error) {
        logger.error("cannot_start", {{"error", error.what()}});
        std::cerr << "cellblock-gateway: " << error.what() << "\n";
        return 1;
    }

    try {
        serve(config, logger, durable, generated_token);
    } catch (const std::exception& error) {
        logger.error("fatal", {{"error", error.what()}});
        std::cerr << "cellblock-gateway: " << error.what() << "\n";
        return 1;
    }
    return 0;
}
