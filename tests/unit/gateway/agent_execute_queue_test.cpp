#include <gtest/gtest.h>

#include "cellblock/gateway/agent/execute_queue.hpp"

// The execute queue on its own (execute_queue.hpp): its order rule, its limit and abandon, without a kernel.

using namespace cellblock::gateway::agent;

namespace {
ExecuteQueue::Pending execute_of(ExecuteQueue& queue, const std::string& code) {
    ExecuteRequest request;
    request.code = code;
    ExecuteHandlers handlers;
    handlers.on_event = [](const nlohmann::json&) {};
    return queue.make_execute(std::move(request), std::move(handlers));
}
}  // namespace

TEST(ExecuteQueue, RunsOneAtATimeFirstComeFirstServed) {
    ExecuteQueue queue;
    EXPECT_FALSE(queue.busy());
    EXPECT_FALSE(queue.start_next());
    queue.push(execute_of(queue, "a"));
    queue.push(queue.make_reset({}, [](const std::optional<std::string>&) {}));
    queue.push(execute_of(queue, "c"));
    EXPECT_EQ(queue.in_flight(), 3U);

    auto first = queue.start_next();
    ASSERT_TRUE(first);
    EXPECT_EQ(first->request.code, "a");
    ASSERT_NE(queue.running(), nullptr);
    EXPECT_EQ(queue.running()->pending.ticket, first->ticket);  // busy while its kernel starts
    EXPECT_FALSE(queue.start_next());                           // nothing starts while one runs
    EXPECT_EQ(queue.queued(), 2U);
    EXPECT_EQ(queue.in_flight(), 3U);

    EXPECT_NE(queue.finish(), nullptr);
    auto second = queue.start_next();
    ASSERT_TRUE(second);
    EXPECT_TRUE(second->is_reset);  // a reset waits its turn behind the executes queued before it
    EXPECT_GT(second->ticket, first->ticket);
    queue.finish();
    auto third = queue.start_next();
    ASSERT_TRUE(third);
    EXPECT_EQ(third->request.code, "c");
    queue.finish();
    EXPECT_FALSE(queue.busy());
    EXPECT_EQ(queue.finish(), nullptr);
}

TEST(ExecuteQueue, AResumedExecuteHoldsTheQueue) {
    ExecuteQueue queue;
    queue.hold();
    queue.push(execute_of(queue, "after"));
    EXPECT_TRUE(queue.busy());
    EXPECT_FALSE(queue.start_next());
    queue.finish();
    auto next = queue.start_next();
    ASSERT_TRUE(next);
    EXPECT_EQ(next->request.code, "after");
}

TEST(ExecuteQueue, IsFullAtItsLimit) {
    ExecuteQueue queue;
    queue.push(execute_of(queue, "running"));
    ASSERT_TRUE(queue.start_next());
    for (std::size_t i = 0; i + 1 < ExecuteQueue::max_queued; ++i)
        queue.push(execute_of(queue, "waiting"));
    EXPECT_FALSE(queue.full());  // the running one does not count
    queue.push(execute_of(queue, "last"));
    EXPECT_TRUE(queue.full());
    EXPECT_EQ(queue.queued(), ExecuteQueue::max_queued);
    EXPECT_EQ(queue.in_flight(), ExecuteQueue::max_queued + 1);
    EXPECT_EQ(queue.take_all().size(), ExecuteQueue::max_queued);
    EXPECT_FALSE(queue.full());
    EXPECT_NE(queue.running(), nullptr);  // take_all leaves the running one
}

TEST(ExecuteQueue, AbandonTakesAQueuedOneOutAndMarksTheRunningOne) {
    ExecuteQueue queue;
    auto running = execute_of(queue, "running");
    const auto running_ticket = running.ticket;
    queue.push(std::move(running));
    auto started = queue.start_next();
    ASSERT_TRUE(started);
    queue.running()->pending = std::move(*started);
    auto waiting = execute_of(queue, "waiting");
    const auto waiting_ticket = waiting.ticket;
    queue.push(std::move(waiting));
    queue.push(execute_of(queue, "next"));

    ExecuteQueue::Abandoned queued = queue.abandon(waiting_ticket);
    ASSERT_TRUE(queued.queued);
    EXPECT_FALSE(queued.running);
    EXPECT_EQ(queued.queued->request.code, "waiting");
    EXPECT_FALSE(queued.queued->handlers.on_event);  // its stream consumer is gone
    EXPECT_EQ(queue.queued(), 1U);

    ExecuteQueue::Abandoned current = queue.abandon(running_ticket);
    EXPECT_FALSE(current.queued);
    EXPECT_TRUE(current.running);
    EXPECT_TRUE(queue.running()->interrupted_by_client);
    EXPECT_FALSE(queue.running()->pending.handlers.on_event);
    // It still runs to its answer: the next waits, and a second abandon is nothing new.
    EXPECT_FALSE(queue.start_next());
    EXPECT_FALSE(queue.abandon(running_ticket).running);
    EXPECT_FALSE(queue.abandon(12345).queued);
    queue.finish();
    auto next = queue.start_next();
    ASSERT_TRUE(next);
    EXPECT_EQ(next->request.code, "next");
}
