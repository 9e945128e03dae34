// Resource limits applied with setrlimit in the child (values clamped to what this process may set).
#pragma once

#include "cellblock/sandbox/sandbox.hpp"
#include "child.hpp"

namespace cellblock::sandbox::detail {

void plan_rlimits(const ResourceLimits& limits, StepNames& steps, ChildPlan& plan);

}  // namespace cellblock::sandbox::detail
