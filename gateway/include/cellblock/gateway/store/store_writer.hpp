#pragma once
// Every store call off the io_context thread (docs/decisions/0012-store-calls-off-the-io-thread.md): the io
// thread never waits on a database or a disk.
// - Writes: one writer thread applies them to the SessionStore in the order they were queued; what is queued
//   together is committed (fsync'd) together, each write in its own savepoint. A batch the store could not
//   reach (StoreUnavailable: the server restarted or stalls) is retried with backoff, not dropped.
// - Reads and leases (`read`): one reader thread runs them in the order they were asked, and posts each
//   answer back to the io_context; an answer that does not come within its limit is given up as unanswered
//   (the request that waited answers 503 store_unavailable, or goes on without it).
// `after_pending` lets a reader wait for what was queued before it.
#include <boost/asio/io_context.hpp>
#include <boost/asio/posix/stream_descriptor.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/thread_pool.hpp>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "cellblock/gateway/store/store.hpp"

namespace cellblock::gateway {
class Logger;

// What a store read answered: its value, or why there is none (the store failed, or did not answer in time).
template <class T>
struct StoreAnswer {
    std::optional<T> value;
    std::string error;  // empty when `value` is set
    bool ok() const { return value.has_value(); }
};

class StoreWriter {
  public:
    using Write = std::function<void(SessionStore&)>;
    // How long a request waits for a store read by default before it goes on without it.
    static constexpr std::chrono::milliseconds default_read_limit{2000};

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
    // Runs `call` on the reader thread and hands its answer to `then` on the io_context thread. No answer
    // within `limit`: `then` gets an unanswered StoreAnswer at the limit, and the value `call` answers later
    // goes to `late` (io_context thread; e.g. a lease taken too late is released there).
    template <class T>
    void read(std::function<T(SessionStore&)> call, std::chrono::milliseconds limit,
              std::function<void(StoreAnswer<T>)> then, std::function<void(T)> late = nullptr);
    // For reads where blocking is the point: start-up (before the io_context serves) and tests. Calls made
    // while serving go through `read`.
    SessionStore& store() { return store_; }
    // The store's kind, fixed at start: safe to ask on any thread without touching the store.
    bool shared() const { return shared_; }
    // Calls `wake` (once, on the io_context) when any gateway on a shared store releases lease `name`. A
    // release not heard (no listening connection, or it broke and is not open again yet) wakes no one:
    // waiters keep a timer of their own. io_context thread only.
    void when_lease_released(const std::string& name, std::function<void()> wake);
    // Whether releases are heard now (else a waiter has only its timer).
    bool hears_lease_releases() const { return lease_socket_.has_value(); }

  private:
    struct Task {
        Write write;
        std::function<void()> notify;
    };
    void enqueue(Task task);
    // Watches the listening connection's socket on the io_context; what it hears wakes the waiters.
    void listen_for_lease_releases();
    void watch(std::shared_ptr<LeaseReleases> releases);
    void watch_lease_socket();
    void heard_lease_releases();
    // A listening connection that broke (the server restarted) is opened again on the reader thread, after
    // relisten_delay_ (1 s, doubling to 30 s while it fails); meanwhile waiters ask on their timers.
    void listen_again_later();
    static constexpr std::chrono::seconds max_relisten_delay{30};
    void run();
    static constexpr std::size_t max_batch = 512;

    // Applies `batch`; a batch the store could not reach is retried with backoff for up to retry_limit.
    void apply(const std::vector<Write>& batch);
    static constexpr std::chrono::seconds retry_limit{60};

    boost::asio::io_context& io_;
    const Logger& logger_;
    SessionStore& store_;
    const bool shared_;
    std::mutex mutex_;
    std::condition_variable wake_, idle_;
    std::deque<Task> queue_;
    bool busy_ = false;
    bool stopping_ = false;
    // The connection that hears lease releases (shared stores), watched on the io_context without blocking
    // it; the descriptor stays the connection's (released, not closed, by the watcher).
    std::shared_ptr<LeaseReleases> lease_releases_;
    std::optional<boost::asio::posix::stream_descriptor> lease_socket_;
    boost::asio::steady_timer relisten_timer_{io_};
    std::chrono::milliseconds relisten_delay_{1000};
    std::multimap<std::string, std::function<void()>> lease_waiters_;  // io_context thread only
    std::thread thread_;                  // started after everything it uses exists
    boost::asio::thread_pool reader_{1};  // one thread: reads (and lease calls) run in the order asked
};

template <class T>
void StoreWriter::read(std::function<T(SessionStore&)> call, std::chrono::milliseconds limit,
                       std::function<void(StoreAnswer<T>)> then, std::function<void(T)> late) {
    // Settled once, on the io_context thread: by the answer or by the timer, whichever comes first.
    struct Pending {
        explicit Pending(boost::asio::io_context& io) : timer(io) {}
        boost::asio::steady_timer timer;
        std::function<void(StoreAnswer<T>)> then;
        std::function<void(T)> late;
        bool settled = false;
    };
    auto pending = std::make_shared<Pending>(io_);
    pending->then = std::move(then);
    pending->late = std::move(late);
    pending->timer.expires_after(limit);
    pending->timer.async_wait([pending](const boost::system::error_code& error) {
        if (error || std::exchange(pending->settled, true))
            return;
        pending->then(StoreAnswer<T>{std::nullopt, "the store did not answer in time"});
    });
    boost::asio::post(reader_, [this, pending, call = std::move(call)] {
        StoreAnswer<T> answer;
        try {
            answer.value = call(store_);
        } catch (const std::exception& error) {
            answer.error = error.what();
        }
        boost::asio::post(io_, [pending, answer = std::move(answer)]() mutable {
            if (std::exchange(pending->settled, true)) {
                if (answer.value && pending->late)
                    pending->late(std::move(*answer.value));
                return;
            }
            pending->timer.cancel();
            pending->then(std::move(answer));
        });
    });
}

}  // namespace cellblock::gateway
