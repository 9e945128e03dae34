// The gateway's side of a session's network policy (kernel/README.md "Network policy"): host patterns, the
// ceiling a policy must stay within, and what reaches the kernel as CELLBLOCK_NETWORK_POLICY.
#include "cellblock/gateway/access/network_policy.hpp"

#include <gtest/gtest.h>

#include "cellblock/gateway/common/config.hpp"

using namespace cellblock::gateway;
using nlohmann::json;

TEST(NetworkPattern, NormalizesOrRefusesWithANetworkPolicyError) {
    EXPECT_EQ(normalize_host_pattern("*.PythonHosted.ORG."), "*.pythonhosted.org");
    for (const char* bad : {"", "a*.b.c", "http://pypi.org", "pypi.org:443"})
        EXPECT_THROW(normalize_host_pattern(bad), NetworkPolicyError) << bad;
}

// The rules themselves are the contract's (tests/unit/contract/host_pattern_test.cpp); here, that the gateway
// refuses with them.
TEST(NetworkCeiling, AWildcardCeilingDoesNotCoverAnIpLiteral) {
    EXPECT_THROW(
        check_within_ceiling(parse_network_request(json::parse(R"({"allow": ["10.0.0.1"]})")), {"*.0.0.1"}),
        NetworkPolicyError);
    EXPECT_THROW(normalize_host_pattern("*.10.0.0.1"), NetworkPolicyError);
}

TEST(NetworkRequest, ParsesAndNormalizes) {
    NetworkRequest request =
        parse_network_request(json::parse(R"({"allow": ["PyPI.org.", "pypi.org", "*.x.org"], "ask": true})"));
    EXPECT_EQ(request.allow, (std::vector<std::string>{"pypi.org", "*.x.org"}));
    EXPECT_TRUE(request.ask);
    EXPECT_TRUE(parse_network_request(nullptr).none());
    EXPECT_TRUE(parse_network_request(json::object()).none());
}

TEST(NetworkRequest, RefusesMalformed) {
    for (const char* bad :
         {R"("pypi.org")", R"({"allow": "pypi.org"})", R"({"allow": [1]})", R"({"ask": "yes"})",
          R"({"allow": [], "allowed": []})", R"({"allow": ["bad host"]})"}) {
        try {
            parse_network_request(json::parse(bad));
            ADD_FAILURE() << bad << " was accepted";
        } catch (const NetworkPolicyError& error) {
            EXPECT_EQ(error.kind(), NetworkPolicyError::Kind::malformed) << bad;
        }
    }
}

TEST(NetworkRequest, BeyondTheCeilingIsRefusedNamingPatternAndCeiling) {
    const std::vector<std::string> ceiling = {"*.org", "files.test"};
    EXPECT_NO_THROW(check_within_ceiling(
        parse_network_request(json::parse(R"({"allow": ["pypi.org", "files.test"]})")), ceiling));
    try {
        check_within_ceiling(parse_network_request(json::parse(R"({"allow": ["pypi.org", "evil.com"]})")),
                             ceiling);
        ADD_FAILURE() << "evil.com was accepted";
    } catch (const NetworkPolicyError& error) {
        EXPECT_EQ(error.kind(), NetworkPolicyError::Kind::outside_ceiling);
        const std::string message = error.what();
        EXPECT_NE(message.find("evil.com"), std::string::npos) << message;
        EXPECT_NE(message.find("*.org, files.test"), std::string::npos) << message;
    }
    // "org" itself is not within "*.org".
    EXPECT_THROW(check_within_ceiling(parse_network_request(json::parse(R"({"allow": ["org"]})")), ceiling),
                 NetworkPolicyError);
}

TEST(NetworkRequest, NoCeilingMeansNoNetworkAtAll) {
    EXPECT_NO_THROW(check_within_ceiling(NetworkRequest{}, {}));
    EXPECT_THROW(check_within_ceiling(NetworkRequest{{}, true}, {}), NetworkPolicyError);
    EXPECT_THROW(check_within_ceiling(NetworkRequest{{"pypi.org"}, false}, {}), NetworkPolicyError);
}

TEST(KernelPolicy, CarriesCeilingPortsAndTimeout) {
    const NetworkSettings settings = checked_settings({"*.Test.", "pypi.org"}, {443}, 7.5);
    EXPECT_EQ(kernel_policy_value(NetworkRequest{}, settings), "");
    const json value = json::parse(kernel_policy_value(NetworkRequest{{"files.test"}, true}, settings));
    EXPECT_EQ(value["allow"], json::array({"files.test"}));
    EXPECT_EQ(value["ask"], true);
    EXPECT_EQ(value["ceiling"], json::array({"*.test", "pypi.org"}));
    EXPECT_EQ(value["ports"], json::array({443}));
    EXPECT_EQ(value["approval_timeout_s"], 7.5);
}

// --egress-deny reaches every kernel's policy, normalized; a range that is not CIDR stops the gateway's
// start.
TEST(KernelPolicy, CarriesTheOperatorsDenyRanges) {
    const NetworkSettings settings = checked_settings({"*"}, {443}, 1, {"203.0.113.7/24", "2001:db8::1/32"});
    EXPECT_EQ(settings.deny, (std::vector<std::string>{"203.0.113.0/24", "2001:db8::/32"}));
    const json value = json::parse(kernel_policy_value(NetworkRequest{{"pypi.org"}, false}, settings));
    EXPECT_EQ(value["deny"], json::array({"203.0.113.0/24", "2001:db8::/32"}));
    EXPECT_FALSE(json::parse(kernel_policy_value(NetworkRequest{{"pypi.org"}, false},
                                                 checked_settings({"*"}, {443}, 1)))
                     .contains("deny"));
    for (const char* bad : {"203.0.113.7", "example.com/24", "10.0.0.0/33", ""})
        EXPECT_THROW(checked_settings({"*"}, {443}, 1, {bad}), NetworkPolicyError) << bad;
}

TEST(KernelPolicy, SettingsAreChecked) {
    EXPECT_THROW(checked_settings({"bad host"}, {443}, 1), NetworkPolicyError);
    EXPECT_THROW(checked_settings({"*"}, {0}, 1), NetworkPolicyError);
    EXPECT_THROW(checked_settings({"*"}, {}, 1), NetworkPolicyError);
    EXPECT_THROW(checked_settings({"*"}, {443}, 0), NetworkPolicyError);
}

TEST(GatewayNetworkConfig, FileEnvironmentAndChecks) {
    GatewayConfig config;
    EXPECT_TRUE(config.network_allow.empty());
    EXPECT_TRUE(config.default_network().none());
    config.merge_json(json::parse(
        R"({"network": {"allow": ["*.test"], "default": {"allow": ["pypi.test"]}, "approval_timeout": 30, "ports": [443]}})"));
    EXPECT_EQ(config.network_allow, std::vector<std::string>{"*.test"});
    EXPECT_EQ(config.default_network().allow, std::vector<std::string>{"pypi.test"});
    EXPECT_EQ(config.network_settings().approval_timeout_s, 30);
    EXPECT_NO_THROW(config.check_network());
    EXPECT_THROW(config.merge_json(json::parse(R"({"network": {"allowed": []}})")), std::invalid_argument);

    config.merge_environment([](const std::string& name) -> std::optional<std::string> {
        if (name == "CELLBLOCK_GATEWAY_NETWORK_ALLOW")
            return "pypi.org, *.pythonhosted.org";
        if (name == "CELLBLOCK_GATEWAY_NETWORK_DEFAULT")
            return R"({"allow": ["evil.com"]})";
        return std::nullopt;
    });
    EXPECT_EQ(config.network_allow, (std::vector<std::string>{"pypi.org", "*.pythonhosted.org"}));
    // A default beyond the ceiling stops the gateway at start with the reason.
    try {
        config.check_network();
        ADD_FAILURE() << "a default beyond the ceiling was accepted";
    } catch (const std::invalid_argument& error) {
        EXPECT_NE(std::string(error.what()).find("evil.com"), std::string::npos) << error.what();
    }
    config.network_default = nullptr;
    config.egress_hosts = "/nonexistent/hosts";
    EXPECT_THROW(config.check_network(), std::invalid_argument);
}
