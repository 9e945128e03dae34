#include <algorithm>
#include <chrono>
#include <utility>

#include "cellblock/gateway/common/time_format.hpp"
#include "cellblock/gateway/kernels/kernel_manager.hpp"

// KernelManager: culling idle kernels (--cull-idle-timeout; on a shared store by the cull-leader alone, from
// the activity every gateway records) and the 200 ms housekeeping sweep (progress, shared activity, leases).

namespace cellblock::gateway {

void KernelManager::flush_progress() {
    for (const auto& kernel : live_kernels())
        if (auto progress = kernel->take_progress())
            writer_.submit([id = kernel->id(), last = *progress](SessionStore& store) {
                store.set_kernel_progress(id, last);
            });
}

void KernelManager::housekeeping() {
    flush_progress();
    if (writer_.store().shared() && config_.cull_idle_timeout > 0)
        share_activity();
    const auto now = std::chrono::steady_clock::now();
    if (config_.orphan_timeout > 0 && now >= next_lease_renewal_) {
        for (const auto& kernel : live_kernels())
            kernel->renew_lease();
        next_lease_renewal_ = now + std::chrono::milliseconds(static_cast<long long>(
                                        std::clamp(config_.orphan_timeout / 4, 0.2, 30.0) * 1000));
    }
}

void KernelManager::share_activity() {
    const auto now = std::chrono::system_clock::now();
    std::erase_if(activity_shared_, [this](const auto& entry) { return !kernels_.contains(entry.first); });
    for (const auto& [id, kernel] : kernels_) {
        auto active = kernel->last_activity();
        // Kept in use by what the cull rules spare (connected clients, running code): recorded as active now.
        if ((kernel->connections() > 0 && !config_.cull_connected) ||
            (kernel->state() == KernelState::busy && !config_.cull_busy))
            active = now;
        auto& shared = activity_shared_[id];
        if (active - shared < std::chrono::seconds(1))
            continue;
        shared = active;
        writer_.submit([id = id, when = format_iso8601_utc(active)](SessionStore& store) {
            store.set_kernel_activity(id, when);
        });
    }
}

void KernelManager::cull_shared() {
    for (const auto& [id, kernel] : kernels_)
        kernel->expire_detached_sessions();
    if (cull_read_pending_)
        return;  // the store has not answered the previous sweep yet
    cull_read_pending_ = true;
    // The cull-leader lease and every kernel's record, read together on the store's reader thread.
    struct Sweep {
        bool leader = false;
        std::vector<KernelRecord> records;
    };
    writer_.read<Sweep>(
        [was_leader = cull_leader_](SessionStore& store) {
            Sweep sweep{was_leader || store.try_lease("cull-leader").has_value(), {}};
            if (sweep.leader)
                sweep.records = store.kernels();
            return sweep;
        },
        std::chrono::milliseconds(static_cast<long long>(std::max(1.0, config_.cull_interval) * 1000)),
        [this](StoreAnswer<Sweep> answer) {
            cull_read_pending_ = false;
            if (!answer.ok())
                return logger_.error("store_read_failed",
                                     {{"lease", "cull-leader"}, {"error", answer.error}});
            if (answer.value->leader && !std::exchange(cull_leader_, true))
                logger_.info("cull_leader", {{"owner", owner_}});
            if (cull_leader_ && !stopping_)
                cull_recorded(answer.value->records);
        },
        [this](const Sweep& late) {
            cull_read_pending_ = false;
            if (late.leader && !std::exchange(cull_leader_, true))
                logger_.info("cull_leader", {{"owner", owner_}});  // kept: the next sweep culls
        });
}

void KernelManager::cull_recorded(const std::vector<KernelRecord>& records) {
    const auto now = std::chrono::system_clock::now();
    const auto idle_limit =
        std::chrono::milliseconds(static_cast<long long>(config_.cull_idle_timeout * 1000));
    for (const KernelRecord& record : records) {
        if (record.pooled || shut_down_here_.contains(record.id))
            continue;
        auto active = parse_iso8601_utc(record.last_activity).value_or(now);  // unknown: not idle
        if (auto held = find(record.id)) {
            if (held->connections() > 0 && !config_.cull_connected)
                continue;
            if (held->state() == KernelState::busy && !config_.cull_busy)
                continue;
            active = std::max(active, held->last_activity());
        }
        if (now - active < idle_limit)
            continue;
        auto kernel = attach_stored(record.id, record);
        if (!kernel)
            continue;  // not running: its own gateway forgets it
        const auto idle_seconds = std::chrono::duration_cast<std::chrono::seconds>(now - active).count();
        logger_.info("kernel_culled", {{"kernel_id", record.id}, {"idle_seconds", idle_seconds}});
        kernel->notify_clients("[cellblock-gateway] kernel " + record.id + " is being shut down after " +
                               std::to_string(idle_seconds) + " s of inactivity (cull_idle_timeout)\n");
        shutdown_kernel(record.id,
                        "kernel culled after " + std::to_string(idle_seconds) + " s of inactivity");
    }
}

void KernelManager::cull() {
    if (writer_.shared())
        return cull_shared();
    const auto now = std::chrono::system_clock::now();
    const auto idle_limit =
        std::chrono::milliseconds(static_cast<long long>(config_.cull_idle_timeout * 1000));
    std::vector<std::string> victims;
    for (const auto& [id, kernel] : kernels_) {
        kernel->expire_detached_sessions();
        if (now - kernel->last_activity() < idle_limit)
            continue;
        if (kernel->connections() > 0 && !config_.cull_connected)
            continue;
        if (kernel->state() == KernelState::busy && !config_.cull_busy)
            continue;
        victims.push_back(id);
    }
    for (const std::string& id : victims) {
        auto kernel = find(id);
        const auto idle_seconds =
            std::chrono::duration_cast<std::chrono::seconds>(now - kernel->last_activity()).count();
        logger_.info("kernel_culled", {{"kernel_id", id}, {"idle_seconds", idle_seconds}});
        // Tell connected clients why the kernel is about to disappear (Kernel Gateway culls silently).
        kernel->notify_clients("[cellblock-gateway] kernel " + id + " is being shut down after " +
                               std::to_string(idle_seconds) + " s of inactivity (cull_idle_timeout)\n");
        shutdown_kernel(id, "kernel culled after " + std::to_string(idle_seconds) + " s of inactivity");
    }
}

}  // namespace cellblock::gateway
