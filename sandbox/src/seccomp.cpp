#include "seccomp.hpp"

#include <linux/sched.h>
#include <seccomp.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/personality.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <string>

#include "system.hpp"
#include "unique_fd.hpp"

namespace cellblock::sandbox::detail {
namespace {

struct ContextDeleter {
    void operator()(scmp_filter_ctx ctx) const noexcept { seccomp_release(ctx); }
};
using Context = std::unique_ptr<void, ContextDeleter>;

void check(int result, const std::string& what) {
    // libseccomp returns -errno; a rule that is not installed is a hole, so every call is checked.
    if (result != 0) {
        throw_errno("seccomp " + what, -result);
    }
}

// Syscalls answered with EPERM: confinement.md §4 item 5, grouped by why they are denied.
constexpr const char* denied_with_eperm[] = {
    // tracing other processes and reading their memory
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "kcmp",
    "pidfd_getfd",
    // kernel keyrings (not namespaced), eBPF, perf, userfaultfd: large kernel attack surface
    "keyctl",
    "add_key",
    "request_key",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    // mounts and namespaces
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "setns",
    "unshare",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "move_mount",
    "open_tree",
    "mount_setattr",
    "open_by_handle_at",
    "name_to_handle_at",
    // modules and system control
    "init_module",
    "finit_module",
    "delete_module",
    "kexec_load",
    "kexec_file_load",
    "reboot",
    "swapon",
    "swapoff",
    "syslog",
    "acct",
    "quotactl",
    "quotactl_fd",
    "settimeofday",
    "clock_settime",
    "clock_adjtime",
    "adjtimex",
    "iopl",
    "ioperm",
    "vhangup",
    "lookup_dcookie",
    "uselib",
    "sysfs",
    "_sysctl",
    "ustat",
    "nfsservctl",
    // NUMA placement and stacking our own sandbox inside
    "mbind",
    "set_mempolicy",
    "move_pages",
    "migrate_pages",
    "landlock_create_ruleset",
    "landlock_add_rule",
    "landlock_restrict_self",
};

// io_uring's operations bypass seccomp entirely; ENOSYS makes libraries fall back to plain syscalls.
constexpr const char* denied_with_enosys[] = {"io_uring_setup", "io_uring_enter", "io_uring_register"};

int resolve(const char* name) {
    return seccomp_syscall_resolve_name(name);
}

void add_rule(scmp_filter_ctx ctx, std::uint32_t action, const char* name, unsigned count,
              const scmp_arg_cmp* conditions, const std::string& description) {
    const int number = resolve(name);
    if (number == __NR_SCMP_ERROR) {
        throw SandboxError(std::string("seccomp: libseccomp does not know ") + name);
    }
    // A negative number is a pseudo-syscall: it does not exist on this architecture, nothing to deny.
    if (number < 0) {
        return;
    }
    check(seccomp_rule_add_array(ctx, action, number, count, conditions), "rule " + description);
}

void deny(scmp_filter_ctx ctx, const char* name, int error) {
    add_rule(ctx, SCMP_ACT_ERRNO(static_cast<std::uint32_t>(error)), name, 0, nullptr, name);
}

// One condition per rule: libseccomp rejects two comparisons of one argument in a rule, and a rule it
// rejects must never be dropped silently (confinement.md §4, problem 3).
void deny_if(scmp_filter_ctx ctx, const char* name, int error, scmp_arg_cmp condition,
             const std::string& what) {
    add_rule(ctx, SCMP_ACT_ERRNO(static_cast<std::uint32_t>(error)), name, 1, &condition,
             std::string(name) + "(" + what + ")");
}

}  // namespace

std::vector<sock_filter> build_seccomp_filter(SocketFamilies families) {
    Context ctx(seccomp_init(SCMP_ACT_ALLOW));
    if (!ctx) {
        throw SandboxError("seccomp: seccomp_init failed");
    }
    // Only the native architecture: i386 `int 0x80` (or x32) syscalls kill the process.
    check(seccomp_attr_set(ctx.get(), SCMP_FLTATR_ACT_BADARCH, SCMP_ACT_KILL_PROCESS), "bad-arch action");
    // The filter is only loaded after NO_NEW_PRIVS; do not let libseccomp set it behind our back.
    check(seccomp_attr_set(ctx.get(), SCMP_FLTATR_CTL_NNP, 0), "NNP attribute");

    for (const char* name : denied_with_eperm) {
        deny(ctx.get(), name, EPERM);
    }
    for (const char* name : denied_with_enosys) {
        deny(ctx.get(), name, ENOSYS);
    }

    // Sockets: only AF_UNIX. Everything else (INET, INET6, NETLINK, PACKET, VSOCK, ...) is refused.
    if (families == SocketFamilies::unix_only) {
        for (const char* name : {"socket", "socketpair"}) {
            deny_if(ctx.get(), name, EAFNOSUPPORT, SCMP_A0(SCMP_CMP_NE, AF_UNIX), "family != AF_UNIX");
        }
    } else {
        // With a loopback listener, socket() also admits AF_INET and AF_INET6. This opens no way out:
        // the network namespace holds only `lo` (no other interface, no route, no resolver), so an inet
        // socket reaches the sandbox's own loopback and nothing else, where the only service is the
        // listener the launcher handed to its caller. Raw and packet-level inet sockets still need
        // CAP_NET_RAW, which the program does not have; NETLINK, PACKET, VSOCK, ... stay refused.
        // A rule may compare an argument once and rules only add denials, so "not UNIX, INET or INET6"
        // is spelled as: every family number below AF_INET6 except those three, and everything above.
        static_assert(AF_UNIX == 1 && AF_INET == 2 && AF_INET6 == 10);
        deny_if(ctx.get(), "socket", EAFNOSUPPORT, SCMP_A0(SCMP_CMP_GT, AF_INET6), "family > AF_INET6");
        for (const int family : {0, 3, 4, 5, 6, 7, 8, 9}) {
            deny_if(ctx.get(), "socket", EAFNOSUPPORT,
                    SCMP_A0(SCMP_CMP_EQ, static_cast<scmp_datum_t>(family)),
                    "family == " + std::to_string(family));
        }
        // socketpair is only meaningful for AF_UNIX.
        deny_if(ctx.get(), "socketpair", EAFNOSUPPORT, SCMP_A0(SCMP_CMP_NE, AF_UNIX), "family != AF_UNIX");
    }
    // No new namespaces through clone (unshare/setns are denied above); clone3 passes its flags in
    // memory that seccomp cannot read, so it gets ENOSYS and glibc falls back to clone.
    const std::pair<unsigned long, const char*> namespace_flags[] = {
        {CLONE_NEWUSER, "CLONE_NEWUSER"},     {CLONE_NEWNS, "CLONE_NEWNS"},   {CLONE_NEWPID, "CLONE_NEWPID"},
        {CLONE_NEWNET, "CLONE_NEWNET"},       {CLONE_NEWIPC, "CLONE_NEWIPC"}, {CLONE_NEWUTS, "CLONE_NEWUTS"},
        {CLONE_NEWCGROUP, "CLONE_NEWCGROUP"},
    };
    for (const auto& [flag, flag_name] : namespace_flags) {
        deny_if(ctx.get(), "clone", EPERM, SCMP_A0(SCMP_CMP_MASKED_EQ, flag, flag),
                std::string("flags & ") + flag_name);
    }
    deny(ctx.get(), "clone3", ENOSYS);
    // Terminal injection; the request is compared on its low 32 bits, which is all the kernel reads
    // (CVE-2019-10063 passed the check with high bits set).
    for (const auto& [request, request_name] :
         {std::pair<unsigned long, const char*>{TIOCSTI, "TIOCSTI"}, {TIOCLINUX, "TIOCLINUX"}}) {
        deny_if(ctx.get(), "ioctl", EPERM, SCMP_A1(SCMP_CMP_MASKED_EQ, 0xFFFFFFFFUL, request),
                std::string("request == ") + request_name);
    }
    // personality flags that weaken exploit mitigations.
    for (const auto& [flag, flag_name] :
         {std::pair<unsigned long, const char*>{READ_IMPLIES_EXEC, "READ_IMPLIES_EXEC"},
          {ADDR_NO_RANDOMIZE, "ADDR_NO_RANDOMIZE"},
          {ADDR_COMPAT_LAYOUT, "ADDR_COMPAT_LAYOUT"},
          {MMAP_PAGE_ZERO, "MMAP_PAGE_ZERO"}}) {
        deny_if(ctx.get(), "personality", EPERM, SCMP_A0(SCMP_CMP_MASKED_EQ, flag, flag),
                std::string("persona & ") + flag_name);
    }

    // Export as classic BPF through a memfd, then keep the instructions in memory for the children.
    UniqueFd memory(::memfd_create("cellblock-seccomp", MFD_CLOEXEC));
    if (!memory) {
        throw_errno("seccomp: memfd_create");
    }
    check(seccomp_export_bpf(ctx.get(), memory.get()), "export BPF");
    struct stat info {};
    if (::fstat(memory.get(), &info) != 0) {
        throw_errno("seccomp: fstat BPF");
    }
    const auto size = static_cast<std::size_t>(info.st_size);
    if (size == 0 || size % sizeof(sock_filter) != 0) {
        throw SandboxError("seccomp: exported BPF has a bad size");
    }
    std::vector<sock_filter> program(size / sizeof(sock_filter));
    std::size_t done = 0;
    while (done < size) {
        const ssize_t got = ::pread(memory.get(), reinterpret_cast<char*>(program.data()) + done, size - done,
                                    static_cast<off_t>(done));
        if (got <= 0) {
            throw_errno("seccomp: read BPF", got == 0 ? EIO : errno);
        }
        done += static_cast<std::size_t>(got);
    }
    return program;
}

}  // namespace cellblock::sandbox::detail
