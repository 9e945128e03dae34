#include "cellblock/gateway/tenant_quotas.hpp"

#include "cellblock/gateway/kernel_manager.hpp"
#include "cellblock/gateway/tenants.hpp"

namespace cellblock::gateway {

nlohmann::json TenantUsage::to_json() const {
    return {{"sessions", sessions}, {"memory_mb", memory_mb}, {"executes", executes}};
}

TenantQuotas::TenantQuotas(const TenantDirectory& tenants, const KernelManager& kernels,
                           std::int64_t kernel_memory_mb)
    : tenants_(tenants), kernel_memory_mb_(kernel_memory_mb) {
    kernels_only_ = [&kernels, kernel_memory_mb](const std::string& tenant) {
        TenantUsage usage;
        for (const auto& kernel : kernels.list())
            if (kernel->tenant() == tenant) {
                ++usage.sessions;
                usage.memory_mb += kernel_memory_mb;
            }
        return usage;
    };
    count_ = kernels_only_;
}

void TenantQuotas::admit(const Principal& principal, const TenantUsage& adding) const {
    if (principal.is_operator())
        return;
    const TenantQuota& quota = tenants_.get(principal.tenant).quota;
    const TenantUsage now = count_(principal.tenant);
    auto check = [&principal](const std::optional<std::int64_t>& limit, std::int64_t used, std::int64_t added,
                              const char* what) {
        if (added > 0 && limit && used + added > *limit)
            throw QuotaExceeded("tenant " + principal.tenant + " has " + std::to_string(used) + " of " +
                                std::to_string(*limit) + " " + what);
    };
    check(quota.sessions, now.sessions, adding.sessions, "sessions");
    check(quota.memory_mb, now.memory_mb, adding.memory_mb, "MB of memory");
    check(quota.executes, now.executes, adding.executes, "executes running");
}

}  // namespace cellblock::gateway
