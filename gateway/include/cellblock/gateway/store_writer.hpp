#pragma once
// Store writes off the io_context thread: one writer thread applies them to the SessionStore in the order
// they were queued; what is queued together is committed (fsync'd) together, each write in its own savepoint.
// The gateway answers a request without waiting for the disk; `after_pending` lets a reader wait for what was
// queued before it.
#include <boost/asio/io_context.hpp>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "cellblock/gateway/store.hpp"

namespace cellblock::gateway {
class Logger;

class StoreWriter {
  public:
    using Write = std::function<void(SessionStore&)>;

    StoreWriter(boost::asio::io_context& io, const Logger& logger, SessionStore& store);
    ~StoreWriter();  // applies everything still queued, then stops the thread
    StoreWriter(const StoreWriter&) = delete;
    StoreWriter& operator=(const StoreWriter&) = delete;

    // Queues `write`; a failure is logged (event store_write_failed) and the next write goes on.
    void submit(Write write);
    // Posts `handler` to the io_context once every write queued before this call is committed (or failed).
    void after_pending(std::function<void()> handler);
    // Blocks until the queue is empty (gateway exit, tests).
    void drain();
    // For reads on the io_context thread (start-up, audit queries after `after_pending`).
    SessionStore& store() { return store_; }

  private:
    struct Task {
        Write write;
        std::function<void()> notify;
    };
    void enqueue(Task task);
    void run();
    static constexpr std::size_t max_batch = 512;

    boost::asio::io_context& io_;
    const Logger& logger_;
    SessionStore& store_;
    std::mutex mutex_;
    std::condition_variable wake_, idle_;
    std::deque<Task> queue_;
    bool busy_ = false;
    bool stopping_ = false;
    std::thread thread_;  // last: started after everything it uses exists
};

}  // namespace cellblock::gateway
