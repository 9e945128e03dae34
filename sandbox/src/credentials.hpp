// Credentials: the program runs as the inside uid/gid with no capabilities, an empty bounding set,
// no supplementary groups and NO_NEW_PRIVS. These are the last steps before seccomp and execve.
#pragma once

#include "child.hpp"

namespace cellblock::sandbox::detail {

void plan_credentials(uid_t inside_uid, StepNames& steps, ChildPlan& plan);
// Child side (async-signal-safe); returns false with *failed_step set on error (errno set).
bool drop_privileges(const ChildPlan& plan, int* failed_step) noexcept;

}  // namespace cellblock::sandbox::detail
