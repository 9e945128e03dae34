#include "cellblock/gateway/agent/agent_config.hpp"

#include <CLI/CLI.hpp>
#include <cmath>
#include <cstdint>
#include <fstream>

#include "cellblock/gateway/common/config.hpp"

namespace cellblock::gateway::agent {

using nlohmann::json;

json AgentLimits::to_json() const {
    return {{"timeout_s", timeout_s}, {"memory_mb", memory_mb}, {"output_bytes", output_bytes}};
}

namespace {
double positive_number(const json& value, const std::string& field) {
    if (!value.is_number())
        throw LimitError(field, field + " must be a number");
    const double number = value.get<double>();
    if (!std::isfinite(number) || number <= 0)
        throw LimitError(field, field + " must be greater than 0");
    return number;
}

std::uint64_t positive_integer(const json& value, const std::string& field) {
    if (!value.is_number_integer() &&
        !(value.is_number_float() && std::floor(value.get<double>()) == value.get<double>()))
        throw LimitError(field, field + " must be an integer");
    const double number = value.get<double>();
    if (number < 1)
        throw LimitError(field, field + " must be at least 1");
    if (number > 1e18)
        throw LimitError(field, field + " is too large");
    return static_cast<std::uint64_t>(number);
}

std::string number_text(double value) {
    json as_json = value;
    return as_json.dump();
}
}  // namespace

AgentLimits parse_limits(const json& requested, const AgentLimits& defaults, const AgentLimits& maxima) {
    AgentLimits limits = defaults;
    if (requested.is_null())
        return limits;
    if (!requested.is_object())
        throw LimitError("limits", "limits must be a JSON object");
    for (const auto& [key, value] : requested.items()) {
        const std::string field = "limits." + key;
        if (key == "timeout_s") {
            limits.timeout_s = positive_number(value, field);
            if (limits.timeout_s > maxima.timeout_s)
                throw LimitError(field, field + " = " + number_text(limits.timeout_s) +
                                            " exceeds the gateway's maximum of " +
                                            number_text(maxima.timeout_s));
        } else if (key == "memory_mb") {
            limits.memory_mb = positive_integer(value, field);
            if (limits.memory_mb > maxima.memory_mb)
                throw LimitError(field, field + " = " + std::to_string(limits.memory_mb) +
                                            " exceeds the gateway's maximum of " +
                                            std::to_string(maxima.memory_mb));
        } else if (key == "output_bytes") {
            limits.output_bytes = positive_integer(value, field);
            if (limits.output_bytes > maxima.output_bytes)
                throw LimitError(field, field + " = " + std::to_string(limits.output_bytes) +
                                            " exceeds the gateway's maximum of " +
                                            std::to_string(maxima.output_bytes));
        } else {
            throw LimitError(field, "unknown limit " + key + " (known: timeout_s, memory_mb, output_bytes)");
        }
    }
    return limits;
}

void AgentConfig::load_kernel_defaults(const std::filesystem::path& kernel_config_file) {
    std::ifstream input(kernel_config_file);
    if (!input)
        return;
    const json parsed = json::parse(input, nullptr, false);
    if (!parsed.is_object() || !parsed.contains("limits") || !parsed["limits"].is_object())
        return;
    const json& limits = parsed["limits"];
    // Only values the kernel really uses as its defaults; anything odd keeps the compiled-in default.
    if (limits.contains("timeout_s") && limits["timeout_s"].is_number() &&
        limits["timeout_s"].get<double>() > 0)
        default_limits.timeout_s = limits["timeout_s"].get<double>();
    if (limits.contains("memory_mb") && limits["memory_mb"].is_number_unsigned())
        default_limits.memory_mb = limits["memory_mb"].get<std::uint64_t>();
    if (limits.contains("output_bytes") && limits["output_bytes"].is_number_unsigned())
        default_limits.output_bytes = limits["output_bytes"].get<std::uint64_t>();
    // The defaults are always allowed, whatever the maxima say.
    max_limits.timeout_s = std::max(max_limits.timeout_s, default_limits.timeout_s);
    max_limits.memory_mb = std::max(max_limits.memory_mb, default_limits.memory_mb);
    max_limits.output_bytes = std::max(max_limits.output_bytes, default_limits.output_bytes);
}

json AgentConfig::to_json() const {
    return {{"session_ttl_s", session_ttl_s},
            {"deleted_retention_s", deleted_retention_s},
            {"default_limits", default_limits.to_json()},
            {"max_limits", max_limits.to_json()},
            {"inline_output_bytes", inline_output_bytes},
            {"saved_output_bytes", saved_output_bytes},
            {"interrupt_grace_s", interrupt_grace_s},
            {"keepalive_s", keepalive_s},
            {"max_file_bytes", max_file_bytes},
            {"max_sessions", max_sessions},
            {"approvals_mcp", approvals_mcp ? "on" : "off"}};
}

void add_agent_options(CLI::App& app, AgentConfig& config) {
    const std::string group = "Agent API";
    app.add_option("--agent-session-ttl", config.session_ttl_s,
                   "seconds before an idle agent session is deleted, 0 = never")
        ->envname("CELLBLOCK_AGENT_SESSION_TTL")
        ->check(CLI::Range(0.0, longest_duration_s))
        ->group(group);
    app.add_option("--agent-deleted-retention", config.deleted_retention_s,
                   "seconds a deleted agent session's record, notebook and audit trail stay in the store, "
                   "0 = forever")
        ->envname("CELLBLOCK_AGENT_DELETED_RETENTION")
        ->check(CLI::Range(0.0, longest_duration_s))
        ->group(group);
    app.add_option("--agent-max-timeout", config.max_limits.timeout_s,
                   "largest limits.timeout_s a session may ask for")
        ->check(CLI::PositiveNumber & CLI::Range(0.0, longest_duration_s))
        ->group(group);
    // The kernel's own ceiling (kernel/README.md): a larger memory_mb would not fit the sandbox's bytes.
    constexpr std::uint64_t max_memory_mb = std::uint64_t{1} << 30;
    app.add_option("--agent-max-memory-mb", config.max_limits.memory_mb, "largest limits.memory_mb")
        ->check(CLI::Range(std::uint64_t{1}, max_memory_mb))
        ->group(group);
    app.add_option("--agent-max-output-bytes", config.max_limits.output_bytes, "largest limits.output_bytes")
        ->check(CLI::PositiveNumber)
        ->group(group);
    app.add_option("--agent-inline-output-bytes", config.inline_output_bytes,
                   "bytes of each output returned inline; the rest is saved in the workspace")
        ->check(CLI::Range(256, 64 << 20))
        ->group(group);
    app.add_option(
           "--agent-saved-output-bytes", config.saved_output_bytes,
           "most output of one execute saved in the workspace (the kernel keeps head and tail beyond it)")
        ->check(CLI::PositiveNumber)
        ->group(group);
    app.add_option("--agent-interrupt-grace", config.interrupt_grace_s,
                   "seconds an interrupted execute may take to stop before its kernel is restarted")
        ->check(CLI::PositiveNumber & CLI::Range(0.0, longest_duration_s))
        ->group(group);
    app.add_option("--agent-keepalive", config.keepalive_s, "seconds between NDJSON keepalive lines")
        ->check(CLI::PositiveNumber & CLI::Range(0.0, longest_duration_s))
        ->group(group);
    app.add_option("--agent-max-sessions", config.max_sessions, "most agent sessions at once")->group(group);
    app.add_option_function<std::string>(
           "--approvals-mcp", [&config](const std::string& value) { config.approvals_mcp = value == "on"; },
           "on: MCP clients may decide network approvals (decide_approval); off (default): only the REST API "
           "and the CLI decide, so an agent's MCP client cannot approve its own code's requests")
        ->envname("CELLBLOCK_AGENT_APPROVALS_MCP")
        ->check(CLI::IsMember({"off", "on"}))
        ->group(group);
}

}  // namespace cellblock::gateway::agent
