#include "cellblock/gateway/agent/approvals_book.hpp"

namespace cellblock::gateway::agent {

using nlohmann::json;

json Approval::to_json() const {
    return {{"id", id},
            {"host", host},
            {"port", port},
            {"method", method},
            {"timeout_s", timeout_s},
            {"requested", requested},
            {"state", decision.empty() ? "pending" : "decided"},
            {"decided", decided.empty() ? json(nullptr) : json(decided)},
            {"decision", decision.empty() ? json(nullptr) : json(decision)},
            {"decided_by", decided_by.empty() ? json(nullptr) : json(decided_by)}};
}

json Approval::to_event(const std::string& session_id) const {
    json event = to_json();
    event["type"] = "approval";
    event["session"] = session_id;
    return event;
}

void Approval::decide(const std::string& decision_made, const std::string& by, const std::string& when) {
    decision = decision_made;
    decided_by = by;
    decided = when;
}

ApprovalDecisionResult ApprovalDecisionResult::decided_before(const Approval& approval) {
    return {Status::already_decided,
            "approval " + approval.id + " was already decided: " + approval.decision + " by " +
                approval.decided_by,
            approval.to_json()};
}

Approval* ApprovalsBook::find(const std::string& approval_id) {
    for (Approval& approval : approvals_)
        if (approval.id == approval_id)
            return &approval;
    return nullptr;
}

json ApprovalsBook::to_json() const {
    json list = json::array();
    for (const Approval& approval : approvals_)
        list.push_back(approval.to_json());
    return list;
}

void ApprovalsBook::add(Approval approval) {
    approvals_.push_back(std::move(approval));
    while (approvals_.size() > max_approvals)
        approvals_.pop_front();
}

void ApprovalsBook::lose_all_but(const std::string& kernel_id, const std::string& now) {
    for (Approval& approval : approvals_)
        if (approval.decision.empty() && approval.kernel_id != kernel_id)
            approval.decide("lost", "the kernel that held it ended", now);
}

void ApprovalsBook::await_decision(const std::string& msg_id, DecisionWaiter waiter) {
    decision_waiters_[msg_id] = std::move(waiter);
}

bool ApprovalsBook::answer_decision(const std::string& msg_id, const json& reply) {
    auto waiter = decision_waiters_.find(msg_id);
    if (waiter == decision_waiters_.end())
        return false;
    auto answer = std::move(waiter->second);
    decision_waiters_.erase(waiter);
    answer(reply);
    return true;
}

}  // namespace cellblock::gateway::agent
