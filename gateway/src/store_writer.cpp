#include "cellblock/gateway/store_writer.hpp"

#include <boost/asio/post.hpp>

#include "cellblock/gateway/log.hpp"

namespace cellblock::gateway {

StoreWriter::StoreWriter(boost::asio::io_context& io, const Logger& logger, SessionStore& store)
    : io_(io), logger_(logger), store_(store), thread_([this] { run(); }) {}

StoreWriter::~StoreWriter() {
    {
        std::lock_guard lock(mutex_);
        stopping_ = true;
    }
    wake_.notify_all();
    if (thread_.joinable())
        thread_.join();
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
        if (!batch.empty()) {
            try {
                store_.write_batch(batch, [this](const std::exception& error) {
                    // The logger writes one line to stderr; safe from this thread.
                    logger_.error("store_write_failed", {{"error", error.what()}});
                });
            } catch (const std::exception& error) {
                logger_.error("store_write_failed", {{"error", error.what()}, {"writes", batch.size()}});
            }
        }
        if (notify)
            boost::asio::post(io_, std::move(notify));
        lock.lock();
        busy_ = false;
        if (queue_.empty())
            idle_.notify_all();
    }
}

}  // namespace cellblock::gateway
