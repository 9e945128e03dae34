// libcellblock_zygote.so: the template's side of a zygote launch. Decodes the kernel's plan, clones from the
// host's mount namespace with the same flags as Launcher::launch, and runs the same run_child in the child.
#include "cellblock/sandbox/zygote_spawn.h"

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <memory>
#include <new>

#include "child.hpp"
#include "plan_codec.hpp"

namespace {

using cellblock::sandbox::detail::DecodedPlan;

// Every signal blocked around the clone, so that no handler of the template's runs in the child before
// run_child resets them (it empties the mask as its last step); the template's own mask comes back after.
class AllSignalsBlocked {
  public:
    AllSignalsBlocked() {
        sigset_t all;
        sigfillset(&all);
        error_ = ::pthread_sigmask(SIG_SETMASK, &all, &previous_);
    }
    ~AllSignalsBlocked() {
        if (error_ == 0 && restore_) {
            ::pthread_sigmask(SIG_SETMASK, &previous_, nullptr);
        }
    }
    AllSignalsBlocked(const AllSignalsBlocked&) = delete;
    AllSignalsBlocked& operator=(const AllSignalsBlocked&) = delete;
    int error() const noexcept { return error_; }
    // In the child: run_child has set the mask an exec'd program starts with (empty); keep it.
    void keep_current_mask() noexcept { restore_ = false; }

  private:
    sigset_t previous_{};
    int error_ = 0;
    bool restore_ = true;
};

void kill_and_reap(pid_t child, int pidfd) noexcept {
    ::syscall(SYS_pidfd_send_signal, pidfd, SIGKILL, nullptr, 0);
    int status = 0;
    while (::waitpid(child, &status, __WALL) < 0 && errno == EINTR) {
    }
    ::close(pidfd);
}

}  // namespace

extern "C" long cellblock_zygote_spawn(const unsigned char* plan, size_t plan_len, const int* fds,
                                       size_t nfds, int host_mount_ns_fd, int own_mount_ns_fd, int own_cwd_fd,
                                       int* pidfd_out) {
    if (plan == nullptr || pidfd_out == nullptr || (nfds > 0 && fds == nullptr)) {
        return -EINVAL;
    }
    if (host_mount_ns_fd >= 0 && (own_mount_ns_fd < 0 || own_cwd_fd < 0)) {
        return -EINVAL;  // no way back into our own view
    }
    std::unique_ptr<DecodedPlan> decoded;
    try {
        decoded = cellblock::sandbox::detail::decode_plan({plan, plan_len}, {fds, nfds});
    } catch (const std::bad_alloc&) {
        return -ENOMEM;
    } catch (const std::exception&) {
        return -EINVAL;
    }
    if (decoded->plan.exec_program) {
        return -EINVAL;  // a template's fork continues into the template's code
    }
    if (!decoded->plan.drop_privileges) {
        // Only the kernel (root, through a 0600 socket in a root-only directory) reaches a template, and its
        // worker plans always drop privileges; a plan that does not would hand the template's root to user
        // code.
        return -EPERM;
    }

    unsigned long flags =
        CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_PIDFD | SIGCHLD;
    if (decoded->plan.new_user_namespace) {
        flags |= CLONE_NEWUSER;
    }

    AllSignalsBlocked blocked;
    if (blocked.error() != 0) {
        return -blocked.error();
    }
    if (host_mount_ns_fd >= 0 && ::setns(host_mount_ns_fd, CLONE_NEWNS) != 0) {
        return -errno;  // still in our own namespace: setns changes nothing when it fails
    }
    int pidfd = -1;
    const long child = ::syscall(SYS_clone, flags, nullptr, &pidfd, nullptr, 0);
    if (child == 0) {
        // The child: confined exactly as the plan says, or _exit(127) after reporting the failed step.
        const int confined = cellblock::sandbox::detail::run_child(decoded->plan);
        blocked.keep_current_mask();
        return confined;
    }
    const int clone_error = errno;
    if (host_mount_ns_fd >= 0) {
        if (::setns(own_mount_ns_fd, CLONE_NEWNS) != 0 || ::fchdir(own_cwd_fd) != 0) {
            const int error = errno;
            if (child > 0) {
                kill_and_reap(static_cast<pid_t>(child), pidfd);
            }
            errno = error;
            return -ENOTRECOVERABLE;
        }
    }
    if (child < 0) {
        return -clone_error;
    }
    *pidfd_out = pidfd;
    return child;
}
