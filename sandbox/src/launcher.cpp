// Launcher: prepares everything in the parent, clones the child into fresh namespaces, finishes the
// parent's half of the setup (id maps, cgroups) and learns from the error pipe whether execve happened.
#include <dirent.h>
#include <fcntl.h>
#include <linux/sched.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>

#include "cgroups.hpp"
#include "child.hpp"
#include "credentials.hpp"
#include "fds.hpp"
#include "mounts.hpp"
#include "network.hpp"
#include "process_impl.hpp"
#include "rlimits.hpp"
#include "seccomp.hpp"
#include "system.hpp"
#include "user_namespace.hpp"

namespace cellblock::sandbox {

using detail::throw_errno;
using detail::UniqueFd;

struct Launcher::State {
    Policy policy;
    std::vector<std::string> weakened;
    std::vector<sock_filter> seccomp_filter;
    std::vector<sock_filter> seccomp_filter_with_inet;  // built on the first launch with a listener
    detail::CgroupHost cgroups;
    bool user_namespaces = true;
    bool weakness_logged = false;

    // A mechanism the limits need is missing: refuse, or record it when the policy allows weaker
    // confinement (and say so on stderr, once per mechanism).
    void require(bool available, const std::string& mechanism) {
        if (available) {
            return;
        }
        if (!policy.allow_weaker_confinement) {
            throw SandboxError(mechanism +
                               " is unavailable on this host; refusing to start (set "
                               "\"allow_weaker_confinement\": true in the policy to run without it)");
        }
        if (std::find(weakened.begin(), weakened.end(), mechanism) != weakened.end()) {
            return;
        }
        weakened.push_back(mechanism);
        const nlohmann::json line = {{"level", "warning"},
                                     {"component", "sandbox"},
                                     {"event", "weaker_confinement"},
                                     {"missing", mechanism}};
        std::cerr << line.dump() << std::endl;
    }

    void require_limits(const ResourceLimits& limits) {
        if (limits.memory_bytes > 0) {
            require(!cgroups.memory_base.empty(), "the cgroup memory controller");
        }
        if (limits.pids > 0) {
            require(!cgroups.pids_base.empty(), "the cgroup pids controller");
        }
        if (limits.cpu_cores > 0) {
            require(!cgroups.cpu_base.empty(), "the cgroup cpu controller");
        }
    }
};

namespace {

void prepare_workspace(const std::filesystem::path& workspace, uid_t uid, const Policy& policy) {
    if (workspace.empty() || !workspace.is_absolute()) {
        throw SandboxError("workspace: '" + workspace.string() + "' must be an absolute host directory");
    }
    UniqueFd dir(::open(workspace.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
    if (!dir) {
        throw_errno("workspace: open " + workspace.string());
    }
    if (::fchown(dir.get(), uid, uid) != 0) {
        throw_errno("workspace: chown " + workspace.string());
    }
    if (::fchmod(dir.get(), 0750) != 0) {
        throw_errno("workspace: chmod " + workspace.string());
    }
    // Entries owned by root or by an earlier session's uid from our range become the new session's, so a
    // restarted session can still edit its files.
    adopt_tree(
        workspace, uid,
        [&policy](uid_t owner) {
            return owner == 0 || (owner >= policy.uid_first && owner - policy.uid_first < policy.uid_count);
        },
        100000);
}

struct SignalBlock {
    sigset_t previous{};
    SignalBlock() {
        sigset_t all;
        sigfillset(&all);
        if (const int error = ::pthread_sigmask(SIG_SETMASK, &all, &previous); error != 0) {
            throw_errno("pthread_sigmask", error);
        }
    }
    ~SignalBlock() { ::pthread_sigmask(SIG_SETMASK, &previous, nullptr); }
    SignalBlock(const SignalBlock&) = delete;
    SignalBlock& operator=(const SignalBlock&) = delete;
};

}  // namespace

Launcher::Launcher(Policy policy) : state_(std::make_unique<State>()) {
    state_->policy = std::move(policy);
    auto& state = *state_;
    detail::make_directories(state.policy.state_dir, 0711);
    state.user_namespaces = detail::user_namespaces_available();
    if (!state.user_namespaces) {
        if (::geteuid() != 0) {
            throw SandboxError("user namespaces are unavailable and we are not root: cannot confine");
        }
        state.require(
            false,
            "user namespaces (the sandbox runs its setup as host root before dropping to the session uid)");
    }
    state.cgroups = detail::CgroupHost::probe();
    state.require_limits(state.policy.limits);
    if (state.policy.seccomp) {
        state.seccomp_filter = detail::build_seccomp_filter(detail::SocketFamilies::unix_only);
    }
}

Launcher::~Launcher() = default;
Launcher::Launcher(Launcher&&) noexcept = default;
Launcher& Launcher::operator=(Launcher&&) noexcept = default;

const std::vector<std::string>& Launcher::weakened() const noexcept {
    return state_->weakened;
}
const Policy& Launcher::policy() const noexcept {
    return state_->policy;
}

Process Launcher::launch(const LaunchRequest& request) {
    auto& state = *state_;
    const Policy& policy = state.policy;
    if (request.argv.empty()) {
        throw SandboxError("launch: argv is empty");
    }
    if (request.argv.front().empty() || request.argv.front().front() != '/') {
        throw SandboxError("launch: argv[0] '" + request.argv.front() +
                           "' must be an absolute path inside the sandbox");
    }
    const ResourceLimits limits = request.limits.value_or(policy.limits);
    state.require_limits(limits);

    auto impl = std::make_unique<Process::Impl>();
    impl->limits = limits;
    impl->lease = detail::UidLease::acquire(policy);
    const uid_t host_uid = impl->lease.uid();
    prepare_workspace(request.workspace, host_uid, policy);

    detail::StepNames steps;
    detail::ChildPlan plan;
    plan.step_pdeathsig = steps.add("prctl PR_SET_PDEATHSIG");
    plan.step_sync = steps.add("wait for the launcher (id maps, v2 cgroups)");
    plan.step_cgroupns = steps.add("unshare the cgroup namespace");
    plan.step_hostname = steps.add("sethostname " + policy.hostname);
    plan.step_loopback = steps.add("bring up the loopback interface");
    plan.step_setsid = steps.add("setsid");
    plan.step_seccomp = steps.add("load the seccomp filter");
    plan.step_sigmask = steps.add("unblock signals");
    plan.step_execve = steps.add("execve " + request.argv.front());
    plan.hostname = policy.hostname;
    plan.loopback_up = policy.network_loopback;
    plan.cwd = request.cwd.empty() ? policy.workspace_target : request.cwd;
    plan.step_chdir = steps.add("chdir " + plan.cwd);

    const std::string name = std::to_string(host_uid);  // unique while we hold the uid's lease
    impl->skeleton = detail::RootSkeleton::prepare(policy, name, request.workspace, steps, plan);
    impl->cgroups = detail::CgroupSession::create(state.cgroups, name, limits);
    for (const auto& tasks_file : impl->cgroups.self_join_files()) {
        plan.cgroup_joins.push_back(
            {tasks_file.string(), steps.add("join cgroup " + tasks_file.parent_path().string())});
    }
    detail::plan_rlimits(limits, steps, plan);
    detail::plan_credentials(state.user_namespaces ? policy.inside_uid : host_uid, steps, plan);
    if (!state.user_namespaces) {
        plan.uid = plan.gid = host_uid;
    }
    detail::ListenerChannel listener_channel;
    if (request.loopback_listener) {
        listener_channel = detail::ListenerChannel::prepare(*request.loopback_listener, steps, plan);
    }
    if (policy.seccomp) {
        plan.seccomp_filter = &state.seccomp_filter;
        if (request.loopback_listener) {
            if (state.seccomp_filter_with_inet.empty()) {
                state.seccomp_filter_with_inet =
                    detail::build_seccomp_filter(detail::SocketFamilies::unix_and_inet);
            }
            plan.seccomp_filter = &state.seccomp_filter_with_inet;
        }
    }

    int sync_pipe[2];
    int error_pipe[2];
    if (::pipe2(sync_pipe, O_CLOEXEC) != 0) {
        throw_errno("launch: pipe");
    }
    UniqueFd sync_read(sync_pipe[0]), sync_write(sync_pipe[1]);
    if (::pipe2(error_pipe, O_CLOEXEC) != 0) {
        throw_errno("launch: pipe");
    }
    UniqueFd error_read(error_pipe[0]), error_write(error_pipe[1]);
    plan.sync_read_fd = sync_read.get();
    plan.sync_write_fd = sync_write.get();
    plan.error_read_fd = error_read.get();
    plan.error_write_fd = error_write.get();

    UniqueFd dev_null;
    auto stdio = [&](int fd) {
        if (fd >= 0) {
            return fd;
        }
        if (!dev_null) {
            dev_null.reset(::open("/dev/null", O_RDWR | O_CLOEXEC));
            if (!dev_null) {
                throw_errno("launch: open /dev/null");
            }
        }
        return dev_null.get();
    };
    std::vector<int> fd_sources{stdio(request.stdin_fd), stdio(request.stdout_fd), stdio(request.stderr_fd)};
    for (const int fd : request.pass_fds) {
        if (::fcntl(fd, F_GETFD) < 0) {
            throw_errno("launch: pass_fds " + std::to_string(fd));
        }
        fd_sources.push_back(fd);
    }
    detail::plan_fds(std::move(fd_sources), steps, plan);

    std::vector<std::string> argv = request.argv;
    std::vector<std::string> envp = detail::merge_environment(policy.environment, request.environment);
    for (auto& arg : argv) {
        plan.argv.push_back(arg.data());
    }
    plan.argv.push_back(nullptr);
    for (auto& entry : envp) {
        plan.envp.push_back(entry.data());
    }
    plan.envp.push_back(nullptr);

    unsigned long flags =
        CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_PIDFD | SIGCHLD;
    if (state.user_namespaces) {
        flags |= CLONE_NEWUSER;
    }
    int pidfd = -1;
    long child = 0;
    {
        // Blocked in the parent thread around clone so that no handler runs in the child before it
        // resets them; the child restores an empty mask just before execve.
        SignalBlock blocked;
        child = ::syscall(SYS_clone, flags, nullptr, &pidfd, nullptr, 0);
        if (child == 0) {
            detail::run_child(plan);
        }
    }
    if (child < 0) {
        throw_errno("clone (new user, mount, pid, net, ipc and uts namespaces)");
    }
    impl->pid = static_cast<pid_t>(child);
    impl->pidfd.reset(pidfd);
    impl->started = std::chrono::steady_clock::now();
    sync_read.reset();
    error_write.reset();
    listener_channel.close_child_end();

    // The child reports {step, errno} and exits on failure; EOF means execve happened.
    auto child_status = [&]() -> std::optional<std::string> {
        detail::ChildFailure failure{};
        ssize_t got = 0;
        do {
            got = ::read(error_read.get(), &failure, sizeof failure);
        } while (got < 0 && errno == EINTR);
        if (got < 0) {
            throw_errno("launch: read the child's status");
        }
        if (got == 0) {
            return std::nullopt;
        }
        if (got != sizeof failure) {
            return std::string("launch: the child reported a truncated error");
        }
        return steps.name(failure.step) + ": " + std::strerror(failure.error);
    };
    try {
        if (state.user_namespaces) {
            detail::write_id_maps(impl->pid, policy.inside_uid, host_uid);
        }
        impl->cgroups.add_process(impl->pid);
        const char go = 1;
        if (::write(sync_write.get(), &go, 1) != 1) {
            throw_errno("launch: release the child");
        }
    } catch (const SandboxError&) {
        // The child may have failed first (it sets up its mounts meanwhile), which is then the
        // real cause; closing the sync pipe makes a waiting child give up.
        sync_write.reset();
        impl->kill_everything();
        if (auto child_error = child_status()) {
            throw SandboxError(*child_error);
        }
        throw;
    }
    sync_write.reset();
    auto child_error = child_status();
    if (!child_error) {
        if (request.loopback_listener) {
            try {
                impl->loopback_listeners = listener_channel.receive();
            } catch (const SandboxError&) {
                impl->kill_everything();
                throw;
            }
        }
        return Process(std::move(impl));  // the program runs
    }
    impl->reap(true);
    throw SandboxError(*child_error);
}

}  // namespace cellblock::sandbox
