#pragma once
// Every setting of the gateway, with the defaults compiled in. Precedence (lowest first): these defaults, the
// JSON config file, environment variables (KG_* where Kernel Gateway has the same meaning, else
// CELLBLOCK_GATEWAY_*; the agent API's CELLBLOCK_AGENT_*), then the command line. Each setting's names
// (config key, environment variable, flag), help and field are declared once, in the table gateway_settings()
// returns (settings_table.cpp): the file and environment merges and --print-config (config.cpp), the command
// line (main.cpp) and docs/configuration.md are made from it.
#include <cstdint>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "cellblock/contract/limits.hpp"
#include "cellblock/gateway/access/network_policy.hpp"
#include "cellblock/gateway/agent/agent_config.hpp"

namespace cellblock::gateway {

// The longest duration any gateway setting takes, the same ceiling the kernel holds its limits to
// (contract/include/cellblock/contract/limits.hpp). GatewayConfig::check_durations and the agent API's
// options hold to it.
using contract::longest_duration_s;

// Members are grouped by topic, not by size: there is one instance.
struct GatewayConfig {  // NOLINT(clang-analyzer-optin.performance.Padding)
    // Network and TLS.
    std::string ip = "127.0.0.1";
    std::uint16_t port = 8888;
    std::string base_url = "/";
    std::optional<std::string> token;  // nullopt = generate one at startup; "" = no authentication
    std::string certfile, keyfile, client_ca;

    // CORS (each header is emitted only when non-empty, as Kernel Gateway does).
    std::string allow_origin, allow_credentials, allow_headers, allow_methods, expose_headers, max_age;

    // Kernelspecs: directories that contain <name>/kernel.json; empty = <prefix>/share/jupyter/kernels.
    std::vector<std::string> kernelspec_dirs;
    std::string default_kernel_name = "python3";
    std::string force_kernel_name;
    // Extra names accepted for a kernelspec. A target that does not exist is ignored, so "python3" falls back
    // to a kernelspec directory really called python3 (Debian's ipykernel) when cellblock-python is not
    // installed.
    std::map<std::string, std::string> kernel_aliases = {{"python3", "cellblock-python"},
                                                         {"python", "python3"}};

    // Kernel lifecycle.
    bool list_kernels = true;
    int max_kernels = 0;  // 0 = unlimited; counts kernels handed out or starting for a request
    int warm_pool = 1;    // pre-started kernels of the default spec (not listed, not counted)
    std::vector<std::string> pool_ignored_env = {"KERNEL_LAUNCH_TIMEOUT", "KERNEL_USERNAME",
                                                 "KERNEL_WORKING_DIR"};
    double kernel_launch_timeout = 60;  // seconds until a kernel must answer kernel_info
    bool autorestart = true;
    int restart_limit = 5;
    double cull_idle_timeout = 0;  // seconds; 0 = never cull
    double cull_interval = 300;
    bool cull_connected = false;
    bool cull_busy = false;
    std::vector<std::string> env_whitelist;          // request env names passed besides KERNEL_*
    std::vector<std::string> env_process_whitelist;  // gateway env names passed to kernels besides PATH

    // WebSocket.
    double ws_ping_interval = 30;                // 0 disables pings
    std::size_t max_message_bytes = 64u << 20;   // largest WebSocket message accepted from a client
    std::size_t max_body_bytes = 8u << 20;       // largest REST body
    std::size_t offline_buffer_messages = 2000;  // per dropped session_id, replayed on reconnect
    std::size_t offline_buffer_bytes = 32u << 20;
    double offline_session_ttl = 300;  // seconds a dropped session_id keeps its sockets and buffer
    std::size_t max_pending_send_bytes = 64u << 20;  // a client slower than this is disconnected

    // Connections before authentication (connection_admission.hpp). A connection is unauthenticated until its
    // first request with a valid token; until then its request headers must arrive within header_timeout
    // seconds (an authenticated keep-alive connection may idle for 60 s between requests).
    double header_timeout = 10;
    std::size_t max_unauthenticated_connections = 0;    // 0 = min(4096, (file limit - fd_reserve) / 2)
    std::size_t max_unauthenticated_per_address = 128;  // per client IP address; 0 = the global cap
    std::size_t fd_reserve = 128;  // accepting pauses while fewer descriptors than this are free; 0 = off

    // Filesystem. state_dir holds the store and, unless runtime_dir / workspace_root say otherwise, the
    // kernels' connection files, sockets and workspaces (see state_directory.hpp); empty = the default
    // ($XDG_STATE_HOME/cellblock or ~/.local/state/cellblock).
    std::string state_dir;
    std::string runtime_dir;
    std::string workspace_root;
    // Where the SessionStore lives: empty = the embedded SQLite file in state_dir; postgresql://... = a
    // PostgreSQL store that several gateways (each with its own state_dir) share.
    std::string store;
    // The secret that seals kernels' keys in the store (store_sealing.hpp): empty = `store-key` in the state
    // directory (SQLite); a shared (PostgreSQL) store needs one file, the same for every gateway on it.
    std::string store_key_file;
    // Seconds a kernel keeps running without a gateway before it stops itself; 0 = forever.
    double orphan_timeout = 600;
    // SIGTERM normally leaves kernels running for the next gateway (upgrade, restart); this stops them.
    bool shutdown_kernels_on_exit = false;
    // The worker zygote's tenant (kernel/README.md "Worker zygote"): every kernel this gateway starts gets it
    // as CELLBLOCK_ZYGOTE_TENANT, so their workers are forks of that tenant's template when the kernel config
    // switches the zygote on. Sessions of one tenant share a template's hash secret and address-space layout,
    // so it names one trust domain; never taken from a client. Empty = none. A plain name: at most 64 of
    // A-Za-z0-9._-.
    std::string zygote_tenant;

    std::string log_level = "warning";

    // Where kernels run (provisioner.hpp): "local" (children of the gateway) or "slurm" (one batch job per
    // kernel); a kernelspec's metadata.cellblock.provisioner overrides it.
    std::string provisioner = "local";
    // The launch registry that Slurm-hosted kernels report to: an address of this host the nodes can reach.
    std::string launch_registry_ip = "127.0.0.1";
    // sbatch options; empty = Slurm's default.
    std::string slurm_partition, slurm_account, slurm_qos, slurm_constraint;
    std::string slurm_time_limit;  // --time (e.g. "8:00:00")
    int slurm_cpus_per_task = 1;
    int slurm_mem_mb = 0;  // --mem for kernels without a session memory limit; 0 = the partition's default
    // Added to a session's memory limit (CELLBLOCK_MEMORY_MB, the worker's) for the kernel process itself.
    int slurm_memory_overhead_mb = 256;
    std::string slurm_job_output = "/dev/null";  // --output on the node (%j = job id)
    double slurm_poll_interval = 1;              // seconds between squeue polls of the gateway's jobs

    // Network by allowlist (network_policy.hpp; config file key "network": {"allow", "default",
    // "egress_hosts", "approval_timeout", "ports"}). The ceiling: no session's policy may reach beyond these
    // patterns; empty = no session gets network.
    std::vector<std::string> network_allow;
    // The policy of kernels created through the Kernel Gateway API ({"allow": [...], "ask": bool}) unless
    // their kernelspec has metadata.cellblock.network; null = no network.
    nlohmann::json network_default = nullptr;
    std::string egress_hosts;               // hosts(5) file: names the kernels' proxy resolves only to these
    double network_approval_timeout = 120;  // seconds a held request waits for a decision, then is denied
    std::vector<int> network_ports = {443, 80};
    std::vector<std::string> egress_deny;  // CIDR ranges no kernel's proxy reaches (network.egress_deny)

    // The agent API's settings (/agent/v1 and /mcp; config file key "agent"). Its default_limits are not
    // settings: they are the kernel's own (AgentConfig::load_kernel_defaults, after the merge).
    agent::AgentConfig agent;

    // Merges the keys present in `file_json` (same names as the fields); throws std::invalid_argument.
    void merge_json(const nlohmann::json& file_json);
    void merge_file(const std::string& path);
    // Reads KG_* / CELLBLOCK_GATEWAY_* variables through `lookup` (getenv in production).
    void merge_environment(const std::function<std::optional<std::string>(const std::string&)>& lookup);
    nlohmann::json to_json() const;
    // The network settings every kernel's policy carries, checked; throws NetworkPolicyError.
    NetworkSettings network_settings() const;
    // network_default as a request, checked against the ceiling; throws NetworkPolicyError.
    NetworkRequest default_network() const;
    // Throws std::invalid_argument for network settings that cannot work (bad patterns, a default beyond the
    // ceiling, an unreadable --egress-hosts file), so the gateway refuses to start with the reason.
    void check_network() const;
    // Throws std::invalid_argument when zygote_tenant is not a plain name (the kernel would refuse to start).
    void check_zygote_tenant() const;
    // Throws std::invalid_argument, naming the setting, unless every duration above is a number of seconds
    // from 0 to 1.5e9 (47 years; their timers count milliseconds in 64 bits, which a larger value overflows)
    // and header_timeout is not 0.
    void check_durations() const;
    // Throws std::invalid_argument, naming the config key, when a setting whose flag's check holds for every
    // source (EnvRead::by_flag: the agent API's) has a value that fails it, which only the config file can
    // have given.
    void check_every_source() const;
    // Kernelspec directories to scan, with the installed default when none is configured.
    std::vector<std::string> effective_kernelspec_dirs() const;
};

// How --print-config shows a setting.
enum class Printed {
    as_is,
    masked_store,  // masked_store() of it; "sqlite" when empty
    never,         // a secret (the token)
};

// A check the command line makes before it takes a value (CLI11); the file and the environment do not make
// it, unless the setting's EnvRead is by_flag.
enum class FlagCheck {
    none,
    range,           // low to high, said as whole numbers (CLI11's "INT in [...]")
    unsigned_range,  // the same for a field no negative number fits ("UINT in [...]")
    non_negative,
    positive,
    duration,           // seconds from 0 to longest_duration_s
    positive_duration,  // the same, above 0
};

// Who reads a setting's environment variable.
enum class EnvRead {
    merge,  // GatewayConfig::merge_environment, by the environment's rule, without the flag's check
    // The flag's CLI11 option, as the flag's value: checked as the flag (CLI11 says "(Env:NAME)" in --help,
    // and the help text is shown as written); GatewayConfig::check_every_source checks the file's value.
    by_flag,
};

// A field inside a member of GatewayConfig (config.agent.max_limits.timeout_s), which one pointer-to-member
// cannot name: reached through the path nested_field() was given.
template <typename T>
struct NestedField {
    T& (*get)(GatewayConfig&);
    const T& (*get_const)(const GatewayConfig&);
};

template <auto... Path>
constexpr auto nested_field() {
    using T = std::remove_cvref_t<decltype((std::declval<GatewayConfig&>().*....*Path))>;
    return NestedField<T>{[](GatewayConfig& config) -> T& { return (config.*....*Path); },
                          [](const GatewayConfig& config) -> const T& { return (config.*....*Path); }};
}

// The field a setting's Field names in `config`.
template <typename T>
T& field_of(GatewayConfig& config, T GatewayConfig::*member) {
    return config.*member;
}
template <typename T>
const T& field_of(const GatewayConfig& config, T GatewayConfig::*member) {
    return config.*member;
}
template <typename T>
T& field_of(GatewayConfig& config, NestedField<T> field) {
    return field.get(config);
}
template <typename T>
const T& field_of(const GatewayConfig& config, NestedField<T> field) {
    return field.get_const(config);
}

// One setting: where it comes from, what it means, and the field of GatewayConfig it sets.
struct Setting {
    using Field =
        std::variant<std::string GatewayConfig::*, std::optional<std::string> GatewayConfig::*,
                     bool GatewayConfig::*, int GatewayConfig::*, std::uint16_t GatewayConfig::*,
                     std::size_t GatewayConfig::*, double GatewayConfig::*,
                     std::vector<std::string> GatewayConfig::*, std::vector<int> GatewayConfig::*,
                     std::map<std::string, std::string> GatewayConfig::*, nlohmann::json GatewayConfig::*,
                     // The agent API's (std::uint64_t is std::size_t on the platforms built for).
                     NestedField<bool>, NestedField<std::size_t>, NestedField<double>>;

    std::string_view topic;      // the heading it is listed under in docs/configuration.md
    std::string_view key;        // config file key; "network.allow" is "allow" in the file's "network" object
    std::string_view env = {};   // environment variable; empty = none
    std::string_view flag = {};  // command-line option; empty = none
    std::string_view help;
    Field field;
    std::string_view default_text = {};  // the default in words, when its compiled value does not say it
    std::string_view printed_as = {};    // --print-config path when not the key ("slurm.partition")
    std::string_view separators = ",:";  // between the items of a list in the environment
    Printed printed = Printed::as_is;
    FlagCheck check = FlagCheck::none;
    double low = 0, high = 0;  // FlagCheck::range and unsigned_range
    // The values the flag takes, comma-separated; empty = any. A true/false field with two choices is
    // written as them everywhere ("off,on": the first is false).
    std::string_view choices = {};
    std::string_view file_flag = {};  // a second flag that reads the value from a file (a secret)
    std::string_view group = {};      // the flag's --help group; empty = CLI11's default
    bool switch_only = false;         // the flag takes no value and switches the setting on
    EnvRead env_read = EnvRead::merge;

    // A value from the config file, by the file's rule: an integer field takes only a whole number in its
    // range, a floating-point one a finite number, a flag true or false; null leaves the field alone (a JSON
    // field takes it). Throws std::invalid_argument naming `where`.
    void set_from_json(GatewayConfig& config, const nlohmann::json& value, const std::string& where) const;
    // A value as text, by the environment's rule (numbers as JSON numbers, true/1/yes or false/0/no/"", lists
    // split at `separators`, a JSON field as JSON text, "" = null). Throws std::invalid_argument naming
    // `where`.
    void set_from_text(GatewayConfig& config, const std::string& text, const std::string& where) const;
    nlohmann::json value_of(const GatewayConfig& config) const;
    // Throws std::invalid_argument, naming the config key, when the value in `config` fails the flag's check.
    void check_value(const GatewayConfig& config) const;
    // The default as docs/configuration.md and --help show it.
    std::string default_shown() const;
};

// Every setting, in the order they are merged and documented.
std::span<const Setting> gateway_settings();

// The settings as Markdown tables (the generated part of docs/configuration.md): key, environment variable,
// flag, default and meaning of each.
std::string configuration_reference();

// The store setting with any password in it replaced by *** (URI and keyword forms): what logs and
// --print-config show.
std::string masked_store(const std::string& store);

// Directory of installed data (<prefix>/share), found relative to the running executable.
std::string installed_data_dir();

}  // namespace cellblock::gateway
