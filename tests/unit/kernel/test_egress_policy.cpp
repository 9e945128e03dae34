// The session network policy (kernel/README.md "Network policy") and the operator's pinned hosts file: what a
// session may reach.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "egress/egress_hosts.hpp"
#include "egress/egress_policy.hpp"

namespace cellblock::kernel::egress {
namespace {

using nlohmann::json;

// The host-pattern rules themselves are the contract's (tests/unit/contract/host_pattern_test.cpp); here,
// that the proxy's policy decides by them and refuses with its own error type.
TEST(EgressPattern, ThePolicyDecidesByTheContractsRules) {
    const auto policy = EgressPolicy::parse(json{{"allow", {"PyPI.org.", "*.example.com"}}});
    EXPECT_EQ(policy.decide(normalize_host("pypi.ORG")).verdict, Verdict::allowed);
    EXPECT_EQ(policy.decide(normalize_host("pypi.org.")).verdict, Verdict::allowed);
    EXPECT_EQ(policy.decide(normalize_host("a.example.com")).verdict, Verdict::allowed);
    EXPECT_NE(policy.decide(normalize_host("example.com")).verdict, Verdict::allowed);
    EXPECT_NE(policy.decide(normalize_host("badexample.com")).verdict, Verdict::allowed);
}

TEST(EgressPattern, ValidatedHostRefusesWithAPolicyError) {
    EXPECT_EQ(validated_host("Files.PythonHosted.org"), "files.pythonhosted.org");
    EXPECT_THROW(validated_host("a..b"), PolicyError);
    EXPECT_THROW(validated_host(std::string(64, 'a') + ".test"), PolicyError);
}

TEST(EgressPolicyParse, ReadsTheContractShape) {
    const auto policy = EgressPolicy::parse(json::parse(R"({"allow": ["pypi.org", "*.pythonhosted.org"],
        "ask": true, "ceiling": ["*.org", "pypi.org"], "ports": [443, 8443], "approval_timeout_s": 2.5})"));
    EXPECT_EQ(policy.allow(), (std::vector<std::string>{"pypi.org", "*.pythonhosted.org"}));
    EXPECT_EQ(policy.ceiling(), (std::vector<std::string>{"*.org", "pypi.org"}));
    EXPECT_TRUE(policy.ask());
    EXPECT_TRUE(policy.port_allowed(8443));
    EXPECT_FALSE(policy.port_allowed(80));
    EXPECT_EQ(policy.approval_timeout(), std::chrono::milliseconds(2500));
    EXPECT_EQ(policy.describe_allowlist(), "pypi.org, *.pythonhosted.org");
}

TEST(EgressPolicyParse, DefaultsArePortsWebAndNoAsking) {
    const auto policy = EgressPolicy::parse(json{{"allow", {"pypi.org"}}});
    EXPECT_FALSE(policy.ask());
    EXPECT_TRUE(policy.port_allowed(443));
    EXPECT_TRUE(policy.port_allowed(80));
    EXPECT_FALSE(policy.port_allowed(22));
    EXPECT_EQ(policy.approval_timeout(), std::chrono::seconds(120));
}

TEST(EgressPolicyParse, BadInputIsRefusedNamingTheField) {
    const auto message_of = [](const json& policy) {
        try {
            EgressPolicy::parse(policy);
        } catch (const PolicyError& error) {
            return std::string(error.what());
        }
        return std::string("accepted");
    };
    EXPECT_NE(message_of(json::array()).find("expected a JSON object"), std::string::npos);
    EXPECT_NE(message_of(json{{"allow", "pypi.org"}}).find("\"allow\" must be a list"), std::string::npos);
    EXPECT_NE(message_of(json{{"allow", {1}}}).find("\"allow\" entries must be strings"), std::string::npos);
    EXPECT_NE(message_of(json{{"allow", {"a.*.org"}}}).find("pattern \"a.*.org\" is not valid"),
              std::string::npos);
    EXPECT_NE(message_of(json{{"allow", {"*evil.org"}}}).find("is not valid"), std::string::npos);
    EXPECT_NE(message_of(json{{"allow", {"*.10.0.0.1"}}}).find("is not valid"), std::string::npos);
    EXPECT_NE(message_of(json{{"ceiling", {""}}}).find("\"ceiling\" pattern"), std::string::npos);
    EXPECT_NE(message_of(json{{"ask", "yes"}}).find("\"ask\" must be true or false"), std::string::npos);
    EXPECT_NE(message_of(json{{"ports", {0}}}).find("\"ports\" entries"), std::string::npos);
    EXPECT_NE(message_of(json{{"ports", {70000}}}).find("\"ports\" entries"), std::string::npos);
    EXPECT_NE(message_of(json{{"ports", json::array()}}).find("non-empty"), std::string::npos);
    EXPECT_NE(message_of(json{{"approval_timeout_s", -1}}).find("approval_timeout_s"), std::string::npos);
    EXPECT_NE(message_of(json{{"approval_timeout_s", "5"}}).find("approval_timeout_s"), std::string::npos);
    EXPECT_NE(message_of(json{{"allowed", {"pypi.org"}}}).find("unknown field \"allowed\""),
              std::string::npos);
}

// The operator's --egress-deny ranges: any address in them, IPv4-mapped spellings included, and only those.
TEST(EgressPolicyParse, DenyRangesRefuseTheirAddresses) {
    const auto policy =
        EgressPolicy::parse({{"allow", {"*"}}, {"deny", {"203.0.113.0/24", "2001:db8:1::/48"}}});
    for (const char* inside : {"203.0.113.1", "203.0.113.255", "::ffff:203.0.113.9", "2001:db8:1::5"}) {
        const auto reason = policy.denied(boost::asio::ip::make_address(inside));
        ASSERT_TRUE(reason) << inside;
        EXPECT_NE(reason->find("deny list"), std::string::npos) << *reason;
    }
    for (const char* outside : {"203.0.114.1", "8.8.8.8", "2001:db8:2::1"})
        EXPECT_FALSE(policy.denied(boost::asio::ip::make_address(outside))) << outside;
    EXPECT_FALSE(
        EgressPolicy::parse({{"allow", {"*"}}}).denied(boost::asio::ip::make_address("203.0.113.1")));
    for (const json& bad : {json("10.0.0.0/8"), json({"10.0.0.1"}), json({"nope/8"}), json({1})})
        EXPECT_THROW(EgressPolicy::parse({{"allow", {"*"}}, {"deny", bad}}), PolicyError) << bad.dump();
}

TEST(EgressPolicyDecide, AllowAskRefuseAndCeiling) {
    const auto policy = EgressPolicy::parse(json{
        {"allow", {"pypi.org", "*.pythonhosted.org", "evil.com"}}, {"ask", true}, {"ceiling", {"*.org"}}});
    const auto allowed = policy.decide("files.pythonhosted.org");
    EXPECT_EQ(allowed.verdict, Verdict::allowed);
    EXPECT_EQ(allowed.rule, "*.pythonhosted.org");
    EXPECT_EQ(policy.decide("pypi.org").verdict, Verdict::allowed);
    EXPECT_EQ(policy.decide("python.org").verdict, Verdict::ask);
    // The allowlist cannot exceed the operator's ceiling, nor can asking.
    EXPECT_EQ(policy.decide("evil.com").verdict, Verdict::outside_ceiling);
    EXPECT_EQ(policy.decide("org").verdict, Verdict::outside_ceiling);

    const auto no_ask = EgressPolicy::parse(json{{"allow", {"pypi.org"}}, {"ceiling", {"*"}}});
    EXPECT_EQ(no_ask.decide("python.org").verdict, Verdict::not_allowed);
}

TEST(EgressPolicyDecide, WithoutCeilingTheAllowlistIsTheCeiling) {
    const auto policy = EgressPolicy::parse(json{{"allow", {"pypi.org"}}, {"ask", true}});
    EXPECT_EQ(policy.decide("pypi.org").verdict, Verdict::allowed);
    EXPECT_EQ(policy.decide("python.org").verdict, Verdict::outside_ceiling);
}

TEST(EgressPolicyDecide, SessionAdditionsAllowExactlyThatHostWithinTheCeiling) {
    auto policy = EgressPolicy::parse(json{{"allow", json::array()}, {"ask", true}, {"ceiling", {"*.org"}}});
    EXPECT_EQ(policy.decide("python.org").verdict, Verdict::ask);
    EXPECT_TRUE(policy.allow_for_session("Python.org."));
    const auto decision = policy.decide("python.org");
    EXPECT_EQ(decision.verdict, Verdict::allowed);
    EXPECT_EQ(decision.rule, "session:python.org");
    EXPECT_EQ(policy.decide("docs.python.org").verdict, Verdict::ask);
    EXPECT_FALSE(policy.allow_for_session("evil.com"));
    EXPECT_EQ(policy.decide("evil.com").verdict, Verdict::outside_ceiling);
    EXPECT_EQ(policy.describe_allowlist(), "python.org");
}

TEST(PinnedHostsFile, ParsesAddressesAliasesCommentsAndIpv6) {
    const auto hosts = PinnedHosts::parse(
        "# test internet\n"
        "127.0.0.1   pypi.test files.test   # two names\n"
        "\n"
        "  127.0.0.2\tFiles.Test.\n"
        "::1 v6.test\r\n"
        "169.254.169.254 metadata.test",
        "hosts");
    ASSERT_NE(hosts.lookup("pypi.test"), nullptr);
    EXPECT_EQ(hosts.lookup("pypi.test")->size(), 1u);
    ASSERT_NE(hosts.lookup("FILES.test"), nullptr);
    ASSERT_EQ(hosts.lookup("files.test")->size(), 2u);
    EXPECT_EQ(hosts.lookup("files.test")->at(1).to_string(), "127.0.0.2");
    ASSERT_NE(hosts.lookup("v6.test"), nullptr);
    EXPECT_TRUE(hosts.lookup("v6.test")->at(0).is_v6());
    EXPECT_EQ(hosts.lookup("metadata.test")->at(0).to_string(), "169.254.169.254");
    EXPECT_EQ(hosts.lookup("evil.test"), nullptr);
}

TEST(PinnedHostsFile, BadLinesAreRefusedWithFileAndLine) {
    const auto message_of = [](std::string_view text) {
        try {
            PinnedHosts::parse(text, "egress-hosts");
        } catch (const HostsFileError& error) {
            return std::string(error.what());
        }
        return std::string("accepted");
    };
    EXPECT_EQ(message_of("127.0.0.1 ok.test\n127.0.0.1\n"),
              "egress-hosts:2: expected \"ADDRESS NAME [ALIAS...]\", got only \"127.0.0.1\"");
    EXPECT_EQ(message_of("pypi.test 127.0.0.1"),
              "egress-hosts:1: \"pypi.test\" is not an IPv4 or IPv6 address");
    EXPECT_NE(message_of("127.0.0.1 bad/name").find("egress-hosts:1: \"bad/name\" is not a host name"),
              std::string::npos);
    EXPECT_NE(message_of("127.0.0.1 10.0.0.1").find("is an address where a host name belongs"),
              std::string::npos);
    EXPECT_NE(message_of("300.0.0.1 a.test").find("not an IPv4 or IPv6 address"), std::string::npos);
}

TEST(PinnedHostsFile, LoadsFromDiskAndNamesAMissingFile) {
    const auto file =
        std::filesystem::temp_directory_path() / ("cellblock-hosts-" + std::to_string(::getpid()));
    std::ofstream(file) << "127.0.0.1 pypi.test\n";
    const auto hosts = PinnedHosts::load(file);
    std::filesystem::remove(file);
    ASSERT_NE(hosts.lookup("pypi.test"), nullptr);
    try {
        PinnedHosts::load(file);
        FAIL() << "a missing hosts file was accepted";
    } catch (const HostsFileError& error) {
        EXPECT_NE(std::string(error.what()).find(file.string()), std::string::npos);
    }
}

}  // namespace
}  // namespace cellblock::kernel::egress
