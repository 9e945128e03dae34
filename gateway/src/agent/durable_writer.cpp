#include "cellblock/gateway/agent/durable_writer.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <boost/asio/post.hpp>
#include <cerrno>
#include <cstring>
#include <system_error>

#include "cellblock/gateway/log.hpp"

namespace cellblock::gateway::agent {

namespace {
// Owns one file descriptor (RAII).
class FileDescriptor {
  public:
    explicit FileDescriptor(int fd) : fd_(fd) {}
    ~FileDescriptor() {
        if (fd_ >= 0)
            ::close(fd_);
    }
    FileDescriptor(const FileDescriptor&) = delete;
    FileDescriptor& operator=(const FileDescriptor&) = delete;
    int get() const { return fd_; }

  private:
    int fd_;
};

[[noreturn]] void fail(const std::string& step, const std::filesystem::path& file) {
    throw std::system_error(errno, std::generic_category(), step + " " + file.string());
}

void write_all(int fd, std::string_view data, const std::filesystem::path& file) {
    while (!data.empty()) {
        const ssize_t written = ::write(fd, data.data(), data.size());
        if (written < 0) {
            if (errno == EINTR)
                continue;
            fail("write", file);
        }
        data.remove_prefix(static_cast<std::size_t>(written));
    }
}
}  // namespace

DurableWriter::DurableWriter(boost::asio::io_context& io, const Logger& logger)
    : io_(io), logger_(logger), thread_([this] { run(); }) {}

DurableWriter::~DurableWriter() {
    {
        std::lock_guard lock(mutex_);
        stopping_ = true;
    }
    wake_.notify_all();
    if (thread_.joinable())
        thread_.join();
}

void DurableWriter::append_line(std::filesystem::path file, std::string line) {
    line.push_back('\n');
    enqueue({Task::Kind::append, std::move(file), std::move(line), nullptr});
}

void DurableWriter::replace_file(std::filesystem::path file, std::string content) {
    enqueue({Task::Kind::replace, std::move(file), std::move(content), nullptr});
}

void DurableWriter::after_pending(std::function<void()> handler) {
    enqueue({Task::Kind::notify, {}, {}, std::move(handler)});
}

void DurableWriter::drain() {
    std::unique_lock lock(mutex_);
    idle_.wait(lock, [this] { return queue_.empty() && !busy_; });
}

void DurableWriter::enqueue(Task task) {
    {
        std::lock_guard lock(mutex_);
        queue_.push_back(std::move(task));
    }
    wake_.notify_one();
}

void DurableWriter::run() {
    std::unique_lock lock(mutex_);
    while (true) {
        wake_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) {
            if (stopping_)
                return;
            continue;
        }
        Task task = std::move(queue_.front());
        queue_.pop_front();
        busy_ = true;
        lock.unlock();
        perform(task);
        lock.lock();
        busy_ = false;
        if (queue_.empty())
            idle_.notify_all();
    }
}

void DurableWriter::perform(const Task& task) {
    try {
        switch (task.kind) {
            case Task::Kind::notify:
                boost::asio::post(io_, task.handler);
                return;
            case Task::Kind::append: {
                FileDescriptor fd(::open(task.file.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0600));
                if (fd.get() < 0)
                    fail("open", task.file);
                write_all(fd.get(), task.data, task.file);
                if (::fdatasync(fd.get()) != 0)
                    fail("fdatasync", task.file);
                return;
            }
            case Task::Kind::replace: {
                const std::filesystem::path temporary = task.file.string() + ".tmp";
                {
                    FileDescriptor fd(
                        ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
                    if (fd.get() < 0)
                        fail("open", temporary);
                    write_all(fd.get(), task.data, temporary);
                    if (::fsync(fd.get()) != 0)
                        fail("fsync", temporary);
                }
                if (::rename(temporary.c_str(), task.file.c_str()) != 0)
                    fail("rename to", task.file);
                FileDescriptor directory(
                    ::open(task.file.parent_path().c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
                if (directory.get() < 0)
                    fail("open directory of", task.file);
                if (::fsync(directory.get()) != 0)
                    fail("fsync directory of", task.file);
                return;
            }
        }
    } catch (const std::exception& error) {
        // The logger writes one line to stderr; safe from this thread.
        logger_.error("agent_state_write_failed", {{"error", error.what()}});
    }
}

}  // namespace cellblock::gateway::agent
