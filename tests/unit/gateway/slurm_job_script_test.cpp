// The Slurm job script is run by /bin/sh on a compute node, outside any sandbox: no name or value of a
// kernel's environment may be evaluated there. Each test runs the script with the real /bin/sh and checks the
// host: the marker file a command would have created does not exist, and the document the kernel would read
// is intact.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "cellblock/contract/environment.hpp"
#include "cellblock/gateway/kernels/provisioner.hpp"

namespace cellblock::gateway {
namespace {

namespace fs = std::filesystem;

class SlurmJobScript : public ::testing::Test {
  protected:
    void SetUp() override {
        std::string pattern = (fs::temp_directory_path() / "cbgw-script-XXXXXX").string();
        ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
        root_ = pattern;
        marker_ = (root_ / "owned").string();
    }
    void TearDown() override { fs::remove_all(root_); }

    // Runs the script with /bin/sh; `cat` stands in for the kernel and prints what it reads on stdin.
    std::string run(const std::string& script) {
        const fs::path file = root_ / "job.sh";
        std::ofstream(file) << script;
        const std::string command = "/bin/sh " + file.string() + " 2>&1";
        FILE* pipe = ::popen(command.c_str(), "r");
        EXPECT_NE(pipe, nullptr);
        std::string output;
        std::array<char, 4096> buffer{};
        for (std::size_t got; (got = std::fread(buffer.data(), 1, buffer.size(), pipe)) > 0;)
            output.append(buffer.data(), got);
        EXPECT_EQ(::pclose(pipe), 0) << output;
        return output;
    }

    fs::path root_;
    std::string marker_;
};

TEST_F(SlurmJobScript, ValuesReachTheKernelAsDataNeverAsShellWords) {
    const std::map<std::string, std::string> environment = {
        {"PATH", "/usr/bin:/bin"},
        {"KERNEL_SUBSTITUTION", "$(touch " + marker_ + ")"},
        {"KERNEL_BACKTICKS", "`touch " + marker_ + "`"},
        {"KERNEL_QUOTES", "'; touch " + marker_ + "; '\""},
        {"KERNEL_DELIMITER", "x\nCELLBLOCK_LAUNCH_ENVIRONMENT\ntouch " + marker_ + "\n"},
        {"CELLBLOCK_REPORT_TOKEN", "0123456789abcdef"}};
    // `cat --environment-stdin` would fail: the stand-in kernel is `sh -c 'cat' argv0`, which ignores the
    // flag.
    const std::string output = run(slurm_job_script({"/bin/sh", "-c", "exec cat", "kernel"}, environment));
    EXPECT_FALSE(fs::exists(marker_)) << "the script ran a command from the environment";
    ASSERT_FALSE(output.empty());
    EXPECT_EQ(contract::decode_environment(output), environment);
}

TEST_F(SlurmJobScript, ArgumentsAreQuotedWords) {
    const std::string output = run(slurm_job_script(
        {"/bin/sh", "-c", "printf '%s|' \"$@\"", "kernel", "$(touch " + marker_ + ")", "a b"},
        {{"PATH", "/usr/bin:/bin"}}));
    EXPECT_FALSE(fs::exists(marker_));
    EXPECT_EQ(output, "$(touch " + marker_ + ")|a b|--environment-stdin|");
}

TEST_F(SlurmJobScript, ABadNameIsRefusedBeforeAnyScriptIsWritten) {
    EXPECT_THROW(slurm_job_script({"/bin/true"}, {{"KERNEL_X$(touch " + marker_ + ")", "1"}}),
                 contract::InvalidEnvironment);
}

}  // namespace
}  // namespace cellblock::gateway
