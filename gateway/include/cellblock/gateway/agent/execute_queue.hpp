#pragma once
// A session's execute queue (gateway/src/agent/README.md): the executes and resets waiting, the one running,
// their tickets and the queue's limit. Knows nothing of kernels, leases or answers: AgentSession
// (agent_session_queue.cpp) starts what it hands out and answers what it takes back.
//
// The order rule: one at a time, first come first served. Executes and resets share one queue, so a reset
// runs after the executes queued before it; nothing starts while one runs (a resumed execute, a kernel
// still starting for the next one: both count as running), and an entry abandoned while queued is taken
// out without ever running.
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>

#include "cellblock/gateway/agent/execution.hpp"

namespace cellblock::gateway::agent {

struct ExecuteRequest {
    std::string code;
    double timeout_s = 0;        // the circuit breaker for this call; <= the session's limits.timeout_s
    std::string client_address;  // for the audit trail
    std::string client_kind;     // "http", "ndjson", "mcp"
    std::string token_id;        // the tenant token that asked (never the token); empty for the operator
};

struct ExecuteHandlers {
    ExecutionCollector::EventSink on_event;              // optional, for streaming
    std::function<void(nlohmann::json answer)> on_done;  // always called exactly once
};

class ExecuteQueue {
  public:
    using Done = std::function<void(std::optional<std::string> error)>;
    struct Pending {
        std::uint64_t ticket = 0;
        bool is_reset = false;
        ExecuteRequest request;
        ExecuteHandlers handlers;
        Done reset_done;
    };
    struct Running {
        Pending pending;
        std::unique_ptr<ExecutionCollector> collector;
        std::chrono::steady_clock::time_point started;
        std::chrono::system_clock::time_point started_wall;
        bool timed_out =
            false;  // the safety net passed (the kernel did not enforce the limit) and it was interrupted
        bool kernel_restarted = false;  // still running after the grace period: the kernel was restarted
        bool interrupted_by_client = false;
        std::string kernel_failure;  // the kernel died or went away during the execute
        std::string msg_id;          // of the execute_request (the in-flight record in the store)
    };
    // What abandon found for a ticket.
    struct Abandoned {
        std::optional<Pending> queued;  // taken out of the queue, its stream consumer dropped: answer it
        bool running = false;           // the running one, now marked interrupted by its client
    };

    // More executes than this waiting behind the running one are refused (429) instead of piling up.
    static constexpr std::size_t max_queued = 64;

    // A new entry: an execute, or a reset when `reset_done` is set; its ticket is for abandon.
    Pending make_execute(ExecuteRequest request, ExecuteHandlers handlers);
    Pending make_reset(ExecuteRequest request, Done reset_done);
    void push(Pending pending) { pending_.push_back(std::move(pending)); }
    // The next entry to start, by the order rule; nullopt while one runs or none waits. The entry counts as
    // running from now on (running() holds only its ticket until the caller fills it in).
    std::optional<Pending> start_next();
    // Counts as running without an entry of the queue (an execute resumed from the kernel's record).
    void hold() {
        if (!running_)
            running_ = std::make_unique<Running>();
    }
    // The running one, nullptr when none.
    Running* running() { return running_.get(); }
    const Running* running() const { return running_.get(); }
    // Ends the running one (nullptr when none): the next may start.
    std::unique_ptr<Running> finish() { return std::move(running_); }
    // The client of `ticket` went away.
    Abandoned abandon(std::uint64_t ticket);
    // Empties the queue (the running one stays) and gives what waited, oldest first.
    std::deque<Pending> take_all() { return std::exchange(pending_, {}); }

    bool busy() const { return running_ != nullptr || !pending_.empty(); }
    // Executes running or queued (what a tenant's `executes` quota counts, tenant_quotas.hpp).
    std::size_t in_flight() const { return pending_.size() + (running_ != nullptr ? 1 : 0); }
    std::size_t queued() const { return pending_.size(); }
    bool full() const { return pending_.size() >= max_queued; }

  private:
    std::deque<Pending> pending_;
    std::unique_ptr<Running> running_;
    std::uint64_t next_ticket_ = 1;
};

}  // namespace cellblock::gateway::agent
