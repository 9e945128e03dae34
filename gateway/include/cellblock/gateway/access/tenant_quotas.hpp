#pragma once
// Tenants' quotas, enforced in one place for every transport: before a session or kernel starts for a tenant
// and before one of its executes is queued, `TenantQuotas` compares what the tenant uses now plus what the
// request adds with the tenant's quota (TenantDirectory). The operator has no quota. Counted:
// - sessions: agent sessions and Kernel Gateway kernels alive at once (an agent session's kernel is the
//   session); on a shared store, through every gateway (what the store records, with what this gateway
//   holds);
// - memory_mb: the sum of their memory limits, counted as sessions are;
// - executes: executes running or queued at once through this gateway (queues are each gateway's own).
// What runs already is never touched: a lowered quota refuses only what comes next.
#include <cstdint>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>

#include "cellblock/gateway/access/principal.hpp"
#include "cellblock/gateway/http/router.hpp"
#include "cellblock/gateway/store/store_writer.hpp"

namespace cellblock::gateway {

class KernelManager;
class TenantDirectory;

struct TenantUsage {
    std::int64_t sessions = 0, memory_mb = 0, executes = 0;
    nlohmann::json to_json() const;
};

// What a tenant holds, by id, so that two views of it (this gateway's and the store's) merge without counting
// a session twice, also when one view has it as an agent session and the other only as its kernel.
struct TenantHoldings {
    std::map<std::string, std::int64_t> sessions;  // agent sessions: id -> memory limit (MB)
    std::set<std::string> ended;                   // agent sessions the store records deleted
    std::set<std::string> kernels;                 // the tenant's kernels, agent sessions' ones included
    std::set<std::string> session_kernels;         // the kernels of agent sessions (counted as their session)
    std::int64_t executes = 0;

    void merge(const TenantHoldings& other);
    // A kernel of no agent session counts `kernel_memory_mb`.
    TenantUsage usage(std::int64_t kernel_memory_mb) const;
};

// A request past a quota. Each layer answers it its own way: 429 {"reason": "quota_exceeded"} on REST, a tool
// error with that reason on MCP.
class QuotaExceeded : public std::runtime_error {
  public:
    using std::runtime_error::runtime_error;
};

class TenantQuotas {
  public:
    // What a tenant holds through this gateway; until the agent layer installs its count (AgentService), the
    // kernels held here.
    using HoldingsCount = std::function<TenantHoldings(const std::string& tenant)>;
    // nullopt: admitted; else the refusal to answer (429 quota_exceeded, 503 store_unavailable).
    using Admitted = std::function<void(std::optional<HttpError>)>;

    TenantQuotas(const TenantDirectory& tenants, const KernelManager& kernels, StoreWriter& writer,
                 std::int64_t kernel_memory_mb);

    // Installs the count (empty: back to the kernels held here).
    void count_holdings_with(HoldingsCount count) { count_ = count ? std::move(count) : kernels_only_; }
    // What a tenant uses through this gateway.
    TenantUsage usage(const std::string& tenant) const { return count_(tenant).usage(kernel_memory_mb_); }
    // What a tenant uses through every gateway: on a shared store, its sessions and kernels as the store
    // records them (read on the store's reader thread) merged with what is held here; `then` runs on the io
    // thread, with no value when the store did not answer in time.
    void usage_everywhere(const std::string& tenant,
                          std::function<void(StoreAnswer<TenantUsage>)> then) const;
    // Before a session or kernel of `memory_mb` starts: `then` gets nullopt when it fits `principal`'s
    // tenant's sessions and memory_mb quotas counted through every gateway, else the refusal ("tenant alice
    // has 10 of 10 sessions"). The operator, and a tenant without either quota, are answered at once.
    void admit_session(const Principal& principal, std::int64_t memory_mb, Admitted then) const;
    // Throws QuotaExceeded when `adding` would take `principal`'s tenant past one of its quotas counted
    // through this gateway (executes: they queue per gateway); returns for the operator and within quota.
    void admit(const Principal& principal, const TenantUsage& adding) const;
    // The memory a Kernel Gateway kernel counts (the default worker memory limit).
    std::int64_t kernel_memory_mb() const { return kernel_memory_mb_; }

  private:
    // Throws QuotaExceeded when `now` plus `adding` is past `tenant`'s quota.
    void check(const std::string& tenant, const TenantUsage& now, const TenantUsage& adding) const;

    const TenantDirectory& tenants_;
    StoreWriter& writer_;
    std::int64_t kernel_memory_mb_;
    HoldingsCount kernels_only_, count_;
};

}  // namespace cellblock::gateway
