// `cellblock-kernel --template-service --config FILE`: one tenant's worker zygote template (the tenant named
// by CELLBLOCK_ZYGOTE_TENANT, as for a kernel), supervised. The gateway runs one per tenant that has kernels
// on this host (gateway/src/kernels/template_services.cpp) and stops it after the tenant's last kernel;
// kernels started with CELLBLOCK_ZYGOTE_SUPERVISED=1 then never start a template themselves.
//
// The service starts the template in a cgroup of its own (the sandbox policy's limits), becomes its parent
// (PR_SET_CHILD_SUBREAPER), copies its log lines to <state_dir>/zygote-<tenant>.log and starts the next
// generation when one retires (200 forks or an hour, cellblock_runtime/zygote.py). It stops on SIGTERM or
// SIGINT, or when the process that started it ends: a typed retire request to the template, a short wait for
// its end, then SIGKILL. Forked workers are not in the template's cgroup and go on. When it ends it leaves
// nothing of the tenant's templates in <state_dir>: not their socket, workspace, root skeleton
// (sandbox::Template) nor its log.
#pragma once

#include <filesystem>

namespace cellblock::kernel {

// The exit status when the config switches the zygote off or names no tenant: nothing to supervise.
inline constexpr int template_service_off = 3;

int run_template_service(const std::filesystem::path& config_file);

}  // namespace cellblock::kernel
