#include "egress/egress_address.hpp"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <memory>

namespace cellblock::kernel::egress {
namespace {

struct V4Range {
    std::uint32_t network;
    int prefix;
    const char* reason;
};

constexpr std::uint32_t v4(int a, int b, int c, int d) {
    return (static_cast<std::uint32_t>(a) << 24) | (static_cast<std::uint32_t>(b) << 16) |
           (static_cast<std::uint32_t>(c) << 8) | static_cast<std::uint32_t>(d);
}

// Most specific first: the first match gives the reason.
constexpr std::array v4_ranges{
    V4Range{v4(169, 254, 169, 254), 32, "the cloud metadata address"},
    V4Range{v4(255, 255, 255, 255), 32, "the broadcast address"},
    V4Range{v4(0, 0, 0, 0), 32, "the unspecified address"},
    V4Range{v4(0, 0, 0, 0), 8, "a \"this network\" address (0.0.0.0/8)"},
    V4Range{v4(127, 0, 0, 0), 8, "a loopback address"},
    V4Range{v4(10, 0, 0, 0), 8, "a private address"},
    V4Range{v4(172, 16, 0, 0), 12, "a private address"},
    V4Range{v4(192, 168, 0, 0), 16, "a private address"},
    V4Range{v4(100, 64, 0, 0), 10, "a carrier-grade NAT address"},
    V4Range{v4(169, 254, 0, 0), 16, "a link-local address"},
    V4Range{v4(192, 0, 0, 0), 24, "an IETF protocol assignment address"},
    V4Range{v4(192, 0, 2, 0), 24, "a documentation address"},
    V4Range{v4(198, 51, 100, 0), 24, "a documentation address"},
    V4Range{v4(203, 0, 113, 0), 24, "a documentation address"},
    V4Range{v4(198, 18, 0, 0), 15, "a benchmarking address"},
    V4Range{v4(224, 0, 0, 0), 4, "a multicast address"},
    V4Range{v4(240, 0, 0, 0), 4, "a reserved address"},
};

bool in_v4_range(std::uint32_t address, const V4Range& range) {
    const std::uint32_t mask = range.prefix == 0 ? 0 : ~std::uint32_t{0} << (32 - range.prefix);
    return (address & mask) == (range.network & mask);
}

std::optional<std::string> v4_reason(std::uint32_t address) {
    for (const auto& range : v4_ranges) {
        if (in_v4_range(address, range)) {
            return range.reason;
        }
    }
    return std::nullopt;
}

using V6Bytes = boost::asio::ip::address_v6::bytes_type;

bool has_prefix(const V6Bytes& bytes, std::initializer_list<std::uint8_t> prefix_bytes, int prefix_bits) {
    int bit = 0;
    for (const auto expected : prefix_bytes) {
        const int take = std::min(8, prefix_bits - bit);
        if (take <= 0) {
            break;
        }
        const auto mask = static_cast<std::uint8_t>(0xff << (8 - take));
        if ((bytes[bit / 8] & mask) != (expected & mask)) {
            return false;
        }
        bit += take;
    }
    return true;
}

std::uint32_t v4_at(const V6Bytes& bytes, std::size_t offset) {
    return (static_cast<std::uint32_t>(bytes[offset]) << 24) |
           (static_cast<std::uint32_t>(bytes[offset + 1]) << 16) |
           (static_cast<std::uint32_t>(bytes[offset + 2]) << 8) |
           static_cast<std::uint32_t>(bytes[offset + 3]);
}

std::optional<std::string> embedded(const char* form, std::uint32_t address) {
    if (auto reason = v4_reason(address)) {
        return *reason + " (" + form + ")";
    }
    return std::nullopt;
}

std::optional<std::string> v6_reason(const boost::asio::ip::address_v6& address) {
    const auto bytes = address.to_bytes();
    if (address.is_unspecified()) {
        return "the unspecified address";
    }
    if (address.is_loopback()) {
        return "a loopback address";
    }
    // ::ffff:a.b.c.d (IPv4-mapped) and ::a.b.c.d (deprecated IPv4-compatible): the kernel may route the first
    // to the IPv4 address itself.
    if (has_prefix(bytes, {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff}, 96)) {
        return embedded("IPv4-mapped", v4_at(bytes, 12));
    }
    if (has_prefix(bytes, {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}, 96)) {
        return embedded("IPv4-compatible", v4_at(bytes, 12)).value_or("a reserved IPv4-compatible address");
    }
    if (has_prefix(bytes, {0x00, 0x64, 0xff, 0x9b, 0, 0, 0, 0, 0, 0, 0, 0}, 96)) {
        return embedded("NAT64", v4_at(bytes, 12));
    }
    if (has_prefix(bytes, {0x00, 0x64, 0xff, 0x9b, 0x00, 0x01}, 48)) {
        // RFC 8215's local-use NAT64 prefix: where the IPv4 address sits depends on the operator's prefix
        // length, so the whole range is refused.
        return "a local-use NAT64 address (64:ff9b:1::/48)";
    }
    if (has_prefix(bytes, {0x20, 0x02}, 16)) {
        return embedded("6to4", v4_at(bytes, 2));
    }
    if (has_prefix(bytes, {0xfe, 0x80}, 10)) {
        return "a link-local address";
    }
    if (has_prefix(bytes, {0xfe, 0xc0}, 10)) {
        return "a site-local address";
    }
    if (has_prefix(bytes, {0xfc}, 7)) {
        return "a unique local (private) address";
    }
    if (has_prefix(bytes, {0xff}, 8)) {
        return "a multicast address";
    }
    if (has_prefix(bytes, {0x20, 0x01, 0x0d, 0xb8}, 32)) {
        return "a documentation address";
    }
    if (has_prefix(bytes, {0x01, 0x00, 0, 0, 0, 0, 0, 0}, 64)) {
        return "a discard-only address";
    }
    if (has_prefix(bytes, {0x20, 0x01, 0x00, 0x00}, 32)) {
        return "a Teredo address";
    }
    return std::nullopt;
}

}  // namespace

std::optional<std::string> forbidden_address_reason(
    const boost::asio::ip::address& address, std::span<const boost::asio::ip::address> host_addresses) {
    auto reason = address.is_v4() ? v4_reason(address.to_v4().to_uint()) : v6_reason(address.to_v6());
    if (reason) {
        return reason;
    }
    for (const auto& own : host_addresses) {
        if (own == address) {
            return "an address of the kernel's own host";
        }
    }
    return std::nullopt;
}

std::vector<boost::asio::ip::address> host_interface_addresses() {
    ifaddrs* list = nullptr;
    if (::getifaddrs(&list) != 0) {
        return {};
    }
    const std::unique_ptr<ifaddrs, decltype(&::freeifaddrs)> owned(list, &::freeifaddrs);
    std::vector<boost::asio::ip::address> addresses;
    for (const ifaddrs* entry = list; entry; entry = entry->ifa_next) {
        if (!entry->ifa_addr) {
            continue;
        }
        if (entry->ifa_addr->sa_family == AF_INET) {
            const auto* v4 = reinterpret_cast<const sockaddr_in*>(entry->ifa_addr);
            addresses.emplace_back(boost::asio::ip::address_v4(ntohl(v4->sin_addr.s_addr)));
        } else if (entry->ifa_addr->sa_family == AF_INET6) {
            const auto* v6 = reinterpret_cast<const sockaddr_in6*>(entry->ifa_addr);
            boost::asio::ip::address_v6::bytes_type bytes{};
            std::memcpy(bytes.data(), v6->sin6_addr.s6_addr, bytes.size());
            addresses.emplace_back(boost::asio::ip::address_v6(bytes));
        }
    }
    return addresses;
}

}  // namespace cellblock::kernel::egress
