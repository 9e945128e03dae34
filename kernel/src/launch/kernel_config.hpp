// The kernel's own configuration: `--config FILE` (JSON) plus the per-kernel environment overrides the
// gateway sets. Relative paths in the file resolve against the file's directory.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "cellblock/contract/limits.hpp"

namespace cellblock::kernel {

class ConfigError : public std::runtime_error {
  public:
    using std::runtime_error::runtime_error;
};

// Every duration the kernel takes (its config file, its environment, a request's metadata) and every memory
// limit is within the ceilings the gateway checks with (contract/include/cellblock/contract/limits.hpp).
inline constexpr double longest_seconds = contract::longest_duration_s;
using contract::largest_memory_mb;

// A zygote tenant names files under the sandbox's state_dir: at most this many of A-Z a-z 0-9 . _ -. That is
// 64 for a store tenant's name plus the gateway's "t<8 hex>_" before it
// (gateway/src/kernels/kernel_manager.cpp).
inline constexpr std::size_t longest_tenant_name = 74;

struct ExecutionLimits {
    double timeout_s = 600;                // wall clock per execute; 0 = none
    double interrupt_grace_s = 2;          // after the timeout's SIGINT, kill the worker if it is still busy
    std::uint64_t output_bytes = 1 << 20;  // published output per execute; 0 = unlimited
    std::uint64_t memory_mb = 2048;        // the worker sandbox's memory limit; 0 = none
};

// The worker zygote (sandbox/README.md "Worker zygote"): workers forked from a preloaded template shared by
// the sessions of one tenant. On unless worker.zygote is false, where a tenant is named (the gateway names
// one for every kernel it starts); every failure falls back to exec.
struct ZygoteConfig {
    bool enabled = true;            // worker.zygote
    bool supervised = false;        // CELLBLOCK_ZYGOTE_SUPERVISED=1: a template service starts the template
    std::string tenant;             // worker.zygote_tenant, overridden by CELLBLOCK_ZYGOTE_TENANT
    std::filesystem::path library;  // worker.zygote_library: host path of libcellblock_zygote.so
    // What a template this kernel starts imports before forking (worker.zygote_preload, module names), and
    // after how many forks or seconds it retires (worker.zygote_generation_forks / _seconds). Unset: the
    // template's defaults (cellblock_runtime/zygote.py). The template service reads them from the same
    // config; without a service, whichever of the tenant's kernels finds no template starts it, so those
    // should agree.
    std::optional<std::vector<std::string>> preload;
    std::optional<unsigned> generation_forks;
    std::optional<double> generation_seconds;
    bool active() const noexcept { return enabled && !tenant.empty(); }
    // The CELLBLOCK_ZYGOTE_* variables that tell a template these settings.
    std::vector<std::string> template_environment() const;
};

struct KernelConfig {
    std::filesystem::path python = "/usr/bin/python3";
    std::filesystem::path worker_script;             // host path of cellblock_worker.py
    double worker_start_timeout_s = 60;              // a worker must report ready within this
    std::filesystem::path sandbox_policy;            // host path of the sandbox policy JSON
    std::filesystem::path workspace_root;            // where private workspaces are created
    std::optional<std::filesystem::path> workspace;  // CELLBLOCK_WORKSPACE: use this directory as is
    ExecutionLimits limits;
    // The session's network policy (CELLBLOCK_NETWORK_POLICY: a JSON object, checked in detail by
    // egress::EgressPolicy::parse) and the operator's pinned names (CELLBLOCK_EGRESS_HOSTS: a hosts(5)
    // file). No policy (unset or empty) = no network at all: workers get no listener and no inet sockets.
    std::optional<nlohmann::json> network_policy;
    std::optional<std::filesystem::path> egress_hosts;
    ZygoteConfig zygote;

    // Reads `file`, then applies CELLBLOCK_WORKSPACE, CELLBLOCK_TIMEOUT_S, CELLBLOCK_MEMORY_MB,
    // CELLBLOCK_OUTPUT_BYTES, CELLBLOCK_NETWORK_POLICY, CELLBLOCK_EGRESS_HOSTS and CELLBLOCK_ZYGOTE_TENANT
    // from `environment`.
    // Throws ConfigError naming the file and the field.
    using EnvironmentLookup = std::function<std::optional<std::string>(const std::string&)>;
    static KernelConfig load(const std::filesystem::path& file, const EnvironmentLookup& environment);
    static EnvironmentLookup process_environment();
};

}  // namespace cellblock::kernel
