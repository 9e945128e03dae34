#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "cellblock/gateway/agent/agent_config.hpp"

using namespace cellblock::gateway::agent;
using nlohmann::json;

namespace {
const AgentLimits defaults{600, 2048, 1 << 20};
const AgentLimits maxima{3600, 8192, 64 << 20};

std::string failing_field(const json& requested) {
    try {
        parse_limits(requested, defaults, maxima);
    } catch (const LimitError& error) {
        return error.field();
    }
    return "";
}
}  // namespace

TEST(AgentLimits, MissingLimitsAreTheDefaults) {
    EXPECT_EQ(parse_limits(nullptr, defaults, maxima), defaults);
    EXPECT_EQ(parse_limits(json::object(), defaults, maxima), defaults);
}

TEST(AgentLimits, RequestedValuesOverrideDefaults) {
    const AgentLimits limits = parse_limits({{"timeout_s", 2.5}, {"output_bytes", 4096}}, defaults, maxima);
    EXPECT_DOUBLE_EQ(limits.timeout_s, 2.5);
    EXPECT_EQ(limits.output_bytes, 4096u);
    EXPECT_EQ(limits.memory_mb, defaults.memory_mb);
}

TEST(AgentLimits, ValuesAboveTheMaximaNameTheLimit) {
    EXPECT_EQ(failing_field({{"memory_mb", 8193}}), "limits.memory_mb");
    EXPECT_EQ(failing_field({{"timeout_s", 3600.5}}), "limits.timeout_s");
    EXPECT_EQ(failing_field({{"output_bytes", (64 << 20) + 1}}), "limits.output_bytes");
    try {
        parse_limits({{"memory_mb", 9000}}, defaults, maxima);
        FAIL() << "no error";
    } catch (const LimitError& error) {
        EXPECT_NE(std::string(error.what()).find("8192"), std::string::npos) << error.what();
    }
}

TEST(AgentLimits, WrongTypesUnknownKeysAndNonPositiveValuesAreRefused) {
    EXPECT_EQ(failing_field({{"timeout_s", "soon"}}), "limits.timeout_s");
    EXPECT_EQ(failing_field({{"timeout_s", 0}}), "limits.timeout_s");
    EXPECT_EQ(failing_field({{"memory_mb", -1}}), "limits.memory_mb");
    EXPECT_EQ(failing_field({{"memory_mb", 1.5}}), "limits.memory_mb");
    EXPECT_EQ(failing_field({{"cpu", 2}}), "limits.cpu");
    EXPECT_EQ(failing_field(json::array()), "limits");
}

TEST(AgentLimits, KernelConfigDefaultsAreAdoptedAndAlwaysAllowed) {
    const auto file = std::filesystem::temp_directory_path() /
                      ("agent-kernel-config-" + std::to_string(::getpid()) + ".json");
    std::ofstream(file) << R"({"limits": {"timeout_s": 90, "memory_mb": 32768, "output_bytes": 2048}})";
    AgentConfig config;
    config.load_kernel_defaults(file);
    std::filesystem::remove(file);
    EXPECT_DOUBLE_EQ(config.default_limits.timeout_s, 90);
    EXPECT_EQ(config.default_limits.memory_mb, 32768u);
    EXPECT_EQ(config.default_limits.output_bytes, 2048u);
    EXPECT_GE(config.max_limits.memory_mb, 32768u);
    EXPECT_EQ(parse_limits(nullptr, config.default_limits, config.max_limits), config.default_limits);
}

TEST(AgentLimits, UnreadableKernelConfigKeepsCompiledDefaults) {
    AgentConfig config;
    const AgentLimits before = config.default_limits;
    config.load_kernel_defaults("/nonexistent/kernel-config.json");
    EXPECT_EQ(config.default_limits, before);
}
