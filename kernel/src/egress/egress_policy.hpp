// A session's network policy for the egress proxy (kernel/README.md "Network policy"): which hosts the
// confined worker may reach, the operator's ceiling that no allowlist or approval can exceed, the ports, and
// whether a host outside the allowlist (but inside the ceiling) is held for a human's approval.
#pragma once

#include <boost/asio/ip/address.hpp>
#include <boost/asio/ip/network_v4.hpp>
#include <boost/asio/ip/network_v6.hpp>
#include <chrono>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "cellblock/contract/host_pattern.hpp"

namespace cellblock::kernel::egress {

class PolicyError : public std::runtime_error {
  public:
    using std::runtime_error::runtime_error;
};

// The host and pattern rules the gateway checks a session's request with (contract/README.md).
using contract::is_ip_literal;
using contract::normalize_host;
using contract::pattern_matches;
using contract::pattern_within;

// contract::validated_host, its error as a PolicyError.
std::string validated_host(std::string_view host);

enum class Verdict {
    allowed,         // on the allowlist (or added for the session by an approval)
    ask,             // inside the ceiling, not allowed, and the policy asks: hold for approval
    not_allowed,     // inside the ceiling, not allowed, no asking
    outside_ceiling  // never reached nor asked for, whatever the allowlist says
};

struct PolicyDecision {
    Verdict verdict;
    std::string rule;  // the allowlist pattern that admitted the host (when allowed)
};

class EgressPolicy {
  public:
    // The JSON object of CELLBLOCK_NETWORK_POLICY: {"allow": [...], "ask": bool, "ceiling": [...],
    // "ports": [...], "approval_timeout_s": number, "deny": [CIDR...]}. Throws PolicyError naming the field.
    // Without a ceiling the allowlist is its own ceiling, and asking then has nothing to ask for (refused).
    static EgressPolicy parse(const nlohmann::json& policy);

    PolicyDecision decide(std::string_view host) const;
    bool port_allowed(std::uint16_t port) const;
    // An `allow_session` decision: `host` (an exact name) is allowed for the rest of the session. Ignored
    // (returns false) for a host outside the ceiling.
    bool allow_for_session(std::string_view host);

    const std::vector<std::string>& allow() const { return allow_; }
    const std::vector<std::string>& ceiling() const { return ceiling_; }
    const std::vector<std::string>& session_allowed() const { return session_allowed_; }
    const std::vector<std::uint16_t>& ports() const { return ports_; }
    bool ask() const { return ask_; }
    std::chrono::milliseconds approval_timeout() const { return approval_timeout_; }

    // For refusal messages: "pypi.org, *.pythonhosted.org" (session additions included), or "nothing".
    std::string describe_allowlist() const;
    std::string describe_ceiling() const;
    std::string describe_ports() const;

    // Why `address` is in the operator's deny list ("203.0.113.0/24 is in the operator's deny list"), or
    // nullopt. An IPv4-mapped IPv6 address is judged by its IPv4 address.
    std::optional<std::string> denied(const boost::asio::ip::address& address) const;

  private:
    bool within_ceiling(std::string_view host) const;

    std::vector<std::string> allow_;
    std::vector<std::string> ceiling_;
    std::vector<std::string> session_allowed_;
    std::vector<std::uint16_t> ports_{443, 80};
    bool ask_ = false;
    std::chrono::milliseconds approval_timeout_{120'000};
    std::vector<boost::asio::ip::network_v4> deny_v4_;
    std::vector<boost::asio::ip::network_v6> deny_v6_;
};

}  // namespace cellblock::kernel::egress
