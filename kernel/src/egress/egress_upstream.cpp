// Resolving the host and connecting to the server: the operator's pinned names first, then IP literals, then
// the resolver, each address checked against the deny list, the private ranges and the host's own addresses.
#include <boost/asio/connect.hpp>

#include "egress/egress_session.hpp"

namespace cellblock::kernel::egress {

void Session::resolve() {
    phase_ = Phase::connecting;
    arm(proxy_.limits.connect,
        "could not connect to " + record_.host + " within " + seconds_text(proxy_.limits.connect));
    if (const auto* addresses = proxy_.pinned.lookup(record_.host)) {
        // The operator's own statement: these addresses are exempt from the private-address refusal (not
        // from the operator's deny list).
        std::vector<tcp::endpoint> endpoints;
        for (const auto& address : *addresses) {
            if (const auto reason = proxy_.policy.denied(address)) {
                return refuse_address(address, *reason);
            }
            endpoints.emplace_back(address, record_.port);
        }
        return connect(std::move(endpoints));
    }
    if (is_ip_literal(record_.host)) {
        const auto address = asio::ip::make_address(record_.host);
        if (const auto reason = refusal_reason(address)) {
            return refuse_address(address, *reason);
        }
        return connect({tcp::endpoint(address, record_.port)});
    }
    resolver_.async_resolve(
        record_.host, std::to_string(record_.port),
        [self = shared_from_this()](error_code error, const tcp::resolver::results_type& results) {
            self->on_resolved(error, results);
        });
}

// Why the proxy does not connect to `address`: the operator's deny list, then the ranges and the host's
// own addresses (egress_address.hpp).
std::optional<std::string> Session::refusal_reason(const asio::ip::address& address) const {
    if (auto denied = proxy_.policy.denied(address)) {
        return denied;
    }
    return forbidden_address_reason(address, proxy_.host_addresses);
}

void Session::on_resolved(error_code error, const tcp::resolver::results_type& results) {
    if (error) {
        if (timed_out_) {
            return refuse(http::status::gateway_timeout, *timed_out_);
        }
        return refuse(http::status::bad_gateway, "cannot resolve " + record_.host + ": " + error.message(),
                      true);
    }
    std::vector<tcp::endpoint> endpoints;
    std::optional<std::pair<asio::ip::address, std::string>> refused;
    for (const auto& entry : results) {
        const auto address = entry.endpoint().address();
        if (auto reason = refusal_reason(address)) {
            if (!refused) {
                refused.emplace(address, std::move(*reason));
            }
            continue;
        }
        endpoints.push_back(entry.endpoint());
    }
    if (endpoints.empty()) {
        if (refused) {
            return refuse_address(refused->first, refused->second);
        }
        return refuse(http::status::bad_gateway, "cannot resolve " + record_.host + ": no address", true);
    }
    connect(std::move(endpoints));
}

void Session::refuse_address(const asio::ip::address& address, const std::string& reason) {
    refuse(http::status::forbidden, record_.host + " resolves to " + address.to_string() + ", " + reason +
                                        "; the proxy does not connect to loopback, private, link-local, "
                                        "multicast or metadata addresses");
}

void Session::connect(std::vector<tcp::endpoint> endpoints) {
    endpoints_ = std::move(endpoints);
    asio::async_connect(
        upstream_, endpoints_,
        [self = shared_from_this()](error_code error, const tcp::endpoint&) { self->on_connected(error); });
}

void Session::on_connected(error_code error) {
    if (error) {
        if (timed_out_) {
            return refuse(http::status::gateway_timeout, *timed_out_, true);
        }
        return refuse(
            http::status::bad_gateway,
            "cannot connect to " + record_.host + ":" + std::to_string(record_.port) + ": " + error.message(),
            true);
    }
    record_.allowed = true;
    if (connect_method_) {
        return establish_tunnel();
    }
    forward_request();
}

}  // namespace cellblock::kernel::egress
