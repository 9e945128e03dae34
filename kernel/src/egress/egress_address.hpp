// Which resolved addresses the egress proxy refuses to connect to (SSRF, DNS rebinding): the check runs on
// the addresses a name resolved to, right before connecting, never on the name.
#pragma once

#include <boost/asio/ip/address.hpp>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace cellblock::kernel::egress {

// Why `address` must not be reached from a sandbox ("a loopback address", "the cloud metadata address", ...),
// or nullopt for a public unicast address. IPv4-mapped, IPv4-compatible, NAT64 and 6to4 IPv6 forms are
// judged by the IPv4 address they carry. Addresses pinned by the operator's hosts file are exempt, but that
// decision is the caller's (PinnedHosts), not this function's.
// `host_addresses`: the kernel host's own interface addresses (host_interface_addresses), refused whatever
// their range, so that a public address of the host does not reach a service bound to all of its interfaces
// (the gateway itself, for one).
std::optional<std::string> forbidden_address_reason(
    const boost::asio::ip::address& address, std::span<const boost::asio::ip::address> host_addresses = {});

// The addresses of the host's network interfaces (getifaddrs), read once when the proxy starts. Empty when
// getifaddrs fails (the range rules still apply).
std::vector<boost::asio::ip::address> host_interface_addresses();

}  // namespace cellblock::kernel::egress
