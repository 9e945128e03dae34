#pragma once
// A kernel's operating-system process: spawned in its own session (so signals reach its whole process group),
// or adopted from an earlier gateway by pid; watched through a pidfd on the io_context, reaped exactly once,
// and killed when the owner goes away, unless released to outlive the gateway.
#include <sys/types.h>

#include <boost/asio/io_context.hpp>
#include <boost/asio/posix/stream_descriptor.hpp>
#include <chrono>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace cellblock::gateway {

struct ProcessExit {
    int exit_code = -1;  // valid when !signaled
    int signal = 0;      // valid when signaled
    bool signaled = false;
    bool status_unknown = false;  // an adopted process is not our child: its exit status cannot be read
    std::string describe() const;
};

class ChildProcess {
  public:
    // Throws std::system_error (with the failing step) when the process cannot be started.
    ChildProcess(boost::asio::io_context& io, const std::vector<std::string>& argv,
                 const std::map<std::string, std::string>& environment, const std::string& working_directory,
                 const std::string& output_file = {});  // stdout+stderr go here (appended) unless empty
    struct Adopt {};
    // Watches the running process `pid` (started by an earlier gateway, in its own session). Throws
    // std::system_error when it is gone.
    ChildProcess(boost::asio::io_context& io, Adopt, pid_t pid);
    ~ChildProcess();  // SIGKILLs the process group if still running (and not released), then reaps
    ChildProcess(const ChildProcess&) = delete;
    ChildProcess& operator=(const ChildProcess&) = delete;

    pid_t pid() const { return pid_; }
    bool running() const { return !exited_; }
    // Sends `signal_number` to the whole process group (the kernel and anything it started).
    bool signal_group(int signal_number) const;
    // Called once, on the io_context, when the process exits.
    void on_exit(std::function<void(ProcessExit)> handler);
    // Blocks up to `timeout` for the process to exit (used only at gateway shutdown, outside the io_context).
    bool wait_for_exit(std::chrono::milliseconds timeout);
    // Stops watching and lets the process run on after this object (and the gateway) is gone.
    void release();

  private:
    void watch();
    void reap();
    pid_t pid_ = -1;
    bool exited_ = false;
    bool adopted_ = false;
    bool released_ = false;
    boost::asio::posix::stream_descriptor pidfd_;
    std::function<void(ProcessExit)> exit_handler_;
};

}  // namespace cellblock::gateway
