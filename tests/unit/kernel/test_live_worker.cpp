// A LiveWorker is shared between the shell thread, which polls its pidfd, and other threads that may
// terminate it at any moment: the descriptor a reader got must stay a pidfd of that worker.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <thread>

#include "cellblock/sandbox/sandbox.hpp"
#include "worker/worker_supervisor.hpp"

namespace cellblock::kernel {
namespace {

namespace fs = std::filesystem;

class LiveWorkerTest : public ::testing::Test {
  protected:
    void SetUp() override {
        ASSERT_EQ(::geteuid(), 0u) << "confined processes need root (run the suite as root)";
        std::string pattern = (fs::temp_directory_path() / "cellblock-live-worker-XXXXXX").string();
        ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
        workspace_ = pattern;
        policy_ = sandbox::Policy::load(CELLBLOCK_DEFAULT_POLICY_SOURCE);
        policy_.uid_first = 281000;  // apart from the sandbox units (280000..) and the batteries
        policy_.uid_count = 500;
    }
    void TearDown() override { fs::remove_all(workspace_); }

    std::shared_ptr<LiveWorker> start_sleeper(sandbox::Launcher& launcher) {
        sandbox::LaunchRequest request;
        request.argv = {"/usr/bin/sleep", "60"};
        request.workspace = workspace_;
        return std::make_shared<LiveWorker>(launcher.launch(request), UniqueFd(), UniqueFd(), UniqueFd());
    }

    fs::path workspace_;
    sandbox::Policy policy_;
};

short poll_events(int fd) {
    pollfd item{fd, POLLIN, 0};
    EXPECT_GE(::poll(&item, 1, 0), 0);
    return item.revents;
}

TEST_F(LiveWorkerTest, PidfdStaysValidAndReportsTheEndAfterTerminate) {
    sandbox::Launcher launcher(policy_);
    auto worker = start_sleeper(launcher);
    const int pidfd = worker->pidfd();
    EXPECT_EQ(poll_events(pidfd), 0);  // running
    worker->terminate();
    // Descriptors opened by anyone after terminate must not take the reader's number.
    UniqueFd other(::open("/dev/null", O_RDONLY | O_CLOEXEC));
    ASSERT_TRUE(other);
    EXPECT_EQ(worker->pidfd(), pidfd);
    EXPECT_NE(other.get(), pidfd);
    const short events = poll_events(pidfd);
    EXPECT_TRUE(events & POLLIN) << events;     // ended (reaped: POLLHUP too)
    EXPECT_FALSE(events & POLLNVAL) << events;  // not a closed descriptor
}

TEST_F(LiveWorkerTest, ReaderPollingWhileAnotherThreadTerminatesSeesTheEnd) {
    sandbox::Launcher launcher(policy_);
    auto worker = start_sleeper(launcher);
    std::atomic<short> seen{0};
    std::thread reader([&] {
        pollfd item{worker->pidfd(), POLLIN, 0};
        const int ready = ::poll(&item, 1, 30000);
        seen = ready > 0 ? item.revents : static_cast<short>(-1);
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    worker->terminate();
    reader.join();
    EXPECT_TRUE(seen.load() > 0 && (seen.load() & POLLIN)) << seen.load();
}

}  // namespace
}  // namespace cellblock::kernel
