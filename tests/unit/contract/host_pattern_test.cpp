// Host patterns (contract/include/cellblock/contract/host_pattern.hpp): the one set of rules by which the
// gateway checks a session's request against the operator's ceiling and the kernel's egress proxy decides a
// connection.
#include "cellblock/contract/host_pattern.hpp"

#include <gtest/gtest.h>

using namespace cellblock::contract;

TEST(HostPattern, NormalizesCaseAndTrailingDot) {
    EXPECT_EQ(validated_host_pattern("PyPI.org."), "pypi.org");
    EXPECT_EQ(validated_host_pattern("*.PythonHosted.ORG"), "*.pythonhosted.org");
    EXPECT_EQ(validated_host_pattern("*"), "*");
    EXPECT_EQ(validated_host_pattern("10.0.0.1"), "10.0.0.1");
    EXPECT_EQ(validated_host_pattern("::1"), "::1");
}

TEST(HostPattern, RefusesWhatIsNotAHostPatternAndSaysWhy) {
    for (const char* bad : {"", ".", "a..b", "*.", "**", "a*.b.c", "*b.c", "b.*.c", "http://pypi.org",
                            "pypi.org/simple", "a b", "pypi.org:443", "*.*.org"})
        EXPECT_THROW(validated_host_pattern(bad), HostPatternError) << bad;
    try {
        validated_host_pattern("*.10.0.0.1");
        FAIL() << "a wildcard before an IP address was accepted";
    } catch (const HostPatternError& error) {
        EXPECT_STREQ(error.what(), "a wildcard cannot precede an IP address");
    }
}

// 253 characters at most (DNS), with or without the trailing dot.
TEST(HostPattern, ANameIsAtMost253Characters) {
    const std::string longest = std::string(63, 'a') + "." + std::string(63, 'b') + "." +
                                std::string(63, 'c') + "." + std::string(61, 'd');
    ASSERT_EQ(longest.size(), 253u);
    EXPECT_EQ(validated_host(longest), longest);
    EXPECT_EQ(validated_host(longest + "."), longest);
    EXPECT_THROW(validated_host(longest + "e"), HostPatternError);
    EXPECT_THROW(validated_host_pattern("*." + longest + "e"), HostPatternError);
}

TEST(HostPattern, WildcardCeilingCoversWholeLabelsOnly) {
    EXPECT_TRUE(pattern_within("a.example.com", "*.example.com"));
    EXPECT_TRUE(pattern_within("a.b.example.com", "*.example.com"));
    EXPECT_TRUE(pattern_within("*.a.example.com", "*.example.com"));
    EXPECT_TRUE(pattern_within("*.example.com", "*.example.com"));
    EXPECT_FALSE(pattern_within("example.com", "*.example.com"));
    EXPECT_FALSE(pattern_within("badexample.com", "*.example.com"));
    EXPECT_FALSE(pattern_within("*", "*.example.com"));
    EXPECT_FALSE(pattern_within("*.example.com", "*.a.example.com"));
    EXPECT_FALSE(pattern_within("example.com.evil.org", "*.example.com"));
    EXPECT_TRUE(pattern_within("*.pythonhosted.org", "*.org"));
    EXPECT_FALSE(pattern_within("*.org", "*.pythonhosted.org"));
}

TEST(HostPattern, AWildcardMatchesWholeLabelsOnly) {
    EXPECT_TRUE(pattern_matches("*.example.com", "a.example.com"));
    EXPECT_TRUE(pattern_matches("*.example.com", "a.b.example.com"));
    EXPECT_FALSE(pattern_matches("*.example.com", "example.com"));
    EXPECT_FALSE(pattern_matches("*.example.com", "badexample.com"));
    EXPECT_FALSE(pattern_matches("*.example.com", ".example.com"));
    EXPECT_FALSE(pattern_matches("*.example.com", "example.com.evil.test"));
    EXPECT_TRUE(pattern_matches("*", "anything.test"));
}

TEST(HostPattern, ExactNamesAndIpLiteralsMatchThemselvesOnly) {
    EXPECT_TRUE(pattern_matches("pypi.org", "pypi.org"));
    EXPECT_FALSE(pattern_matches("pypi.org", "www.pypi.org"));
    EXPECT_FALSE(pattern_matches("pypi.org", "pypi.org.evil.test"));
    EXPECT_TRUE(pattern_matches("93.184.216.34", "93.184.216.34"));
    EXPECT_FALSE(pattern_matches("93.184.216.34", "93.184.216.3"));
}

TEST(HostPattern, AHostIsNormalizedOrRefused) {
    EXPECT_EQ(normalize_host("PyPI.Org."), "pypi.org");
    EXPECT_EQ(validated_host("Files.PythonHosted.org"), "files.pythonhosted.org");
    EXPECT_EQ(validated_host("::1"), "::1");
    for (const std::string bad :
         {std::string(), std::string("a..b"), std::string("evil.test/x"), std::string("evil test"),
          std::string("evil\0.test", 10), std::string(64, 'a') + ".test"})
        EXPECT_THROW(validated_host(bad), HostPatternError) << bad;
}

TEST(HostPattern, ExactAndStarCeilings) {
    EXPECT_TRUE(pattern_within("anything.org", "*"));
    EXPECT_TRUE(pattern_within("*.org", "*"));
    EXPECT_TRUE(pattern_within("*", "*"));
    EXPECT_TRUE(pattern_within("pypi.org", "pypi.org"));
    EXPECT_FALSE(pattern_within("files.pypi.org", "pypi.org"));
    EXPECT_FALSE(pattern_within("*.pypi.org", "pypi.org"));
    EXPECT_FALSE(pattern_within("10.0.0.2", "10.0.0.1"));
}

// What the gateway admits into a policy is exactly what the proxy lets through: a wildcard ceiling never
// covers an IP literal, on either side.
TEST(HostPattern, AWildcardNeverCoversAnIpLiteral) {
    EXPECT_FALSE(pattern_within("10.0.0.1", "*.0.0.1"));
    EXPECT_FALSE(pattern_matches("*.0.0.1", "10.0.0.1"));
    EXPECT_TRUE(pattern_within("10.0.0.1", "*"));
    EXPECT_TRUE(pattern_matches("*", "10.0.0.1"));
}
