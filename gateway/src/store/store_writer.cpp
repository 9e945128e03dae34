#include "cellblock/gateway/store/store_writer.hpp"

#include <boost/asio/post.hpp>
#include <utility>

#include "cellblock/gateway/observability/log.hpp"

namespace cellblock::gateway {

StoreWriter::StoreWriter(boost::asio::io_context& io, const Logger& logger, SessionStore& store)
    : io_(io), logger_(logger), store_(store), shared_(store.shared()), thread_([this] { run(); }) {
    if (shared_)
        listen_for_lease_releases();
}

StoreWriter::~StoreWriter() {
    if (lease_socket_)
        lease_socket_->release();  // the connection closes its own descriptor
    {
        std::lock_guard lock(mutex_);
        stopping_ = true;
    }
    wake_.notify_all();
    if (thread_.joinable())
        thread_.join();
}

void StoreWriter::listen_for_lease_releases() {
    try {
        watch(store_.listen_for_lease_releases());
    } catch (const StoreError& error) {
        logger_.warn("store_listen_failed", {{"error", error.what()}});
        listen_again_later();  // executes waiting for a lease ask again on their timers meanwhile
    }
}

void StoreWriter::watch(std::shared_ptr<LeaseReleases> releases) {
    if (!releases || releases->socket() < 0)
        return;
    lease_releases_ = std::move(releases);
    lease_socket_.emplace(io_, lease_releases_->socket());
    watch_lease_socket();
}

void StoreWriter::listen_again_later() {
    relisten_timer_.expires_after(relisten_delay_);
    relisten_delay_ = std::min<std::chrono::milliseconds>(relisten_delay_ * 2, max_relisten_delay);
    relisten_timer_.async_wait([this](const boost::system::error_code& error) {
        if (error)
            return;
        using Releases = std::shared_ptr<LeaseReleases>;
        auto resumed = [this](Releases releases) {
            if (lease_socket_ || !releases || releases->socket() < 0)
                return false;  // already listening again (a late answer), or not a usable connection
            watch(std::move(releases));
            relisten_delay_ = std::chrono::milliseconds(1000);
            logger_.warn("store_listen_resumed", {});  // the end of the store_listen_failed warned
            return true;
        };
        read<Releases>([](SessionStore& store) { return Releases(store.listen_for_lease_releases()); },
                       default_read_limit,
                       [this, resumed](StoreAnswer<Releases> answer) {
                           const bool listening = answer.ok() && resumed(std::move(*answer.value));
                           if (!listening && !lease_socket_)
                               listen_again_later();
                       },
                       [resumed](Releases late) { resumed(std::move(late)); });
    });
}

void StoreWriter::watch_lease_socket() {
    lease_socket_->async_wait(boost::asio::posix::stream_descriptor::wait_read,
                              [this](const boost::system::error_code& error) {
                                  if (!error)
                                      heard_lease_releases();
                              });
}

void StoreWriter::heard_lease_releases() {
    for (const std::string& name : lease_releases_->take()) {
        auto [first, last] = lease_waiters_.equal_range(name);
        std::vector<std::function<void()>> woken;
        for (auto waiter = first; waiter != last; ++waiter)
            woken.push_back(std::move(waiter->second));
        lease_waiters_.erase(first, last);
        for (auto& wake : woken)
            wake();
    }
    if (lease_releases_->socket() < 0) {
        logger_.warn("store_listen_failed", {{"error", "the connection that hears lease releases broke"}});
        lease_socket_->release();
        lease_socket_.reset();
        lease_releases_.reset();
        // Woken as if they heard a release: they ask again now, and from now on on their short timers (no
        // listening connection), registering again once it is back.
        auto waiters = std::exchange(lease_waiters_, {});
        for (auto& [name, wake] : waiters)
            wake();
        listen_again_later();
        return;
    }
    watch_lease_socket();
}

void StoreWriter::when_lease_released(const std::string& name, std::function<void()> wake) {
    if (lease_socket_)
        lease_waiters_.emplace(name, std::move(wake));
}

void StoreWriter::submit(Write write) {
    enqueue({std::move(write), nullptr});
}

void StoreWriter::after_pending(std::function<void()> handler) {
    enqueue({nullptr, std::move(handler)});
}

void StoreWriter::drain() {
    std::unique_lock lock(mutex_);
    idle_.wait(lock, [this] { return queue_.empty() && !busy_; });
}

void StoreWriter::enqueue(Task task) {
    {
        std::lock_guard lock(mutex_);
        queue_.push_back(std::move(task));
    }
    wake_.notify_one();
}

void StoreWriter::run() {
    std::unique_lock lock(mutex_);
    while (true) {
        wake_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) {
            if (stopping_)
                return;
            continue;
        }
        // Everything queued up to the next notification goes into one transaction: one fsync for a burst of
        // executes instead of one per write.
        std::vector<Write> batch;
        std::function<void()> notify;
        while (!queue_.empty() && batch.size() < max_batch) {
            Task task = std::move(queue_.front());
            queue_.pop_front();
            if (task.notify) {
                notify = std::move(task.notify);
                break;
            }
            batch.push_back(std::move(task.write));
        }
        busy_ = true;
        lock.unlock();
        if (!batch.empty())
            apply(batch);
        if (notify)
            boost::asio::post(io_, std::move(notify));
        lock.lock();
        busy_ = false;
        if (queue_.empty())
            idle_.notify_all();
    }
}

void StoreWriter::apply(const std::vector<Write>& batch) {
    const auto give_up = std::chrono::steady_clock::now() + retry_limit;
    auto backoff = std::chrono::milliseconds(100);
    while (true) {
        try {
            store_.write_batch(batch, [this](const std::exception& error) {
                // The logger writes one line to stderr; safe from this thread.
                logger_.error("store_write_failed", {{"error", error.what()}});
            });
            return;
        } catch (const StoreUnavailable& error) {
            // Rolled back whole: the same batch again once the store is back (a restarted server, a dropped
            // connection). Only this thread waits; the io_context goes on serving.
            bool stopping = false;
            {
                std::lock_guard lock(mutex_);
                stopping = stopping_;
            }
            // At exit a store that stays away costs a few seconds, not the whole retry limit.
            if (std::chrono::steady_clock::now() + backoff > give_up ||
                (stopping && backoff > std::chrono::milliseconds(1000))) {
                logger_.error("store_write_failed", {{"error", error.what()}, {"writes", batch.size()}});
                return;
            }
            logger_.warn("store_write_retried", {{"error", error.what()}, {"retry_ms", backoff.count()}});
            std::this_thread::sleep_for(backoff);  // the writer's own thread: nothing else waits on it
            backoff = std::min(backoff * 2, std::chrono::milliseconds(5000));
        } catch (const std::exception& error) {
            logger_.error("store_write_failed", {{"error", error.what()}, {"writes", batch.size()}});
            return;
        }
    }
}

}  // namespace cellblock::gateway
