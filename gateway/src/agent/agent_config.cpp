#include "cellblock/gateway/agent/agent_config.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fstream>

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

}  // namespace cellblock::gateway::agent
