// The child between clone and execve. It is a copy of a multi-threaded process, so it must not
// allocate, lock or touch stdio: only system calls on data the parent prepared.
#include "child.hpp"

#include <fcntl.h>
#include <linux/seccomp.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>

#include "credentials.hpp"
#include "fds.hpp"
#include "network.hpp"

namespace cellblock::sandbox::detail {

const std::string& StepNames::name(int step) const {
    static const std::string unknown = "an unknown setup step";
    if (step < 0 || static_cast<std::size_t>(step) >= names_.size()) {
        return unknown;
    }
    return names_[static_cast<std::size_t>(step)];
}

namespace {

[[noreturn]] void report_and_exit(int error_fd, int step, int error) noexcept {
    const ChildFailure failure{step, error};
    // Best effort: if the parent is gone there is nobody to tell.
    [[maybe_unused]] const auto ignored = ::write(error_fd, &failure, sizeof failure);
    ::_exit(127);
}

// The flags a remount must keep: a mount inherited from a more privileged namespace has its
// nosuid/nodev/noexec/ro/atime flags locked, and dropping any of them makes the remount fail.
unsigned long locked_flags(const char* target) noexcept {
    struct statfs info {};
    if (::statfs(target, &info) != 0) {
        return 0;
    }
    const unsigned long keep =
        ST_RDONLY | ST_NOSUID | ST_NODEV | ST_NOEXEC | ST_NOATIME | ST_NODIRATIME | ST_RELATIME;
    // The ST_* values of these flags equal the MS_* values.
    return static_cast<unsigned long>(info.f_flags) & keep;
}

int run_mount(const MountOp& op) noexcept {
    int result = 0;
    if (op.action == MountOp::Action::mount) {
        result = ::mount(op.has_source ? op.source.c_str() : nullptr, op.target.c_str(),
                         op.has_fstype ? op.fstype.c_str() : nullptr, op.flags,
                         op.has_data ? op.data.c_str() : nullptr);
    } else {
        const unsigned long flags = MS_REMOUNT | MS_BIND | op.flags | locked_flags(op.target.c_str());
        result = ::mount(nullptr, op.target.c_str(), nullptr, flags, nullptr);
    }
    return result == 0 ? 0 : errno;
}

// Each step below reports its failure as {step, errno} on `error_fd` and exits (report_and_exit); like
// run_child they only make system calls on data the parent prepared.

// Die with the thread that launched us, run no handler of the parent's code, and close the parent's ends
// of the pipes.
void reset_inherited_state(const ChildPlan& plan, int error_fd) noexcept {
    // Set now for the setup, and again after the uid change, which clears it.
    if (plan.parent_death_signal && ::prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) != 0) {
        report_and_exit(error_fd, plan.step_pdeathsig, errno);
    }
    // Signal handlers of the parent's code must never run here: reset them all to the default.
    for (int signo = 1; signo < NSIG; ++signo) {
        if (signo == SIGKILL || signo == SIGSTOP) {
            continue;
        }
        struct sigaction action {};
        action.sa_handler = SIG_DFL;
        ::sigaction(signo, &action, nullptr);  // EINVAL for glibc-reserved signals is fine
    }
    // A template's fork never had the parent's ends (-1).
    if (plan.sync_write_fd >= 0) {
        ::close(plan.sync_write_fd);
    }
    if (plan.error_read_fd >= 0) {
        ::close(plan.error_read_fd);
    }
    if (plan.listener_parent_fd >= 0) {
        ::close(plan.listener_parent_fd);
    }
}

void join_cgroups(const ChildPlan& plan, int error_fd) noexcept {
    for (const auto& join : plan.cgroup_joins) {
        const int fd = ::open(join.tasks_file.c_str(), O_WRONLY | O_CLOEXEC);
        if (fd < 0) {
            report_and_exit(error_fd, join.step, errno);
        }
        if (::write(fd, "0", 1) != 1) {
            report_and_exit(error_fd, join.step, errno);
        }
        ::close(fd);
    }
}

// The mounts need no uid map (we hold every capability in our new user namespace from the start and
// reach host files as the host uid we were cloned with), so they run while the parent writes the maps
// and moves us into our cgroups.
void enter_new_root(const ChildPlan& plan, int error_fd) noexcept {
    for (const auto& op : plan.mounts_before_pivot) {
        if (const int error = run_mount(op); error != 0) {
            report_and_exit(error_fd, op.step, error);
        }
    }
    if (::chdir(plan.new_root.c_str()) != 0) {
        report_and_exit(error_fd, plan.step_chdir_root, errno);
    }
    // pivot_root(".", ".") stacks the old root on top of the new one; unmounting "." then drops it
    // without needing a directory for it inside the new root.
    if (::syscall(SYS_pivot_root, ".", ".") != 0) {
        report_and_exit(error_fd, plan.step_pivot, errno);
    }
    if (::umount2(".", MNT_DETACH) != 0) {
        report_and_exit(error_fd, plan.step_umount_old, errno);
    }
    if (::chdir("/") != 0) {
        report_and_exit(error_fd, plan.step_chdir_root, errno);
    }
    for (const auto& op : plan.mounts_after_pivot) {
        if (const int error = run_mount(op); error != 0) {
            report_and_exit(error_fd, op.step, error);
        }
    }
}

void set_up_network(const ChildPlan& plan, int error_fd) noexcept {
    if (::sethostname(plan.hostname.data(), plan.hostname.size()) != 0) {
        report_and_exit(error_fd, plan.step_hostname, errno);
    }
    if (plan.loopback_up) {
        if (const int error = bring_loopback_up(); error != 0) {
            report_and_exit(error_fd, plan.step_loopback, error);
        }
    }
}

// Wait until the parent has written our uid/gid maps and put us into our cgroups; the cgroup namespace
// must be created after that so that its root is the session's cgroup.
void wait_for_launcher(const ChildPlan& plan, int error_fd) noexcept {
    char go = 0;
    ssize_t got = 0;
    do {
        got = ::read(plan.sync_read_fd, &go, 1);
    } while (got < 0 && errno == EINTR);
    if (got != 1) {
        report_and_exit(error_fd, plan.step_sync, got < 0 ? errno : EPIPE);
    }
    ::close(plan.sync_read_fd);
    if (plan.new_cgroup_namespace && ::unshare(CLONE_NEWCGROUP) != 0) {
        report_and_exit(error_fd, plan.step_cgroupns, errno);
    }
}

// In the namespace with our cgroups joined (the sockets are charged to the session), before the program's
// fds are installed (which closes the channel) and long before anything of the program runs.
void send_listeners(const ChildPlan& plan, int error_fd) noexcept {
    if (plan.listeners.empty()) {
        return;
    }
    int failed_step = 0;
    if (!send_loopback_listeners(plan, &failed_step)) {
        report_and_exit(error_fd, failed_step, errno);
    }
    ::close(plan.listener_child_fd);
}

// The program's rlimits and credentials, then the parent-death signal again (the uid change cleared it).
void drop_to_program(const ChildPlan& plan, int error_fd) noexcept {
    for (const auto& limit : plan.rlimits) {
        if (::setrlimit(static_cast<__rlimit_resource>(limit.resource), &limit.value) != 0) {
            report_and_exit(error_fd, limit.step, errno);
        }
    }
    int failed_step = 0;
    if (plan.drop_privileges && !drop_privileges(plan, &failed_step)) {
        report_and_exit(error_fd, failed_step, errno);
    }
    if (plan.parent_death_signal && ::prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) != 0) {
        report_and_exit(error_fd, plan.step_pdeathsig, errno);
    }
}

// The seccomp filter, then the empty signal mask the program starts with.
void lock_down(const ChildPlan& plan, int error_fd) noexcept {
    if (plan.seccomp_filter != nullptr && !plan.seccomp_filter->empty()) {
        const sock_fprog program{static_cast<unsigned short>(plan.seccomp_filter->size()),
                                 const_cast<sock_filter*>(plan.seccomp_filter->data())};
        if (::syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0, &program) != 0) {
            report_and_exit(error_fd, plan.step_seccomp, errno);
        }
    }
    sigset_t none;
    sigemptyset(&none);
    if (::sigprocmask(SIG_SETMASK, &none, nullptr) != 0) {
        report_and_exit(error_fd, plan.step_sigmask, errno);
    }
}

}  // namespace

int run_child(const ChildPlan& plan) noexcept {
    int error_fd = plan.error_write_fd;
    auto fail = [&](int step, int error) { report_and_exit(error_fd, step, error); };

    reset_inherited_state(plan, error_fd);
    join_cgroups(plan, error_fd);
    enter_new_root(plan, error_fd);
    set_up_network(plan, error_fd);
    wait_for_launcher(plan, error_fd);
    send_listeners(plan, error_fd);

    if (::setsid() < 0) {
        fail(plan.step_setsid, errno);
    }

    int failed_step = 0;
    if (!install_fds(plan, &failed_step, &error_fd)) {
        fail(failed_step, errno);
    }
    // From here error_fd is where install_fds moved the error pipe.
    drop_to_program(plan, error_fd);
    // If the launcher died before that, nobody would kill us: its end of the error pipe (held until
    // our execve) is then closed, which poll reports as POLLERR on ours.
    pollfd launcher_alive{error_fd, POLLOUT, 0};
    if (::poll(&launcher_alive, 1, 0) < 0 || (launcher_alive.revents & (POLLERR | POLLHUP)) != 0) {
        ::_exit(127);
    }
    if (::chdir(plan.cwd.c_str()) != 0) {
        fail(plan.step_chdir, errno);
    }
    lock_down(plan, error_fd);
    if (!plan.exec_program) {
        // What execve's CLOEXEC would have done: the parent reads an end of file, which means success.
        ::close(error_fd);
        return 0;
    }
    ::execve(plan.argv[0], plan.argv.data(), plan.envp.data());
    fail(plan.step_execve, errno);
    ::_exit(127);  // not reached: fail() exits
}

}  // namespace cellblock::sandbox::detail
