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

std::vector<std::string> parse_list(const std::string& text) {
    std::vector<std::string> items;
    std::string current;
    for (char c : text) {
        if (c == ',' || c == ':') {
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

void GatewayConfig::merge_json(const json& j) {
    if (!j.is_object())
        throw std::invalid_argument("the gateway config must be a JSON object");
    static const std::vector<std::string> known = {"ip",
                                                   "port",
                                                   "base_url",
                                                   "token",
                                                   "certfile",
                                                   "keyfile",
                                                   "client_ca",
                                                   "allow_origin",
                                                   "allow_credentials",
                                                   "allow_headers",
                                                   "allow_methods",
                                                   "expose_headers",
                                                   "max_age",
                                                   "kernelspec_dirs",
                                                   "default_kernel_name",
                                                   "force_kernel_name",
                                                   "kernel_aliases",
                                                   "list_kernels",
                                                   "max_kernels",
                                                   "warm_pool",
                                                   "pool_ignored_env",
                                                   "kernel_launch_timeout",
                                                   "autorestart",
                                                   "restart_limit",
                                                   "cull_idle_timeout",
                                                   "cull_interval",
                                                   "cull_connected",
                                                   "cull_busy",
                                                   "env_whitelist",
                                                   "env_process_whitelist",
                                                   "ws_ping_interval",
                                                   "max_message_bytes",
                                                   "max_body_bytes",
                                                   "offline_buffer_messages",
                                                   "offline_buffer_bytes",
                                                   "offline_session_ttl",
                                                   "max_pending_send_bytes",
                                                   "header_timeout",
                                                   "max_unauthenticated_connections",
                                                   "max_unauthenticated_per_address",
                                                   "fd_reserve",
                                                   "runtime_dir",
                                                   "workspace_root",
                                                   "state_dir",
                                                   "store",
                                                   "store_key_file",
                                                   "orphan_timeout",
                                                   "shutdown_kernels_on_exit",
                                                   "zygote_tenant",
                                                   "log_level",
                                                   "provisioner",
                                                   "launch_registry_ip",
                                                   "slurm_partition",
                                                   "slurm_account",
                                                   "slurm_qos",
                                                   "slurm_constraint",
                                                   "slurm_time_limit",
                                                   "slurm_cpus_per_task",
                                                   "slurm_mem_mb",
                                                   "slurm_memory_overhead_mb",
                                                   "slurm_job_output",
                                                   "slurm_poll_interval",
                                                   "network"};
    for (const auto& [key, value] : j.items()) {
        if (key.starts_with("_"))
            continue;  // comments
        if (std::find(known.begin(), known.end(), key) == known.end())
            throw std::invalid_argument("unknown gateway config key '" + key + "'");
    }
    take(j, "ip", ip);
    take(j, "port", port);
    take(j, "base_url", base_url);
    if (j.contains("token") && j["token"].is_string())
        token = j["token"].get<std::string>();
    take(j, "certfile", certfile);
    take(j, "keyfile", keyfile);
    take(j, "client_ca", client_ca);
    take(j, "allow_origin", allow_origin);
    take(j, "allow_credentials", allow_credentials);
    take(j, "allow_headers", allow_headers);
    take(j, "allow_methods", allow_methods);
    take(j, "expose_headers", expose_headers);
    take(j, "max_age", max_age);
    take(j, "kernelspec_dirs", kernelspec_dirs);
    take(j, "default_kernel_name", default_kernel_name);
    take(j, "force_kernel_name", force_kernel_name);
    take(j, "kernel_aliases", kernel_aliases);
    take(j, "list_kernels", list_kernels);
    take(j, "max_kernels", max_kernels);
    take(j, "warm_pool", warm_pool);
    take(j, "pool_ignored_env", pool_ignored_env);
    take(j, "kernel_launch_timeout", kernel_launch_timeout);
    take(j, "autorestart", autorestart);
    take(j, "restart_limit", restart_limit);
    take(j, "cull_idle_timeout", cull_idle_timeout);
    take(j, "cull_interval", cull_interval);
    take(j, "cull_connected", cull_connected);
    take(j, "cull_busy", cull_busy);
    take(j, "env_whitelist", env_whitelist);
    take(j, "env_process_whitelist", env_process_whitelist);
    take(j, "ws_ping_interval", ws_ping_interval);
    take(j, "max_message_bytes", max_message_bytes);
    take(j, "max_body_bytes", max_body_bytes);
    take(j, "offline_buffer_messages", offline_buffer_messages);
    take(j, "offline_buffer_bytes", offline_buffer_bytes);
    take(j, "offline_session_ttl", offline_session_ttl);
    take(j, "max_pending_send_bytes", max_pending_send_bytes);
    take(j, "header_timeout", header_timeout);
    take(j, "max_unauthenticated_connections", max_unauthenticated_connections);
    take(j, "max_unauthenticated_per_address", max_unauthenticated_per_address);
    take(j, "fd_reserve", fd_reserve);
    take(j, "runtime_dir", runtime_dir);
    take(j, "workspace_root", workspace_root);
    take(j, "state_dir", state_dir);
    take(j, "store", store);
    take(j, "store_key_file", store_key_file);
    take(j, "orphan_timeout", orphan_timeout);
    take(j, "shutdown_kernels_on_exit", shutdown_kernels_on_exit);
    take(j, "zygote_tenant", zygote_tenant);
    take(j, "log_level", log_level);
    take(j, "provisioner", provisioner);
    take(j, "launch_registry_ip", launch_registry_ip);
    take(j, "slurm_partition", slurm_partition);
    take(j, "slurm_account", slurm_account);
    take(j, "slurm_qos", slurm_qos);
    take(j, "slurm_constraint", slurm_constraint);
    take(j, "slurm_time_limit", slurm_time_limit);
    take(j, "slurm_cpus_per_task", slurm_cpus_per_task);
    take(j, "slurm_mem_mb", slurm_mem_mb);
    take(j, "slurm_memory_overhead_mb", slurm_memory_overhead_mb);
    take(j, "slurm_job_output", slurm_job_output);
    take(j, "slurm_poll_interval", slurm_poll_interval);
    if (j.contains("network") && !j["network"].is_null()) {
        const json& network = j["network"];
        if (!network.is_object())
            throw std::invalid_argument("config key 'network': must be an object");
        for (const auto& [key, value] : network.items())
            if (!key.starts_with("_") && key != "allow" && key != "default" && key != "egress_hosts" &&
                key != "approval_timeout" && key != "ports" && key != "egress_deny")
                throw std::invalid_argument("unknown gateway config key 'network." + key + "'");
        take(network, "allow", network_allow);
        if (network.contains("default"))
            network_default = network["default"];
        take(network, "egress_hosts", egress_hosts);
        take(network, "approval_timeout", network_approval_timeout);
        take(network, "ports", network_ports);
        take(network, "egress_deny", egress_deny);
    }
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
    auto text = [&](const char* name, std::string& field) {
        if (auto value = lookup(name))
            field = *value;
    };
    auto number = [&](const char* name, auto& field) {
        if (auto value = lookup(name))
            field = parse_number<std::remove_reference_t<decltype(field)>>(name, *value);
    };
    auto boolean = [&](const char* name, bool& field) {
        if (auto value = lookup(name))
            field = parse_bool(name, *value);
    };
    auto list = [&](const char* name, std::vector<std::string>& field) {
        if (auto value = lookup(name))
            field = parse_list(*value);
    };
    text("KG_IP", ip);
    number("KG_PORT", port);
    text("KG_BASE_URL", base_url);
    if (auto value = lookup("KG_AUTH_TOKEN"))
        token = *value;
    text("KG_CERTFILE", certfile);
    text("KG_KEYFILE", keyfile);
    text("KG_CLIENT_CA", client_ca);
    text("KG_ALLOW_ORIGIN", allow_origin);
    text("KG_ALLOW_CREDENTIALS", allow_credentials);
    text("KG_ALLOW_HEADERS", allow_headers);
    text("KG_ALLOW_METHODS", allow_methods);
    text("KG_EXPOSE_HEADERS", expose_headers);
    text("KG_MAX_AGE", max_age);
    text("KG_DEFAULT_KERNEL_NAME", default_kernel_name);
    text("KG_FORCE_KERNEL_NAME", force_kernel_name);
    boolean("KG_LIST_KERNELS", list_kernels);
    number("KG_MAX_KERNELS", max_kernels);
    number("KG_PRESPAWN_COUNT", warm_pool);
    list("KG_ENV_WHITELIST", env_whitelist);
    list("KG_ENV_PROCESS_WHITELIST", env_process_whitelist);
    number("KG_WS_PING_INTERVAL_SECS", ws_ping_interval);
    list("CELLBLOCK_GATEWAY_KERNELSPEC_DIRS", kernelspec_dirs);
    number("CELLBLOCK_GATEWAY_CULL_IDLE_TIMEOUT", cull_idle_timeout);
    number("CELLBLOCK_GATEWAY_CULL_INTERVAL", cull_interval);
    number("CELLBLOCK_GATEWAY_HEADER_TIMEOUT", header_timeout);
    number("CELLBLOCK_GATEWAY_MAX_UNAUTHENTICATED_CONNECTIONS", max_unauthenticated_connections);
    number("CELLBLOCK_GATEWAY_MAX_UNAUTHENTICATED_PER_ADDRESS", max_unauthenticated_per_address);
    number("CELLBLOCK_GATEWAY_FD_RESERVE", fd_reserve);
    text("CELLBLOCK_GATEWAY_RUNTIME_DIR", runtime_dir);
    text("CELLBLOCK_GATEWAY_WORKSPACE_ROOT", workspace_root);
    text("CELLBLOCK_GATEWAY_STATE_DIR", state_dir);
    text("CELLBLOCK_GATEWAY_STORE", store);
    text("CELLBLOCK_GATEWAY_STORE_KEY_FILE", store_key_file);
    number("CELLBLOCK_GATEWAY_ORPHAN_TIMEOUT", orphan_timeout);
    boolean("CELLBLOCK_GATEWAY_SHUTDOWN_KERNELS_ON_EXIT", shutdown_kernels_on_exit);
    text("CELLBLOCK_GATEWAY_ZYGOTE_TENANT", zygote_tenant);
    text("CELLBLOCK_GATEWAY_LOG_LEVEL", log_level);
    text("CELLBLOCK_GATEWAY_PROVISIONER", provisioner);
    text("CELLBLOCK_GATEWAY_LAUNCH_REGISTRY_IP", launch_registry_ip);
    text("CELLBLOCK_GATEWAY_SLURM_PARTITION", slurm_partition);
    text("CELLBLOCK_GATEWAY_SLURM_ACCOUNT", slurm_account);
    text("CELLBLOCK_GATEWAY_SLURM_QOS", slurm_qos);
    text("CELLBLOCK_GATEWAY_SLURM_CONSTRAINT", slurm_constraint);
    text("CELLBLOCK_GATEWAY_SLURM_TIME_LIMIT", slurm_time_limit);
    number("CELLBLOCK_GATEWAY_SLURM_CPUS_PER_TASK", slurm_cpus_per_task);
    number("CELLBLOCK_GATEWAY_SLURM_MEM_MB", slurm_mem_mb);
    text("CELLBLOCK_GATEWAY_SLURM_JOB_OUTPUT", slurm_job_output);
    number("CELLBLOCK_GATEWAY_SLURM_POLL_INTERVAL", slurm_poll_interval);
    if (auto value = lookup("CELLBLOCK_GATEWAY_NETWORK_ALLOW")) {
        // Comma-separated (':' belongs to IPv6 literals here).
        network_allow.clear();
        std::string current;
        for (char c : *value + ",") {
            if (c == ',') {
                if (!current.empty())
                    network_allow.push_back(current);
                current.clear();
            } else if (c != ' ') {
                current += c;
            }
        }
    }
    if (auto value = lookup("CELLBLOCK_GATEWAY_NETWORK_DEFAULT")) {
        network_default = value->empty() ? json(nullptr) : json::parse(*value, nullptr, false);
        if (network_default.is_discarded())
            throw std::invalid_argument("CELLBLOCK_GATEWAY_NETWORK_DEFAULT: not valid JSON");
    }
    text("CELLBLOCK_GATEWAY_EGRESS_HOSTS", egress_hosts);
    number("CELLBLOCK_GATEWAY_NETWORK_APPROVAL_TIMEOUT", network_approval_timeout);
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
    json j = {{"ip", ip},
              {"port", port},
              {"base_url", base_url},
              {"kernelspec_dirs", effective_kernelspec_dirs()},
              {"default_kernel_name", default_kernel_name},
              {"kernel_aliases", kernel_aliases},
              {"list_kernels", list_kernels},
              {"max_kernels", max_kernels},
              {"warm_pool", warm_pool},
              {"cull_idle_timeout", cull_idle_timeout},
              {"cull_interval", cull_interval},
              {"cull_connected", cull_connected},
              {"cull_busy", cull_busy},
              {"ws_ping_interval", ws_ping_interval},
              {"header_timeout", header_timeout},
              {"max_unauthenticated_connections", max_unauthenticated_connections},
              {"max_unauthenticated_per_address", max_unauthenticated_per_address},
              {"fd_reserve", fd_reserve},
              {"state_dir", state_dir},
              // The password (if the URL holds one) is not printed.
              {"store", store.empty() ? std::string("sqlite") : masked_store(store)},
              {"store_key_file", store_key_file},
              {"orphan_timeout", orphan_timeout},
              {"shutdown_kernels_on_exit", shutdown_kernels_on_exit},
              {"zygote_tenant", zygote_tenant},
              {"provisioner", provisioner},
              {"launch_registry_ip", launch_registry_ip},
              {"slurm",
               {{"partition", slurm_partition},
                {"account", slurm_account},
                {"qos", slurm_qos},
                {"constraint", slurm_constraint},
                {"time_limit", slurm_time_limit},
                {"cpus_per_task", slurm_cpus_per_task},
                {"mem_mb", slurm_mem_mb},
                {"job_output", slurm_job_output},
                {"poll_interval", slurm_poll_interval}}},
              {"network",
               {{"allow", network_allow},
                {"default", network_default},
                {"egress_hosts", egress_hosts},
                {"approval_timeout", network_approval_timeout},
                {"ports", network_ports},
                {"egress_deny", egress_deny}}},
              {"tls", !certfile.empty()}};
    return j;
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
