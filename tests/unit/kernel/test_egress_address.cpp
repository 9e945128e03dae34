// Addresses the proxy refuses after resolution (SSRF, DNS rebinding): a table of every refused range, its
// IPv6 spellings, and public addresses that must stay reachable.
#include <gtest/gtest.h>

#include <algorithm>

#include "egress/egress_address.hpp"

namespace cellblock::kernel::egress {
namespace {

struct Case {
    const char* address;
    const char* reason;  // expected substring of the refusal, or nullptr: reachable
};

const Case cases[] = {
    {"127.0.0.1", "loopback"},
    {"127.255.255.254", "loopback"},
    {"0.0.0.0", "unspecified"},
    {"0.1.2.3", "this network"},
    {"10.1.2.3", "private"},
    {"172.16.0.1", "private"},
    {"172.31.255.255", "private"},
    {"192.168.1.1", "private"},
    {"100.64.0.1", "carrier-grade NAT"},
    {"100.127.255.255", "carrier-grade NAT"},
    {"169.254.169.254", "cloud metadata"},
    {"169.254.1.1", "link-local"},
    {"224.0.0.251", "multicast"},
    {"239.255.255.250", "multicast"},
    {"255.255.255.255", "broadcast"},
    {"240.0.0.1", "reserved"},
    {"192.0.2.10", "documentation"},
    {"198.51.100.7", "documentation"},
    {"203.0.113.9", "documentation"},
    {"198.18.0.1", "benchmarking"},
    {"::", "unspecified"},
    {"::1", "loopback"},
    {"fe80::1", "link-local"},
    {"febf::1", "link-local"},
    {"fc00::1", "unique local"},
    {"fd12:3456::1", "unique local"},
    {"ff02::1", "multicast"},
    {"::ffff:127.0.0.1", "loopback address (IPv4-mapped)"},
    {"::ffff:169.254.169.254", "cloud metadata address (IPv4-mapped)"},
    {"::ffff:10.0.0.1", "private address (IPv4-mapped)"},
    {"::127.0.0.1", "loopback address (IPv4-compatible)"},
    {"::8.8.8.8", "reserved IPv4-compatible"},
    {"64:ff9b::a9fe:a9fe", "cloud metadata address (NAT64)"},
    {"2002:7f00:1::", "loopback address (6to4)"},
    {"64:ff9b:1::808:808", "local-use NAT64"},
    {"64:ff9b:1:ffff::1", "local-use NAT64"},
    {"2001:db8::1", "documentation"},
    {"fec0::1", "site-local"},
    // reachable
    {"8.8.8.8", nullptr},
    {"93.184.216.34", nullptr},
    {"172.32.0.1", nullptr},
    {"100.128.0.1", nullptr},
    {"169.253.255.255", nullptr},
    {"11.0.0.1", nullptr},
    {"2606:4700::6810:84e5", nullptr},
    {"::ffff:8.8.8.8", nullptr},
    {"64:ff9b::808:808", nullptr},
    {"2002:808:808::", nullptr},
};

TEST(EgressAddress, RefusedRangesAndPublicAddresses) {
    for (const auto& c : cases) {
        const auto reason = forbidden_address_reason(boost::asio::ip::make_address(c.address));
        if (c.reason == nullptr) {
            EXPECT_FALSE(reason.has_value()) << c.address << " refused as " << reason.value_or("");
        } else {
            ASSERT_TRUE(reason.has_value()) << c.address << " is not refused";
            EXPECT_NE(reason->find(c.reason), std::string::npos) << c.address << ": " << *reason;
        }
    }
}

// A public address of the kernel's own host reaches whatever listens on all of its interfaces (the gateway):
// refused like a private one, and only that address.
TEST(EgressAddress, TheHostsOwnAddressesAreRefusedWhateverTheirRange) {
    const std::vector<boost::asio::ip::address> host = {boost::asio::ip::make_address("93.184.216.34"),
                                                        boost::asio::ip::make_address("2606:4700::1")};
    for (const char* own : {"93.184.216.34", "2606:4700::1"}) {
        const auto reason = forbidden_address_reason(boost::asio::ip::make_address(own), host);
        ASSERT_TRUE(reason.has_value()) << own;
        EXPECT_NE(reason->find("the kernel's own host"), std::string::npos) << *reason;
    }
    EXPECT_FALSE(forbidden_address_reason(boost::asio::ip::make_address("93.184.216.35"), host).has_value());
}

TEST(EgressAddress, TheHostsInterfaceAddressesIncludeLoopback) {
    const auto addresses = host_interface_addresses();
    EXPECT_NE(std::find(addresses.begin(), addresses.end(), boost::asio::ip::make_address("127.0.0.1")),
              addresses.end());
}

}  // namespace
}  // namespace cellblock::kernel::egress
