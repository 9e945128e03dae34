#pragma once
// A session's network approvals (gateway/src/agent/README.md, "Network: policy, approvals, audit"): the
// requests its kernel's proxy holds for a decision and what became of them (the newest max_approvals, in
// memory), and the decisions sent to the kernel that await its verdict. Knows nothing of kernels or audit.
#include <cstddef>
#include <deque>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

namespace cellblock::gateway::agent {

// A network request the kernel's proxy holds for a decision (kernel/README.md "Network policy"), and what
// became of it.
struct Approval {
    std::string id, host, method, kernel_id;
    int port = 0;
    double timeout_s = 0;
    std::string requested, decided;  // ISO 8601; `decided` empty while pending
    std::string decision;            // allow_once, allow_session, deny, timeout, lost; empty while pending
    std::string decided_by;
    // Who sent the decision through this gateway (for the audit entry, which the kernel's own
    // approval_decided event may write first).
    std::string asking_client, asking_token_id;
    nlohmann::json to_json() const;
    // to_json() as an event of the execute stream and the live page: with "type": "approval" and the session.
    nlohmann::json to_event(const std::string& session_id) const;
    // Records the decision on a pending approval.
    void decide(const std::string& decision_made, const std::string& by, const std::string& when);
};

// The kernel's verdict on a decision sent to it.
struct ApprovalDecisionResult {
    enum class Status { ok, unknown, already_decided, no_kernel, kernel_refused, no_answer } status;
    std::string message;
    nlohmann::json approval;  // the approval after the decision (ok, already_decided)

    // The answer for an approval decided before (`approval` is not pending).
    static ApprovalDecisionResult decided_before(const Approval& approval);
};

class ApprovalsBook {
  public:
    static constexpr std::size_t max_approvals = 1000;
    using DecisionWaiter = std::function<void(const nlohmann::json& reply)>;

    // nullptr when unknown (or dropped as one of the oldest).
    Approval* find(const std::string& approval_id);
    // Oldest first.
    nlohmann::json to_json() const;
    // Adds a newly requested approval, dropping the oldest beyond max_approvals.
    void add(Approval approval);
    // A request held by another kernel's proxy than `kernel_id` ended with that kernel: pending ones are
    // decided "lost" at `now`.
    void lose_all_but(const std::string& kernel_id, const std::string& now);

    // A decision sent on the control channel as `msg_id` waits for the kernel's reply.
    void await_decision(const std::string& msg_id, DecisionWaiter waiter);
    // The kernel's reply to `msg_id`: its waiter runs (and is forgotten); false when none waits.
    bool answer_decision(const std::string& msg_id, const nlohmann::json& reply);
    // Stops waiting for `msg_id`; false when it was answered already.
    bool forget_decision(const std::string& msg_id) { return decision_waiters_.erase(msg_id) > 0; }

  private:
    std::deque<Approval> approvals_;  // the newest max_approvals
    // Decisions sent on the control channel, by the request's msg_id, until the kernel answers.
    std::map<std::string, DecisionWaiter> decision_waiters_;
};

}  // namespace cellblock::gateway::agent
