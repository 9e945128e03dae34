#pragma once
// Tenants' quotas, enforced in one place for every transport: before a session or kernel starts for a tenant
// and before one of its executes is queued, `TenantQuotas::admit` compares what the tenant uses now plus what
// the request adds with the tenant's quota (TenantDirectory). The operator has no quota. Counted (issue 38):
// - sessions: agent sessions and Kernel Gateway kernels alive at once (an agent session's kernel is the
// session);
// - memory_mb: the sum of their memory limits;
// - executes: executes running or queued at once.
// What runs already is never touched: a lowered quota refuses only what comes next.
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>

#include "cellblock/gateway/principal.hpp"

namespace cellblock::gateway {

class KernelManager;
class TenantDirectory;

struct TenantUsage {
    std::int64_t sessions = 0, memory_mb = 0, executes = 0;
    nlohmann::json to_json() const;
};

// A request past a quota. Each layer answers it its own way: 429 {"reason": "quota_exceeded"} on REST, a tool
// error with that reason on MCP.
class QuotaExceeded : public std::runtime_error {
  public:
    using std::runtime_error::runtime_error;
};

class TenantQuotas {
  public:
    // What a tenant uses now; until the agent layer installs its count (AgentService), the kernels held here.
    using UsageCount = std::function<TenantUsage(const std::string& tenant)>;

    TenantQuotas(const TenantDirectory& tenants, const KernelManager& kernels, std::int64_t kernel_memory_mb);

    // Installs the count (empty: back to the kernels held here).
    void count_usage_with(UsageCount count) { count_ = count ? std::move(count) : kernels_only_; }
    TenantUsage usage(const std::string& tenant) const { return count_(tenant); }
    // Throws QuotaExceeded ("tenant alice has 10 of 10 sessions") when `adding` would take `principal`'s
    // tenant past one of its quotas; returns for the operator and within quota.
    void admit(const Principal& principal, const TenantUsage& adding) const;
    // The memory a Kernel Gateway kernel counts (the default worker memory limit).
    std::int64_t kernel_memory_mb() const { return kernel_memory_mb_; }

  private:
    const TenantDirectory& tenants_;
    std::int64_t kernel_memory_mb_;
    UsageCount kernels_only_, count_;
};

}  // namespace cellblock::gateway
