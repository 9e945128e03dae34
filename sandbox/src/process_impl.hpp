// What a running sandbox owns. Member order matters: members are destroyed bottom-up, so the
// process is killed and reaped (in ~Impl) before its cgroups, root skeleton and uid lease go.
#pragma once

#include <chrono>
#include <optional>
#include <vector>

#include "cellblock/sandbox/sandbox.hpp"
#include "cgroups.hpp"
#include "mounts.hpp"
#include "unique_fd.hpp"
#include "user_namespace.hpp"

namespace cellblock::sandbox {

struct Process::Impl {
    detail::UidLease lease;
    detail::RootSkeleton skeleton;
    detail::CgroupSession cgroups;
    detail::UniqueFd pidfd;
    pid_t pid = -1;
    ResourceLimits limits;
    std::chrono::steady_clock::time_point started;
    std::optional<Outcome> outcome;
    bool killed_for_time = false;
    bool output_limit_noted = false;
    std::vector<UniqueFd> loopback_listeners;  // until the caller takes them
    // A zygote template forked the program: it is not our child, the template reaps it and reports its wait
    // status on this connection (closing it makes the template kill the program).
    detail::UniqueFd zygote_connection;
    bool forked_by_template = false;

    Impl() = default;
    Impl(const Impl&) = delete;
    Impl& operator=(const Impl&) = delete;
    ~Impl();

    // Kill the sandbox's pid 1 (which takes its whole pid namespace along) and every cgroup member.
    void kill_everything() noexcept;
    // Reap pid 1 if it ended (blocking if `block`), recording the outcome.
    std::optional<Outcome> reap(bool block);

  private:
    std::optional<Outcome> reap_template_child(bool block);
    Outcome outcome_of(bool exited, int status, double cpu_seconds);
};

}  // namespace cellblock::sandbox
