#pragma once
// A session's network policy as the gateway sees it (the contract: kernel/README.md "Network policy"): host
// patterns checked against the operator's ceiling (--network-allow) when a session or kernel is created, and
// the CELLBLOCK_NETWORK_POLICY value handed to the kernel, whose proxy enforces it. The gateway never links
// the kernel: this is its own small matcher of the same pattern rules.
//
// Patterns are case-insensitive with a trailing dot ignored. "*" = any host; "*.example.com" = any name with
// at least one more whole label before ".example.com" (never "example.com" itself, nor "badexample.com");
// anything else is one exact name (an IP literal matches that literal only).
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace cellblock::gateway {

// Why a policy was refused. `malformed`: not a policy (wrong type, unknown key, a pattern that is not a host
// name); `outside_ceiling`: well-formed but more than the operator allows (the message names the pattern and
// the ceiling).
class NetworkPolicyError : public std::invalid_argument {
  public:
    enum class Kind { malformed, outside_ceiling };
    NetworkPolicyError(Kind kind, const std::string& message) : std::invalid_argument(message), kind_(kind) {}
    Kind kind() const { return kind_; }

  private:
    Kind kind_;
};

// What a session asks for: {"allow": [...], "ask": bool}. Empty `allow` without `ask` = no network.
struct NetworkRequest {
    std::vector<std::string> allow;  // normalized patterns
    bool ask = false;
    bool none() const { return allow.empty() && !ask; }
    nlohmann::json to_json() const;
    bool operator==(const NetworkRequest&) const = default;
};

// The operator's settings that every kernel's policy carries (from GatewayConfig).
struct NetworkSettings {
    std::vector<std::string> ceiling;  // --network-allow; empty = no session gets network
    std::vector<int> ports = {443, 80};
    double approval_timeout_s = 120;
    // --egress-deny: address ranges (CIDR) no kernel's proxy connects to, whatever resolves there.
    std::vector<std::string> deny;
};

// contract::validated_host_pattern (contract/include/cellblock/contract/host_pattern.hpp, the rules the
// kernel's egress proxy decides with); throws NetworkPolicyError malformed saying what is wrong.
std::string normalize_host_pattern(std::string_view pattern);
// Whether some ceiling pattern admits every host `pattern` admits (contract::pattern_within).
bool within_ceiling(std::string_view pattern, const std::vector<std::string>& ceiling);

// Reads {"allow": [string...], "ask": bool} (both optional; null = no network); throws NetworkPolicyError
// malformed.
NetworkRequest parse_network_request(const nlohmann::json& requested);
// Throws NetworkPolicyError outside_ceiling for a pattern no ceiling pattern covers, or "ask" without any
// ceiling.
void check_within_ceiling(const NetworkRequest& request, const std::vector<std::string>& ceiling);
// Checks the operator's own settings (valid patterns, ports 1-65535, a positive approval timeout, deny ranges
// in CIDR notation, normalized); throws NetworkPolicyError malformed.
NetworkSettings checked_settings(const std::vector<std::string>& ceiling, const std::vector<int>& ports,
                                 double approval_timeout_s, const std::vector<std::string>& deny = {});

// The CELLBLOCK_NETWORK_POLICY value of a kernel with `request`: "" for no network, else
// {"allow", "ask", "ceiling", "ports", "approval_timeout_s"}.
std::string kernel_policy_value(const NetworkRequest& request, const NetworkSettings& settings);

}  // namespace cellblock::gateway
