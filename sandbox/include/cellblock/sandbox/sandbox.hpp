// Public API of the cellblock confinement library.
//
// The library starts one program confined (namespaces, a minimal read-only root, seccomp, rlimits,
// cgroups) and hands back a Process that owns everything the sandbox holds: killing it, waiting for it
// and learning why it ended. It knows nothing about what runs inside it (no Jupyter here).
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "cellblock/sandbox/unique_fd.hpp"

namespace cellblock::sandbox {

// Thrown for every setup failure, with the step and errno text (e.g. "mount /usr: Permission denied").
class SandboxError : public std::runtime_error {
  public:
    using std::runtime_error::runtime_error;
};

// Thrown by Launcher::launch with LaunchRequest::zygote_socket when the template could not start the
// program (no socket, no answer in time, a refusal, a malformed answer). Nothing was released and
// nothing of the request is left: the caller retries the same request without the socket (the exec path).
class ZygoteUnavailable : public SandboxError {
  public:
    using SandboxError::SandboxError;
};

// Thrown by Workspace; kind lets an HTTP layer pick 404 / 413 / 400 / 409.
class WorkspaceError : public SandboxError {
  public:
    enum class Kind { not_found, too_large, not_regular, bad_path, io };
    WorkspaceError(Kind kind, const std::string& what) : SandboxError(what), kind_(kind) {}
    Kind kind() const noexcept { return kind_; }

  private:
    Kind kind_;
};

struct MountSpec {
    // symlink: a symbolic link at target pointing to source (e.g. /bin -> usr/bin).
    enum class Kind { bind, tmpfs, proc, dev, file, symlink };
    Kind kind = Kind::bind;
    std::string source;            // host path (bind) or link text (symlink); ignored otherwise
    std::string target;            // path inside the sandbox
    bool writable = false;         // binds and tmpfs are read-only unless set
    bool optional = false;         // a missing bind source is skipped instead of failing
    std::uint64_t size_bytes = 0;  // tmpfs size (0 = kernel default)
    std::string content;           // kind == file: the file's content, written before the root goes read-only
};

struct ResourceLimits {
    std::uint64_t memory_bytes = 0;     // cgroup memory (+swap) limit; 0 = none
    std::uint64_t pids = 0;             // cgroup pids.max; 0 = none
    double cpu_cores = 0;               // cgroup cpu quota in cores; 0 = none
    std::uint64_t open_files = 256;     // RLIMIT_NOFILE
    std::uint64_t processes = 0;        // RLIMIT_NPROC (per session uid); 0 = none
    std::uint64_t file_size_bytes = 0;  // RLIMIT_FSIZE; 0 = none
    std::uint64_t cpu_seconds = 0;      // RLIMIT_CPU; 0 = none
    std::chrono::milliseconds wall_clock{
        0};                          // whole-process wall clock, enforced by Process::wait*; 0 = none
    std::uint64_t output_bytes = 0;  // used by callers that read the output (the CLI); 0 = none
};

struct Policy {
    // Host uids/gids handed to sessions: [uid_first, uid_first + uid_count). Never 0.
    uid_t uid_first = 200000;
    uid_t uid_count = 10000;
    uid_t inside_uid = 1000;  // uid/gid the program sees
    std::string hostname = "cellblock";
    std::string workspace_target = "/workspace";
    std::vector<MountSpec> mounts;         // applied in order on the new tmpfs root
    std::vector<std::string> environment;  // "NAME=value": the base environment; nothing is inherited
    ResourceLimits limits;
    bool seccomp = true;
    bool network_loopback = true;           // bring lo up in the empty network namespace
    bool allow_weaker_confinement = false;  // start even if a mechanism (cgroups, userns) is missing
    std::filesystem::path state_dir = "/run/cellblock";  // staging roots (uid leases are host-wide)

    static Policy from_json(const nlohmann::json& json);
    static Policy load(const std::filesystem::path& file);
};

// Why a confined program ended.
struct Outcome {
    enum class Reason { exited, signaled, memory_limit, time_limit, cpu_limit, output_limit };
    Reason reason = Reason::exited;
    int exit_code = 0;  // valid when reason == exited
    int signal = 0;     // the terminating signal otherwise (0 if unknown)

    // A short phrase for people: "exited with status 3", "killed by signal 11 (Segmentation fault)",
    // "killed by the memory limit", "killed by the time limit", ...
    std::string describe() const;
    // What a shell would report: the exit code, or 128 + signal.
    int shell_status() const;
};

// A TCP socket listening on the sandbox's own loopback interface, created inside its network namespace
// before the program starts and handed to the caller (Process::take_loopback_listeners), who serves it
// from outside: the one door out of the empty namespace, and only to whatever the caller puts behind it.
// In this mode the program may also create AF_INET/AF_INET6 sockets (so that it can connect to the
// listener); the namespace has nothing but `lo`, so they reach nothing else.
struct LoopbackListener {
    std::uint16_t port = 0;  // 1..65535
    bool ipv6 = false;       // also listen on [::1]:port (besides 127.0.0.1:port)
};

struct LaunchRequest {
    std::vector<std::string> argv;         // argv[0] must be an absolute path inside the sandbox
    std::vector<std::string> environment;  // added to (and overriding) the policy's environment
    std::filesystem::path workspace;       // host directory mounted read-write at policy.workspace_target
    std::string cwd;                       // default: policy.workspace_target
    int stdin_fd = -1;                     // -1 = /dev/null
    int stdout_fd = -1;                    // -1 = /dev/null
    int stderr_fd = -1;                    // -1 = /dev/null
    std::vector<int> pass_fds;             // become fds 3, 4, ... in the program; everything else is closed
    std::optional<ResourceLimits> limits;  // overrides policy.limits
    std::optional<LoopbackListener> loopback_listener;  // needs policy.network_loopback
    // Empty: clone and execve argv (the exec path). Otherwise the socket of a zygote template
    // (sandbox/README.md "Worker zygote") that clones the program from its own preloaded copy of it; the
    // confinement is the same plan, argv and environment are then the template's. Throws
    // ZygoteUnavailable when the template does not start it.
    std::filesystem::path zygote_socket;
};

// A zygote template (Launcher::launch_template): started with the worker's argv and environment, as host
// root, no user namespace, no seccomp, no parent-death signal, detached (its own session, not the caller's
// child), in its own mount/UTS/IPC/net namespaces whose root is the policy's (an empty workspace).
struct TemplateRequest {
    std::string name;                      // names its root skeleton and empty workspace under state_dir
    std::vector<std::string> argv;         // argv[0] absolute inside its root
    std::vector<std::string> environment;  // added to the policy's
    int listening_socket = -1;             // becomes fd 3 (SOCK_SEQPACKET, listening)
    int stdout_fd = -1;                    // -1 = /dev/null
    int stderr_fd = -1;                    // -1 = /dev/null
    // Host path of libcellblock_zygote.so: its directory is bound read-only at /opt/cellblock/zygote in the
    // template's root only, and CELLBLOCK_ZYGOTE_LIBRARY names it there.
    std::filesystem::path zygote_library;
    // Set: the template runs in a cgroup of its own with these limits, "template-<name>.<16 random hex>",
    // which the returned Template owns, as it owns its empty workspace, state_dir/templates/<name>.<the hex>.
    // Unset: it stays in the caller's cgroups, its workspace is state_dir/templates/<name> and the Template
    // owns nothing.
    std::optional<ResourceLimits> limits;
};

// A started zygote template. It is not the caller's child (a double fork; a PR_SET_CHILD_SUBREAPER caller
// becomes its parent). With TemplateRequest::limits this object owns the template's cgroup and empty
// workspace (its alone: templates of one name overlap, a tenant's generations), and a share of its root
// skeleton (<state_dir>/roots/<name>, which templates of the same name share): the destructor kills whatever
// is still in the cgroup and removes both, and the last share of the skeleton removes it, so end the template
// (or wait for its end) first.
class Template {
  public:
    Template(Template&&) noexcept;
    Template& operator=(Template&&) noexcept;
    Template(const Template&) = delete;
    Template& operator=(const Template&) = delete;
    ~Template();

    pid_t pid() const noexcept;
    void kill_all() const noexcept;  // SIGKILL everything in its cgroup (no-op without one)

    struct Impl;

  private:
    friend class Launcher;
    explicit Template(std::unique_ptr<Impl> impl);
    std::unique_ptr<Impl> impl_;
};

class Process {
  public:
    Process(Process&&) noexcept;
    Process& operator=(Process&&) noexcept;
    Process(const Process&) = delete;
    Process& operator=(const Process&) = delete;
    // Kills every process of the sandbox, reaps, removes the cgroups and releases the uid lease.
    ~Process();

    pid_t pid() const noexcept;       // host pid of the program (pid 1 of its pid namespace)
    int pidfd() const noexcept;       // pollable; readable when the program has ended
    uid_t host_uid() const noexcept;  // the session's host uid

    void signal(int signo);    // deliver to the program (e.g. SIGINT); no-op once ended
    void kill();               // SIGKILL the whole sandbox
    void note_output_limit();  // the caller cut the output: report output_limit if it ends by a kill

    // The listening sockets of LaunchRequest::loopback_listener (127.0.0.1 first, then [::1] if asked);
    // the caller owns them from here. Empty without the option, and on every call after the first.
    std::vector<UniqueFd> take_loopback_listeners();

    std::optional<Outcome> try_wait();
    Outcome wait();  // honours limits.wall_clock
    std::optional<Outcome> wait_for(std::chrono::milliseconds timeout);

    struct Impl;

  private:
    friend class Launcher;
    explicit Process(std::unique_ptr<Impl> impl);
    std::unique_ptr<Impl> impl_;
};

// Use a Launcher from one thread at a time. The sandbox's parent-death signal is tied to the thread
// that called launch(): launch from a thread that outlives the Process (or the sandbox is killed when
// that thread exits).
class Launcher {
  public:
    explicit Launcher(Policy policy);
    ~Launcher();
    Launcher(Launcher&&) noexcept;
    Launcher& operator=(Launcher&&) noexcept;

    // Starts request.argv confined. Throws SandboxError with context on any failure; nothing is left behind.
    Process launch(const LaunchRequest& request);

    // Starts a zygote template; fd 4 in it is the launcher's mount namespace (/proc/self/ns/mnt). It is not
    // the caller's child (a double fork): nobody here waits for it. Throws SandboxError with context on any
    // failure.
    Template launch_template(const TemplateRequest& request);

    // Mechanisms this host lacks that the policy allowed to skip (empty on a fully confined host).
    const std::vector<std::string>& weakened() const noexcept;
    const Policy& policy() const noexcept;

  private:
    struct State;
    std::unique_ptr<State> state_;
};

// Host-side access to a workspace that untrusted code can also write: every path is resolved with
// openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS), only regular files are read,
// sizes are capped, and nothing blocks on a planted FIFO.
class Workspace {
  public:
    explicit Workspace(const std::filesystem::path& root);
    Workspace(Workspace&&) noexcept;
    Workspace& operator=(Workspace&&) noexcept;
    ~Workspace();

    struct Entry {
        std::string path;  // relative to the root, '/'-separated
        std::uint64_t size;
        bool is_directory;
    };

    std::string read_file(const std::string& relative, std::uint64_t max_bytes) const;
    // Creates missing parent directories; replaces an existing regular file.
    void write_file(const std::string& relative, std::string_view bytes, std::uint64_t max_bytes) const;
    void remove_file(const std::string& relative) const;
    std::vector<Entry> list(std::size_t max_entries = 10000) const;
    const std::filesystem::path& root() const noexcept;

  private:
    std::filesystem::path root_;
    int root_fd_ = -1;
};

// Removes `directory` and everything under it, as a fd-relative walk (openat with O_NOFOLLOW |
// O_DIRECTORY, unlinkat) that never follows a symbolic link and never leaves the directory's mount: a
// symlink planted inside by untrusted code loses only the link, never its target, and a mount point inside
// is left alone. Going back up, each parent is checked to be the directory it was, so a tree moved during
// the walk stops it instead of redirecting it. A `directory` that does not exist is not an error; one that
// is a symlink or not a directory is refused. Throws SandboxError naming the first entry that could not
// be removed, after removing everything else it could.
void remove_tree(const std::filesystem::path& directory);

// Gives the tree under `directory` (not `directory` itself) to `uid` (owner and group): every entry whose
// owner is not `uid` and for which `adoptable(owner)` holds. The same fd-relative walk as remove_tree:
// nothing is followed, nothing on another mount (a bind mount inside) is touched, each entry is changed
// through a descriptor opened without following and checked to be the entry listed, multiply-linked
// non-directories are left alone, and at most `max_entries` entries are looked at. Throws SandboxError
// naming the first entry that could not be changed.
void adopt_tree(const std::filesystem::path& directory, uid_t uid,
                const std::function<bool(uid_t)>& adoptable, std::size_t max_entries);

}  // namespace cellblock::sandbox
