// cgroups: per-session memory (+swap), pids and cpu limits, nested under the cgroups this process
// already sits in. cgroup v1 (separate hierarchies per controller) and v2 (unified) are both handled.
#pragma once

#include <sys/types.h>

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "cellblock/sandbox/sandbox.hpp"

namespace cellblock::sandbox::detail {

// Where this host lets us create session cgroups; probed once per Launcher.
struct CgroupHost {
    enum class Version { none, v1, v2 };
    Version version = Version::none;
    // The parent directory for sessions per controller ("<our cgroup>/cellblock"); empty = unavailable.
    std::filesystem::path memory_base, pids_base, cpu_base;
    bool memory_swap = false;  // v1: memory.memsw.* exists (swap accounting on)

    static CgroupHost probe();
};

// The cgroups of one session. The destructor kills every process still in them and removes them.
class CgroupSession {
  public:
    CgroupSession() = default;
    CgroupSession(CgroupSession&&) noexcept;
    CgroupSession& operator=(CgroupSession&&) noexcept;
    CgroupSession(const CgroupSession&) = delete;
    CgroupSession& operator=(const CgroupSession&) = delete;
    ~CgroupSession();

    // Creates and configures the cgroups the limits need (only controllers that the limits use).
    // `name` must be unique to the caller (the leased uid): an existing cgroup of that name is stale.
    static CgroupSession create(const CgroupHost& host, const std::string& name,
                                const ResourceLimits& limits);

    // v1: the "tasks" files the child writes itself into (see CgroupJoin); v2: empty, and the parent
    // calls add_process.
    std::vector<std::filesystem::path> self_join_files() const;
    void add_process(pid_t pid) const;
    bool memory_limit_hit() const;   // the OOM killer fired inside the session
    void kill_all() const noexcept;  // SIGKILL every process in the session's cgroups

  private:
    void remove() noexcept;
    CgroupHost::Version version_ = CgroupHost::Version::none;
    std::vector<std::filesystem::path> dirs_;  // every directory we created (to join and remove)
    std::filesystem::path memory_dir_;
};

}  // namespace cellblock::sandbox::detail
