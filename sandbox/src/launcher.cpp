// Launcher: prepares everything in the parent, clones the child into fresh namespaces, finishes the
// parent's half of the setup (id maps, cgroups) and learns from the error pipe whether execve happened.
#include <dirent.h>
#include <fcntl.h>
#include <linux/sched.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
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
#include "zygote_client.hpp"

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

    // The filter of a launch: one that also allows inet sockets for a launch with a loopback listener (built
    // on the first such launch).
    const std::vector<sock_filter>& seccomp_filter_for(bool loopback_listener) {
        if (!loopback_listener) {
            return seccomp_filter;
        }
        if (seccomp_filter_with_inet.empty()) {
            seccomp_filter_with_inet = detail::build_seccomp_filter(detail::SocketFamilies::unix_and_inet);
        }
        return seccomp_filter_with_inet;
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

// A template answers within this, or the launch falls back to exec (ZygoteUnavailable). A dead template
// refuses the connect and a retired one answers at once, so only a template that is alive and busy waits
// this long. It forks one worker at a time while every kernel that starts beside it competes for the same
// cores: 150 kernels started at once on an idle 2-core machine had 146 launches outwait 2 s, and each
// fallback's exec (≈ 0.35 s of CPU importing IPython) slowed the template further (57 s until all answered).
// Kept well below the minute a caller usually gives a worker to become ready, which must still cover an exec
// after a template that never answered.
constexpr std::chrono::milliseconds zygote_answer_timeout{15000};
// A forked child's setup ends with the error pipe closed by the child and by the template (which holds a
// copy of every fd of the plan); an exec'd child's ends with execve, which cannot be held up by anyone else.
constexpr std::chrono::seconds error_pipe_timeout{60};

bool wait_for_error_pipe(int error_read) {
    const auto deadline = std::chrono::steady_clock::now() + error_pipe_timeout;
    for (;;) {
        const auto left =
            std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now())
                .count();
        if (left <= 0) {
            return false;
        }
        pollfd readable{error_read, POLLIN, 0};
        const int ready = ::poll(&readable, 1, static_cast<int>(left));
        if (ready > 0) {
            return true;
        }
        if (ready < 0 && errno != EINTR) {
            throw_errno("launch: poll the child's error pipe");
        }
    }
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

// The steps every launch plans, in this order (their numbers are what the child reports on the error pipe).
void plan_base_steps(const Policy& policy, const std::string& program, const std::string& sync_step,
                     std::string cwd, detail::StepNames& steps, detail::ChildPlan& plan) {
    plan.step_pdeathsig = steps.add("prctl PR_SET_PDEATHSIG");
    plan.step_sync = steps.add(sync_step);
    plan.step_cgroupns = steps.add("unshare the cgroup namespace");
    plan.step_hostname = steps.add("sethostname " + policy.hostname);
    plan.step_loopback = steps.add("bring up the loopback interface");
    plan.step_setsid = steps.add("setsid");
    plan.step_seccomp = steps.add("load the seccomp filter");
    plan.step_sigmask = steps.add("unblock signals");
    plan.step_execve = steps.add("execve " + program);
    plan.hostname = policy.hostname;
    plan.loopback_up = policy.network_loopback;
    plan.cwd = std::move(cwd);
    plan.step_chdir = steps.add("chdir " + plan.cwd);
}

void plan_cgroup_joins(const detail::CgroupSession& cgroups, detail::StepNames& steps,
                       detail::ChildPlan& plan) {
    for (const auto& tasks_file : cgroups.self_join_files()) {
        plan.cgroup_joins.push_back(
            {tasks_file.string(), steps.add("join cgroup " + tasks_file.parent_path().string())});
    }
}

// Points the plan's argv and envp at these strings, which must outlive the launch.
void plan_program(std::vector<std::string>& argv, std::vector<std::string>& envp, detail::ChildPlan& plan) {
    for (auto& arg : argv) {
        plan.argv.push_back(arg.data());
    }
    plan.argv.push_back(nullptr);
    for (auto& entry : envp) {
        plan.envp.push_back(entry.data());
    }
    plan.envp.push_back(nullptr);
}

void check_program(const LaunchRequest& request) {
    if (request.argv.empty()) {
        throw SandboxError("launch: argv is empty");
    }
    if (request.argv.front().empty() || request.argv.front().front() != '/') {
        throw SandboxError("launch: argv[0] '" + request.argv.front() +
                           "' must be an absolute path inside the sandbox");
    }
}

// The program's fds 0-2 (/dev/null, opened into `dev_null` when first needed, for those the request does
// not give) and the request's pass_fds after them.
std::vector<int> program_fds(const LaunchRequest& request, UniqueFd& dev_null) {
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
    return fd_sources;
}

// The template's fork continues into its preloaded worker instead of execve, and must not die with the
// template; everything else of the plan is the same.
void spawn_through_template(const std::filesystem::path& zygote_socket, detail::ChildPlan& plan,
                            Process::Impl& impl) {
    plan.exec_program = false;
    plan.parent_death_signal = false;
    auto spawned = detail::request_zygote_spawn(zygote_socket, plan, zygote_answer_timeout);
    impl.pid = spawned.pid;
    impl.pidfd = std::move(spawned.pidfd);
    impl.zygote_connection = std::move(spawned.connection);
    impl.forked_by_template = true;
}

void clone_child(const detail::ChildPlan& plan, Process::Impl& impl) {
    unsigned long flags =
        CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_PIDFD | SIGCHLD;
    if (plan.new_user_namespace) {
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
            detail::run_child(plan);  // execs (plan.exec_program) or _exits
            ::_exit(127);
        }
    }
    if (child < 0) {
        throw_errno("clone (new user, mount, pid, net, ipc and uts namespaces)");
    }
    impl.pid = static_cast<pid_t>(child);
    impl.pidfd.reset(pidfd);
}

// The words of read_child_failure's messages, which name the launch and its child.
struct ChildStatusWords {
    const char* read_failed;  // the error pipe could not be read (thrown, with errno)
    const char* truncated;    // the report is shorter than a ChildFailure
    const char* step_prefix;  // comes before "<step>: <error>"
};

// A child (launch's, or the template) reports {step, errno} on its error pipe and exits if a setup step
// fails; end of file means its execve happened. Returns nothing then, else what the failure is.
std::optional<std::string> read_child_failure(int error_read, const detail::StepNames& steps,
                                              const ChildStatusWords& words) {
    detail::ChildFailure failure{};
    ssize_t got = 0;
    do {
        got = ::read(error_read, &failure, sizeof failure);
    } while (got < 0 && errno == EINTR);
    if (got < 0) {
        throw_errno(words.read_failed);
    }
    if (got == 0) {
        return std::nullopt;
    }
    if (got != sizeof failure) {
        return std::string(words.truncated);
    }
    return words.step_prefix + steps.name(failure.step) + ": " + std::strerror(failure.error);
}

// What launch's child reported; one a template forked is first given error_pipe_timeout to report.
std::optional<std::string> child_status(int error_read, bool through_template, Process::Impl& impl,
                                        const detail::StepNames& steps) {
    if (through_template && !wait_for_error_pipe(error_read)) {
        impl.kill_everything();
        return "zygote template: the child's error pipe was still open after " +
               std::to_string(error_pipe_timeout.count()) +
               " s (the child hung in its setup, or the template kept its copy of the pipe)";
    }
    return read_child_failure(
        error_read, steps,
        {"launch: read the child's status", "launch: the child reported a truncated error", ""});
}

// The parent's half of the setup (id maps, cgroup), then the go on the sync pipe.
void release_child(bool user_namespaces, const Policy& policy, uid_t host_uid, Process::Impl& impl,
                   int sync_write) {
    if (user_namespaces) {
        detail::write_id_maps(impl.pid, policy.inside_uid, host_uid);
    }
    impl.cgroups.add_process(impl.pid);
    const char go = 1;
    if (::write(sync_write, &go, 1) != 1) {
        throw_errno("launch: release the child");
    }
}

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
    check_program(request);
    const ResourceLimits limits = request.limits.value_or(policy.limits);
    state.require_limits(limits);

    auto impl = std::make_unique<Process::Impl>();
    impl->limits = limits;
    impl->lease = detail::UidLease::acquire(policy);
    const uid_t host_uid = impl->lease.uid();
    prepare_workspace(request.workspace, host_uid, policy);

    detail::StepNames steps;
    detail::ChildPlan plan;
    plan_base_steps(policy, request.argv.front(), "wait for the launcher (id maps, v2 cgroups)",
                    request.cwd.empty() ? policy.workspace_target : request.cwd, steps, plan);

    const std::string name = std::to_string(host_uid);  // unique while we hold the uid's lease
    impl->skeleton = detail::RootSkeleton::prepare(policy, name, request.workspace, steps, plan);
    impl->cgroups = detail::CgroupSession::create(state.cgroups, name, limits);
    plan_cgroup_joins(impl->cgroups, steps, plan);
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
        plan.seccomp_filter = &state.seccomp_filter_for(request.loopback_listener.has_value());
    }

    auto [sync_read, sync_write] = detail::make_pipe("launch: pipe");
    auto [error_read, error_write] = detail::make_pipe("launch: pipe");
    plan.sync_read_fd = sync_read.get();
    plan.sync_write_fd = sync_write.get();
    plan.error_read_fd = error_read.get();
    plan.error_write_fd = error_write.get();

    UniqueFd dev_null;
    detail::plan_fds(program_fds(request, dev_null), steps, plan);

    std::vector<std::string> argv = request.argv;
    std::vector<std::string> envp = detail::merge_environment(policy.environment, request.environment);
    plan_program(argv, envp, plan);

    plan.new_user_namespace = state.user_namespaces;
    const bool through_template = !request.zygote_socket.empty();
    if (through_template) {
        spawn_through_template(request.zygote_socket, plan, *impl);
    } else {
        clone_child(plan, *impl);
    }
    impl->started = std::chrono::steady_clock::now();
    sync_read.reset();
    error_write.reset();
    listener_channel.close_child_end();

    try {
        release_child(state.user_namespaces, policy, host_uid, *impl, sync_write.get());
    } catch (const SandboxError&) {
        // The child may have failed first (it sets up its mounts meanwhile), which is then the
        // real cause; closing the sync pipe makes a waiting child give up.
        sync_write.reset();
        impl->kill_everything();
        if (auto child_error = child_status(error_read.get(), through_template, *impl, steps)) {
            throw SandboxError(*child_error);
        }
        throw;
    }
    sync_write.reset();
    auto child_error = child_status(error_read.get(), through_template, *impl, steps);
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

namespace cellblock::sandbox {

namespace {

// Where the template finds libcellblock_zygote.so inside its root.
constexpr const char* zygote_library_dir_inside = "/opt/cellblock/zygote";

bool is_plain_name(const std::string& name) {
    if (name.empty() || name.size() > 100 || name == "." || name == "..") {
        return false;
    }
    return std::all_of(name.begin(), name.end(), [](char c) {
        return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' ||
               c == '_' || c == '.';
    });
}

void check_template_request(const TemplateRequest& request) {
    if (!is_plain_name(request.name)) {
        throw SandboxError("launch_template: '" + request.name + "' is not a plain name ([A-Za-z0-9._-])");
    }
    if (request.argv.empty() || request.argv.front().empty() || request.argv.front().front() != '/') {
        throw SandboxError("launch_template: argv[0] must be an absolute path inside the sandbox");
    }
    if (request.listening_socket < 0 || ::fcntl(request.listening_socket, F_GETFD) < 0) {
        throw SandboxError("launch_template: the listening socket is not an open fd");
    }
}

// The request's environment, plus the zygote library (bound into `policy`'s mounts) when it names one.
std::vector<std::string> template_environment(const TemplateRequest& request, Policy& policy) {
    std::vector<std::string> environment = request.environment;
    if (!request.zygote_library.empty()) {
        if (!request.zygote_library.is_absolute() ||
            !std::filesystem::is_regular_file(request.zygote_library)) {
            throw SandboxError("launch_template: the zygote library " + request.zygote_library.string() +
                               " is not a file");
        }
        MountSpec library;
        library.kind = MountSpec::Kind::bind;
        library.source = request.zygote_library.parent_path().string();
        library.target = zygote_library_dir_inside;
        policy.mounts.push_back(library);
        environment.push_back(std::string("CELLBLOCK_ZYGOTE_LIBRARY=") + zygote_library_dir_inside + "/" +
                              request.zygote_library.filename().string());
    }
    return environment;
}

// An empty workspace of its own: what the template's start caches about /workspace is an empty one's.
std::filesystem::path make_template_workspace(const Policy& policy, const std::string& name) {
    auto workspace = policy.state_dir / "templates" / name;
    detail::make_directories(policy.state_dir / "templates", 0700);
    remove_tree(workspace);
    if (::mkdir(workspace.c_str(), 0755) != 0) {
        throw_errno("launch_template: mkdir " + workspace.string());
    }
    return workspace;
}

// Double fork: the middle process makes the namespaces and exits at once, so the template is nobody's
// child here (init, or a subreaper, reaps it) and needs no thread of ours. The middle process reports the
// template's pid (or -errno) on `pid_write`.
void double_fork_template(const detail::ChildPlan& plan, int pid_write) {
    long middle = 0;
    {
        SignalBlock blocked;
        middle = ::syscall(SYS_clone, CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWNET | SIGCHLD,
                           nullptr, nullptr, nullptr, 0);
        if (middle == 0) {
            const long grandchild = ::syscall(SYS_clone, SIGCHLD, nullptr, nullptr, nullptr, 0);
            if (grandchild == 0) {
                detail::run_child(plan);  // execs or _exits
                ::_exit(127);
            }
            const pid_t reported = grandchild > 0 ? static_cast<pid_t>(grandchild) : -errno;
            [[maybe_unused]] const auto ignored = ::write(pid_write, &reported, sizeof reported);
            ::_exit(grandchild > 0 ? 0 : 1);
        }
    }
    if (middle < 0) {
        throw_errno("launch_template: clone (new mount, uts, ipc and net namespaces)");
    }
    int middle_status = 0;
    while (::waitpid(static_cast<pid_t>(middle), &middle_status, 0) < 0) {
        if (errno != EINTR) {
            throw_errno("launch_template: wait for the intermediate process");
        }
    }
}

pid_t read_template_pid(int pid_read) {
    pid_t template_pid = 0;
    if (::read(pid_read, &template_pid, sizeof template_pid) != sizeof template_pid) {
        throw SandboxError("launch_template: the intermediate process did not report the template's pid");
    }
    if (template_pid <= 0) {
        throw_errno("launch_template: clone the template", -template_pid);
    }
    return template_pid;
}

// Returns once the template's execve happened; throws the step it reported failing.
void await_template_exec(int error_read, const detail::StepNames& steps) {
    if (auto failure = read_child_failure(
            error_read, steps,
            {"launch_template: read the template's status",
             "launch_template: the template reported a truncated error", "zygote template: "})) {
        throw SandboxError(*failure);
    }
}

}  // namespace

struct Template::Impl {
    pid_t pid = 0;
    // Declared before the cgroup, so released after it: once the destructor's body and the cgroup's removal
    // have ended the template, never while it runs in the skeleton.
    detail::SkeletonClaim skeleton_claim;  // empty without TemplateRequest::limits
    detail::CgroupSession cgroups;         // empty without TemplateRequest::limits
    std::filesystem::path own_workspace;   // removed with this object when it owns the template (limits set)
    Impl() = default;
    Impl(const Impl&) = delete;
    Impl& operator=(const Impl&) = delete;
    ~Impl() {
        if (!own_workspace.empty()) {
            cgroups.kill_all();
            remove_tree(own_workspace);
        }
    }
};

Template::Template(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Template::Template(Template&&) noexcept = default;
Template& Template::operator=(Template&&) noexcept = default;
Template::~Template() = default;

pid_t Template::pid() const noexcept {
    return impl_ ? impl_->pid : 0;
}

void Template::kill_all() const noexcept {
    if (impl_) {
        impl_->cgroups.kill_all();
    }
}

Template Launcher::launch_template(const TemplateRequest& request) {
    Policy policy = state_->policy;
    check_template_request(request);
    const std::vector<std::string> environment = template_environment(request, policy);
    // Owned templates of one name overlap (a tenant's generations, two gateways' services), and each one's
    // Template kills and removes its cgroup and workspace: both are its own, named "<name>.<16 hex>". A
    // shared name let the next generation's start kill the last one, and the last one's end kill the next.
    // The root skeleton stays the name's, shared (SkeletonClaim).
    const std::string instance = request.limits ? request.name + "." + detail::random_hex(8) : request.name;
    const auto workspace = make_template_workspace(policy, instance);

    detail::StepNames steps;
    detail::ChildPlan plan;
    plan.parent_death_signal = false;  // outlives the kernel that started it
    plan.drop_privileges = false;      // host root: it clones workers into new user namespaces
    plan.new_user_namespace = false;
    plan.new_cgroup_namespace = false;
    plan_base_steps(policy, request.argv.front(), "wait for the launcher", policy.workspace_target, steps,
                    plan);
    auto impl = std::make_unique<Template::Impl>();
    if (request.limits) {
        impl->skeleton_claim = detail::SkeletonClaim::acquire(policy.state_dir, request.name);
    }
    auto skeleton = detail::RootSkeleton::prepare(policy, request.name, workspace, steps, plan);
    if (request.limits) {
        // Its own memory and pids limits, accounted apart from every kernel's (the pages its forks share stay
        // charged here).
        impl->cgroups =
            detail::CgroupSession::create(state_->cgroups, "template-" + instance, *request.limits);
        plan_cgroup_joins(impl->cgroups, steps, plan);
    }

    auto [sync_read, sync_write] = detail::make_pipe("launch_template: pipe");
    auto [error_read, error_write] = detail::make_pipe("launch_template: pipe");
    auto [pid_read, pid_write] = detail::make_pipe("launch_template: pipe");
    plan.sync_read_fd = sync_read.get();
    plan.sync_write_fd = sync_write.get();
    plan.error_read_fd = error_read.get();
    plan.error_write_fd = error_write.get();

    UniqueFd dev_null(::open("/dev/null", O_RDWR | O_CLOEXEC));
    if (!dev_null) {
        throw_errno("launch_template: open /dev/null");
    }
    UniqueFd host_mount_namespace(::open("/proc/self/ns/mnt", O_RDONLY | O_CLOEXEC));
    if (!host_mount_namespace) {
        throw_errno("launch_template: open /proc/self/ns/mnt");
    }
    detail::plan_fds({dev_null.get(), request.stdout_fd >= 0 ? request.stdout_fd : dev_null.get(),
                      request.stderr_fd >= 0 ? request.stderr_fd : dev_null.get(), request.listening_socket,
                      host_mount_namespace.get()},
                     steps, plan);

    std::vector<std::string> argv = request.argv;
    std::vector<std::string> envp = detail::merge_environment(policy.environment, environment);
    plan_program(argv, envp, plan);

    double_fork_template(plan, pid_write.get());
    pid_write.reset();
    sync_read.reset();
    error_write.reset();
    const pid_t template_pid = read_template_pid(pid_read.get());
    impl->pid = template_pid;
    impl->cgroups.add_process(template_pid);
    if (request.limits) {
        impl->own_workspace = workspace;
    }
    const char go = 1;
    if (::write(sync_write.get(), &go, 1) != 1) {
        throw_errno("launch_template: release the template");
    }
    sync_write.reset();
    await_template_exec(error_read.get(), steps);
    return Template(std::move(impl));
}

}  // namespace cellblock::sandbox
