#include "cellblock/gateway/access/tenant_quotas.hpp"

#include "cellblock/gateway/access/tenants.hpp"
#include "cellblock/gateway/kernels/kernel_manager.hpp"

namespace cellblock::gateway {

using nlohmann::json;

nlohmann::json TenantUsage::to_json() const {
    return {{"sessions", sessions}, {"memory_mb", memory_mb}, {"executes", executes}};
}

void TenantHoldings::merge(const TenantHoldings& other) {
    sessions.insert(other.sessions.begin(), other.sessions.end());
    ended.insert(other.ended.begin(), other.ended.end());
    kernels.insert(other.kernels.begin(), other.kernels.end());
    session_kernels.insert(other.session_kernels.begin(), other.session_kernels.end());
    executes += other.executes;
}

TenantUsage TenantHoldings::usage(std::int64_t kernel_memory_mb) const {
    TenantUsage usage{0, 0, executes};
    for (const auto& [id, memory_mb] : sessions)
        if (!ended.contains(id)) {
            ++usage.sessions;
            usage.memory_mb += memory_mb;
        }
    for (const std::string& kernel : kernels)
        if (!session_kernels.contains(kernel)) {
            ++usage.sessions;
            usage.memory_mb += kernel_memory_mb;
        }
    return usage;
}

namespace {

std::string string_field(const json& record, const char* name) {
    auto found = record.find(name);
    return found != record.end() && found->is_string() ? found->get<std::string>() : std::string();
}

// What the store records of `tenant` through every gateway (reader thread). A deleted session's kernel stays
// its session's: a kernel record outlives the deletion until the kernel has stopped, and must not count then.
TenantHoldings stored_holdings(SessionStore& store, const std::string& tenant,
                               std::int64_t kernel_memory_mb) {
    TenantHoldings stored;
    for (const json& record : store.agent_sessions()) {
        if (!record.is_object() || string_field(record, "tenant") != tenant)
            continue;
        const std::string id = string_field(record, "id");
        if (const std::string kernel = string_field(record, "kernel_id"); !kernel.empty())
            stored.session_kernels.insert(kernel);
        if (record.value("deleted", false)) {
            stored.ended.insert(id);
            continue;
        }
        const json limits = record.value("limits", json::object());
        stored.sessions[id] =
            limits.is_object() && limits.contains("memory_mb") && limits["memory_mb"].is_number_unsigned()
                ? limits["memory_mb"].get<std::int64_t>()
                : kernel_memory_mb;
    }
    for (const KernelRecord& kernel : store.kernels())
        if (kernel.tenant == tenant && !kernel.pooled)
            stored.kernels.insert(kernel.id);
    return stored;
}

}  // namespace

TenantQuotas::TenantQuotas(const TenantDirectory& tenants, const KernelManager& kernels, StoreWriter& writer,
                           std::int64_t kernel_memory_mb)
    : tenants_(tenants), writer_(writer), kernel_memory_mb_(kernel_memory_mb) {
    kernels_only_ = [&kernels](const std::string& tenant) {
        TenantHoldings held;
        for (const auto& kernel : kernels.list())
            if (kernel->tenant() == tenant)
                held.kernels.insert(kernel->id());
        return held;
    };
    count_ = kernels_only_;
}

void TenantQuotas::usage_everywhere(const std::string& tenant,
                                    std::function<void(StoreAnswer<TenantUsage>)> then) const {
    if (!writer_.shared())
        return then({usage(tenant), {}});
    writer_.read<TenantHoldings>(
        [tenant, memory_mb = kernel_memory_mb_](SessionStore& store) {
            return stored_holdings(store, tenant, memory_mb);
        },
        StoreWriter::default_read_limit,
        [this, tenant, then = std::move(then)](StoreAnswer<TenantHoldings> stored) {
            if (!stored.ok())
                return then({std::nullopt, stored.error});
            // Counted when the answer is here: what this gateway started meanwhile counts too.
            TenantHoldings everywhere = count_(tenant);
            everywhere.merge(*stored.value);
            then({everywhere.usage(kernel_memory_mb_), {}});
        });
}

void TenantQuotas::admit_session(const Principal& principal, std::int64_t memory_mb, Admitted then) const {
    if (principal.is_operator())
        return then(std::nullopt);
    const TenantQuota& quota = tenants_.get(principal.tenant).quota;
    if (!quota.sessions && !quota.memory_mb)
        return then(std::nullopt);
    usage_everywhere(principal.tenant, [this, tenant = principal.tenant, memory_mb,
                                        then = std::move(then)](StoreAnswer<TenantUsage> now) {
        if (!now.ok())
            return then(HttpError(http::status::service_unavailable, "the store did not answer: " + now.error,
                                  "store_unavailable"));
        try {
            check(tenant, *now.value, {1, memory_mb, 0});
        } catch (const QuotaExceeded& exceeded) {
            return then(HttpError(http::status::too_many_requests, exceeded.what(), "quota_exceeded"));
        } catch (const TenantRequestError& removed) {
            // Removed while the store answered: its token is refused from now on, and so is this.
            return then(HttpError(http::status::not_found, removed.what(), removed.reason()));
        }
        then(std::nullopt);
    });
}

void TenantQuotas::admit(const Principal& principal, const TenantUsage& adding) const {
    if (principal.is_operator())
        return;
    check(principal.tenant, usage(principal.tenant), adding);
}

void TenantQuotas::check(const std::string& tenant, const TenantUsage& now, const TenantUsage& adding) const {
    const TenantQuota& quota = tenants_.get(tenant).quota;
    auto past = [&tenant](const std::optional<std::int64_t>& limit, std::int64_t used, std::int64_t added,
                          const char* what) {
        if (added > 0 && limit && used + added > *limit)
            throw QuotaExceeded("tenant " + tenant + " has " + std::to_string(used) + " of " +
                                std::to_string(*limit) + " " + what);
    };
    past(quota.sessions, now.sessions, adding.sessions, "sessions");
    past(quota.memory_mb, now.memory_mb, adding.memory_mb, "MB of memory");
    past(quota.executes, now.executes, adding.executes, "executes running");
}

}  // namespace cellblock::gateway
