// Approvals: a session held until a person or a model decides (ApprovalBroker), one pending approval per host
// answering every session it holds, and what the decision does to the session.
#include <random>

#include "egress/egress_session.hpp"

namespace cellblock::kernel::egress {

namespace {

std::string new_approval_id() {
    std::random_device random;
    std::uniform_int_distribution<int> digit(0, 15);
    std::string id = "ap-";
    for (int i = 0; i < 16; ++i) {
        id += "0123456789abcdef"[digit(random)];
    }
    return id;
}

}  // namespace

void EgressProxy::Impl::request_approval(const std::string& host, std::uint16_t port,
                                         const std::string& method,
                                         std::function<void(Decision, const std::string&)> waiter) {
    auto& entry = pending[host];
    if (!entry) {
        entry = std::make_shared<PendingApproval>(io);
        entry->request = {new_approval_id(), host, port, method};
        entry->timer.expires_after(policy.approval_timeout());
        // Neither the timer nor the broker's callback owns the approval: the callback may outlive the
        // proxy (a broker keeps it), and nothing of the io_context may be destroyed after it.
        entry->timer.async_wait([this, weak_entry = std::weak_ptr(entry)](error_code error) {
            if (const auto held = weak_entry.lock(); held && !error) {
                decide(held, Decision::timeout, "");
            }
        });
        entry->waiters.push_back(std::move(waiter));
        ++approval_waiters;
        const auto request = entry->request;
        observer.on_approval_requested(request,
                                       std::chrono::duration<double>(policy.approval_timeout()).count());
        std::weak_ptr<Impl> weak = weak_from_this();
        broker.request(
            request, [weak, host = request.host, id = request.id](Decision decision, std::string decided_by) {
                if (const auto self = weak.lock()) {
                    self->post_if_running(
                        [raw = self.get(), host, id, decision, decided_by = std::move(decided_by)] {
                            if (const auto found = raw->pending.find(host);
                                found != raw->pending.end() && found->second->request.id == id) {
                                raw->decide(found->second, decision, decided_by);
                            }
                        });
                }
            });
        return;
    }
    entry->waiters.push_back(std::move(waiter));
    ++approval_waiters;
}

// By value: erasing the map's entry below must not destroy the approval while it is decided.
void EgressProxy::Impl::decide(
    std::shared_ptr<PendingApproval> entry,  // NOLINT(performance-unnecessary-value-param)
    Decision decision, const std::string& decided_by) {
    if (entry->decided) {
        return;
    }
    entry->decided = true;
    entry->timer.cancel();
    if (const auto found = pending.find(entry->request.host);
        found != pending.end() && found->second == entry) {
        pending.erase(found);
    }
    if (decision == Decision::allow_session) {
        policy.allow_for_session(entry->request.host);
    }
    observer.on_approval_decided(entry->request, decision, decided_by);
    auto waiters = std::move(entry->waiters);
    approval_waiters -= waiters.size();
    for (auto& waiter : waiters) {
        waiter(decision, decided_by);
    }
}

void Session::ask() {
    phase_ = Phase::deciding;
    deadline_.cancel();
    proxy_.request_approval(record_.host, record_.port, record_.method,
                            [self = shared_from_this()](Decision decision, const std::string& decided_by) {
                                self->on_decision(decision, decided_by);
                            });
}

void Session::on_decision(Decision decision, const std::string& decided_by) {
    if (phase_ != Phase::deciding) {
        return;
    }
    const std::string target = record_.host + ":" + std::to_string(record_.port);
    switch (decision) {
        case Decision::allow_once:
        case Decision::allow_session:
            record_.rule = "approval:" + std::string(to_string(decision)) + " by " + decided_by;
            return resolve();
        case Decision::deny:
            return refuse(http::status::forbidden, "the request to " + target + " was denied by " +
                                                       (decided_by.empty() ? "the approver" : decided_by));
        case Decision::timeout:
            return refuse(http::status::forbidden, "no decision within " +
                                                       seconds_text(proxy_.policy.approval_timeout()) +
                                                       " on the request to " + target + "; refused");
    }
}

}  // namespace cellblock::kernel::egress
