#include <algorithm>
#include <chrono>

#include "cellblock/gateway/kernels/kernel_manager.hpp"

// KernelManager: the warm pool (kernels of the default kernelspec started ahead of requests, refilled after
// one is handed out). Which request it may serve and the hand-out itself are decided in start_kernel
// (kernel_manager.cpp).

namespace cellblock::gateway {

namespace {

// A kernel handed out from the pool is replaced after this pause, not at once: a kernel's start takes tens of
// ms of CPU, which on a small machine competes with the new session's WebSocket connect and first requests
// (tests/bench/README.md, "A warm create without the pool's refill beside it").
constexpr auto pool_refill_pause = std::chrono::milliseconds(100);

}  // namespace

bool KernelManager::pool_can_serve(const KernelSpec& spec, const KernelStartRequest& request) const {
    const auto& request_env = request.env;
    auto pool_spec = registry_.find(registry_.default_name());
    if (!pool_spec || pool_spec->directory != spec.directory)
        return false;
    // Pooled kernels have the spec's (or the gateway's default) network policy in their environment.
    if (request.network) {
        try {
            const NetworkSettings settings = config_.network_settings();
            if (kernel_policy_value(*request.network, settings) !=
                kernel_policy_value(spec_network(spec), settings))
                return false;
        } catch (const std::exception&) {
            return false;
        }
    }
    // A warm kernel already has its environment: only requests whose variables would not change it qualify.
    for (const auto& [name, value] : request_env) {
        const bool passed = name.starts_with("KERNEL_") ||
                            std::find(config_.env_whitelist.begin(), config_.env_whitelist.end(), name) !=
                                config_.env_whitelist.end();
        if (!passed)
            continue;
        if (std::find(config_.pool_ignored_env.begin(), config_.pool_ignored_env.end(), name) ==
            config_.pool_ignored_env.end())
            return false;
    }
    return true;
}

std::size_t KernelManager::pool_ready_count() const {
    return static_cast<std::size_t>(
        std::count_if(pool_.begin(), pool_.end(), [](const auto& k) { return k->ready(); }));
}

void KernelManager::refill_pool_soon() {
    if (pool_refill_pending_)
        return;
    pool_refill_pending_ = true;
    pool_refill_timer_.expires_after(pool_refill_pause);
    pool_refill_timer_.async_wait([this](const boost::system::error_code& timer_error) {
        if (!timer_error)  // else cancelled: refilled already, or the manager is stopping (or gone)
            refill_pool();
    });
}

void KernelManager::refill_pool() {
    if (pool_refill_pending_) {
        pool_refill_pending_ = false;
        pool_refill_timer_.cancel();
    }
    if (stopping_ || config_.warm_pool <= 0)
        return;
    auto spec = registry_.find(registry_.default_name());
    if (!spec)
        return;
    while (static_cast<int>(pool_.size()) < config_.warm_pool) {
        std::shared_ptr<Kernel> kernel;
        try {
            kernel = create_kernel(*spec, {});
        } catch (const std::exception& error) {
            logger_.error("pool_kernel_create_failed", {{"error", error.what()}});
            return;
        }
        pool_.push_back(kernel);
        std::weak_ptr<Kernel> weak = kernel;
        kernel->start([this, weak](std::optional<std::string> error) {
            auto started = weak.lock();
            if (!error) {
                pool_failures_ = 0;
                return;
            }
            logger_.warn("pool_kernel_failed", {{"error", *error}});
            if (started) {
                auto position = std::find(pool_.begin(), pool_.end(), started);
                if (position != pool_.end())
                    pool_.erase(position);
                started->shutdown("failed");
                forget(started->id());
            }
            // Back off so a broken kernelspec does not turn into a fork loop.
            ++pool_failures_;
            pool_retry_timer_.expires_after(
                std::chrono::seconds(std::min(30, 1 << std::min(pool_failures_, 5))));
            pool_retry_timer_.async_wait([this](const boost::system::error_code& timer_error) {
                if (!timer_error)
                    refill_pool();
            });
        });
        if (pool_failures_ > 0)
            break;  // one at a time while failing
    }
}

}  // namespace cellblock::gateway
