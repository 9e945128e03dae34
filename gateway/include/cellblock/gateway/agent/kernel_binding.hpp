#pragma once
// An agent session's hold on its kernel (gateway/src/agent/README.md): the kernel and the session's link to
// it, the request for a kernel in flight and whoever waits for it to settle, the id of a kernel that let the
// session go, whether a kernel served the session before, and the kernel's kernel_info_reply. Asks no one:
// AgentSession (agent_session_kernel.cpp) starts, attaches and readies kernels through the KernelManager and
// moves the binding from state to state.
//
// The state is two things, each one explicit value:
//
// What it holds (`Hold`):
//   unbound  no kernel: a new session, a kernel dropped (dead past its restart limit, deleted through
//            /api/kernels, culled) or shut down with its session.
//   bound    a kernel and the session's link to it (one more KernelClient with the session's own session_id).
//   let_go   the kernel disconnected the session (shut down, replaced, or restarted through another gateway
//            on a shared store): its id is kept, so that on a shared store the next request for a kernel asks
//            for its new process instead of starting another. The next request forgets it either way.
//
// What it asks for (`Request`), while every caller of AgentSession::ensure_kernel waits:
//   none       nothing in flight: the next waiter starts a request.
//   attaching  the shared store is asked whether another gateway runs the new process of the kernel that
//              let go or died.
//   starting   the KernelManager starts a kernel for the session.
//   readying   a kernel's readiness is awaited: the bound one, or (after a gateway restart) a re-adopted
//              one, bound once it is ready.
// A request ends by settling (every waiter answered, nullopt = a kernel is ready) or by handing its waiters
// back to wait for another request (a re-adopted kernel that failed).
//
// The two are independent: a bound kernel may be readied, and a kernel may let the session go while its
// readiness is awaited.
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "cellblock/gateway/kernels/kernel.hpp"

namespace cellblock::gateway::agent {

class KernelBinding {
  public:
    using Done = std::function<void(std::optional<std::string> error)>;
    enum class Request { none, attaching, starting, readying };
    struct Unbound {};
    struct Bound {
        std::shared_ptr<Kernel> kernel;
        std::shared_ptr<KernelClientLink> link;
    };
    struct LetGo {
        std::string kernel_id;
    };
    using Hold = std::variant<Unbound, Bound, LetGo>;

    // `served_before`: a kernel served the session already (its history was reloaded), so the first kernel
    // bound replaces it and the state it had is lost.
    explicit KernelBinding(bool served_before) : served_before_(served_before) {}

    const Hold& hold() const { return hold_; }
    // The bound kernel and link; nullptr unless bound.
    std::shared_ptr<Kernel> kernel() const;
    std::shared_ptr<KernelClientLink> link() const;
    // unbound/let_go -> bound, without a link yet (attaching to the kernel may let the session go at once,
    // so the kernel is held before). True when it replaces a kernel that served the session before: the
    // variables are gone, and the next answer says so.
    bool bind(std::shared_ptr<Kernel> kernel);
    // The session's link to the bound kernel (nothing when the kernel let the session go meanwhile).
    void set_link(std::shared_ptr<KernelClientLink> link);
    // bound -> let_go (`keep_id`: the session goes on, it may come back to this kernel) or unbound. Nothing
    // when not bound.
    void let_go(bool keep_id);
    // bound -> unbound, handing back the kernel (to shut down, or whose new process to ask for); nullptr
    // and nothing changed when not bound.
    std::shared_ptr<Kernel> unbind();
    // let_go -> unbound, handing back the kernel's id; "" and nothing changed otherwise.
    std::string take_let_go();
    // Whether the next kernel bound replaces one that served the session (resume: a re-adopted kernel is the
    // same one, a lost one was not).
    void set_served_before(bool served) { served_before_ = served; }

    Request request() const { return request_; }
    bool requesting(Request request) const { return request_ == request; }
    // Adds a waiter for the request; true when none is in flight: the caller starts one (`begin`).
    bool wait(Done done);
    void begin(Request request) { request_ = request; }
    // Ends the request (none) and answers every waiter with `error` (nullopt: the kernel is ready), in the
    // order they came. A waiter that asks again starts a new request.
    void settle(const std::optional<std::string>& error);
    // Ends the request (none) and hands its waiters back unanswered.
    std::vector<Done> take_waiters();

    // The kernel_info_request sent on the session's link, whose reply says the kernel's runtime versions.
    void expect_kernel_info(std::string msg_id) { kernel_info_msg_id_ = std::move(msg_id); }
    // Keeps the content of the reply to the expected kernel_info_request; false for any other message.
    bool take_kernel_info(const JupyterMessage& message);
    // The kernel_info_reply content of the newest kernel that answered (null before any).
    const nlohmann::json& kernel_info() const { return kernel_info_; }

  private:
    Hold hold_;
    Request request_ = Request::none;
    std::vector<Done> waiters_;
    bool served_before_;
    std::string kernel_info_msg_id_;
    nlohmann::json kernel_info_;
};

}  // namespace cellblock::gateway::agent
