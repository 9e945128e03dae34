// SIGINT and SIGTERM are blocked in every thread (main blocks them before any thread starts) and taken
// here, on one thread, with sigwait: an asynchronous handler would interrupt xeus's zmq_poll with EINTR,
// which cppzmq turns into an uncaught exception.
// SIGINT interrupts the worker, SIGTERM and SIGQUIT stop the kernel, SIGHUP is ignored (the kernel is
// meant to outlive the gateway that started it).
#pragma once

#include <functional>
#include <thread>

namespace cellblock::kernel {

// Blocks SIGINT, SIGTERM, SIGHUP and SIGQUIT in the calling thread (and so in every thread it starts)
// and ignores SIGPIPE. Call first thing in main.
void block_kernel_signals();

class SignalRouter {
  public:
    SignalRouter(std::function<void()> on_interrupt, std::function<void(int)> on_terminate);
    ~SignalRouter();
    SignalRouter(const SignalRouter&) = delete;
    SignalRouter& operator=(const SignalRouter&) = delete;

  private:
    std::function<void()> on_interrupt_;
    std::function<void(int)> on_terminate_;
    std::thread thread_;
};

}  // namespace cellblock::kernel
