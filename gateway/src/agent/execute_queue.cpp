#include "cellblock/gateway/agent/execute_queue.hpp"

namespace cellblock::gateway::agent {

ExecuteQueue::Pending ExecuteQueue::make_execute(ExecuteRequest request, ExecuteHandlers handlers) {
    Pending pending;
    pending.ticket = next_ticket_++;
    pending.request = std::move(request);
    pending.handlers = std::move(handlers);
    return pending;
}

ExecuteQueue::Pending ExecuteQueue::make_reset(ExecuteRequest request, Done reset_done) {
    Pending pending;
    pending.ticket = next_ticket_++;
    pending.is_reset = true;
    pending.request = std::move(request);
    pending.reset_done = std::move(reset_done);
    return pending;
}

std::optional<ExecuteQueue::Pending> ExecuteQueue::start_next() {
    if (running_ || pending_.empty())
        return std::nullopt;
    Pending pending = std::move(pending_.front());
    pending_.pop_front();
    running_ = std::make_unique<Running>();
    running_->pending.ticket = pending.ticket;  // marks the session busy while its kernel starts
    return pending;
}

ExecuteQueue::Abandoned ExecuteQueue::abandon(std::uint64_t ticket) {
    Abandoned abandoned;
    for (auto it = pending_.begin(); it != pending_.end(); ++it) {
        if (it->ticket != ticket)
            continue;
        abandoned.queued = std::move(*it);
        pending_.erase(it);
        abandoned.queued->handlers.on_event = nullptr;
        return abandoned;
    }
    if (running_ && running_->pending.ticket == ticket && !running_->interrupted_by_client) {
        // The answer still completes (and is audited); only its streaming consumer is gone.
        running_->interrupted_by_client = true;
        running_->pending.handlers.on_event = nullptr;
        abandoned.running = true;
    }
    return abandoned;
}

}  // namespace cellblock::gateway::agent
