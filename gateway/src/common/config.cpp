#include "cellblock/gateway/common/config.hpp"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <regex>
#include <stdexcept>
#include <type_traits>
#include <utility>
#include <variant>

namespace cellblock::gateway {

using nlohmann::json;

namespace {
// A value into its field exactly, or an error naming `where`: an integer field takes only a whole number
// within its range (a port of 70000 or a byte cap of -1 would otherwise be truncated or wrapped into another,
// valid looking value), a floating-point field a finite number, a flag true or false. One rule for the config
// file and the environment.
template <typename T>
T exact_value(const json& value, const std::string& where) {
    if constexpr (std::is_same_v<T, bool>) {
        if (!value.is_boolean())
            throw std::invalid_argument(where + ": must be true or false");
        return value.get<bool>();
    } else if constexpr (std::is_integral_v<T>) {
        if (!value.is_number_integer())  // nlohmann: true for signed and unsigned integers, not for floats
            throw std::invalid_argument(where + ": must be a whole number, got " + value.dump());
        if (value.is_number_unsigned()) {
            if (const auto number = value.get<std::uint64_t>(); std::in_range<T>(number))
                return static_cast<T>(number);
        } else if (const auto number = value.get<std::int64_t>(); std::in_range<T>(number)) {
            return static_cast<T>(number);
        }
        throw std::invalid_argument(where + ": " + value.dump() + " is out of range (" +
                                    std::to_string(std::numeric_limits<T>::min()) + " to " +
                                    std::to_string(std::numeric_limits<T>::max()) + ")");
    } else if constexpr (std::is_floating_point_v<T>) {
        if (!value.is_number() || !std::isfinite(value.get<double>()))
            throw std::invalid_argument(where + ": must be a number, got " + value.dump());
        return value.get<T>();
    } else {
        try {
            return value.get<T>();
        } catch (const json::exception& error) {
            throw std::invalid_argument(where + ": " + error.what());
        }
    }
}

template <typename T>
void take(const json& source, const char* key, T& field) {
    auto found = source.find(key);
    if (found == source.end() || found->is_null())
        return;
    field = exact_value<T>(*found, std::string("config key '") + key + "'");
}

bool parse_bool(const std::string& name, const std::string& text) {
    if (text == "1" || text == "true" || text == "True" || text == "yes")
        return true;
    if (text == "0" || text == "false" || text == "False" || text == "no" || text.empty())
        return false;
    throw std::invalid_argument(name + ": expected true/false, got '" + text + "'");
}

// An environment variable's number, read as a JSON number so that it meets exact_value's rule.
template <typename T>
T parse_number(const std::string& name, const std::string& text) {
    const json number = json::parse(text, nullptr, false);
    if (number.is_discarded() || !number.is_number())
        throw std::invalid_argument(name + ": expected a number, got '" + text + "'");
    return exact_value<T>(number, name);
}

std::vector<std::string> parse_list(const std::string& text, std::string_view separators) {
    std::vector<std::string> items;
    std::string current;
    for (char c : text) {
        if (separators.find(c) != std::string_view::npos) {
            if (!current.empty())
                items.push_back(current);
            current.clear();
        } else if (c != ' ') {
            current += c;
        }
    }
    if (!current.empty())
        items.push_back(current);
    return items;
}
}  // namespace

// The table: every setting once. The order is the merge order (which error shows first when several values
// are wrong) and the order of docs/configuration.md.
namespace {
// The table: every setting once. The order is the merge order (which error shows first when several values
// are wrong) and the order of docs/configuration.md.
using C = GatewayConfig;
constexpr Setting setting_table[] = {
    // Network and TLS.
    {.topic = "Network and TLS",
     .key = "ip",
     .env = "KG_IP",
     .flag = "--ip",
     .help = "address to bind",
     .field = &C::ip},
    {.topic = "Network and TLS",
     .key = "port",
     .env = "KG_PORT",
     .flag = "--port",
     .help = "port to bind; 0 = any free port",
     .field = &C::port,
     .check = FlagCheck::range,
     .low = 0,
     .high = 65535},
    {.topic = "Network and TLS",
     .key = "base_url",
     .env = "KG_BASE_URL",
     .flag = "--base-url",
     .help = "URL prefix of every route",
     .field = &C::base_url},
    {.topic = "Network and TLS",
     .key = "token",
     .env = "KG_AUTH_TOKEN",
     .flag = "--token",
     .help = "auth token; empty = no authentication. On the command line any local user reads it: prefer "
             "--token-file (a file of mode 600) or KG_AUTH_TOKEN. A config file value that is not a string "
             "is ignored",
     .field = &C::token,
     .default_text = "generated at startup",
     .printed = Printed::never,
     .file_flag = "--token-file"},
    {.topic = "Network and TLS",
     .key = "certfile",
     .env = "KG_CERTFILE",
     .flag = "--certfile",
     .help = "TLS certificate chain (PEM); enables HTTPS/WSS",
     .field = &C::certfile},
    {.topic = "Network and TLS",
     .key = "keyfile",
     .env = "KG_KEYFILE",
     .flag = "--keyfile",
     .help = "TLS private key (PEM)",
     .field = &C::keyfile},
    {.topic = "Network and TLS",
     .key = "client_ca",
     .env = "KG_CLIENT_CA",
     .flag = "--client-ca",
     .help = "CA file; client certificates become mandatory",
     .field = &C::client_ca},
    // CORS: each header is sent only when its setting is not empty, as Kernel Gateway does.
    {.topic = "CORS",
     .key = "allow_origin",
     .env = "KG_ALLOW_ORIGIN",
     .flag = "--allow-origin",
     .help = "Access-Control-Allow-Origin",
     .field = &C::allow_origin},
    {.topic = "CORS",
     .key = "allow_credentials",
     .env = "KG_ALLOW_CREDENTIALS",
     .help = "Access-Control-Allow-Credentials",
     .field = &C::allow_credentials},
    {.topic = "CORS",
     .key = "allow_headers",
     .env = "KG_ALLOW_HEADERS",
     .help = "Access-Control-Allow-Headers",
     .field = &C::allow_headers},
    {.topic = "CORS",
     .key = "allow_methods",
     .env = "KG_ALLOW_METHODS",
     .help = "Access-Control-Allow-Methods",
     .field = &C::allow_methods},
    {.topic = "CORS",
     .key = "expose_headers",
     .env = "KG_EXPOSE_HEADERS",
     .help = "Access-Control-Expose-Headers",
     .field = &C::expose_headers},
    {.topic = "CORS",
     .key = "max_age",
     .env = "KG_MAX_AGE",
     .help = "Access-Control-Max-Age",
     .field = &C::max_age},
    // Kernelspecs.
    {.topic = "Kernelspecs",
     .key = "kernelspec_dirs",
     .env = "CELLBLOCK_GATEWAY_KERNELSPEC_DIRS",
     .flag = "--kernelspec-dir",
     .help = "directories holding <name>/kernel.json",
     .field = &C::kernelspec_dirs,
     .default_text = "<prefix>/share/jupyter/kernels"},
    {.topic = "Kernelspecs",
     .key = "default_kernel_name",
     .env = "KG_DEFAULT_KERNEL_NAME",
     .flag = "--default-kernel-name",
     .help = "kernelspec used when none is requested",
     .field = &C::default_kernel_name},
    {.topic = "Kernelspecs",
     .key = "force_kernel_name",
     .env = "KG_FORCE_KERNEL_NAME",
     .help = "kernelspec used whatever a request asks for; empty = the requested one",
     .field = &C::force_kernel_name},
    {.topic = "Kernelspecs",
     .key = "kernel_aliases",
     .help = "extra names accepted for a kernelspec (alias: target); a target that does not exist is ignored",
     .field = &C::kernel_aliases},
    // Kernel lifecycle.
    {.topic = "Kernel lifecycle",
     .key = "list_kernels",
     .env = "KG_LIST_KERNELS",
     .flag = "--list-kernels",
     .help = "allow GET /api/kernels and /api/sessions",
     .field = &C::list_kernels},
    {.topic = "Kernel lifecycle",
     .key = "max_kernels",
     .env = "KG_MAX_KERNELS",
     .flag = "--max-kernels",
     .help = "kernels handed out or starting for a request at once; 0 = unlimited",
     .field = &C::max_kernels,
     .check = FlagCheck::range,
     .low = 0,
     .high = 100000},
    {.topic = "Kernel lifecycle",
     .key = "warm_pool",
     .env = "KG_PRESPAWN_COUNT",
     .flag = "--warm-pool",
     .help = "pre-started kernels of the default kernelspec handed out by POST /api/kernels (not listed, not "
             "counted)",
     .field = &C::warm_pool,
     .check = FlagCheck::range,
     .low = 0,
     .high = 1000},
    {.topic = "Kernel lifecycle",
     .key = "pool_ignored_env",
     .help = "request env names a warm-pool kernel may differ in and still be handed out",
     .field = &C::pool_ignored_env},
    {.topic = "Kernel lifecycle",
     .key = "kernel_launch_timeout",
     .help = "seconds until a kernel must answer kernel_info",
     .field = &C::kernel_launch_timeout},
    {.topic = "Kernel lifecycle",
     .key = "autorestart",
     .help = "restart a kernel that died",
     .field = &C::autorestart},
    {.topic = "Kernel lifecycle",
     .key = "restart_limit",
     .help = "restarts of one kernel before it is dead",
     .field = &C::restart_limit},
    {.topic = "Kernel lifecycle",
     .key = "cull_idle_timeout",
     .env = "CELLBLOCK_GATEWAY_CULL_IDLE_TIMEOUT",
     .flag = "--cull-idle-timeout",
     .help = "seconds of inactivity before a kernel is culled; 0 = never",
     .field = &C::cull_idle_timeout},
    {.topic = "Kernel lifecycle",
     .key = "cull_interval",
     .env = "CELLBLOCK_GATEWAY_CULL_INTERVAL",
     .flag = "--cull-interval",
     .help = "seconds between cull checks",
     .field = &C::cull_interval},
    {.topic = "Kernel lifecycle",
     .key = "cull_connected",
     .flag = "--cull-connected",
     .help = "cull kernels that have open WebSockets",
     .field = &C::cull_connected},
    {.topic = "Kernel lifecycle",
     .key = "cull_busy",
     .flag = "--cull-busy",
     .help = "cull busy kernels",
     .field = &C::cull_busy},
    {.topic = "Kernel lifecycle",
     .key = "env_whitelist",
     .env = "KG_ENV_WHITELIST",
     .help = "request env names passed to kernels besides KERNEL_*",
     .field = &C::env_whitelist},
    {.topic = "Kernel lifecycle",
     .key = "env_process_whitelist",
     .env = "KG_ENV_PROCESS_WHITELIST",
     .help = "the gateway's env names passed to kernels besides PATH",
     .field = &C::env_process_whitelist},
    // WebSocket.
    {.topic = "WebSocket",
     .key = "ws_ping_interval",
     .env = "KG_WS_PING_INTERVAL_SECS",
     .flag = "--ws-ping-interval",
     .help = "seconds between WebSocket pings; 0 = off",
     .field = &C::ws_ping_interval},
    {.topic = "WebSocket",
     .key = "max_message_bytes",
     .help = "largest WebSocket message accepted from a client",
     .field = &C::max_message_bytes},
    {.topic = "WebSocket",
     .key = "max_body_bytes",
     .help = "largest REST request body",
     .field = &C::max_body_bytes},
    {.topic = "WebSocket",
     .key = "offline_buffer_messages",
     .help = "messages kept per dropped session_id, replayed on reconnect",
     .field = &C::offline_buffer_messages},
    {.topic = "WebSocket",
     .key = "offline_buffer_bytes",
     .help = "bytes kept per dropped session_id",
     .field = &C::offline_buffer_bytes},
    {.topic = "WebSocket",
     .key = "offline_session_ttl",
     .help = "seconds a dropped session_id keeps its sockets and buffer",
     .field = &C::offline_session_ttl},
    {.topic = "WebSocket",
     .key = "max_pending_send_bytes",
     .help = "bytes queued for a client; a slower client is disconnected",
     .field = &C::max_pending_send_bytes},
    // Connections before authentication (connection_admission.hpp).
    {.topic = "Connections before authentication",
     .key = "header_timeout",
     .env = "CELLBLOCK_GATEWAY_HEADER_TIMEOUT",
     .flag = "--header-timeout",
     .help = "seconds a connection that has not authenticated has to send its request headers",
     .field = &C::header_timeout,
     .check = FlagCheck::positive},
    {.topic = "Connections before authentication",
     .key = "max_unauthenticated_connections",
     .env = "CELLBLOCK_GATEWAY_MAX_UNAUTHENTICATED_CONNECTIONS",
     .flag = "--max-unauthenticated-connections",
     .help = "connections kept before their first authenticated request; more are closed at once; 0 = "
             "min(4096, (file limit - fd_reserve) / 2)",
     .field = &C::max_unauthenticated_connections},
    {.topic = "Connections before authentication",
     .key = "max_unauthenticated_per_address",
     .env = "CELLBLOCK_GATEWAY_MAX_UNAUTHENTICATED_PER_ADDRESS",
     .flag = "--max-unauthenticated-per-address",
     .help = "the same, per client IP address; 0 = the global cap",
     .field = &C::max_unauthenticated_per_address},
    {.topic = "Connections before authentication",
     .key = "fd_reserve",
     .env = "CELLBLOCK_GATEWAY_FD_RESERVE",
     .flag = "--fd-reserve",
     .help = "file descriptors kept free for kernel starts: accepting pauses below it; 0 = off",
     .field = &C::fd_reserve},
    // Filesystem and store (state_directory.hpp, store_sealing.hpp).
    {.topic = "State and store",
     .key = "runtime_dir",
     .env = "CELLBLOCK_GATEWAY_RUNTIME_DIR",
     .flag = "--runtime-dir",
     .help = "private directory for connection files and ipc sockets",
     .field = &C::runtime_dir,
     .default_text = "in the state directory"},
    {.topic = "State and store",
     .key = "workspace_root",
     .env = "CELLBLOCK_GATEWAY_WORKSPACE_ROOT",
     .flag = "--workspace-root",
     .help = "where per-kernel CELLBLOCK_WORKSPACE directories are made",
     .field = &C::workspace_root,
     .default_text = "in the state directory"},
    {.topic = "State and store",
     .key = "state_dir",
     .env = "CELLBLOCK_GATEWAY_STATE_DIR",
     .flag = "--state-dir",
     .help = "the store, kernels' sockets and workspaces; kernels survive a gateway restart on the same one",
     .field = &C::state_dir,
     .default_text = "$XDG_STATE_HOME/cellblock or ~/.local/state/cellblock"},
    {.topic = "State and store",
     .key = "store",
     .env = "CELLBLOCK_GATEWAY_STORE",
     .flag = "--store",
     .help = "the session store: empty = SQLite in the state directory; postgresql://... = a PostgreSQL "
             "store "
             "shared by several gateways. A password on the command line is readable by every local user: "
             "prefer --store-file (mode 600) or CELLBLOCK_GATEWAY_STORE",
     .field = &C::store,
     .default_text = "SQLite in the state directory",
     .printed = Printed::masked_store,
     .file_flag = "--store-file"},
    {.topic = "State and store",
     .key = "store_key_file",
     .env = "CELLBLOCK_GATEWAY_STORE_KEY_FILE",
     .flag = "--store-key-file",
     .help = "the secret (64 hex digits, mode 600) that seals kernels' keys in the store; required for a "
             "PostgreSQL store, the same file for every gateway on it",
     .field = &C::store_key_file,
     .default_text = "store-key in the state directory"},
    {.topic = "State and store",
     .key = "orphan_timeout",
     .env = "CELLBLOCK_GATEWAY_ORPHAN_TIMEOUT",
     .flag = "--orphan-timeout",
     .help = "seconds a kernel keeps running without a gateway before it stops itself; 0 = forever",
     .field = &C::orphan_timeout,
     .check = FlagCheck::non_negative},
    {.topic = "State and store",
     .key = "shutdown_kernels_on_exit",
     .env = "CELLBLOCK_GATEWAY_SHUTDOWN_KERNELS_ON_EXIT",
     .flag = "--shutdown-kernels-on-exit",
     .help = "SIGTERM stops the kernels too (by default they keep running for the next gateway; SIGINT "
             "always "
             "stops them)",
     .field = &C::shutdown_kernels_on_exit,
     .switch_only = true},
    {.topic = "State and store",
     .key = "zygote_tenant",
     .env = "CELLBLOCK_GATEWAY_ZYGOTE_TENANT",
     .flag = "--zygote-tenant",
     .help = "the worker zygote's tenant of every kernel this gateway starts (CELLBLOCK_ZYGOTE_TENANT; "
             "used when "
             "the kernel config switches the zygote on); sessions of one tenant share a template. A "
             "plain name: "
             "at most 64 of A-Za-z0-9._-",
     .field = &C::zygote_tenant},
    {.topic = "State and store",
     .key = "log_level",
     .env = "CELLBLOCK_GATEWAY_LOG_LEVEL",
     .flag = "--log-level",
     .help = "debug, info, warning or error",
     .field = &C::log_level},
    // Where kernels run (provisioner.hpp).
    {.topic = "Provisioner and Slurm",
     .key = "provisioner",
     .env = "CELLBLOCK_GATEWAY_PROVISIONER",
     .flag = "--provisioner",
     .help = "where kernels run: local (children of the gateway) or slurm (one batch job per kernel; see "
             "gateway/README.md); a kernelspec's metadata.cellblock.provisioner overrides it",
     .field = &C::provisioner,
     .choices = "local,slurm"},
    {.topic = "Provisioner and Slurm",
     .key = "launch_registry_ip",
     .env = "CELLBLOCK_GATEWAY_LAUNCH_REGISTRY_IP",
     .flag = "--launch-registry-ip",
     .help = "address of this host that Slurm-hosted kernels report to",
     .field = &C::launch_registry_ip},
    {.topic = "Provisioner and Slurm",
     .key = "slurm_partition",
     .env = "CELLBLOCK_GATEWAY_SLURM_PARTITION",
     .flag = "--slurm-partition",
     .help = "sbatch --partition; empty = Slurm's default",
     .field = &C::slurm_partition,
     .printed_as = "slurm.partition"},
    {.topic = "Provisioner and Slurm",
     .key = "slurm_account",
     .env = "CELLBLOCK_GATEWAY_SLURM_ACCOUNT",
     .flag = "--slurm-account",
     .help = "sbatch --account; empty = Slurm's default",
     .field = &C::slurm_account,
     .printed_as = "slurm.account"},
    {.topic = "Provisioner and Slurm",
     .key = "slurm_qos",
     .env = "CELLBLOCK_GATEWAY_SLURM_QOS",
     .flag = "--slurm-qos",
     .help = "sbatch --qos; empty = Slurm's default",
     .field = &C::slurm_qos,
     .printed_as = "slurm.qos"},
    {.topic = "Provisioner and Slurm",
     .key = "slurm_constraint",
     .env = "CELLBLOCK_GATEWAY_SLURM_CONSTRAINT",
     .flag = "--slurm-constraint",
     .help = "sbatch --constraint; empty = none",
     .field = &C::slurm_constraint,
     .printed_as = "slurm.constraint"},
    {.topic = "Provisioner and Slurm",
     .key = "slurm_time_limit",
     .env = "CELLBLOCK_GATEWAY_SLURM_TIME_LIMIT",
     .help = "sbatch --time (e.g. \"8:00:00\"); empty = the partition's default",
     .field = &C::slurm_time_limit,
     .printed_as = "slurm.time_limit"},
    {.topic = "Provisioner and Slurm",
     .key = "slurm_cpus_per_task",
     .env = "CELLBLOCK_GATEWAY_SLURM_CPUS_PER_TASK",
     .help = "sbatch --cpus-per-task",
     .field = &C::slurm_cpus_per_task,
     .printed_as = "slurm.cpus_per_task"},
    {.topic = "Provisioner and Slurm",
     .key = "slurm_mem_mb",
     .env = "CELLBLOCK_GATEWAY_SLURM_MEM_MB",
     .help = "sbatch --mem for kernels without a session memory limit; 0 = the partition's default",
     .field = &C::slurm_mem_mb,
     .printed_as = "slurm.mem_mb"},
    {.topic = "Provisioner and Slurm",
     .key = "slurm_memory_overhead_mb",
     .help = "MiB added to a session's memory limit for the kernel process itself",
     .field = &C::slurm_memory_overhead_mb,
     .printed_as = "slurm.memory_overhead_mb"},
    {.topic = "Provisioner and Slurm",
     .key = "slurm_job_output",
     .env = "CELLBLOCK_GATEWAY_SLURM_JOB_OUTPUT",
     .help = "sbatch --output on the node (%j = job id)",
     .field = &C::slurm_job_output,
     .printed_as = "slurm.job_output"},
    {.topic = "Provisioner and Slurm",
     .key = "slurm_poll_interval",
     .env = "CELLBLOCK_GATEWAY_SLURM_POLL_INTERVAL",
     .help = "seconds between squeue polls of the gateway's jobs",
     .field = &C::slurm_poll_interval,
     .printed_as = "slurm.poll_interval"},
    // Network by allowlist (network_policy.hpp).
    {.topic = "Network",
     .key = "network.allow",
     .env = "CELLBLOCK_GATEWAY_NETWORK_ALLOW",
     .flag = "--network-allow",
     .help = "host patterns a session's network policy may reach (\"pypi.org\", \"*.pythonhosted.org\", "
             "\"*\"): the ceiling; none = no session gets network. In the environment comma-separated",
     .field = &C::network_allow,
     .separators = ","},
    {.topic = "Network",
     .key = "network.default",
     .env = "CELLBLOCK_GATEWAY_NETWORK_DEFAULT",
     .flag = "--network-default",
     .help = "network policy of kernels started through the Kernel Gateway API, as JSON {\"allow\": [...], "
             "\"ask\": bool} within the ceiling (a kernelspec's metadata.cellblock.network overrides it); "
             "null or empty = no network",
     .field = &C::network_default},
    {.topic = "Network",
     .key = "network.egress_hosts",
     .env = "CELLBLOCK_GATEWAY_EGRESS_HOSTS",
     .flag = "--egress-hosts",
     .help = "hosts(5) file: a name listed there resolves only to its addresses, which are exempt from the "
             "private-address refusal",
     .field = &C::egress_hosts},
    {.topic = "Network",
     .key = "network.approval_timeout",
     .env = "CELLBLOCK_GATEWAY_NETWORK_APPROVAL_TIMEOUT",
     .flag = "--network-approval-timeout",
     .help = "seconds a held network request waits for an approval before it is denied",
     .field = &C::network_approval_timeout,
     .check = FlagCheck::positive},
    {.topic = "Network",
     .key = "network.ports",
     .help = "ports the kernels' egress proxy connects to",
     .field = &C::network_ports},
    {.topic = "Network",
     .key = "network.egress_deny",
     .flag = "--egress-deny",
     .help = "address ranges (CIDR) no kernel's egress proxy connects to, whatever a name resolves to, "
             "besides "
             "the private, loopback and metadata ranges always refused",
     .field = &C::egress_deny},
};
}  // namespace

std::span<const Setting> gateway_settings() {
    return setting_table;
}

void Setting::set_from_json(GatewayConfig& config, const json& value, const std::string& where) const {
    std::visit(
        [&](auto member) {
            using T = std::remove_cvref_t<decltype(config.*member)>;
            if constexpr (std::is_same_v<T, json>) {
                config.*member = value;  // null included: "no policy"
            } else if constexpr (std::is_same_v<T, std::optional<std::string>>) {
                // The token: only a string sets it; anything else leaves it (nullopt = generated at startup).
                if (value.is_string())
                    config.*member = value.get<std::string>();
            } else {
                if (!value.is_null())
                    config.*member = exact_value<T>(value, where);
            }
        },
        field);
}

void Setting::set_from_text(GatewayConfig& config, const std::string& text, const std::string& where) const {
    std::visit(
        [&](auto member) {
            using T = std::remove_cvref_t<decltype(config.*member)>;
            if constexpr (std::is_same_v<T, std::string> || std::is_same_v<T, std::optional<std::string>>) {
                config.*member = text;
            } else if constexpr (std::is_same_v<T, bool>) {
                config.*member = parse_bool(where, text);
            } else if constexpr (std::is_arithmetic_v<T>) {
                config.*member = parse_number<T>(where, text);
            } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
                config.*member = parse_list(text, separators);
            } else {
                // A JSON field (network.default; empty = null), or a list or map written as JSON.
                const json parsed = text.empty() ? json(nullptr) : json::parse(text, nullptr, false);
                if (parsed.is_discarded())
                    throw std::invalid_argument(where + ": not valid JSON");
                set_from_json(config, parsed, where);
            }
        },
        field);
}

json Setting::value_of(const GatewayConfig& config) const {
    return std::visit(
        [&](auto member) -> json {
            const auto& value = config.*member;
            if constexpr (std::is_same_v<std::remove_cvref_t<decltype(value)>, std::optional<std::string>>)
                return value ? json(*value) : json(nullptr);
            else
                return json(value);
        },
        field);
}

std::string Setting::default_shown() const {
    if (!default_text.empty())
        return std::string(default_text);
    return value_of(GatewayConfig{}).dump();
}

namespace {
// Whether `key` (a dotted path, "network.allow") names a setting, or a group of them ("network").
bool is_setting(const std::string& key) {
    const auto settings = gateway_settings();
    return std::any_of(settings.begin(), settings.end(), [&](const Setting& s) { return s.key == key; });
}

bool is_group(const std::string& key) {
    const auto settings = gateway_settings();
    return std::any_of(settings.begin(), settings.end(),
                       [&](const Setting& s) { return s.key.starts_with(key + "."); });
}

// Every key of the file is a setting or a group of them; keys starting with _ are comments.
void check_keys(const json& object, const std::string& prefix) {
    for (const auto& [name, value] : object.items()) {
        if (name.starts_with("_"))
            continue;
        const std::string key = prefix + name;
        if (is_setting(key))
            continue;
        if (!is_group(key))
            throw std::invalid_argument("unknown gateway config key '" + key + "'");
        if (value.is_null())
            continue;
        if (!value.is_object())
            throw std::invalid_argument("config key '" + key + "': must be an object");
        check_keys(value, key + ".");
    }
}

// The value at a dotted key, or nullptr when the file does not hold it.
const json* value_at(const json& object, std::string_view key) {
    const json* current = &object;
    for (;;) {
        const auto dot = key.find('.');
        const auto found = current->find(std::string(key.substr(0, dot)));
        if (found == current->end())
            return nullptr;
        if (dot == std::string_view::npos)
            return &*found;
        if (!found->is_object())
            return nullptr;
        current = &*found;
        key.remove_prefix(dot + 1);
    }
}

std::string number_text(double number) {
    return number == std::floor(number) ? std::to_string(static_cast<long long>(number))
                                        : json(number).dump();
}

// Text for a Markdown table cell: no column break, no HTML tag, no emphasis.
std::string cell(std::string_view text) {
    std::string escaped;
    for (char c : text) {
        if (c == '|' || c == '*')
            escaped += '\\';
        if (c == '<')
            escaped += "&lt;";
        else if (c == '>')
            escaped += "&gt;";
        else
            escaped += c;
    }
    return escaped;
}

std::string code(std::string_view text) {
    return text.empty() ? "-" : "`" + std::string(text) + "`";
}

std::string flag_cell(const Setting& setting) {
    if (setting.flag.empty())
        return "-";
    std::string text = code(setting.flag);
    if (std::holds_alternative<std::vector<std::string> GatewayConfig::*>(setting.field))
        text += " (repeatable)";
    if (setting.switch_only)
        text += " (no value)";
    if (setting.check == FlagCheck::range)
        text += " (" + number_text(setting.low) + " to " + number_text(setting.high) + ")";
    if (setting.check == FlagCheck::non_negative)
        text += " (>= 0)";
    if (setting.check == FlagCheck::positive)
        text += " (> 0)";
    if (!setting.file_flag.empty())
        text += ", " + code(std::string(setting.file_flag) + " FILE");
    return cell(text);
}
}  // namespace

void GatewayConfig::merge_json(const json& j) {
    if (!j.is_object())
        throw std::invalid_argument("the gateway config must be a JSON object");
    check_keys(j, "");
    for (const Setting& setting : gateway_settings())
        if (const json* value = value_at(j, setting.key))
            setting.set_from_json(*this, *value, "config key '" + std::string(setting.key) + "'");
}

void GatewayConfig::merge_file(const std::string& path) {
    std::ifstream input(path);
    if (!input)
        throw std::invalid_argument("cannot read config file " + path);
    json parsed = json::parse(input, nullptr, false);
    if (parsed.is_discarded())
        throw std::invalid_argument("config file " + path + " is not valid JSON");
    merge_json(parsed);
}

void GatewayConfig::merge_environment(
    const std::function<std::optional<std::string>(const std::string&)>& lookup) {
    for (const Setting& setting : gateway_settings()) {
        if (setting.env.empty())
            continue;
        const std::string name(setting.env);
        if (auto value = lookup(name))
            setting.set_from_text(*this, *value, name);
    }
}

std::string masked_store(const std::string& store) {
    // postgresql://user:SECRET@host/db, and the keyword form's password=SECRET or password='SE CRET' (also
    // as a URI parameter, ?password=SECRET&...).
    static const std::regex uri_password(R"(://([^:/@]*):[^@/]*@)");
    static const std::regex keyword_password(R"((\bpassword\s*=\s*)('(?:[^'\\]|\\.)*'|[^\s&]*))",
                                             std::regex::icase);
    return std::regex_replace(std::regex_replace(store, uri_password, "://$1:***@"), keyword_password,
                              "$1***");
}

json GatewayConfig::to_json() const {
    json j = json::object();
    for (const Setting& setting : gateway_settings()) {
        if (setting.printed == Printed::never)
            continue;
        json value = setting.value_of(*this);
        if (setting.printed == Printed::masked_store)  // the password (if the URL holds one) is not printed
            value = value.get<std::string>().empty() ? "sqlite" : masked_store(value.get<std::string>());
        std::string path = "/" + std::string(setting.printed_as.empty() ? setting.key : setting.printed_as);
        std::replace(path.begin(), path.end(), '.', '/');
        j[json::json_pointer(path)] = value;
    }
    // The directories really scanned, with the installed default when none is configured.
    j["kernelspec_dirs"] = effective_kernelspec_dirs();
    j["tls"] = !certfile.empty();
    return j;
}

std::string configuration_reference() {
    std::string text;
    std::string_view topic;
    for (const Setting& setting : gateway_settings()) {
        if (setting.topic != topic) {
            topic = setting.topic;
            text += (text.empty() ? "" : "\n") + std::string("## ") + std::string(topic) + "\n\n" +
                    "| Config key | Environment | Command line | Default | Meaning |\n" +
                    "| --- | --- | --- | --- | --- |\n";
        }
        std::string meaning(setting.help);
        if (!setting.choices.empty())
            meaning += "; one of " + std::string(setting.choices);
        text += "| " + code(setting.key) + " | " + code(setting.env) + " | " + flag_cell(setting) + " | " +
                (setting.default_text.empty() ? code(setting.default_shown()) : cell(setting.default_text)) +
                " | " + cell(meaning) + " |\n";
    }
    return text;
}

NetworkSettings GatewayConfig::network_settings() const {
    return checked_settings(network_allow, network_ports, network_approval_timeout, egress_deny);
}

NetworkRequest GatewayConfig::default_network() const {
    NetworkRequest request = parse_network_request(network_default);
    check_within_ceiling(request, network_settings().ceiling);
    return request;
}

void GatewayConfig::check_network() const {
    try {
        network_settings();
        default_network();
    } catch (const NetworkPolicyError& error) {
        throw std::invalid_argument(std::string("network settings: ") + error.what());
    }
    if (!egress_hosts.empty()) {
        std::ifstream hosts(egress_hosts);
        if (!hosts)
            throw std::invalid_argument("--egress-hosts " + egress_hosts + ": cannot read the file");
    }
}

void GatewayConfig::check_zygote_tenant() const {
    // The same rule as the kernel's (kernel_config.cpp): the name becomes part of a socket path.
    constexpr std::size_t longest = 64;
    const bool plain = std::all_of(zygote_tenant.begin(), zygote_tenant.end(), [](char c) {
        return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
               c == '_' || c == '-';
    });
    if (zygote_tenant.size() > longest || !plain || zygote_tenant == "." || zygote_tenant == "..")
        throw std::invalid_argument("zygote_tenant '" + zygote_tenant +
                                    "': a plain name of at most 64 of A-Za-z0-9._- is needed");
}

void GatewayConfig::check_durations() const {
    const std::pair<const char*, double> durations[] = {
        {"kernel_launch_timeout", kernel_launch_timeout},
        {"cull_idle_timeout", cull_idle_timeout},
        {"cull_interval", cull_interval},
        {"ws_ping_interval", ws_ping_interval},
        {"offline_session_ttl", offline_session_ttl},
        {"header_timeout", header_timeout},
        {"orphan_timeout", orphan_timeout},
        {"slurm_poll_interval", slurm_poll_interval},
        {"network.approval_timeout", network_approval_timeout},
    };
    for (const auto& [name, seconds] : durations)
        if (!(seconds >= 0 && seconds <= longest_duration_s))  // NaN fails both
            throw std::invalid_argument(std::string(name) + ": " + json(seconds).dump() +
                                        " is not a number of seconds from 0 to 1.5e9");
    // A connection that must send its headers within 0 s could never be served.
    if (header_timeout == 0)
        throw std::invalid_argument("header_timeout: must be a positive number of seconds");
}

std::string installed_data_dir() {
    std::error_code error;
    const auto executable = std::filesystem::read_symlink("/proc/self/exe", error);
    if (!error) {
        const auto share = executable.parent_path().parent_path() / "share";
        if (std::filesystem::is_directory(share / "jupyter" / "kernels", error) ||
            std::filesystem::is_directory(share / "cellblock", error))
            return share.string();
    }
    return CELLBLOCK_INSTALL_DATADIR;
}

std::vector<std::string> GatewayConfig::effective_kernelspec_dirs() const {
    if (!kernelspec_dirs.empty())
        return kernelspec_dirs;
    return {installed_data_dir() + "/jupyter/kernels"};
}

}  // namespace cellblock::gateway
