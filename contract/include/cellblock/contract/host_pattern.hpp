#pragma once
// Host patterns of a session's network policy: the gateway checks a session's request against the operator's
// ceiling with them, and the kernel's egress proxy decides every connection with the same rules, so a pattern
// the gateway accepts admits exactly the hosts the proxy lets through.
//
// `*` = any host; `*.example.com` = a name with at least one more whole label before `.example.com` (never an
// IP literal); anything else = that exact name or IP literal. Hosts and patterns are compared normalized:
// lower case, one trailing dot removed.

#include <stdexcept>
#include <string>
#include <string_view>

namespace cellblock::contract {

// What is wrong with a host or pattern, in words for a refusal message ("the host has an empty label").
class HostPatternError : public std::runtime_error {
  public:
    using std::runtime_error::runtime_error;
};

// Lower case, one trailing dot removed: the form every host and pattern is compared in.
std::string normalize_host(std::string_view host);

// True if `host` is an IPv4 or IPv6 literal (IPv6 without brackets).
bool is_ip_literal(std::string_view host);

// A host name (labels of letters, digits, '-' and '_', 1-63 characters each, 253 at most) or an IP literal,
// normalized; throws HostPatternError saying what is wrong.
std::string validated_host(std::string_view host);

// A pattern (`*`, `*.name` or a host), normalized; throws HostPatternError saying what is wrong.
std::string validated_host_pattern(std::string_view pattern);

// Whether `pattern` admits `host` (both normalized).
bool pattern_matches(std::string_view pattern, std::string_view host);

// Whether the ceiling pattern `ceiling` admits every host `pattern` admits (both normalized).
bool pattern_within(std::string_view pattern, std::string_view ceiling);

}  // namespace cellblock::contract
