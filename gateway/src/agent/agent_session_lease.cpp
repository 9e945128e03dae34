#include <boost/asio/post.hpp>

#include "cellblock/gateway/agent/agent_session.hpp"

// AgentSession's execute lease: on a shared store other gateways serve the same session, and one execute at a
// time runs across all of them. The rest of AgentSession: agent_session.cpp.

namespace cellblock::gateway::agent {

namespace {
// How soon a refused execute lease is asked for again: the store failed; another gateway holds it (no
// release heard: no listening connection, or the release came while asking); another gateway holds it and
// its release will be heard (a fallback for a lost notification).
constexpr std::chrono::milliseconds store_retry{200};
constexpr std::chrono::milliseconds lease_retry{10};
constexpr std::chrono::milliseconds unheard_release_retry{500};

// Releases a lease of this gateway on the store's reader thread, once the writes queued under it are
// committed: another gateway's taking would fence them off. Queued behind this gateway's earlier lease calls
// (one reader thread, in order): never overtakes the try_lease that took it. Leases are counted per
// connection (PostgreSQL advisory locks), so every lease taken is released exactly once. `queued` is called
// once the release is on the reader thread's queue: a taking asked after that runs after it. A release
// `withdrawn` before the writes are committed is not sent: the lease stays this gateway's.
void release_lease_later(StoreWriter& writer, const std::string& lease,
                         std::function<void()> queued = nullptr,
                         std::shared_ptr<const bool> withdrawn = nullptr) {
    writer.after_pending([&writer, lease, queued = std::move(queued), withdrawn = std::move(withdrawn)] {
        if (withdrawn && *withdrawn) {
            if (queued)
                queued();
            return;
        }
        writer.read<bool>(
            [lease](SessionStore& store) {
                store.release_lease(lease);
                return true;
            },
            StoreWriter::default_read_limit, [](const StoreAnswer<bool>&) {});
        if (queued)
            queued();
    });
}
}  // namespace

void AgentSession::with_execute_lease(std::chrono::steady_clock::time_point give_up,
                                      std::function<void(std::optional<std::string> unavailable)> then) {
    if (holds_execute_lease_ || !services_.writer.shared())
        return then(std::nullopt);  // an embedded store has this gateway alone: every lease is granted
    const auto now = std::chrono::steady_clock::now();
    if (now >= give_up)
        return then(std::string("the store did not answer within the execute's time limit"));
    if (unsent_release_)
        return keep_execute_lease(give_up, std::move(then));
    const auto limit = std::chrono::duration_cast<std::chrono::milliseconds>(give_up - now);
    std::weak_ptr<AgentSession> weak = weak_from_this();
    if (lease_releases_pending_ > 0)
        return wait_for_lease_release(give_up, std::move(then));
    const std::string lease = "agent-session:" + record_.id;
    // Listening before asking: a release between the refusal and its answer here is not missed.
    lease_release_heard_ = false;
    if (!lease_wakeup_armed_ && services_.writer.hears_lease_releases()) {
        lease_wakeup_armed_ = true;
        services_.writer.when_lease_released(lease, [weak] {
            if (auto self = weak.lock()) {
                self->lease_wakeup_armed_ = false;
                self->lease_release_heard_ = true;
                self->services_.logger.debug("execute_lease_release_heard", {{"session", self->id()}});
                self->retry_execute_lease_now();
            }
        });
    }
    services_.logger.debug("execute_lease_asked", {{"session", id()}});
    // On the store's reader thread with a deadline; a lease it takes after the deadline is released there.
    services_.writer.read<std::optional<std::int64_t>>(
        [lease](SessionStore& store) { return store.try_lease(lease); }, limit,
        [weak, give_up, patience = give_up - now, lease, &writer = services_.writer,
         then = std::move(then)](StoreAnswer<std::optional<std::int64_t>> answer) mutable {
            auto self = weak.lock();
            if (!self) {
                if (answer.ok() && *answer.value)
                    release_lease_later(writer, lease);  // the session went while its lease was asked for
                return;
            }
            if (answer.ok() && *answer.value) {
                self->holds_execute_lease_ = true;
                self->execute_lease_token_ = **answer.value;
                return then(std::nullopt);
            }
            if (!answer.ok())
                self->services_.logger.warn("execute_lease_failed",
                                            {{"session", self->id()}, {"error", answer.error}});
            // Another gateway runs an execute of this session now (asked again once it lets go of the lease,
            // as long as it takes), or the store failed (retried until the execute's limit, then 503
            // store_unavailable).
            if (!answer.ok() && std::chrono::steady_clock::now() + store_retry >= give_up)
                return then("the store is unavailable: " + answer.error);
            self->ask_for_execute_lease_again(answer.ok(), give_up, patience, std::move(then));
        },
        [&writer = services_.writer, lease](std::optional<std::int64_t> taken_late) {
            if (taken_late)
                release_lease_later(writer, lease);
        });
}

void AgentSession::keep_execute_lease(std::chrono::steady_clock::time_point give_up,
                                      std::function<void(std::optional<std::string>)> then) {
    // The previous execute's release still waits for its writes to commit. If this gateway's connection holds
    // the lease still (one round trip, no commit waited for), the release is withdrawn and the lease kept
    // with its token; else (the connection broke, or the release went out meanwhile) it is asked for as
    // usual. Another gateway gets the lease once a release goes out with no next execute asking meanwhile.
    std::weak_ptr<AgentSession> weak = weak_from_this();
    const auto limit =
        std::chrono::duration_cast<std::chrono::milliseconds>(give_up - std::chrono::steady_clock::now());
    services_.writer.read<bool>(
        [lease = "agent-session:" + record_.id](SessionStore& store) { return store.holds_lease(lease); },
        limit,
        [weak, give_up, withdrawal = unsent_release_,
         then = std::move(then)](StoreAnswer<bool> held) mutable {
            auto self = weak.lock();
            if (!self)
                return;
            // A token known lost is never kept (its writes would all be refused).
            if (held.ok() && *held.value && self->unsent_release_ == withdrawal &&
                !self->holds_execute_lease_ && self->execute_lease_token_ > self->lost_lease_token_) {
                *std::exchange(self->unsent_release_, nullptr) = true;
                self->holds_execute_lease_ = true;
                self->services_.logger.debug("execute_lease_kept", {{"session", self->id()}});
                return then(std::nullopt);
            }
            if (self->unsent_release_ == withdrawal)
                self->unsent_release_ = nullptr;  // not held: never withdrawn
            self->with_execute_lease(give_up, std::move(then));
        });
}

void AgentSession::ask_for_execute_lease_again(bool answered, std::chrono::steady_clock::time_point give_up,
                                               std::chrono::steady_clock::duration patience,
                                               std::function<void(std::optional<std::string>)> then) {
    std::weak_ptr<AgentSession> weak = weak_from_this();
    // After a refusal the store answered, the next attempt gets the same patience again.
    execute_lease_retry_ = [weak, answered, give_up, patience, then = std::move(then)]() mutable {
        if (auto again = weak.lock())
            again->with_execute_lease(answered ? std::chrono::steady_clock::now() + patience : give_up,
                                      std::move(then));
    };
    // A refusal is asked again when the holder's release is heard; the timer is for a release not heard.
    // Without a listening connection (or when the release came while asking) it is the short one.
    const bool wait_for_release = services_.writer.hears_lease_releases() && !lease_release_heard_;
    lease_timer_.expires_after(!answered          ? store_retry
                               : wait_for_release ? unheard_release_retry
                                                  : lease_retry);
    lease_timer_.async_wait([weak](const boost::system::error_code& error) {
        if (auto self = weak.lock(); self && !error)
            self->retry_execute_lease_now();
    });
}

void AgentSession::wait_for_lease_release(std::chrono::steady_clock::time_point give_up,
                                          std::function<void(std::optional<std::string>)> then) {
    // Asked again once this gateway's own release is queued (release_execute_lease), or at the execute's
    // limit (a store that does not commit the writes before it: then 503 store_unavailable).
    std::weak_ptr<AgentSession> weak = weak_from_this();
    execute_lease_retry_ = [weak, give_up, then = std::move(then)]() mutable {
        if (auto again = weak.lock())
            again->with_execute_lease(give_up, std::move(then));
    };
    lease_timer_.expires_at(give_up);
    lease_timer_.async_wait([weak](const boost::system::error_code& error) {
        if (auto self = weak.lock(); self && !error)
            self->retry_execute_lease_now();
    });
}

void AgentSession::retry_execute_lease_now() {
    if (auto retry = std::exchange(execute_lease_retry_, nullptr)) {
        lease_timer_.cancel();
        retry();
    }
}

void AgentSession::release_execute_lease() {
    if (!std::exchange(holds_execute_lease_, false) || !services_.writer.shared())
        return;
    ++lease_releases_pending_;
    auto withdrawn = std::make_shared<bool>(false);
    unsent_release_ = withdrawn;
    release_lease_later(
        services_.writer, "agent-session:" + record_.id,
        [weak = weak_from_this(), withdrawn] {
            if (auto self = weak.lock()) {
                --self->lease_releases_pending_;
                if (self->unsent_release_ == withdrawn)
                    self->unsent_release_ = nullptr;  // sent: too late to withdraw
                self->retry_execute_lease_now();
            }
        },
        withdrawn);
}

void AgentSession::submit_under_execute_lease(FencedWrite write) {
    // Fenced by the newest taking's token even when that lease is known lost (execute_lease_lost): the rest
    // of the execute that ran under it is refused too.
    std::optional<LeaseFence> fence;
    if (execute_lease_token_ != 0 && services_.writer.shared())
        fence = LeaseFence{"agent-session:" + record_.id, execute_lease_token_};
    services_.writer.submit([weak = weak_from_this(), &io = services_.io, fence = std::move(fence),
                             write = std::move(write)](SessionStore& store) {
        if (write(store, fence) || !fence)
            return;
        boost::asio::post(io, [weak, token = fence->token] {
            if (auto self = weak.lock())
                self->execute_lease_lost(token);
        });
    });
}

void AgentSession::execute_lease_lost(std::int64_t token) {
    // One line per lost taking, however many of its writes were refused (a batch retried after a dropped
    // connection refuses them again).
    if (token <= lost_lease_token_)
        return;
    lost_lease_token_ = token;
    services_.logger.warn("lease_lost",
                          {{"session", id()}, {"lease", "agent-session:" + record_.id}, {"token", token}});
    // Still believed held (the execute runs on): the next execute asks for the lease again. The unlock is
    // harmless when the store has let go of it already.
    if (holds_execute_lease_ && execute_lease_token_ == token)
        release_execute_lease();
    if (execute_lease_token_ == token)
        unsent_release_ = nullptr;  // a lost lease is asked for again, never kept
}

std::chrono::steady_clock::time_point AgentSession::store_give_up(const Pending& pending) const {
    return std::chrono::steady_clock::now() + std::min(seconds_to_ms(time_limit_of(pending.request)),
                                                       std::chrono::milliseconds(lease_store_limit));
}

}  // namespace cellblock::gateway::agent
