#include "egress/egress_policy.hpp"

#include <algorithm>
#include <cmath>

#include "cellblock/contract/host_pattern.hpp"

namespace cellblock::kernel::egress {
namespace {

using nlohmann::json;

std::string join(const std::vector<std::string>& items) {
    std::string joined;
    for (const auto& item : items) {
        if (!joined.empty()) {
            joined += ", ";
        }
        joined += item;
    }
    return joined;
}

std::string validated_pattern(std::string_view field, const json& value) {
    if (!value.is_string()) {
        throw PolicyError("network policy: \"" + std::string(field) + "\" entries must be strings, got " +
                          value.dump());
    }
    auto text = value.get<std::string>();
    try {
        return contract::validated_host_pattern(text);
    } catch (const contract::HostPatternError& error) {
        throw PolicyError("network policy: \"" + std::string(field) + "\" pattern \"" + text +
                          "\" is not valid: " + error.what() +
                          " (use a host name, an IP address, \"*.example.com\" or \"*\")");
    }
}

std::vector<std::string> pattern_list(const json& policy, std::string_view field) {
    std::vector<std::string> patterns;
    const auto found = policy.find(field);
    if (found == policy.end() || found->is_null()) {
        return patterns;
    }
    if (!found->is_array()) {
        throw PolicyError("network policy: \"" + std::string(field) +
                          "\" must be a list of host patterns, got " + found->dump());
    }
    for (const auto& entry : *found) {
        auto pattern = validated_pattern(field, entry);
        if (std::find(patterns.begin(), patterns.end(), pattern) == patterns.end()) {
            patterns.push_back(std::move(pattern));
        }
    }
    return patterns;
}

}  // namespace

std::string validated_host(std::string_view host) {
    try {
        return contract::validated_host(host);
    } catch (const contract::HostPatternError& error) {
        throw PolicyError(error.what());
    }
}

namespace {

// "deny": ["203.0.113.0/24", "2001:db8::/32"]: the operator's ranges no connection goes to.
void parse_deny(const json& policy, std::vector<boost::asio::ip::network_v4>& v4,
                std::vector<boost::asio::ip::network_v6>& v6) {
    const auto deny = policy.find("deny");
    if (deny == policy.end() || deny->is_null()) {
        return;
    }
    if (!deny->is_array()) {
        throw PolicyError("network policy: \"deny\" must be a list of address ranges, got " + deny->dump());
    }
    for (const auto& entry : *deny) {
        const std::string range = entry.is_string() ? entry.get<std::string>() : std::string();
        boost::system::error_code error;
        if (range.find(':') == std::string::npos) {
            v4.push_back(boost::asio::ip::make_network_v4(range, error));
        } else {
            v6.push_back(boost::asio::ip::make_network_v6(range, error));
        }
        if (error || range.find('/') == std::string::npos) {
            throw PolicyError("network policy: \"deny\" entries must be CIDR ranges, got " + entry.dump());
        }
    }
}

}  // namespace

EgressPolicy EgressPolicy::parse(const json& policy) {
    if (!policy.is_object()) {
        throw PolicyError("network policy: expected a JSON object, got " + policy.dump());
    }
    static constexpr std::string_view known[] = {"allow", "ask", "ceiling", "ports", "approval_timeout_s",
                                                 "deny"};
    for (const auto& [key, value] : policy.items()) {
        if (std::find(std::begin(known), std::end(known), key) == std::end(known)) {
            throw PolicyError("network policy: unknown field \"" + key +
                              "\" (known: allow, ask, ceiling, ports, approval_timeout_s, deny)");
        }
    }
    EgressPolicy parsed;
    parsed.allow_ = pattern_list(policy, "allow");
    const bool has_ceiling = policy.contains("ceiling") && !policy.at("ceiling").is_null();
    parsed.ceiling_ = has_ceiling ? pattern_list(policy, "ceiling") : parsed.allow_;
    if (const auto ask = policy.find("ask"); ask != policy.end() && !ask->is_null()) {
        if (!ask->is_boolean()) {
            throw PolicyError("network policy: \"ask\" must be true or false, got " + ask->dump());
        }
        parsed.ask_ = ask->get<bool>();
    }
    if (const auto ports = policy.find("ports"); ports != policy.end() && !ports->is_null()) {
        if (!ports->is_array() || ports->empty()) {
            throw PolicyError("network policy: \"ports\" must be a non-empty list of port numbers, got " +
                              ports->dump());
        }
        parsed.ports_.clear();
        for (const auto& port : *ports) {
            if (!port.is_number_integer() || port.get<std::int64_t>() < 1 ||
                port.get<std::int64_t>() > 65535) {
                throw PolicyError("network policy: \"ports\" entries must be integers from 1 to 65535, got " +
                                  port.dump());
            }
            parsed.ports_.push_back(static_cast<std::uint16_t>(port.get<std::int64_t>()));
        }
    }
    if (const auto timeout = policy.find("approval_timeout_s");
        timeout != policy.end() && !timeout->is_null()) {
        if (!timeout->is_number() || !std::isfinite(timeout->get<double>()) || timeout->get<double>() <= 0 ||
            timeout->get<double>() > 86400) {
            throw PolicyError(
                "network policy: \"approval_timeout_s\" must be a number of seconds above 0 and "
                "at most 86400, got " +
                timeout->dump());
        }
        parsed.approval_timeout_ =
            std::chrono::milliseconds(static_cast<std::int64_t>(std::ceil(timeout->get<double>() * 1000)));
    }
    parse_deny(policy, parsed.deny_v4_, parsed.deny_v6_);
    return parsed;
}

std::optional<std::string> EgressPolicy::denied(const boost::asio::ip::address& address) const {
    auto as_v4 = [&]() -> std::optional<boost::asio::ip::address_v4> {
        if (address.is_v4()) {
            return address.to_v4();
        }
        if (address.to_v6().is_v4_mapped()) {
            return boost::asio::ip::make_address_v4(boost::asio::ip::v4_mapped, address.to_v6());
        }
        return std::nullopt;
    }();
    if (as_v4) {
        for (const auto& range : deny_v4_) {
            if (range.canonical() == boost::asio::ip::network_v4(*as_v4, range.prefix_length()).canonical()) {
                return range.to_string() + " is in the operator's deny list";
            }
        }
        return std::nullopt;
    }
    for (const auto& range : deny_v6_) {
        if (range.canonical() ==
            boost::asio::ip::network_v6(address.to_v6(), range.prefix_length()).canonical()) {
            return range.to_string() + " is in the operator's deny list";
        }
    }
    return std::nullopt;
}

bool EgressPolicy::within_ceiling(std::string_view host) const {
    return std::any_of(ceiling_.begin(), ceiling_.end(),
                       [&](const std::string& pattern) { return pattern_matches(pattern, host); });
}

PolicyDecision EgressPolicy::decide(std::string_view host) const {
    if (!within_ceiling(host)) {
        return {Verdict::outside_ceiling, {}};
    }
    for (const auto& pattern : allow_) {
        if (pattern_matches(pattern, host)) {
            return {Verdict::allowed, pattern};
        }
    }
    for (const auto& allowed : session_allowed_) {
        if (allowed == host) {
            return {Verdict::allowed, "session:" + allowed};
        }
    }
    return {ask_ ? Verdict::ask : Verdict::not_allowed, {}};
}

bool EgressPolicy::port_allowed(std::uint16_t port) const {
    return std::find(ports_.begin(), ports_.end(), port) != ports_.end();
}

bool EgressPolicy::allow_for_session(std::string_view host) {
    const auto normalized = normalize_host(host);
    if (normalized.empty() || !within_ceiling(normalized)) {
        return false;
    }
    if (std::find(session_allowed_.begin(), session_allowed_.end(), normalized) == session_allowed_.end()) {
        session_allowed_.push_back(normalized);
    }
    return true;
}

std::string EgressPolicy::describe_allowlist() const {
    auto all = allow_;
    all.insert(all.end(), session_allowed_.begin(), session_allowed_.end());
    return all.empty() ? "nothing" : join(all);
}

std::string EgressPolicy::describe_ceiling() const {
    return ceiling_.empty() ? "nothing" : join(ceiling_);
}

std::string EgressPolicy::describe_ports() const {
    std::string joined;
    for (const auto port : ports_) {
        if (!joined.empty()) {
            joined += ", ";
        }
        joined += std::to_string(port);
    }
    return joined;
}

}  // namespace cellblock::kernel::egress
