#pragma once
// Settings of the agent API (/agent/v1 and /mcp): per-session limits with their defaults and maxima, the idle
// TTL, the context-shielding cap and where session records and audit trails are kept. They are settings of
// the gateway (GatewayConfig::agent): their names, flags and checks are in its table (settings_table.cpp).
#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>

#include "cellblock/contract/file_messages.hpp"

namespace cellblock::gateway::agent {

// What a session's kernel may use. They reach the kernel as CELLBLOCK_TIMEOUT_S / _MEMORY_MB / _OUTPUT_BYTES.
struct AgentLimits {
    double timeout_s = 600;                 // wall clock per execute (the kernel interrupts, then kills)
    std::uint64_t memory_mb = 2048;         // the worker's memory limit
    std::uint64_t output_bytes = 1u << 20;  // output one execute may publish; the kernel discards the rest
    nlohmann::json to_json() const;
    bool operator==(const AgentLimits&) const = default;
};

// A request asked for something not allowed; `field` names the limit (e.g. "limits.memory_mb").
class LimitError : public std::invalid_argument {
  public:
    LimitError(std::string field, const std::string& message)
        : std::invalid_argument(message), field_(std::move(field)) {}
    const std::string& field() const { return field_; }

  private:
    std::string field_;
};

// Reads {"timeout_s", "memory_mb", "output_bytes"} (each optional) over `defaults`; throws LimitError for a
// wrong type, a non-positive value, an unknown key or a value above `maxima`.
AgentLimits parse_limits(const nlohmann::json& requested, const AgentLimits& defaults,
                         const AgentLimits& maxima);

struct AgentConfig {
    double session_ttl_s = 3600;  // idle sessions are deleted (kernel shut down) after this; 0 = never
    // A deleted session's record, notebook and audit trail stay in the store this long; 0 = forever.
    double deleted_retention_s = 7 * 24 * 3600;
    AgentLimits default_limits;  // the kernel's own defaults, so warm-pool kernels can serve them
    AgentLimits max_limits{3600, 16384, 256u << 20};
    std::size_t inline_output_bytes =
        std::size_t{32} * 1024;  // per text field of an answer; beyond: head + tail + saved file
    // The most output of one execute the kernel relays for the saved output files (head and tail beyond it).
    std::uint64_t saved_output_bytes = 32u << 20;
    double interrupt_grace_s = 5;  // after the safety net's interrupt, the kernel is restarted if still busy
    double keepalive_s = 10;       // NDJSON keepalive line interval while an execute streams
    // Largest workspace file read or written, the contract's ceiling (the kernel holds requests to it too).
    std::uint64_t max_file_bytes = contract::max_file_bytes;
    std::size_t max_sessions = 1000;
    // Whether MCP clients may decide network approvals (decide_approval). Off by default: the agent's own MCP
    // client reads text its sandboxed code wrote, and must not approve that code's requests.
    bool approvals_mcp = false;

    // Takes the default limits from the kernel's config file (share/cellblock/kernel-config.json) when
    // readable.
    void load_kernel_defaults(const std::filesystem::path& kernel_config_file);
    nlohmann::json to_json() const;
};

}  // namespace cellblock::gateway::agent
