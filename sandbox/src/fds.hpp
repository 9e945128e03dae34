// File descriptors and environment: the program gets exactly stdin/stdout/stderr and the pass_fds
// (as 3, 4, ...); everything else is closed; its environment is explicit.
#pragma once

#include <string>
#include <vector>

#include "cellblock/sandbox/sandbox.hpp"
#include "child.hpp"

namespace cellblock::sandbox::detail {

void plan_fds(std::vector<int> sources, StepNames& steps, ChildPlan& plan);
// Child side; returns false with *failed_step set on error (errno set). *error_fd is updated to where
// the (CLOEXEC) error pipe now lives.
bool install_fds(const ChildPlan& plan, int* failed_step, int* error_fd) noexcept;

// policy environment overridden by the request's, by variable name.
std::vector<std::string> merge_environment(const std::vector<std::string>& base,
                                           const std::vector<std::string>& overrides);

}  // namespace cellblock::sandbox::detail
