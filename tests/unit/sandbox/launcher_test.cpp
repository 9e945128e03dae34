// The launcher's happy path and failure reporting, with real confined processes.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "cellblock/sandbox/sandbox.hpp"

namespace sb = cellblock::sandbox;
namespace fs = std::filesystem;
using namespace std::chrono_literals;

namespace {

class LauncherTest : public ::testing::Test {
  protected:
    void SetUp() override {
        // Not a skip: the README's test command runs as root, and a launcher left untested must show as red.
        ASSERT_EQ(::geteuid(), 0u)
            << "the launcher tests need root to map a dedicated uid (run the suite as root)";
        std::string pattern = (fs::temp_directory_path() / "cellblock-launch-test-XXXXXX").string();
        ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
        workspace_ = pattern;
        policy_ = sb::Policy::load(CELLBLOCK_DEFAULT_POLICY_SOURCE);
        policy_.limits.memory_bytes = 256ULL << 20;
        // A range of our own: "no process of the session uid is left" must not see another suite's
        // sandbox that leased the same uid right after ours.
        policy_.uid_first = 280000;  // 260000.. is the battery, 270000.. the kernel battery
        policy_.uid_count = 1000;
    }
    void TearDown() override {
        if (!workspace_.empty())
            fs::remove_all(workspace_);
    }

    sb::LaunchRequest request(std::vector<std::string> argv) {
        sb::LaunchRequest r;
        r.argv = std::move(argv);
        r.workspace = workspace_;
        return r;
    }

    // Runs argv with stdout captured through a pipe.
    std::pair<sb::Outcome, std::string> run_captured(sb::Launcher& launcher, std::vector<std::string> argv) {
        int ends[2];
        EXPECT_EQ(::pipe2(ends, O_CLOEXEC), 0);
        auto r = request(std::move(argv));
        r.stdout_fd = ends[1];
        auto process = launcher.launch(r);
        ::close(ends[1]);
        std::string out;
        char buffer[4096];
        ssize_t got;
        while ((got = ::read(ends[0], buffer, sizeof buffer)) > 0)
            out.append(buffer, static_cast<std::size_t>(got));
        ::close(ends[0]);
        return {process.wait(), out};
    }

    fs::path workspace_;
    sb::Policy policy_;
};

}  // namespace

TEST_F(LauncherTest, TrueExitsZero) {
    sb::Launcher launcher(policy_);
    auto process = launcher.launch(request({"/usr/bin/true"}));
    EXPECT_GT(process.pid(), 0);
    EXPECT_GE(process.pidfd(), 0);
    EXPECT_GE(process.host_uid(), policy_.uid_first);
    const auto outcome = process.wait();
    EXPECT_EQ(outcome.reason, sb::Outcome::Reason::exited);
    EXPECT_EQ(outcome.exit_code, 0);
    EXPECT_TRUE(launcher.weakened().empty());
}

TEST_F(LauncherTest, ShellExitStatusIsReported) {
    sb::Launcher launcher(policy_);
    auto process = launcher.launch(request({"/bin/sh", "-c", "exit 3"}));
    const auto outcome = process.wait();
    EXPECT_EQ(outcome.describe(), "exited with status 3");
    EXPECT_EQ(outcome.shell_status(), 3);
}

TEST_F(LauncherTest, ProgramRunsAsTheInsideUidInTheWorkspace) {
    sb::Launcher launcher(policy_);
    auto [outcome, out] =
        run_captured(launcher, {"/bin/sh", "-c", "id -u; pwd; hostname; echo hi > note.txt"});
    EXPECT_EQ(outcome.exit_code, 0);
    EXPECT_EQ(out, "1000\n/workspace\ncellblock\n");
    struct stat info {};
    ASSERT_EQ(::stat((workspace_ / "note.txt").c_str(), &info), 0);
    EXPECT_GE(info.st_uid, policy_.uid_first) << "files are owned by the session's host uid, never root";
}

TEST_F(LauncherTest, MissingProgramIsASandboxErrorNamingTheStep) {
    sb::Launcher launcher(policy_);
    try {
        launcher.launch(request({"/usr/bin/definitely-not-here"}));
        FAIL() << "expected SandboxError";
    } catch (const sb::SandboxError& error) {
        EXPECT_EQ(std::string(error.what()),
                  "execve /usr/bin/definitely-not-here: No such file or directory");
    }
}

TEST_F(LauncherTest, BadRequestsAreRefusedBeforeCloning) {
    sb::Launcher launcher(policy_);
    EXPECT_THROW(launcher.launch(request({})), sb::SandboxError);
    EXPECT_THROW(launcher.launch(request({"python3"})), sb::SandboxError);
    auto r = request({"/usr/bin/true"});
    r.workspace = "/nonexistent/workspace";
    EXPECT_THROW(launcher.launch(r), sb::SandboxError);
}

TEST_F(LauncherTest, PassedFdsBecomeThreeAndNothingElseIsInherited) {
    int extra[2];
    ASSERT_EQ(::pipe(extra), 0);  // not CLOEXEC on purpose: it must still not leak unless passed
    int passed[2];
    ASSERT_EQ(::pipe2(passed, O_CLOEXEC), 0);
    sb::Launcher launcher(policy_);
    int ends[2];
    ASSERT_EQ(::pipe2(ends, O_CLOEXEC), 0);
    auto r = request({"/bin/sh", "-c", "ls /proc/self/fd | sort -n | tr '\\n' ' '; echo via-fd3 >&3"});
    r.stdout_fd = ends[1];
    r.pass_fds = {passed[1]};
    auto process = launcher.launch(r);
    ::close(ends[1]);
    ::close(passed[1]);
    std::string out(256, '\0');
    const auto got = ::read(ends[0], out.data(), out.size());
    ASSERT_GT(got, 0);
    out.resize(static_cast<std::size_t>(got));
    EXPECT_EQ(process.wait().exit_code, 0);
    // ls itself opens one directory fd (4 here).
    EXPECT_EQ(out, "0 1 2 3 4 ");
    char via[16] = {};
    EXPECT_EQ(::read(passed[0], via, sizeof via), 8);
    EXPECT_STREQ(via, "via-fd3\n");
    for (const int fd : {extra[0], extra[1], passed[0], ends[0]})
        ::close(fd);
}

TEST_F(LauncherTest, MemoryLimitIsReportedAsSuch) {
    sb::Launcher launcher(policy_);
    auto r = request({"/usr/bin/python3", "-c", "b = bytearray(600 << 20)"});
    auto process = launcher.launch(r);
    const auto outcome = process.wait();
    EXPECT_EQ(outcome.reason, sb::Outcome::Reason::memory_limit) << outcome.describe();
}

TEST_F(LauncherTest, WallClockLimitKillsAndIsReported) {
    sb::Launcher launcher(policy_);
    auto r = request({"/bin/sh", "-c", "sleep 60"});
    sb::ResourceLimits limits = policy_.limits;
    limits.wall_clock = 300ms;
    r.limits = limits;
    auto process = launcher.launch(r);
    const auto outcome = process.wait();
    EXPECT_EQ(outcome.reason, sb::Outcome::Reason::time_limit);
}

TEST_F(LauncherTest, SignalAndKillAreDelivered) {
    sb::Launcher launcher(policy_);
    auto process = launcher.launch(request({"/usr/bin/python3", "-c", "import time; time.sleep(60)"}));
    EXPECT_FALSE(process.wait_for(200ms).has_value());
    process.kill();
    const auto outcome = process.wait_for(10s);
    ASSERT_TRUE(outcome.has_value());
    EXPECT_EQ(outcome->signal, SIGKILL);
}

TEST_F(LauncherTest, DestructorLeavesNoProcessOfTheSessionUid) {
    sb::Launcher launcher(policy_);
    uid_t uid = 0;
    {
        auto process = launcher.launch(request({"/bin/sh", "-c", "sleep 100 & sleep 100 & sleep 100"}));
        uid = process.host_uid();
        std::this_thread::sleep_for(200ms);
    }
    for (const auto& entry : fs::directory_iterator("/proc")) {
        struct stat info {};
        if (::stat(entry.path().c_str(), &info) != 0)
            continue;
        const auto name = entry.path().filename().string();
        if (name.find_first_not_of("0123456789") != std::string::npos)
            continue;
        EXPECT_NE(info.st_uid, uid) << "process " << name << " of the session survived";
    }
}

TEST_F(LauncherTest, ConcurrentSandboxesGetDistinctUids) {
    sb::Launcher launcher(policy_);
    auto a = launcher.launch(request({"/bin/sh", "-c", "sleep 5"}));
    auto b = launcher.launch(request({"/bin/sh", "-c", "sleep 5"}));
    EXPECT_NE(a.host_uid(), b.host_uid());
    a.kill();
    b.kill();
}

TEST_F(LauncherTest, ChildSideFailureNamesTheStep) {
    sb::Launcher launcher(policy_);
    auto r = request({"/usr/bin/true"});
    r.cwd = "/no/such/dir";
    try {
        launcher.launch(r);
        FAIL() << "expected SandboxError";
    } catch (const sb::SandboxError& error) {
        EXPECT_EQ(std::string(error.what()), "chdir /no/such/dir: No such file or directory");
    }
}

TEST_F(LauncherTest, MissingBindSourceIsReportedBeforeLaunch) {
    sb::MountSpec extra;
    extra.kind = sb::MountSpec::Kind::bind;
    extra.source = "/nonexistent/source";
    extra.target = "/opt/extra";
    policy_.mounts.push_back(extra);
    sb::Launcher launcher(policy_);
    try {
        launcher.launch(request({"/usr/bin/true"}));
        FAIL() << "expected SandboxError";
    } catch (const sb::SandboxError& error) {
        EXPECT_EQ(std::string(error.what()), "bind source /nonexistent/source: No such file or directory");
    }
}

TEST_F(LauncherTest, CpuTimeLimitIsReportedAsSuch) {
    sb::Launcher launcher(policy_);
    auto r = request({"/usr/bin/python3", "-c",
                      "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True: pass"});
    sb::ResourceLimits limits = policy_.limits;
    limits.cpu_seconds = 1;
    limits.cpu_cores = 0;  // no quota: only the CPU-time limit
    r.limits = limits;
    auto process = launcher.launch(r);
    // Two CPU-seconds (soft limit ignored, hard limit one second later): generous for a loaded host.
    const auto outcome = process.wait_for(100s);
    ASSERT_TRUE(outcome.has_value());
    EXPECT_EQ(outcome->reason, sb::Outcome::Reason::cpu_limit) << outcome->describe();
}

TEST_F(LauncherTest, FullyEquippedHostReportsNothingWeakened) {
    // On this host every controller exists, so a launch with all limits must not be weakened.
    sb::Launcher launcher(policy_);
    auto process = launcher.launch(request({"/usr/bin/true"}));
    EXPECT_EQ(process.wait().exit_code, 0);
    EXPECT_TRUE(launcher.weakened().empty()) << "this host supports every mechanism the policy needs";
}

// The loopback listener is created in the sandbox's namespace before the program runs and handed over: the
// program's connection to 127.0.0.1:port is accepted here, and nothing of the program ever held the socket.
TEST_F(LauncherTest, LoopbackListenerIsHandedToTheCaller) {
    sb::Launcher launcher(policy_);
    int ends[2];
    ASSERT_EQ(::pipe2(ends, O_CLOEXEC), 0);
    auto r =
        request({"/usr/bin/python3", "-c",
                 "import os, socket\n"
                 "print(sorted(int(fd) for fd in os.listdir('/proc/self/fd')), flush=True)\n"
                 "print(socket.create_connection(('127.0.0.1', 3128), timeout=60).recv(64).decode())\n"});
    r.stdout_fd = ends[1];
    r.loopback_listener = sb::LoopbackListener{3128, false};
    auto process = launcher.launch(r);
    ::close(ends[1]);
    auto listeners = process.take_loopback_listeners();
    ASSERT_EQ(listeners.size(), 1u);
    EXPECT_TRUE(process.take_loopback_listeners().empty()) << "handed over once";
    EXPECT_NE(::fcntl(listeners[0].get(), F_GETFD) & FD_CLOEXEC, 0);
    sb::UniqueFd connection(::accept4(listeners[0].get(), nullptr, nullptr, SOCK_CLOEXEC));
    ASSERT_TRUE(connection) << std::strerror(errno);
    ASSERT_EQ(::write(connection.get(), "served from outside", 19), 19);
    connection.reset();
    std::string out;
    char buffer[4096];
    ssize_t got;
    while ((got = ::read(ends[0], buffer, sizeof buffer)) > 0)
        out.append(buffer, static_cast<std::size_t>(got));
    ::close(ends[0]);
    EXPECT_EQ(process.wait().exit_code, 0) << out;
    // The program's fds: stdin/out/err and the one python opens to list them; the listener is not among them.
    EXPECT_EQ(out, "[0, 1, 2, 3]\nserved from outside\n");
}

TEST_F(LauncherTest, LoopbackListenerNeedsAPortAndTheLoopback) {
    sb::Launcher launcher(policy_);
    auto r = request({"/usr/bin/true"});
    r.loopback_listener = sb::LoopbackListener{0, false};
    EXPECT_THROW(launcher.launch(r), sb::SandboxError);
    auto without_loopback = policy_;
    without_loopback.network_loopback = false;
    sb::Launcher dark(without_loopback);
    r.loopback_listener = sb::LoopbackListener{3128, false};
    EXPECT_THROW(dark.launch(r), sb::SandboxError);
}
