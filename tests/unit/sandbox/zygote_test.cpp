// The zygote path of the sandbox (sandbox/README.md "Worker zygote"): a plan survives the codec, and a worker
// forked by a template through libcellblock_zygote.so is confined exactly as an exec'd one. The template here
// is a small C++ one (zygote_test_template.cpp) speaking the same wire protocol as the Python template.
#include <dlfcn.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <thread>

#include "cellblock/sandbox/sandbox.hpp"
#include "mounts.hpp"
#include "plan_codec.hpp"

namespace sb = cellblock::sandbox;
namespace detail = cellblock::sandbox::detail;
namespace fs = std::filesystem;
using namespace std::chrono_literals;

namespace {

std::string read_file(const fs::path& path) {
    std::ifstream file(path);
    std::stringstream text;
    text << file.rdbuf();
    return text.str();
}

detail::ChildPlan sample_plan(std::vector<sock_filter>& filter) {
    detail::ChildPlan plan;
    plan.exec_program = false;
    plan.parent_death_signal = false;
    plan.drop_privileges = true;
    plan.new_user_namespace = true;
    plan.sync_read_fd = 40;
    plan.sync_write_fd = 41;  // the parent's: never sent
    plan.error_write_fd = 42;
    plan.error_read_fd = 43;  // the parent's: never sent
    plan.cgroup_joins = {{"/sys/fs/cgroup/memory/cellblock/200001/tasks", 7}};
    plan.new_cgroup_namespace = true;
    plan.step_sync = 1;
    plan.step_cgroupns = 2;
    plan.step_setgroups = 3;
    plan.step_hostname = 4;
    plan.step_setsid = 5;
    plan.step_pdeathsig = 6;
    plan.step_chdir = 8;
    plan.step_execve = 9;
    plan.step_sigmask = 10;
    detail::MountOp bind;
    bind.action = detail::MountOp::Action::mount;
    bind.step = 11;
    bind.source = "/usr";
    bind.target = "/run/cellblock/roots/200001/usr";
    bind.flags = 4096;
    bind.has_source = true;
    detail::MountOp tmpfs;
    tmpfs.step = 12;
    tmpfs.source = "tmpfs";
    tmpfs.target = "/run/cellblock/roots/200001/tmp";
    tmpfs.fstype = "tmpfs";
    tmpfs.data = "mode=1777,size=1048576";
    tmpfs.has_source = tmpfs.has_fstype = tmpfs.has_data = true;
    plan.mounts_before_pivot = {bind, tmpfs};
    plan.new_root = "/run/cellblock/roots/200001";
    plan.step_chdir_root = 13;
    plan.step_pivot = 14;
    plan.step_umount_old = 15;
    detail::MountOp remount;
    remount.action = detail::MountOp::Action::remount_bind;
    remount.step = 16;
    remount.target = "/";
    remount.flags = 1 | 2 | 4;
    plan.mounts_after_pivot = {remount};
    plan.hostname = "cellblock";
    plan.loopback_up = true;
    plan.step_loopback = 17;
    plan.listeners = {{false, 3128, 18, 19, 20, 21}, {true, 3128, 22, 23, 24, 25}};
    plan.listener_child_fd = 44;
    plan.listener_parent_fd = 45;         // the parent's: never sent
    plan.fds.sources = {46, 47, 47, 48};  // stdout and stderr the same pipe: sent once
    plan.fds.dup_base = 49;
    plan.fds.step_dup = 26;
    plan.fds.step_close = 27;
    plan.rlimits = {{RLIMIT_NOFILE, {256, 256}, 28}, {RLIMIT_CPU, {10, 11}, 29}};
    plan.uid = 1000;
    plan.gid = 1000;
    plan.last_capability = 40;
    plan.step_bounding = 30;
    plan.step_setresgid = 31;
    plan.step_setresuid = 32;
    plan.step_capset = 33;
    plan.step_ambient = 34;
    plan.step_no_new_privs = 35;
    plan.step_securebits = 36;
    filter = {{0x20, 0, 0, 4}, {0x15, 1, 0, 0xc000003e}, {0x06, 0, 0, 0x7fff0000}};
    plan.seccomp_filter = &filter;
    plan.step_seccomp = 37;
    plan.cwd = "/workspace";
    return plan;
}

}  // namespace

TEST(PlanCodec, APlanRoundTripsWithItsFdsRenamedByTheirIndex) {
    std::vector<sock_filter> filter;
    const auto plan = sample_plan(filter);
    const auto encoded = detail::encode_plan(plan);
    // Only the child's ends travel, each once, in the order the plan first names them.
    EXPECT_EQ(encoded.fds, (std::vector<int>{40, 42, 44, 46, 47, 48}));

    // The template receives them under other numbers.
    const std::vector<int> received{5, 6, 7, 8, 9, 10};
    const auto decoded = detail::decode_plan(encoded.bytes, received);
    const auto& copy = decoded->plan;
    EXPECT_FALSE(copy.exec_program);
    EXPECT_FALSE(copy.parent_death_signal);
    EXPECT_TRUE(copy.drop_privileges);
    EXPECT_TRUE(copy.new_user_namespace);
    EXPECT_EQ(copy.sync_read_fd, 5);
    EXPECT_EQ(copy.error_write_fd, 6);
    EXPECT_EQ(copy.listener_child_fd, 7);
    EXPECT_EQ(copy.sync_write_fd, -1);
    EXPECT_EQ(copy.error_read_fd, -1);
    EXPECT_EQ(copy.listener_parent_fd, -1);
    EXPECT_EQ(copy.fds.sources, (std::vector<int>{8, 9, 9, 10}));
    EXPECT_EQ(copy.fds.dup_base, 11) << "scratch copies go above every received fd";
    EXPECT_EQ(copy.fds.step_dup, 26);
    EXPECT_EQ(copy.fds.step_close, 27);
    ASSERT_EQ(copy.cgroup_joins.size(), 1u);
    EXPECT_EQ(copy.cgroup_joins[0].tasks_file, plan.cgroup_joins[0].tasks_file);
    EXPECT_EQ(copy.cgroup_joins[0].step, 7);
    EXPECT_EQ(copy.step_sync, 1);
    EXPECT_EQ(copy.step_sigmask, 10);
    ASSERT_EQ(copy.mounts_before_pivot.size(), 2u);
    for (std::size_t i = 0; i < 2; ++i) {
        const auto& a = plan.mounts_before_pivot[i];
        const auto& b = copy.mounts_before_pivot[i];
        EXPECT_EQ(a.action, b.action);
        EXPECT_EQ(a.step, b.step);
        EXPECT_EQ(a.source, b.source);
        EXPECT_EQ(a.target, b.target);
        EXPECT_EQ(a.fstype, b.fstype);
        EXPECT_EQ(a.flags, b.flags);
        EXPECT_EQ(a.data, b.data);
        EXPECT_EQ(a.has_source, b.has_source);
        EXPECT_EQ(a.has_fstype, b.has_fstype);
        EXPECT_EQ(a.has_data, b.has_data);
    }
    ASSERT_EQ(copy.mounts_after_pivot.size(), 1u);
    EXPECT_EQ(copy.mounts_after_pivot[0].action, detail::MountOp::Action::remount_bind);
    EXPECT_EQ(copy.mounts_after_pivot[0].flags, 7u);
    EXPECT_EQ(copy.new_root, plan.new_root);
    EXPECT_EQ(copy.step_umount_old, 15);
    EXPECT_EQ(copy.hostname, "cellblock");
    ASSERT_EQ(copy.listeners.size(), 2u);
    EXPECT_TRUE(copy.listeners[1].ipv6);
    EXPECT_EQ(copy.listeners[1].port, 3128);
    EXPECT_EQ(copy.listeners[1].step_send, 25);
    ASSERT_EQ(copy.rlimits.size(), 2u);
    EXPECT_EQ(copy.rlimits[1].resource, RLIMIT_CPU);
    EXPECT_EQ(copy.rlimits[1].value.rlim_cur, 10u);
    EXPECT_EQ(copy.rlimits[1].value.rlim_max, 11u);
    EXPECT_EQ(copy.uid, 1000u);
    EXPECT_EQ(copy.gid, 1000u);
    EXPECT_EQ(copy.step_securebits, 36);
    ASSERT_NE(copy.seccomp_filter, nullptr);
    ASSERT_EQ(copy.seccomp_filter->size(), 3u);
    EXPECT_EQ((*copy.seccomp_filter)[1].code, 0x15);
    EXPECT_EQ((*copy.seccomp_filter)[1].jt, 1);
    EXPECT_EQ((*copy.seccomp_filter)[1].k, 0xc000003eu);
    EXPECT_EQ(copy.step_seccomp, 37);
    EXPECT_EQ(copy.cwd, "/workspace");
    EXPECT_EQ(copy.argv, (std::vector<char*>{nullptr}));
}

// A template decodes one plan per session and frees it: nothing of that session's plan stays readable in its
// heap for the next fork (wipe() is what the destructor runs).
TEST(PlanCodec, ADecodedPlanIsZeroedBeforeItIsFreed) {
    std::vector<sock_filter> filter;
    const auto encoded = detail::encode_plan(sample_plan(filter));
    const auto decoded = detail::decode_plan(encoded.bytes, std::vector<int>{5, 6, 7, 8, 9, 10});
    ASSERT_EQ(decoded->plan.cwd, "/workspace");
    ASSERT_FALSE(decoded->plan.mounts_before_pivot.empty());
    const std::string& source = decoded->plan.mounts_before_pivot.front().source;
    const std::size_t source_size = source.size();
    decoded->wipe();
    EXPECT_EQ(decoded->plan.cwd, std::string(10, '\0'));
    EXPECT_EQ(source, std::string(source_size, '\0'));
    EXPECT_EQ(decoded->plan.hostname.find_first_not_of('\0'), std::string::npos);
}

TEST(PlanCodec, MalformedPlansAreRefused) {
    std::vector<sock_filter> filter;
    const auto encoded = detail::encode_plan(sample_plan(filter));
    const std::vector<int> received{5, 6, 7, 8, 9, 10};
    // Every truncation is refused, not read past.
    for (std::size_t size = 0; size < encoded.bytes.size(); size += 7) {
        std::vector<unsigned char> cut(encoded.bytes.begin(),
                                       encoded.bytes.begin() + static_cast<long>(size));
        EXPECT_THROW(detail::decode_plan(cut, received), sb::SandboxError) << "truncated to " << size;
    }
    auto longer = encoded.bytes;
    longer.push_back(0);
    EXPECT_THROW(detail::decode_plan(longer, received), sb::SandboxError) << "trailing bytes";
    EXPECT_THROW(detail::decode_plan(encoded.bytes, std::vector<int>{5, 6, 7}), sb::SandboxError)
        << "an fd index beyond what was received";
    auto other_version = encoded.bytes;
    other_version[0] ^= 0xff;
    EXPECT_THROW(detail::decode_plan(other_version, received), sb::SandboxError);
}

TEST(PlanCodec, MoreThanSixteenFdsCannotBeSent) {
    std::vector<sock_filter> filter;
    auto plan = sample_plan(filter);
    plan.fds.sources.clear();
    for (int fd = 100; fd < 120; ++fd) {
        plan.fds.sources.push_back(fd);
    }
    EXPECT_THROW(detail::encode_plan(plan), sb::SandboxError);
}

// The library itself refuses plans a worker never has, before anything is cloned: a template runs as host
// root, so a plan that keeps privileges would hand that root to user code.
TEST(ZygoteSpawn, APlanThatKeepsPrivilegesOrExecsIsRefusedBeforeAnythingStarts) {
    void* library = ::dlopen(CELLBLOCK_ZYGOTE_LIBRARY, RTLD_NOW | RTLD_LOCAL);
    ASSERT_NE(library, nullptr) << ::dlerror();
    using Spawn = long (*)(const unsigned char*, size_t, const int*, size_t, int, int, int, int*);
    const auto spawn = reinterpret_cast<Spawn>(::dlsym(library, "cellblock_zygote_spawn"));
    ASSERT_NE(spawn, nullptr) << ::dlerror();
    sb::UniqueFd dev_null(::open("/dev/null", O_RDWR | O_CLOEXEC));
    ASSERT_TRUE(dev_null);

    std::vector<sock_filter> filter;
    auto keeps_privileges = sample_plan(filter);
    keeps_privileges.drop_privileges = false;
    auto execs = sample_plan(filter);
    execs.exec_program = true;
    for (const auto& [plan, expected] : {std::pair{&keeps_privileges, -EPERM}, std::pair{&execs, -EINVAL}}) {
        const auto encoded = detail::encode_plan(*plan);
        const std::vector<int> received(encoded.fds.size(), dev_null.get());
        int pidfd = -1;
        EXPECT_EQ(spawn(encoded.bytes.data(), encoded.bytes.size(), received.data(), received.size(), -1, -1,
                        -1, &pidfd),
                  expected);
        EXPECT_EQ(pidfd, -1) << "no child was started";
    }
    int status = 0;
    EXPECT_EQ(::waitpid(-1, &status, WNOHANG | __WALL), -1) << "a child was started";
    EXPECT_EQ(errno, ECHILD);
    ::dlclose(library);
}

namespace {

// A C++ template (zygote_test_template --private-view), started and stopped by the test.
class TestTemplate {
  public:
    explicit TestTemplate(const fs::path& directory) : socket_(directory / "zygote.sock") {
        const auto view = directory / "view";
        fs::create_directories(view);
        int out[2];
        if (::pipe2(out, O_CLOEXEC) != 0) {
            throw std::runtime_error("pipe");
        }
        pid_ = ::fork();
        if (pid_ == 0) {
            ::dup2(out[1], 1);
            ::execl(CELLBLOCK_ZYGOTE_TEST_TEMPLATE, CELLBLOCK_ZYGOTE_TEST_TEMPLATE, "--library",
                    CELLBLOCK_ZYGOTE_LIBRARY, "--socket", socket_.c_str(), "--private-view", view.c_str(),
                    nullptr);
            ::_exit(126);
        }
        ::close(out[1]);
        std::string line;
        char byte = 0;
        while (::read(out[0], &byte, 1) == 1 && byte != '\n') {
            line += byte;
        }
        ::close(out[0]);
        if (line != "ready") {
            throw std::runtime_error("the test template did not start: '" + line + "'");
        }
    }
    ~TestTemplate() { stop(); }
    // SIGKILLs and reaps it (idempotent).
    void stop() {
        if (pid_ > 0) {
            ::kill(pid_, SIGKILL);
            ::waitpid(pid_, nullptr, 0);
            pid_ = -1;
        }
    }
    const fs::path& socket() const { return socket_; }
    // Still running (it exits with status 3 when a spawn left it outside its own view).
    bool alive() {
        if (pid_ <= 0) {
            return false;
        }
        int status = 0;
        return ::waitpid(pid_, &status, WNOHANG) == 0;
    }

  private:
    fs::path socket_;
    pid_t pid_ = -1;
};

// What a probe (zygote_test_template --probe) says about its confinement, and what the host sees of it.
struct Observed {
    std::multimap<std::string, std::string> inside;
    std::string uid_map;
    std::string host_cgroup;  // the host uid replaced by "UID"
    std::string host_status_uid;
    sb::Outcome outcome;
};

std::string replace_all(std::string text, const std::string& from, const std::string& to) {
    for (auto at = text.find(from); at != std::string::npos; at = text.find(from, at + to.size())) {
        text.replace(at, from.size(), to);
    }
    return text;
}

}  // namespace

class ZygoteLaunchTest : public ::testing::Test {
  protected:
    void SetUp() override {
        ASSERT_EQ(::geteuid(), 0u) << "the zygote tests need root (run the suite as root)";
        std::string pattern = (fs::temp_directory_path() / "cellblock-zygote-test-XXXXXX").string();
        ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
        directory_ = pattern;
        workspace_ = directory_ / "workspace";
        fs::create_directories(workspace_);
        policy_ = sb::Policy::load(CELLBLOCK_DEFAULT_POLICY_SOURCE);
        policy_.limits.memory_bytes = 256ULL << 20;
        policy_.uid_first = 281000;  // launcher_test uses 280000..
        policy_.uid_count = 1000;
        sb::MountSpec probe;
        probe.kind = sb::MountSpec::Kind::bind;
        probe.source = fs::path(CELLBLOCK_ZYGOTE_TEST_TEMPLATE).parent_path().string();
        probe.target = "/opt/probe";
        policy_.mounts.push_back(probe);
    }
    void TearDown() override {
        if (!directory_.empty()) {
            fs::remove_all(directory_);
        }
    }

    sb::LaunchRequest probe_request(const fs::path& zygote_socket) {
        sb::LaunchRequest request;
        request.argv = {"/opt/probe/" + fs::path(CELLBLOCK_ZYGOTE_TEST_TEMPLATE).filename().string(),
                        "--probe"};
        request.workspace = workspace_;
        request.zygote_socket = zygote_socket;
        return request;
    }

    // A probe that has reported and waits (its stdin open) while the host looks at it.
    struct Running {
        sb::Process process;
        int stdin_write = -1;
        Observed seen;
    };

    // Launches a probe, reads its report and looks at it from the host; it runs until finish().
    Running start_probe(sb::Launcher& launcher, const fs::path& zygote_socket) {
        int in[2], out[2];
        EXPECT_EQ(::pipe2(in, O_CLOEXEC), 0);
        EXPECT_EQ(::pipe2(out, O_CLOEXEC), 0);
        auto request = probe_request(zygote_socket);
        request.stdin_fd = in[0];
        request.stdout_fd = out[1];
        Running running{launcher.launch(request), in[1], {}};
        ::close(in[0]);
        ::close(out[1]);
        std::string report;
        char buffer[4096];
        while (report.find("end\n") == std::string::npos) {
            const ssize_t got = ::read(out[0], buffer, sizeof buffer);
            if (got <= 0) {
                break;
            }
            report.append(buffer, static_cast<std::size_t>(got));
        }
        ::close(out[0]);
        auto& seen = running.seen;
        std::istringstream lines(report);
        for (std::string line; std::getline(lines, line);) {
            const auto equals = line.find('=');
            seen.inside.emplace(line.substr(0, equals),
                                equals == std::string::npos ? "" : line.substr(equals + 1));
        }
        const auto proc = fs::path("/proc") / std::to_string(running.process.pid());
        const std::string uid = std::to_string(running.process.host_uid());
        seen.uid_map = replace_all(read_file(proc / "uid_map"), uid, "UID");
        seen.host_cgroup = replace_all(read_file(proc / "cgroup"), uid, "UID");
        std::istringstream status(read_file(proc / "status"));
        for (std::string line; std::getline(status, line);) {
            if (line.rfind("Uid:", 0) == 0) {
                seen.host_status_uid = replace_all(line, uid, "UID");
            }
        }
        return running;
    }

    // Lets the probe end and records how.
    static Observed finish(Running& running) {
        ::close(running.stdin_write);
        running.seen.outcome = running.process.wait();
        return running.seen;
    }

    Observed observe(sb::Launcher& launcher, const fs::path& zygote_socket) {
        auto running = start_probe(launcher, zygote_socket);
        return finish(running);
    }

    fs::path directory_;
    fs::path workspace_;
    sb::Policy policy_;
};

TEST_F(ZygoteLaunchTest, AForkedWorkerIsConfinedExactlyAsAnExecdOne) {
    TestTemplate zygote(directory_);
    sb::Launcher launcher(policy_);
    // Both alive at once: a freed namespace's inode number is reused by the next one.
    auto execd_probe = start_probe(launcher, "");
    auto forked_probe = start_probe(launcher, zygote.socket());
    const auto execd = finish(execd_probe);
    const auto forked = finish(forked_probe);
    ASSERT_TRUE(execd.inside.count("end")) << "the exec'd probe did not finish its report";
    ASSERT_TRUE(forked.inside.count("end")) << "the forked probe did not finish its report";

    // Everything but the namespace identities is the same, line for line.
    auto without_namespaces = [](const std::multimap<std::string, std::string>& report) {
        std::multimap<std::string, std::string> kept;
        for (const auto& [key, value] : report) {
            if (key.rfind("ns.", 0) != 0) {
                kept.emplace(key, value);
            }
        }
        return kept;
    };
    EXPECT_EQ(without_namespaces(forked.inside), without_namespaces(execd.inside));
    for (const auto& [key, value] : without_namespaces(forked.inside)) {
        const auto range = execd.inside.equal_range(key);
        const std::string& wanted = value;  // a structured binding, which this tidy's clang cannot capture
        const bool same =
            std::any_of(range.first, range.second, [&](const auto& entry) { return entry.second == wanted; });
        EXPECT_TRUE(same) << "forked only: " << key << " = " << value;
    }
    // Spot checks that the comparison compares something real.
    EXPECT_EQ(forked.inside.find("status.Uid")->second, "1000\t1000\t1000\t1000");
    EXPECT_EQ(forked.inside.find("status.CapEff")->second, "0000000000000000");
    EXPECT_EQ(forked.inside.find("status.Seccomp")->second, "2");
    EXPECT_EQ(forked.inside.find("status.NoNewPrivs")->second, "1");
    EXPECT_EQ(forked.inside.find("pid")->second, "1");
    EXPECT_EQ(forked.inside.find("hostname")->second, "cellblock");
    EXPECT_EQ(forked.inside.find("cwd")->second, "/workspace");
    EXPECT_EQ(forked.inside.find("fds")->second, "0 1 2 3 ");
    EXPECT_EQ(forked.inside.find("socket_inet")->second, std::strerror(EAFNOSUPPORT));

    // Every namespace is a new one, for both, and not each other's.
    for (const char* ns : {"user", "mnt", "pid", "net", "ipc", "uts", "cgroup"}) {
        char host[256] = {};
        ASSERT_GT(::readlink((std::string("/proc/self/ns/") + ns).c_str(), host, sizeof host - 1), 0);
        const std::string key = std::string("ns.") + ns;
        EXPECT_NE(forked.inside.find(key)->second, host) << key;
        EXPECT_NE(execd.inside.find(key)->second, host) << key;
        EXPECT_NE(forked.inside.find(key)->second, execd.inside.find(key)->second) << key;
    }

    // Seen from the host: the same id map (to each one's leased uid), the same session cgroups, the same uid.
    EXPECT_EQ(forked.uid_map, execd.uid_map);
    EXPECT_NE(forked.uid_map.find("UID"), std::string::npos) << forked.uid_map;
    EXPECT_EQ(forked.host_cgroup, execd.host_cgroup);
    EXPECT_NE(forked.host_cgroup.find("UID"), std::string::npos) << forked.host_cgroup;
    EXPECT_EQ(forked.host_status_uid, execd.host_status_uid);

    // The forked worker's end comes from the template's report.
    EXPECT_EQ(forked.outcome.reason, sb::Outcome::Reason::exited);
    EXPECT_EQ(forked.outcome.exit_code, 0);
    EXPECT_TRUE(zygote.alive()) << "the template left its own mount namespace or cwd after a spawn";
}

TEST_F(ZygoteLaunchTest, AKilledForkedWorkerIsReportedAsKilled) {
    TestTemplate zygote(directory_);
    sb::Launcher launcher(policy_);
    int in[2];
    ASSERT_EQ(::pipe2(in, O_CLOEXEC), 0);
    auto request = probe_request(zygote.socket());
    request.stdin_fd = in[0];
    auto process = launcher.launch(request);
    ::close(in[0]);
    process.kill();
    const auto outcome = process.wait();
    EXPECT_EQ(outcome.reason, sb::Outcome::Reason::signaled);
    EXPECT_EQ(outcome.signal, SIGKILL);
    ::close(in[1]);
    EXPECT_TRUE(zygote.alive());
}

TEST_F(ZygoteLaunchTest, AFailedConfinementStepIsTheStepsErrorNotAFallback) {
    TestTemplate zygote(directory_);
    sb::Launcher launcher(policy_);
    auto request = probe_request(zygote.socket());
    request.cwd = "/no/such/directory";
    try {
        launcher.launch(request);
        FAIL() << "expected SandboxError";
    } catch (const sb::ZygoteUnavailable& error) {
        FAIL() << "a confinement step that fails in the fork is not a missing template: " << error.what();
    } catch (const sb::SandboxError& error) {
        EXPECT_EQ(std::string(error.what()), "chdir /no/such/directory: No such file or directory");
    }
    EXPECT_TRUE(zygote.alive());
}

TEST_F(ZygoteLaunchTest, NoTemplateMeansZygoteUnavailableAndTheExecPathStillWorks) {
    sb::Launcher launcher(policy_);
    EXPECT_THROW(launcher.launch(probe_request(directory_ / "nobody-listens.sock")), sb::ZygoteUnavailable);
    // Something listens but never answers: still unavailable, within the answer timeout.
    const int silent = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    const auto silent_path = (directory_ / "silent.sock").string();
    std::strncpy(address.sun_path, silent_path.c_str(), sizeof address.sun_path - 1);
    ASSERT_EQ(::bind(silent, reinterpret_cast<sockaddr*>(&address), sizeof address), 0);
    ASSERT_EQ(::listen(silent, 4), 0);
    const auto started = std::chrono::steady_clock::now();
    EXPECT_THROW(launcher.launch(probe_request(silent_path)), sb::ZygoteUnavailable);
    EXPECT_LT(std::chrono::steady_clock::now() - started, 30s);
    ::close(silent);
    // Nothing of those attempts is held: the exec path starts the same request.
    const auto seen = observe(launcher, "");
    EXPECT_EQ(seen.outcome.reason, sb::Outcome::Reason::exited);
    EXPECT_EQ(seen.inside.find("status.Uid")->second, "1000\t1000\t1000\t1000");
}

TEST_F(ZygoteLaunchTest, ALaunchedTemplateForksConfinedWorkers) {
    sb::Launcher launcher(policy_);
    const auto socket_path = directory_ / "template.sock";
    const int listening = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    ASSERT_GE(listening, 0);
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    std::strncpy(address.sun_path, socket_path.c_str(), sizeof address.sun_path - 1);
    ASSERT_EQ(::bind(listening, reinterpret_cast<sockaddr*>(&address), sizeof address), 0);
    ASSERT_EQ(::listen(listening, 16), 0);

    sb::TemplateRequest request;
    request.name = "zygote-unit-test";
    request.argv = {"/opt/probe/" + fs::path(CELLBLOCK_ZYGOTE_TEST_TEMPLATE).filename().string(),
                    "--from-fds"};
    request.listening_socket = listening;
    request.zygote_library = CELLBLOCK_ZYGOTE_LIBRARY;
    const pid_t template_pid = launcher.launch_template(request).pid();
    ::close(listening);
    ASSERT_GT(template_pid, 0);
    const int template_pidfd = static_cast<int>(::syscall(SYS_pidfd_open, template_pid, 0));
    ASSERT_GE(template_pidfd, 0);

    // Host root in its own mount, uts, ipc and net namespaces, not in a user namespace, not our child.
    const auto proc = fs::path("/proc") / std::to_string(template_pid);
    std::string status = read_file(proc / "status");
    EXPECT_NE(status.find("Uid:\t0\t0\t0\t0"), std::string::npos) << status;
    EXPECT_EQ(status.find("PPid:\t" + std::to_string(::getpid()) + "\n"), std::string::npos)
        << "the template must not be the launcher's child";
    for (const char* ns : {"mnt", "uts", "ipc", "net"}) {
        EXPECT_NE(fs::read_symlink(proc / "ns" / ns), fs::read_symlink(fs::path("/proc/self/ns") / ns)) << ns;
    }
    EXPECT_EQ(fs::read_symlink(proc / "ns/user"), fs::read_symlink("/proc/self/ns/user"));
    EXPECT_EQ(fs::read_symlink(proc / "ns/pid"), fs::read_symlink("/proc/self/ns/pid"));
    // The library is visible in its root only where CELLBLOCK_ZYGOTE_LIBRARY says.
    EXPECT_TRUE(fs::is_regular_file(proc / "root/opt/cellblock/zygote" /
                                    fs::path(CELLBLOCK_ZYGOTE_LIBRARY).filename()));
    const std::string environment = read_file(proc / "environ");
    EXPECT_NE(environment.find(std::string("CELLBLOCK_ZYGOTE_LIBRARY=/opt/cellblock/zygote/") +
                               fs::path(CELLBLOCK_ZYGOTE_LIBRARY).filename().string()),
              std::string::npos);

    // Workers it forks are confined exactly as exec'd ones.
    auto execd_probe = start_probe(launcher, "");
    auto forked_probe = start_probe(launcher, socket_path);
    const auto execd = finish(execd_probe);
    const auto forked = finish(forked_probe);
    ASSERT_TRUE(forked.inside.count("end"));
    for (const char* key : {"status.Uid", "status.CapEff", "status.CapBnd", "status.Seccomp",
                            "status.NoNewPrivs", "hostname", "cwd", "fds", "pid", "socket_inet"}) {
        EXPECT_EQ(forked.inside.find(key)->second, execd.inside.find(key)->second) << key;
    }
    EXPECT_EQ(forked.uid_map, execd.uid_map);
    EXPECT_EQ(forked.host_cgroup, execd.host_cgroup);
    EXPECT_EQ(forked.outcome.reason, sb::Outcome::Reason::exited);

    pollfd ended{template_pidfd, POLLIN, 0};
    EXPECT_EQ(::poll(&ended, 1, 0), 0) << "the template died";
    ::syscall(SYS_pidfd_send_signal, template_pidfd, SIGKILL, nullptr, 0);
    EXPECT_EQ(::poll(&ended, 1, 10000), 1);
    ::close(template_pidfd);
}

TEST_F(ZygoteLaunchTest, AWorkerOutlivesItsTemplateAndItsEndComesFromThePidfd) {
    // Orphans come to this process instead of init, so that the test reaps the worker itself, as init would.
    ASSERT_EQ(::prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), 0);
    TestTemplate zygote(directory_);
    sb::Launcher launcher(policy_);
    int in[2];
    ASSERT_EQ(::pipe2(in, O_CLOEXEC), 0);
    auto request = probe_request(zygote.socket());
    request.stdin_fd = in[0];
    auto process = launcher.launch(request);
    ::close(in[0]);
    zygote.stop();

    // No parent-death signal from the template: the worker runs on (its kernel kills it when it must).
    pollfd ended{process.pidfd(), POLLIN, 0};
    EXPECT_EQ(::poll(&ended, 1, 500), 0) << "the worker died with its template";

    ::close(in[1]);  // the probe exits 0
    ASSERT_EQ(::poll(&ended, 1, 30000), 1);
    int status = -1;
    ASSERT_EQ(::waitpid(process.pid(), &status, 0), process.pid()) << "reparented to this subreaper";
    const auto outcome = process.wait();
    EXPECT_EQ(outcome.reason, sb::Outcome::Reason::exited) << outcome.describe();
    EXPECT_EQ(outcome.exit_code, 0) << "the status came from PIDFD_INFO_EXIT, not a guess";
    ASSERT_EQ(::prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0), 0);
}

// The root skeleton of templates of one name (src/mounts.hpp SkeletonClaim) goes with the last claim on it,
// never with an earlier one, and other names' skeletons stay.
TEST(SkeletonClaim, TheLastClaimOfANameRemovesItsSkeletonAndNoEarlierOne) {
    std::string pattern = (fs::temp_directory_path() / "cellblock-skeleton-claim-XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    const fs::path state = pattern;
    const auto roots = state / "roots";
    auto first = detail::SkeletonClaim::acquire(state, "zygote-t");
    auto second = detail::SkeletonClaim::acquire(state, "zygote-t");
    for (const char* name : {"zygote-t", "zygote-other"}) {
        fs::create_directories(roots / name / "usr");
        std::ofstream(roots / (std::string(name) + ".fingerprint")) << "1\n";
    }
    EXPECT_TRUE(fs::exists(roots / "zygote-t.lock"));

    first = detail::SkeletonClaim();
    EXPECT_TRUE(fs::is_directory(roots / "zygote-t/usr")) << "another template still uses it";
    EXPECT_TRUE(fs::exists(roots / "zygote-t.fingerprint"));

    second = detail::SkeletonClaim();
    for (const char* left : {"zygote-t", "zygote-t.fingerprint", "zygote-t.lock"}) {
        EXPECT_FALSE(fs::exists(roots / left)) << left;
    }
    EXPECT_TRUE(fs::is_directory(roots / "zygote-other/usr"));
    EXPECT_TRUE(fs::exists(roots / "zygote-other.fingerprint"));

    // A name claimed again after its removal gets a lock file of its own again.
    auto again = detail::SkeletonClaim::acquire(state, "zygote-t");
    EXPECT_TRUE(fs::exists(roots / "zygote-t.lock"));
    again = detail::SkeletonClaim();
    EXPECT_FALSE(fs::exists(roots / "zygote-t.lock"));
    fs::remove_all(state);
}

// An owned template (TemplateRequest::limits) leaves nothing of itself in the state directory once it has
// ended and its Template is gone; one nobody owns leaves its skeleton for the next of its name.
TEST_F(ZygoteLaunchTest, AnOwnedTemplatesRootSkeletonGoesWithIt) {
    policy_.state_dir = directory_ / "state";
    sb::Launcher launcher(policy_);
    const auto roots = policy_.state_dir / "roots";
    for (const bool owned : {true, false}) {
        const std::string name = owned ? "zygote-unit-owned" : "zygote-unit-unowned";
        const int listening = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
        ASSERT_GE(listening, 0);
        sockaddr_un address{};
        address.sun_family = AF_UNIX;
        const auto socket_path = (directory_ / (name + ".sock")).string();
        std::strncpy(address.sun_path, socket_path.c_str(), sizeof address.sun_path - 1);
        ASSERT_EQ(::bind(listening, reinterpret_cast<sockaddr*>(&address), sizeof address), 0);
        ASSERT_EQ(::listen(listening, 16), 0);
        sb::TemplateRequest request;
        request.name = name;
        request.argv = {"/opt/probe/" + fs::path(CELLBLOCK_ZYGOTE_TEST_TEMPLATE).filename().string(),
                        "--from-fds"};
        request.listening_socket = listening;
        request.zygote_library = CELLBLOCK_ZYGOTE_LIBRARY;
        if (owned) {
            request.limits = policy_.limits;
        }
        {
            auto started = launcher.launch_template(request);
            ::close(listening);
            const int pidfd = static_cast<int>(::syscall(SYS_pidfd_open, started.pid(), 0));
            ASSERT_GE(pidfd, 0);
            EXPECT_TRUE(fs::is_directory(roots / name)) << name;
            EXPECT_TRUE(fs::exists(roots / (name + ".fingerprint"))) << name;
            ::syscall(SYS_pidfd_send_signal, pidfd, SIGKILL, nullptr, 0);
            pollfd ended{pidfd, POLLIN, 0};
            EXPECT_EQ(::poll(&ended, 1, 10000), 1);
            ::close(pidfd);
        }
        for (const auto& left : {name, name + ".fingerprint"}) {
            EXPECT_EQ(fs::exists(roots / left), !owned) << left;
        }
        EXPECT_FALSE(fs::exists(roots / (name + ".lock"))) << name;
        // An owned template's workspace is templates/<name>.<hex> (its own), an unowned one's
        // templates/<name>.
        std::size_t workspaces = 0;
        for (const auto& entry : fs::directory_iterator(policy_.state_dir / "templates")) {
            workspaces += entry.path().filename().string().rfind(name, 0) == 0 ? 1 : 0;
        }
        EXPECT_EQ(workspaces, owned ? 0u : 1u) << name;
    }
}

namespace {

// A listening SOCK_SEQPACKET socket at `path`, as a template is given one (fd 3).
int listen_at(const fs::path& path) {
    const int listening = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    std::strncpy(address.sun_path, path.c_str(), sizeof address.sun_path - 1);
    if (listening < 0 || ::bind(listening, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0 ||
        ::listen(listening, 16) != 0) {
        throw std::runtime_error("listen at " + path.string());
    }
    return listening;
}

// The cgroup paths a process is in (/proc/PID/cgroup without the hierarchy ids), e.g. "memory:/a/b".
std::string cgroup_paths(pid_t pid) {
    std::istringstream lines(read_file(fs::path("/proc") / std::to_string(pid) / "cgroup"));
    std::string paths;
    for (std::string line; std::getline(lines, line);) {
        paths += line.substr(line.find(':') + 1) + "\n";
    }
    return paths;
}

bool ended_within(int pidfd, std::chrono::milliseconds limit) {
    pollfd ended{pidfd, POLLIN, 0};
    return ::poll(&ended, 1, static_cast<int>(limit.count())) == 1;
}

}  // namespace

// Two owned templates of one name overlap: a tenant's next generation starts while the last one still serves
// its last workers (kernel/src/launch/template_service.cpp). Each has a cgroup and an empty workspace of its
// own: the next one's start does not kill the last one, and the last one's end (its Template destroyed) kills
// nothing of the next one, which still forks. The root skeleton they share stays until both are gone.
TEST_F(ZygoteLaunchTest, AnOwnedTemplatesEndLeavesTheNextOfItsNameAlone) {
    ASSERT_EQ(::prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), 0);  // the templates and orphans come here
    policy_.state_dir = directory_ / "state";
    sb::Launcher launcher(policy_);
    const std::string name = "zygote-unit-generations";
    auto start = [&](const fs::path& socket_path) {
        const int listening = listen_at(socket_path);
        sb::TemplateRequest request;
        request.name = name;
        request.argv = {"/opt/probe/" + fs::path(CELLBLOCK_ZYGOTE_TEST_TEMPLATE).filename().string(),
                        "--from-fds"};
        request.listening_socket = listening;
        request.zygote_library = CELLBLOCK_ZYGOTE_LIBRARY;
        request.limits = policy_.limits;
        auto started = launcher.launch_template(request);
        ::close(listening);
        return started;
    };
    const auto last_socket = directory_ / "last.sock";
    const auto next_socket = directory_ / "next.sock";
    std::optional<sb::Template> last(start(last_socket));
    const int last_pidfd = static_cast<int>(::syscall(SYS_pidfd_open, last->pid(), 0));
    ASSERT_GE(last_pidfd, 0);
    const std::string last_cgroups = cgroup_paths(last->pid());
    if (last_cgroups.find("/template-" + name) == std::string::npos) {
        ::syscall(SYS_pidfd_send_signal, last_pidfd, SIGKILL, nullptr, 0);
        ::close(last_pidfd);
        GTEST_SKIP() << "no cgroup controller to put an owned template in: " << last_cgroups;
    }
    auto worker = start_probe(launcher, last_socket);  // the last generation's worker, alive throughout

    std::optional<sb::Template> next(start(next_socket));
    const int next_pidfd = static_cast<int>(::syscall(SYS_pidfd_open, next->pid(), 0));
    ASSERT_GE(next_pidfd, 0);
    EXPECT_FALSE(ended_within(last_pidfd, std::chrono::milliseconds(300)))
        << "the next template's start killed the last one";
    const std::string next_cgroups = cgroup_paths(next->pid());
    EXPECT_NE(next_cgroups.find("/template-" + name), std::string::npos) << next_cgroups;
    EXPECT_NE(next_cgroups, last_cgroups) << "two templates in one cgroup";

    // The last generation ends after its last worker (which is not killed) and its Template goes.
    const auto worker_seen = finish(worker);
    EXPECT_EQ(worker_seen.outcome.reason, sb::Outcome::Reason::exited) << worker_seen.outcome.describe();
    EXPECT_EQ(worker_seen.outcome.exit_code, 0);
    ::syscall(SYS_pidfd_send_signal, last_pidfd, SIGKILL, nullptr, 0);
    EXPECT_TRUE(ended_within(last_pidfd, std::chrono::seconds(10)));
    ::close(last_pidfd);
    last.reset();
    while (::waitpid(-1, nullptr, WNOHANG) > 0) {
    }

    EXPECT_FALSE(ended_within(next_pidfd, std::chrono::milliseconds(300)))
        << "the last template's end killed the next one";
    std::size_t workspaces = 0;
    for (const auto& entry : fs::directory_iterator(policy_.state_dir / "templates")) {
        workspaces += entry.path().filename().string().rfind(name, 0) == 0 ? 1 : 0;
    }
    EXPECT_EQ(workspaces, 1u)
        << "the next template's workspace went with the last one, or the last one's stayed";
    EXPECT_TRUE(fs::is_directory(policy_.state_dir / "roots" / name)) << "the next template still uses it";
    const auto forked = observe(launcher, next_socket);
    EXPECT_EQ(forked.outcome.reason, sb::Outcome::Reason::exited) << forked.outcome.describe();
    EXPECT_EQ(cgroup_paths(next->pid()), next_cgroups);

    ::syscall(SYS_pidfd_send_signal, next_pidfd, SIGKILL, nullptr, 0);
    EXPECT_TRUE(ended_within(next_pidfd, std::chrono::seconds(10)));
    ::close(next_pidfd);
    next.reset();
    while (::waitpid(-1, nullptr, WNOHANG) > 0) {
    }
    EXPECT_TRUE(fs::is_empty(policy_.state_dir / "templates"));
    EXPECT_FALSE(fs::exists(policy_.state_dir / "roots" / name));
    ASSERT_EQ(::prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0), 0);
}
