#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "cellblock/sandbox/sandbox.hpp"

namespace sb = cellblock::sandbox;
using nlohmann::json;

namespace {

// Policy::load's error for a file holding `content` ("" when it loads); any other exception escapes the test.
std::string load_error_of_file(const std::string& content) {
    char path[] = "/tmp/cellblock-policy-XXXXXX";
    const int fd = ::mkstemp(path);
    if (fd < 0)
        throw std::runtime_error("mkstemp failed");
    const bool written = ::write(fd, content.data(), content.size()) == static_cast<ssize_t>(content.size());
    ::close(fd);
    std::string error;
    try {
        if (!written)
            throw std::runtime_error("writing the policy file failed");
        sb::Policy::load(path);
    } catch (const sb::SandboxError& failure) {
        error = failure.what();
    } catch (...) {
        ::unlink(path);
        throw;
    }
    ::unlink(path);
    return error;
}

std::string error_of(const json& document) {
    try {
        sb::Policy::from_json(document);
    } catch (const sb::SandboxError& error) {
        return error.what();
    }
    return "";
}

}  // namespace

TEST(Policy, DefaultPolicyFileLoadsWithWorkerDefaults) {
    const auto policy = sb::Policy::load(CELLBLOCK_DEFAULT_POLICY_SOURCE);
    EXPECT_EQ(policy.limits.memory_bytes, 2ULL << 30);
    EXPECT_EQ(policy.limits.pids, 256U);
    EXPECT_DOUBLE_EQ(policy.limits.cpu_cores, 1.0);
    EXPECT_EQ(policy.limits.open_files, 256U);
    EXPECT_EQ(policy.limits.file_size_bytes, 256ULL << 20);
    EXPECT_NE(policy.uid_first, 0U);
    EXPECT_TRUE(policy.seccomp);
    EXPECT_FALSE(policy.allow_weaker_confinement);
    EXPECT_NE(std::find(policy.environment.begin(), policy.environment.end(), "HOME=/workspace"),
              policy.environment.end());
    bool has_usr = false;
    for (const auto& mount : policy.mounts) {
        if (mount.kind == sb::MountSpec::Kind::bind && mount.target == "/usr")
            has_usr = !mount.writable;
    }
    EXPECT_TRUE(has_usr) << "/usr must be bound read-only";
}

TEST(Policy, SizesAcceptUnits) {
    const auto policy =
        sb::Policy::from_json(json::parse(R"({"limits": {"memory": "512M", "file_size": 4096}})"));
    EXPECT_EQ(policy.limits.memory_bytes, 512ULL << 20);
    EXPECT_EQ(policy.limits.file_size_bytes, 4096U);
}

TEST(Policy, UnknownKeysAreRejectedWithTheirName) {
    EXPECT_NE(error_of(json::parse(R"({"seccom": false})")).find("seccom: unknown key"), std::string::npos);
    EXPECT_NE(error_of(json::parse(R"({"limits": {"memroy": 1}})")).find("limits.memroy: unknown key"),
              std::string::npos);
    EXPECT_NE(error_of(json::parse(R"({"mounts": [{"type": "tmpfs", "target": "/tmp", "sorce": "/x"}]})"))
                  .find("mounts[0].sorce"),
              std::string::npos);
}

TEST(Policy, WrongTypesAndValuesAreExplained) {
    EXPECT_NE(error_of(json::parse(R"({"seccomp": "yes"})")).find("seccomp: must be true or false"),
              std::string::npos);
    EXPECT_NE(error_of(json::parse(R"({"limits": {"memory": "lots"}})")).find("is not a size"),
              std::string::npos);
    EXPECT_NE(error_of(json::parse(R"({"limits": {"memory": "5T"}})")).find("unknown unit"),
              std::string::npos);
    EXPECT_NE(error_of(json::parse(R"({"limits": {"pids": -1}})")).find("limits.pids"), std::string::npos);
    EXPECT_NE(error_of(json::parse(R"({"environment": ["NOEQUALS"]})")).find("not NAME=value"),
              std::string::npos);
    EXPECT_NE(error_of(json::parse(R"([1, 2])")).find("must be an object"), std::string::npos);
}

TEST(Policy, HostRootIsNeverHandedOut) {
    EXPECT_NE(error_of(json::parse(R"({"uid_range": {"first": 0, "count": 10}})")).find("uid_range.first"),
              std::string::npos);
    EXPECT_NE(error_of(json::parse(R"({"inside_uid": 0})")).find("inside_uid"), std::string::npos);
}

TEST(Policy, ValuesPastTheirTypeAreRefusedNotTruncated) {
    // Spotted while writing tests/fuzz/sandbox_policy, whose invariants guard them: 4294968296 was handed out
    // as host uid 1000, "999999999999999G" wrapped to a small limit, and huge seconds/cores overflowed their
    // integer conversion.
    EXPECT_NE(error_of(json::parse(R"({"uid_range": {"first": 4294968296, "count": 10}})"))
                  .find("uid_range.first: is past the largest valid uid"),
              std::string::npos);
    EXPECT_NE(error_of(json::parse(R"({"uid_range": {"first": 100000, "count": 4294967297}})"))
                  .find("uid_range.count: is past the largest valid uid"),
              std::string::npos);
    EXPECT_NE(error_of(json::parse(R"({"limits": {"memory": "999999999999999G"}})")).find("is too large"),
              std::string::npos);
    EXPECT_NE(error_of(json::parse(R"({"limits": {"wall_clock_seconds": 1e300}})"))
                  .find("limits.wall_clock_seconds: must be at most"),
              std::string::npos);
    EXPECT_NE(error_of(json::parse(R"({"limits": {"cpu_cores": 1e300}})"))
                  .find("limits.cpu_cores: must be at most"),
              std::string::npos);
    const auto largest = sb::Policy::from_json(json::parse(R"({"limits": {"memory": "17179869183G"}})"));
    EXPECT_EQ(largest.limits.memory_bytes, 17179869183ULL << 30);
}

TEST(Policy, MountsNeedValidTypesAndAbsoluteTargets) {
    EXPECT_NE(error_of(json::parse(R"({"mounts": [{"type": "overlay", "target": "/x"}]})"))
                  .find("'overlay' is not one of"),
              std::string::npos);
    EXPECT_NE(
        error_of(json::parse(R"({"mounts": [{"type": "bind", "target": "/x"}]})")).find("needs \"source\""),
        std::string::npos);
    EXPECT_NE(error_of(json::parse(R"({"mounts": [{"type": "tmpfs", "target": "tmp"}]})")).find("absolute"),
              std::string::npos);
    EXPECT_NE(error_of(json::parse(R"({"mounts": [{"type": "tmpfs", "target": "/a/../etc"}]})")).find("'..'"),
              std::string::npos);
}

TEST(Policy, LoadReportsMissingFileAndBadJson) {
    try {
        sb::Policy::load("/nonexistent/policy.json");
        FAIL() << "expected an error";
    } catch (const sb::SandboxError& error) {
        EXPECT_NE(std::string(error.what()).find("/nonexistent/policy.json"), std::string::npos);
    }
    EXPECT_NE(load_error_of_file("{ not json").find("not valid JSON"), std::string::npos);
    // A number past double's range is nlohmann's out_of_range, not a parse_error: it escaped load().
    const std::string huge_error = load_error_of_file(R"({"limits": {"wall_clock_seconds": 1e999}})");
    EXPECT_NE(huge_error.find("not valid JSON"), std::string::npos) << huge_error;
}
