#include <gtest/gtest.h>

#include <csignal>

#include "cellblock/sandbox/sandbox.hpp"

namespace sb = cellblock::sandbox;
using Reason = sb::Outcome::Reason;

TEST(Outcome, DescribesEachReasonForPeople) {
    EXPECT_EQ((sb::Outcome{Reason::exited, 3, 0}).describe(), "exited with status 3");
    EXPECT_EQ((sb::Outcome{Reason::signaled, 0, SIGSEGV}).describe(),
              "killed by signal 11 (Segmentation fault)");
    EXPECT_EQ((sb::Outcome{Reason::memory_limit, 0, SIGKILL}).describe(), "killed by the memory limit");
    EXPECT_EQ((sb::Outcome{Reason::time_limit, 0, SIGKILL}).describe(), "killed by the time limit");
    EXPECT_EQ((sb::Outcome{Reason::cpu_limit, 0, SIGXCPU}).describe(), "killed by the CPU time limit");
    EXPECT_EQ((sb::Outcome{Reason::output_limit, 0, SIGKILL}).describe(), "killed by the output limit");
}

TEST(Outcome, ShellStatusIsTheExitCodeOr128PlusSignal) {
    EXPECT_EQ((sb::Outcome{Reason::exited, 3, 0}).shell_status(), 3);
    EXPECT_EQ((sb::Outcome{Reason::signaled, 0, SIGTERM}).shell_status(), 128 + SIGTERM);
    EXPECT_EQ((sb::Outcome{Reason::memory_limit, 0, SIGKILL}).shell_status(), 137);
}
