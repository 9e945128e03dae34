#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <utility>
#include <vector>

#include "launch/kernel_config.hpp"

namespace cellblock::kernel {
namespace {

class KernelConfigFile : public ::testing::Test {
  protected:
    void SetUp() override {
        dir =
            std::filesystem::temp_directory_path() / ("cellblock-config-test-" + std::to_string(::getpid()));
        std::filesystem::create_directories(dir);
        file = dir / "kernel-config.json";
        std::ofstream(file) << R"({"worker": {"python": "/usr/bin/python3", "script": "worker/w.py"},
                                   "sandbox_policy": "policy.json", "workspace_root": "/var/ws",
                                   "limits": {"timeout_s": 30, "interrupt_grace_s": 1.5, "output_bytes": 1000,
                                              "memory_mb": 512}})";
    }
    void TearDown() override { std::filesystem::remove_all(dir); }
    KernelConfig::EnvironmentLookup environment() const {
        return [this](const std::string& name) -> std::optional<std::string> {
            auto it = variables.find(name);
            if (it == variables.end())
                return std::nullopt;
            return it->second;
        };
    }
    std::filesystem::path dir, file;
    std::map<std::string, std::string> variables;
};

TEST_F(KernelConfigFile, RelativePathsResolveAgainstTheFile) {
    const auto config = KernelConfig::load(file, environment());
    EXPECT_EQ(config.worker_script, dir / "worker/w.py");
    EXPECT_EQ(config.sandbox_policy, dir / "policy.json");
    EXPECT_EQ(config.workspace_root, "/var/ws");
    EXPECT_EQ(config.limits.timeout_s, 30);
    EXPECT_EQ(config.limits.interrupt_grace_s, 1.5);
    EXPECT_EQ(config.limits.output_bytes, 1000u);
    EXPECT_EQ(config.limits.memory_mb, 512u);
    EXPECT_EQ(config.worker_start_timeout_s, 60);
    EXPECT_FALSE(config.workspace);
}

TEST_F(KernelConfigFile, WorkerStartTimeoutIsReadAndMustBePositive) {
    std::ofstream(file)
        << R"({"worker": {"script": "w.py", "start_timeout_s": 2.5}, "sandbox_policy": "p.json"})";
    EXPECT_EQ(KernelConfig::load(file, environment()).worker_start_timeout_s, 2.5);
    std::ofstream(file)
        << R"({"worker": {"script": "w.py", "start_timeout_s": 0}, "sandbox_policy": "p.json"})";
    EXPECT_THROW(KernelConfig::load(file, environment()), ConfigError);
}

TEST_F(KernelConfigFile, EnvironmentOverridesTheFile) {
    variables = {{"CELLBLOCK_TIMEOUT_S", "2.5"},
                 {"CELLBLOCK_MEMORY_MB", "128"},
                 {"CELLBLOCK_OUTPUT_BYTES", "4096"},
                 {"CELLBLOCK_WORKSPACE", "/srv/ws/abc"}};
    const auto config = KernelConfig::load(file, environment());
    EXPECT_EQ(config.limits.timeout_s, 2.5);
    EXPECT_EQ(config.limits.memory_mb, 128u);
    EXPECT_EQ(config.limits.output_bytes, 4096u);
    EXPECT_EQ(config.workspace, std::filesystem::path("/srv/ws/abc"));
}

TEST_F(KernelConfigFile, BadValuesAreReportedByName) {
    variables = {{"CELLBLOCK_TIMEOUT_S", "soon"}};
    try {
        KernelConfig::load(file, environment());
        FAIL() << "expected ConfigError";
    } catch (const ConfigError& error) {
        EXPECT_NE(std::string(error.what()).find("CELLBLOCK_TIMEOUT_S"), std::string::npos);
    }
    EXPECT_THROW(KernelConfig::load(dir / "missing.json", environment()), ConfigError);
}

// A limit is what the file or the variable says, or the kernel refuses to start naming it: before, a
// memory_mb of -1 became 2^64-1 (no limit), 1.5 MiB became 1, CELLBLOCK_MEMORY_MB=1e30 converted out of range
// and CELLBLOCK_TIMEOUT_S=nan was taken as a time limit.
TEST_F(KernelConfigFile, LimitsPastTheirTypeAreRefusedNotWrappedOrRounded) {
    const auto refusal = [this](const std::string& limits) -> std::string {
        std::ofstream(file) << R"({"worker": {"script": "w.py"}, "sandbox_policy": "p.json", "limits": )"
                            << limits << "}";
        try {
            KernelConfig::load(file, environment());
        } catch (const ConfigError& error) {
            return error.what();
        }
        return "";
    };
    EXPECT_NE(refusal(R"({"memory_mb": -1})").find("limits.memory_mb must be a whole number from 0 to"),
              std::string::npos);
    EXPECT_NE(refusal(R"({"memory_mb": 1.5})").find("limits.memory_mb"), std::string::npos);
    EXPECT_NE(refusal(R"({"output_bytes": -4096})").find("limits.output_bytes"), std::string::npos);
    EXPECT_NE(refusal(R"({"timeout_s": -1})").find("limits.timeout_s must be a number of seconds from 0 to"),
              std::string::npos);
    EXPECT_NE(refusal(R"({"timeout_s": "600"})").find("limits.timeout_s"), std::string::npos);
    // memory_mb becomes bytes: 2^44 MiB wrapped to 0 bytes, which the sandbox reads as no limit.
    EXPECT_NE(refusal(R"({"memory_mb": 17592186044416})")
                  .find("limits.memory_mb must be a whole number from 0 to "),
              std::string::npos);
    EXPECT_EQ(refusal(R"({"memory_mb": 1073741824, "timeout_s": 0})"), "");
    // A deadline counts nanoseconds in 64 bits: 1e300 s overflowed it.
    EXPECT_NE(
        refusal(R"({"timeout_s": 1e300})").find("limits.timeout_s must be a number of seconds from 0 to"),
        std::string::npos);
    EXPECT_NE(refusal(R"({"interrupt_grace_s": 1.6e9})").find("limits.interrupt_grace_s"), std::string::npos);
    EXPECT_EQ(refusal(R"({"timeout_s": 1.5e9})"), "");

    std::ofstream(file) << R"({"worker": {"script": "w.py"}, "sandbox_policy": "p.json"})";
    for (const auto& [name, text] :
         std::vector<std::pair<std::string, std::string>>{{"CELLBLOCK_MEMORY_MB", "1e30"},
                                                          {"CELLBLOCK_MEMORY_MB", "1.5"},
                                                          {"CELLBLOCK_OUTPUT_BYTES", "-1"},
                                                          {"CELLBLOCK_OUTPUT_BYTES", "99999999999999999999"},
                                                          {"CELLBLOCK_MEMORY_MB", "17592186044416"},
                                                          {"CELLBLOCK_TIMEOUT_S", "nan"},
                                                          {"CELLBLOCK_TIMEOUT_S", "1e300"},
                                                          {"CELLBLOCK_INTERRUPT_GRACE_S", "inf"}}) {
        SCOPED_TRACE(name + "=" + text);
        variables = {{name, text}};
        try {
            KernelConfig::load(file, environment());
            ADD_FAILURE() << "accepted";
        } catch (const ConfigError& error) {
            EXPECT_NE(std::string(error.what()).find(name), std::string::npos) << error.what();
        }
    }
}

TEST_F(KernelConfigFile, NetworkPolicyIsReadFromTheEnvironment) {
    EXPECT_FALSE(KernelConfig::load(file, environment()).network_policy);
    variables = {{"CELLBLOCK_NETWORK_POLICY", R"({"allow": ["pypi.org"], "ask": true})"},
                 {"CELLBLOCK_EGRESS_HOSTS", "/etc/cellblock/egress-hosts"}};
    const auto config = KernelConfig::load(file, environment());
    ASSERT_TRUE(config.network_policy);
    EXPECT_EQ((*config.network_policy)["allow"][0], "pypi.org");
    EXPECT_EQ(config.egress_hosts, std::filesystem::path("/etc/cellblock/egress-hosts"));
}

TEST_F(KernelConfigFile, ANetworkPolicyThatIsNotAJsonObjectStopsTheStart) {
    // The last: a number past double's range, found by tests/fuzz/kernel_config.cpp (it escaped as
    // json::out_of_range, not ConfigError, and ended the kernel without saying why).
    for (const std::string text : {R"({"allow": ["pypi.org"])", "[\"pypi.org\"]", "allow everything",
                                   R"({"approval_timeout_s": 1e999})"}) {
        variables = {{"CELLBLOCK_NETWORK_POLICY", text}};
        try {
            KernelConfig::load(file, environment());
            FAIL() << "expected ConfigError for " << text;
        } catch (const ConfigError& error) {
            EXPECT_NE(std::string(error.what()).find("CELLBLOCK_NETWORK_POLICY"), std::string::npos) << text;
        }
    }
}

TEST_F(KernelConfigFile, TheZygoteIsOnByDefaultWhereATenantIsNamed) {
    auto config = KernelConfig::load(file, environment());
    EXPECT_TRUE(config.zygote.enabled);
    EXPECT_FALSE(config.zygote.active()) << "no tenant: every launch by exec";
    EXPECT_FALSE(config.zygote.supervised);
    variables = {{"CELLBLOCK_ZYGOTE_TENANT", "alice"}, {"CELLBLOCK_ZYGOTE_SUPERVISED", "1"}};
    config = KernelConfig::load(file, environment());
    EXPECT_EQ(config.zygote.tenant, "alice");
    EXPECT_TRUE(config.zygote.active());
    EXPECT_TRUE(config.zygote.supervised);

    std::ofstream(file) << R"({"worker": {"script": "w.py", "zygote": false}, "sandbox_policy": "p.json"})";
    EXPECT_FALSE(KernelConfig::load(file, environment()).zygote.active()) << "switched off, a tenant or not";

    std::ofstream(file) << R"({"worker": {"script": "w.py", "zygote": true, "zygote_tenant": "from-file",
                                          "zygote_library": "lib/z.so"}, "sandbox_policy": "p.json"})";
    config = KernelConfig::load(file, environment());
    EXPECT_TRUE(config.zygote.active());
    EXPECT_EQ(config.zygote.tenant, "alice") << "the environment overrides the file";
    EXPECT_EQ(config.zygote.library, dir / "lib/z.so");
    variables.clear();
    EXPECT_EQ(KernelConfig::load(file, environment()).zygote.tenant, "from-file");
}

TEST_F(KernelConfigFile, TheTemplatesPreloadAndGenerationComeFromTheConfigAsItsEnvironment) {
    EXPECT_TRUE(KernelConfig::load(file, environment()).zygote.template_environment().empty())
        << "unset: the template's own defaults";
    std::ofstream(file) << R"({"worker": {"script": "w.py", "zygote": true, "zygote_tenant": "t",
                                          "zygote_preload": ["IPython", "numpy", "scipy.stats", "_private2"],
                                          "zygote_generation_forks": 50, "zygote_generation_seconds": 90.5},
                               "sandbox_policy": "p.json"})";
    EXPECT_EQ(KernelConfig::load(file, environment()).zygote.template_environment(),
              (std::vector<std::string>{"CELLBLOCK_ZYGOTE_PRELOAD=IPython,numpy,scipy.stats,_private2",
                                        "CELLBLOCK_ZYGOTE_GENERATION_FORKS=50",
                                        "CELLBLOCK_ZYGOTE_GENERATION_SECONDS=90.5"}));
    std::ofstream(file)
        << R"({"worker": {"script": "w.py", "zygote_preload": []}, "sandbox_policy": "p.json"})";
    EXPECT_EQ(KernelConfig::load(file, environment()).zygote.template_environment(),
              (std::vector<std::string>{"CELLBLOCK_ZYGOTE_PRELOAD="}))
        << "an empty list preloads nothing (not the defaults)";

    for (const char* bad :
         {R"("zygote_preload": ["os; import sys"])", R"("zygote_preload": ["a,b"])",
          R"("zygote_preload": ["a..b"])", R"("zygote_preload": [".a"])", R"("zygote_preload": ["1a"])",
          R"("zygote_preload": [""])", R"("zygote_preload": "numpy")", R"("zygote_generation_forks": 0)",
          R"("zygote_generation_seconds": 0)", R"("zygote_generation_seconds": -1)",
          R"("zygote_generation_forks": 1.5)", R"("zygote_generation_forks": 1e300)",
          R"("zygote_generation_seconds": 1e300)"}) {
        std::ofstream(file) << R"({"worker": {"script": "w.py", )" << bad
                            << R"(}, "sandbox_policy": "p.json"})";
        EXPECT_THROW(KernelConfig::load(file, environment()), ConfigError) << bad;
    }
}

TEST_F(KernelConfigFile, ATenantIsAPlainName) {
    for (const char* bad : {"../etc", "a/b", "..", "with space", "x\n"}) {
        variables = {{"CELLBLOCK_ZYGOTE_TENANT", bad}};
        EXPECT_THROW(KernelConfig::load(file, environment()), ConfigError) << bad;
    }
    variables = {{"CELLBLOCK_ZYGOTE_TENANT", "team-7.agents_x"}};
    EXPECT_EQ(KernelConfig::load(file, environment()).zygote.tenant, "team-7.agents_x");
}

}  // namespace
}  // namespace cellblock::kernel
