// Which resolved addresses the egress proxy refuses to connect to (SSRF, DNS rebinding): the check runs on
// the addresses a name resolved to, right before connecting, never on the name.
#pragma once

#include <boost/asio/ip/address.hpp>
#include <optional>
#include <string>

namespace cellblock::kernel::egress {

// Why `address` must not be reached from a sandbox ("a loopback address", "the cloud metadata address", ...),
// or nullopt for a public unicast address. IPv4-mapped, IPv4-compatible, NAT64 and 6to4 IPv6 forms are
// judged by the IPv4 address they carry. Addresses pinned by the operator's hosts file are exempt, but that
// decision is the caller's (PinnedHosts), not this function's.
std::optional<std::string> forbidden_address_reason(const boost::asio::ip::address& address);

}  // namespace cellblock::kernel::egress
