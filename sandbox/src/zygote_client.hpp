// The kernel's side of the template socket (sandbox/README.md "Worker zygote", wire protocol): one
// SOCK_SEQPACKET connection per worker, "CBZ1" + the plan with its fds, {"pid": N} + the pidfd back, and
// later {"exit": {...}} once the template has reaped that worker.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <filesystem>
#include <optional>

#include "child.hpp"
#include "unique_fd.hpp"

namespace cellblock::sandbox::detail {

struct ZygoteChild {
    pid_t pid = -1;
    UniqueFd pidfd;
    UniqueFd connection;  // closing it makes the template SIGKILL the worker if it still runs
};

// Connects, sends the plan and waits for the answer, all within `timeout`. Throws ZygoteUnavailable for
// every failure: then no child of this request will ever be released (it waits on the sync pipe, whose
// write end only the caller holds).
ZygoteChild request_zygote_spawn(const std::filesystem::path& socket, const ChildPlan& plan,
                                 std::chrono::milliseconds timeout);

struct ExitReport {
    int wait_status = 0;  // as waitpid(2) gives it
    double cpu_seconds = 0;
};

// The template's {"exit": ...} message on `connection`, waiting at most `timeout`; nullopt if the
// connection closed, the time ran out or the message was not one.
std::optional<ExitReport> read_exit_report(int connection, std::chrono::milliseconds timeout);

// The wait status of an ended, reaped process from its pidfd (PIDFD_GET_INFO with PIDFD_INFO_EXIT, Linux
// >= 6.15); nullopt when the kernel cannot tell (older kernel, not reaped yet).
std::optional<int> pidfd_exit_status(int pidfd);

}  // namespace cellblock::sandbox::detail
