// Network: the sandbox gets an empty network namespace; only loopback is brought up. On request, a TCP
// socket listening on that loopback is made inside the namespace and handed to the parent, which serves
// it from outside (LaunchRequest::loopback_listener).
#pragma once

#include <cstddef>
#include <vector>

#include "cellblock/sandbox/sandbox.hpp"
#include "child.hpp"
#include "unique_fd.hpp"

namespace cellblock::sandbox::detail {

// Child side: ifup lo. Returns 0 or an errno.
int bring_loopback_up() noexcept;

// Parent side of the loopback listeners: a socketpair over which the child sends each listening socket
// (SCM_RIGHTS) before it execs, so the sockets live in the sandbox's namespace but belong to the parent.
class ListenerChannel {
  public:
    ListenerChannel() = default;
    // Plans one listener on 127.0.0.1:port (and one on [::1]:port if asked) into `plan`.
    static ListenerChannel prepare(const LoopbackListener& listener, StepNames& steps, ChildPlan& plan);

    // After clone: the child holds its own copy of its end; ours goes, so a child that dies before
    // sending shows as an end of file instead of a wait.
    void close_child_end() noexcept { child_end_.reset(); }
    // After a successful execve: exactly the planned listening sockets (all were sent before it).
    std::vector<UniqueFd> receive();

  private:
    UniqueFd parent_end_;
    UniqueFd child_end_;
    std::size_t expected_ = 0;
};

// Child side (async-signal-safe), after the namespace is set up and before the fds are installed:
// creates, binds and starts each planned listener, sends it to the parent and closes it here. Returns
// false with *failed_step set on error (errno set).
bool send_loopback_listeners(const ChildPlan& plan, int* failed_step) noexcept;

}  // namespace cellblock::sandbox::detail
