// The cloned child's side of a launch. Everything it needs is precomputed by the parent into a
// ChildPlan: the child runs in a copy of a multi-threaded process, so it only makes system calls
// (async-signal-safe work) and reports the first failure as {step, errno} through the error pipe.
#pragma once

#include <linux/filter.h>
#include <sys/resource.h>
#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

namespace cellblock::sandbox::detail {

// What the child writes to the error pipe when a step fails; the pipe closes on a successful execve.
struct ChildFailure {
    std::int32_t step;
    std::int32_t error;
};

// Human-readable names of the steps, indexed by ChildFailure::step ("mount /usr", "setsid", ...).
class StepNames {
  public:
    int add(std::string name) {
        names_.push_back(std::move(name));
        return static_cast<int>(names_.size() - 1);
    }
    const std::string& name(int step) const;

  private:
    std::vector<std::string> names_;
};

// One mount-table operation, with every string already built.
struct MountOp {
    enum class Action {
        mount,         // mount(source, target, fstype, flags, data)
        remount_bind,  // mount(NULL, target, NULL, MS_REMOUNT|MS_BIND|flags + the mount's locked flags)
    };
    Action action = Action::mount;
    int step = 0;
    std::string source;
    std::string target;
    std::string fstype;
    unsigned long flags = 0;
    std::string data;
    bool has_source = false;
    bool has_fstype = false;
    bool has_data = false;
};

struct RlimitOp {
    int resource;
    rlimit value;
    int step;
};

// The fds the program starts with: sources[i] becomes fd i (0, 1, 2, then the pass_fds).
struct FdPlan {
    std::vector<int> sources;
    int dup_base = 0;  // above every source fd; scratch copies go here first
    int step_dup = 0;
    int step_close = 0;
};

// The child moves itself into a cgroup by writing "0" to its v1 "tasks" file: migrating only the
// calling thread skips the global threadgroup lock (an RCU grace period, several ms on a busy host)
// that a write of a pid to cgroup.procs takes.
struct CgroupJoin {
    std::string tasks_file;
    int step = 0;
};

// One loopback listener the child makes in its network namespace and sends to the parent (network.hpp).
struct ListenerOp {
    bool ipv6 = false;
    std::uint16_t port = 0;
    int step_socket = 0, step_bind = 0, step_listen = 0, step_send = 0;
};

struct ChildPlan {
    // false: a fork of a zygote template (sandbox/README.md "Worker zygote") that must continue into the
    // template's code once confined: run_child closes the error pipe itself (success) and returns instead
    // of calling execve. argv and envp are then unused.
    bool exec_program = true;
    // false for a template's fork: a worker must not die with the template (nor with the template's
    // launcher); its kernel kills it through the pidfd and the cgroup instead.
    bool parent_death_signal = true;
    // false for the template itself, which keeps host root (no user namespace, capabilities, no seccomp).
    bool drop_privileges = true;
    // Whether the clone makes a new user namespace (false only on a host without them, or for a template).
    bool new_user_namespace = true;

    int sync_read_fd = -1;    // the parent writes one byte when ids are mapped and cgroups joined
    int sync_write_fd = -1;   // the parent's end, closed in the child
    int error_write_fd = -1;  // CLOEXEC; ChildFailure goes here
    int error_read_fd = -1;   // the parent's end, closed in the child

    std::vector<CgroupJoin> cgroup_joins;  // done first, while the host's cgroupfs is visible
    bool new_cgroup_namespace = true;
    int step_sync = 0, step_cgroupns = 0, step_setgroups = 0, step_hostname = 0, step_setsid = 0;
    int step_pdeathsig = 0, step_chdir = 0, step_execve = 0, step_sigmask = 0;

    // Mounts, then pivot_root into new_root.
    std::vector<MountOp> mounts_before_pivot;
    std::string new_root;
    int step_chdir_root = 0, step_pivot = 0, step_umount_old = 0;
    std::vector<MountOp> mounts_after_pivot;  // remount / read-only

    std::string hostname;
    bool loopback_up = true;
    int step_loopback = 0;
    std::vector<ListenerOp> listeners;  // empty: no loopback listener
    int listener_child_fd = -1;         // the listeners go out here
    int listener_parent_fd = -1;        // the parent's end, closed in the child

    FdPlan fds;
    std::vector<RlimitOp> rlimits;

    // Credentials.
    uid_t uid = 0;
    gid_t gid = 0;
    int last_capability = 40;
    int step_bounding = 0, step_setresgid = 0, step_setresuid = 0, step_capset = 0, step_ambient = 0;
    int step_no_new_privs = 0, step_securebits = 0;

    // seccomp: the filter exported by the parent (empty = none).
    const std::vector<sock_filter>* seccomp_filter = nullptr;
    int step_seccomp = 0;

    std::string cwd;
    std::vector<char*> argv;  // null-terminated, pointing into strings owned by the launcher
    std::vector<char*> envp;  // null-terminated
};

// Runs in the child after clone: sets everything up and execs; never returns then. Without
// plan.exec_program it returns 0 once the child is confined (the error pipe closed: the parent sees
// success). A failing step is reported through the error pipe and the child _exit(127)s.
int run_child(const ChildPlan& plan) noexcept;

}  // namespace cellblock::sandbox::detail
