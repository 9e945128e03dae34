// File descriptors and environment: the program gets exactly stdin/stdout/stderr and the pass_fds
// (as 3, 4, ...); everything else is closed; its environment is explicit.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include "cellblock/sandbox/sandbox.hpp"
#include "child.hpp"

namespace cellblock::sandbox::detail {

void plan_fds(std::vector<int> sources, StepNames& steps, ChildPlan& plan);
// Child side; returns false with *failed_step set on error (errno set). *error_fd is updated to where
// the (CLOEXEC) error pipe now lives.
bool install_fds(const ChildPlan& plan, int* failed_step, int* error_fd) noexcept;

// Descriptors passed between processes (SCM_RIGHTS) go at most this many to a message.
inline constexpr std::size_t max_fds_per_message = 16;

// Sends `bytes` (at least one) with `fds` attached in one sendmsg (MSG_NOSIGNAL), retrying on EINTR. It does
// not allocate, so the cloned child may call it. Returns sendmsg's result: -1 with errno set (EINVAL for
// more than max_fds_per_message fds or no bytes).
ssize_t send_with_fds(int socket, std::span<const unsigned char> bytes, std::span<const int> fds) noexcept;

// policy environment overridden by the request's, by variable name.
std::vector<std::string> merge_environment(const std::vector<std::string>& base,
                                           const std::vector<std::string>& overrides);

}  // namespace cellblock::sandbox::detail
