/* The C ABI of libcellblock_zygote.so, called by a zygote template (sandbox/README.md "Worker zygote")
 * through ctypes.PyDLL (the GIL held) between PyOS_BeforeFork() and PyOS_AfterFork_Parent() /
 * PyOS_AfterFork_Child(). The caller must be single-threaded (setns into a mount namespace requires it). */
#ifndef CELLBLOCK_SANDBOX_ZYGOTE_SPAWN_H
#define CELLBLOCK_SANDBOX_ZYGOTE_SPAWN_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Clones a child confined exactly as `plan` (the bytes after "CBZ1" of a kernel's request) says; `fds` are
 * the descriptors received with it (SCM_RIGHTS), in order; they stay the caller's, who must close its copies
 * once this returns in the template (the kernel learns the child's success from the end of file on the error
 * pipe, which needs every copy of its write end closed).
 *
 * Returns the child's pid (> 0) in the template, with *pidfd_out set (CLOEXEC); 0 in the child once it is
 * confined exactly as the plan says (it must then continue into the template's code: nothing of the
 * template's may run in it before); -errno in the template when the plan cannot be decoded or asks for an
 * exec (-EINVAL), keeps the caller's privileges (-EPERM), or setns/clone fails (nothing was started). A
 * confinement step that fails in the child is reported through the plan's error pipe and the child
 * _exit(127)s (never returns).
 *
 * host_mount_ns_fd: an fd of the host's mount namespace; the child is cloned from it, because the plan's
 * mount sources are host paths (-1: clone from the caller's own mount namespace). own_mount_ns_fd: the
 * template's own, re-entered after the clone, and the cwd restored with fchdir(own_cwd_fd).
 * -ENOTRECOVERABLE: the template could not return to its own mount namespace or cwd (the child was killed
 * and reaped); the template is then in the host's view and must exit without running anything else. */
long cellblock_zygote_spawn(const unsigned char* plan, size_t plan_len, const int* fds, size_t nfds,
                            int host_mount_ns_fd, int own_mount_ns_fd, int own_cwd_fd, int* pidfd_out);

#ifdef __cplusplus
}
#endif

#endif
