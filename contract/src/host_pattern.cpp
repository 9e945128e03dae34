#include "cellblock/contract/host_pattern.hpp"

#include <arpa/inet.h>

#include <algorithm>

namespace cellblock::contract {
namespace {

constexpr std::size_t max_host_length = 253;
constexpr std::size_t max_label_length = 63;

char lower(char c) {
    return (c >= 'A' && c <= 'Z') ? static_cast<char>(c - 'A' + 'a') : c;
}

// host = <at least one label> "." suffix
bool ends_with_label_suffix(std::string_view host, std::string_view suffix) {
    return host.size() > suffix.size() + 1 && host.ends_with(suffix) &&
           host[host.size() - suffix.size() - 1] == '.';
}

void check_host_name(std::string_view name) {
    std::size_t label_length = 0;
    for (const char c : name) {
        if (c == '.') {
            if (label_length == 0) {
                throw HostPatternError("the host has an empty label");
            }
            label_length = 0;
            continue;
        }
        const bool name_char = (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' || c == '_';
        if (!name_char) {
            throw HostPatternError("the host contains a character that cannot be in a host name");
        }
        if (++label_length > max_label_length) {
            throw HostPatternError("a label of the host is longer than 63 characters");
        }
    }
    if (label_length == 0) {
        throw HostPatternError("the host has an empty label");
    }
}

}  // namespace

std::string normalize_host(std::string_view host) {
    if (host.ends_with('.')) {
        host.remove_suffix(1);
    }
    std::string normalized(host);
    std::transform(normalized.begin(), normalized.end(), normalized.begin(), lower);
    return normalized;
}

bool is_ip_literal(std::string_view host) {
    if (host.empty() || host.size() > 45) {
        return false;
    }
    const std::string text(host);
    unsigned char buffer[16];
    return ::inet_pton(AF_INET, text.c_str(), buffer) == 1 ||
           ::inet_pton(AF_INET6, text.c_str(), buffer) == 1;
}

std::string validated_host(std::string_view host) {
    if (host.empty()) {
        throw HostPatternError("the host is empty");
    }
    if (host.size() > max_host_length + 1) {
        throw HostPatternError("the host is longer than 253 characters");
    }
    auto normalized = normalize_host(host);
    if (is_ip_literal(normalized)) {
        return normalized;
    }
    if (normalized.empty()) {
        throw HostPatternError("the host is empty");
    }
    if (normalized.size() > max_host_length) {  // 254 characters reach here only without a trailing dot
        throw HostPatternError("the host is longer than 253 characters");
    }
    check_host_name(normalized);
    return normalized;
}

std::string validated_host_pattern(std::string_view pattern) {
    if (pattern == "*") {
        return std::string(pattern);
    }
    if (pattern.starts_with("*.")) {
        const auto suffix = validated_host(pattern.substr(2));
        if (is_ip_literal(suffix)) {
            throw HostPatternError("a wildcard cannot precede an IP address");
        }
        return "*." + suffix;
    }
    return validated_host(pattern);
}

bool pattern_matches(std::string_view pattern, std::string_view host) {
    if (pattern == "*") {
        return !host.empty();
    }
    if (pattern.starts_with("*.")) {
        return !is_ip_literal(host) && ends_with_label_suffix(host, pattern.substr(2));
    }
    return pattern == host;
}

bool pattern_within(std::string_view pattern, std::string_view ceiling) {
    if (ceiling == "*" || ceiling == pattern) {
        return true;
    }
    if (pattern == "*" || !ceiling.starts_with("*.")) {
        return false;
    }
    // `*.S` covers `x.S`, `*.x.S` (the pattern's own wildcard is at least one label more), never `S` nor
    // `*.S` seen as something other than itself (handled above).
    const auto suffix = ceiling.substr(2);
    const auto named = pattern.starts_with("*.") ? pattern.substr(2) : pattern;
    if (pattern.starts_with("*.")) {
        return named == suffix || ends_with_label_suffix(named, suffix);
    }
    return !is_ip_literal(named) && ends_with_label_suffix(named, suffix);
}

}  // namespace cellblock::contract
