/* A test-only stand-in for libcellblock_zygote.so (sandbox/include/cellblock/sandbox/zygote_spawn.h): the same C ABI, without any confinement.
 * Its "plan" is 4 bytes, the index in `fds` of the fd that becomes 0, 1, 2 and 3 in the child, optionally
 * followed by a flags byte (1: the child is a child subreaper, as pid 1 of a namespace is) and a directory to
 * chdir to (as run_child's plan.cwd); the child then gets what run_child does to a fork apart from namespaces
 * and credentials: every fd above 3 closed, every signal disposition reset to the default, an empty signal
 * mask. Special 4-byte plans:
 *   "FAIL"   nothing started, -ENOEXEC (a plan that cannot be decoded);
 *   "DIE!"   a child that fails its confinement: _exit(127) before returning into Python.
 * Built by tests/worker/test_zygote_service.py with cc; used only there. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/sched.h>
#include <limits.h>
#include <sys/prctl.h>
#include <signal.h>
#include <stddef.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

long cellblock_zygote_spawn(const unsigned char* plan, size_t plan_len, const int* fds, size_t nfds,
                            int host_mount_ns_fd, int own_mount_ns_fd, int own_cwd_fd, int* pidfd_out) {
    if (plan_len == 4 && memcmp(plan, "FAIL", 4) == 0) return -ENOEXEC;
    int dies = plan_len == 4 && memcmp(plan, "DIE!", 4) == 0;
    if (plan_len < 4 || plan_len > 5 + PATH_MAX - 1) return -EINVAL;
    int subreaper = plan_len > 4 && (plan[4] & 1);
    char cwd[PATH_MAX] = "";
    if (plan_len > 5) {
        memcpy(cwd, plan + 5, plan_len - 5);
        cwd[plan_len - 5] = 0;
    }
    if (!dies)
        for (int i = 0; i < 4; ++i)
            if (plan[i] >= nfds) return -EINVAL;
    if (fcntl(host_mount_ns_fd, F_GETFD) < 0 || fcntl(own_mount_ns_fd, F_GETFD) < 0 || fcntl(own_cwd_fd, F_GETFD) < 0)
        return -EBADF;
    int pidfd = -1;
    long pid = syscall(SYS_clone, CLONE_PIDFD | SIGCHLD, 0, &pidfd, 0, 0);
    if (pid < 0) return -errno;
    if (pid > 0) {
        *pidfd_out = pidfd;
        return pid;
    }
    if (dies) _exit(127);
    if (subreaper && prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0) _exit(126);
    if (cwd[0] && chdir(cwd) != 0) _exit(126);
    int high[4];
    for (int i = 0; i < 4; ++i)
        if ((high[i] = fcntl(fds[plan[i]], F_DUPFD, 100)) < 0) _exit(126);
    for (int i = 0; i < 4; ++i)
        if (dup2(high[i], i) < 0) _exit(126);
    if (syscall(SYS_close_range, 4, ~0U, 0) < 0) _exit(126);
    for (int signo = 1; signo < NSIG; ++signo)
        if (signo != SIGKILL && signo != SIGSTOP) signal(signo, SIG_DFL);
    sigset_t empty;
    sigemptyset(&empty);
    sigprocmask(SIG_SETMASK, &empty, NULL);
    return 0;
}
