// A tenant's worker zygote template, from the host's side (sandbox/README.md "Worker zygote"): where it
// listens, how one is started, how it is told to retire. Used by the template service
// (launch/template_service.cpp, the supervised way: the gateway runs one per tenant) and by a kernel that
// runs without a supervisor, which starts its tenant's template itself when it finds none (an flock election
// between that tenant's kernels).
#pragma once

#include <cellblock/sandbox/sandbox.hpp>
#include <chrono>
#include <filesystem>
#include <string>
#include <vector>

namespace cellblock::kernel {

// Where the worker runtime directory appears inside the sandbox.
inline constexpr const char* worker_dir_inside = "/opt/cellblock/worker";

struct TemplateSpec {
    std::string tenant;                             // a plain name (KernelConfig checks it)
    std::filesystem::path library;                  // host path of libcellblock_zygote.so
    std::vector<std::string> template_environment;  // CELLBLOCK_ZYGOTE_* (preload, generation)
};

// <state_dir>/zygote-<tenant>.sock, <state_dir>/zygote-<tenant>.log
std::filesystem::path template_socket(const sandbox::Launcher& launcher, const std::string& tenant);
std::filesystem::path template_log(const sandbox::Launcher& launcher, const std::string& tenant);

// The sandbox policy every worker (and so its template) is launched with: the policy file's, with the worker
// runtime directory (the script's) bound read-only at worker_dir_inside.
sandbox::Policy worker_policy(const std::filesystem::path& policy_file, const std::filesystem::path& script);

// The worker's argv and environment, as every launch of this worker script (and so its template) has them.
std::vector<std::string> worker_argv(const std::filesystem::path& python,
                                     const std::filesystem::path& script);
std::vector<std::string> worker_base_environment();

// Whether something listens on the template socket (a refused or missing socket is a dead template).
bool template_listens(const std::filesystem::path& socket_path);

// Starts the tenant's template now on a fresh socket, its output to `log_fd`, in a cgroup of its own when
// `limits` is set. `publish`: the socket is renamed over the tenant's at once; otherwise it stays under
// `pending_socket` until publish_template, which the template service calls when the template says it serves,
// so that no launch waits on a template still preparing (or one that never will serve). Throws
// std::runtime_error (or sandbox::SandboxError) naming the step.
struct StartedTemplate {
    sandbox::Template process;
    std::filesystem::path pending_socket;  // empty once published
};
StartedTemplate start_template(sandbox::Launcher& launcher, const TemplateSpec& spec,
                               const std::vector<std::string>& argv,
                               const std::vector<std::string>& environment, int log_fd,
                               std::optional<sandbox::ResourceLimits> limits, bool publish);
void publish_template(const std::filesystem::path& pending_socket, const std::filesystem::path& socket_path);

// The typed retire request (cellblock_runtime/zygote.py): the template stops listening, its live workers go
// on, and it exits after the last one. False when nothing listens or it did not confirm within `timeout`.
bool request_retire(const std::filesystem::path& socket_path, std::chrono::milliseconds timeout);

// A kernel without a supervisor: starts the tenant's template unless one listens or another kernel is
// starting it (flock on <state_dir>/zygote-<tenant>.lock). Returns what happened, for the fallback's log
// line.
std::string start_template_if_dead(sandbox::Launcher& launcher, const TemplateSpec& spec,
                                   const std::vector<std::string>& argv,
                                   const std::vector<std::string>& environment);

}  // namespace cellblock::kernel
