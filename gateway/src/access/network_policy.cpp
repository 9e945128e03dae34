#include "cellblock/gateway/access/network_policy.hpp"

#include <algorithm>
#include <boost/asio/ip/address.hpp>
#include <boost/asio/ip/network_v4.hpp>
#include <boost/asio/ip/network_v6.hpp>

#include "cellblock/contract/host_pattern.hpp"

namespace cellblock::gateway {

using nlohmann::json;
using Kind = NetworkPolicyError::Kind;

namespace {

std::string joined(const std::vector<std::string>& patterns) {
    std::string text;
    for (const std::string& pattern : patterns)
        text += (text.empty() ? "" : ", ") + pattern;
    return text;
}

}  // namespace

json NetworkRequest::to_json() const {
    return {{"allow", allow}, {"ask", ask}};
}

std::string normalize_host_pattern(std::string_view pattern) {
    try {
        return contract::validated_host_pattern(pattern);
    } catch (const contract::HostPatternError& error) {
        throw NetworkPolicyError(Kind::malformed, "\"" + std::string(pattern) +
                                                      "\" is not a host pattern: " + error.what() +
                                                      " (a host name, an IP address, \"*.domain\" or \"*\")");
    }
}

bool within_ceiling(std::string_view pattern, const std::vector<std::string>& ceiling) {
    return std::any_of(ceiling.begin(), ceiling.end(), [pattern](const std::string& covering) {
        return contract::pattern_within(pattern, covering);
    });
}

NetworkRequest parse_network_request(const json& requested) {
    NetworkRequest request;
    if (requested.is_null())
        return request;
    if (!requested.is_object())
        throw NetworkPolicyError(Kind::malformed,
                                 "\"network\" must be an object {\"allow\": [host patterns], \"ask\": bool}");
    for (const auto& [key, value] : requested.items())
        if (key != "allow" && key != "ask")
            throw NetworkPolicyError(Kind::malformed,
                                     "unknown key \"network." + key + "\" (allowed: allow, ask)");
    if (requested.contains("allow") && !requested["allow"].is_null()) {
        if (!requested["allow"].is_array())
            throw NetworkPolicyError(Kind::malformed, "\"network.allow\" must be a list of host patterns");
        for (const json& pattern : requested["allow"]) {
            if (!pattern.is_string())
                throw NetworkPolicyError(Kind::malformed,
                                         "\"network.allow\" must be a list of host patterns");
            std::string normalized = normalize_host_pattern(pattern.get<std::string>());
            if (std::find(request.allow.begin(), request.allow.end(), normalized) == request.allow.end())
                request.allow.push_back(std::move(normalized));
        }
    }
    if (requested.contains("ask") && !requested["ask"].is_null()) {
        if (!requested["ask"].is_boolean())
            throw NetworkPolicyError(Kind::malformed, "\"network.ask\" must be true or false");
        request.ask = requested["ask"].get<bool>();
    }
    return request;
}

void check_within_ceiling(const NetworkRequest& request, const std::vector<std::string>& ceiling) {
    if (request.none())
        return;
    if (ceiling.empty())
        throw NetworkPolicyError(
            Kind::outside_ceiling,
            "this gateway gives no session network access (its network ceiling is empty: "
            "the operator allows hosts with --network-allow)");
    for (const std::string& pattern : request.allow)
        if (!within_ceiling(pattern, ceiling))
            throw NetworkPolicyError(
                Kind::outside_ceiling,
                pattern + " is outside the gateway's network ceiling (" + joined(ceiling) + ")");
}

NetworkSettings checked_settings(const std::vector<std::string>& ceiling, const std::vector<int>& ports,
                                 double approval_timeout_s, const std::vector<std::string>& deny) {
    NetworkSettings settings;
    settings.ceiling.clear();
    for (const std::string& pattern : ceiling) {
        std::string normalized = normalize_host_pattern(pattern);
        if (std::find(settings.ceiling.begin(), settings.ceiling.end(), normalized) == settings.ceiling.end())
            settings.ceiling.push_back(std::move(normalized));
    }
    if (ports.empty())
        throw NetworkPolicyError(Kind::malformed, "network ports: at least one port is needed");
    for (int port : ports)
        if (port < 1 || port > 65535)
            throw NetworkPolicyError(Kind::malformed,
                                     "network port " + std::to_string(port) + " is not between 1 and 65535");
    settings.ports = ports;
    if (!(approval_timeout_s > 0))
        throw NetworkPolicyError(Kind::malformed,
                                 "the network approval timeout must be a positive number of "
                                 "seconds");
    settings.approval_timeout_s = approval_timeout_s;
    for (const std::string& range : deny) {
        boost::system::error_code error;
        const auto slash = range.find('/');
        const std::string address = range.substr(0, slash);
        const auto parsed = boost::asio::ip::make_address(address, error);
        if (error || slash == std::string::npos)
            throw NetworkPolicyError(Kind::malformed, "--egress-deny " + range +
                                                          ": not an address range in CIDR notation (e.g. "
                                                          "203.0.113.0/24, 2001:db8::/32)");
        settings.deny.push_back(parsed.is_v4()
                                    ? boost::asio::ip::make_network_v4(range, error).canonical().to_string()
                                    : boost::asio::ip::make_network_v6(range, error).canonical().to_string());
        if (error)
            throw NetworkPolicyError(Kind::malformed, "--egress-deny " + range + ": " + error.message());
    }
    return settings;
}

std::string kernel_policy_value(const NetworkRequest& request, const NetworkSettings& settings) {
    if (request.none())
        return "";
    json policy = {{"allow", request.allow},
                   {"ask", request.ask},
                   {"ceiling", settings.ceiling},
                   {"ports", settings.ports},
                   {"approval_timeout_s", settings.approval_timeout_s}};
    if (!settings.deny.empty())
        policy["deny"] = settings.deny;
    return policy.dump();
}

}  // namespace cellblock::gateway
