#pragma once
// Durable, ordered file writes off the io_context thread: JSONL appends (audit trails, cell history) and
// atomic replacements (session records), each followed by fdatasync before the next one, on one writer
// thread. The gateway answers a request without waiting for the disk; `after_pending` lets a reader wait for
// what was queued.
#include <boost/asio/io_context.hpp>
#include <condition_variable>
#include <deque>
#include <filesystem>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

namespace cellblock::gateway {
class Logger;
}

namespace cellblock::gateway::agent {

class DurableWriter {
  public:
    DurableWriter(boost::asio::io_context& io, const Logger& logger);
    ~DurableWriter();  // writes everything still queued, then stops the thread
    DurableWriter(const DurableWriter&) = delete;
    DurableWriter& operator=(const DurableWriter&) = delete;

    // Appends `line` + '\n' to `file` (created 0600), then fdatasync.
    void append_line(std::filesystem::path file, std::string line);
    // Writes `content` to a temporary file, fsyncs it and renames it over `file`, then fsyncs the directory.
    void replace_file(std::filesystem::path file, std::string content);
    // Posts `handler` to the io_context once every write queued before this call is on disk (or failed).
    void after_pending(std::function<void()> handler);
    // Blocks until the queue is empty (used at shutdown).
    void drain();

  private:
    struct Task {
        enum class Kind { append, replace, notify } kind;
        std::filesystem::path file;
        std::string data;
        std::function<void()> handler;
    };
    void enqueue(Task task);
    void run();
    void perform(const Task& task);

    boost::asio::io_context& io_;
    const Logger& logger_;
    std::mutex mutex_;
    std::condition_variable wake_, idle_;
    std::deque<Task> queue_;
    bool busy_ = false;
    bool stopping_ = false;
    std::thread thread_;  // last: started after everything it uses exists
};

}  // namespace cellblock::gateway::agent
