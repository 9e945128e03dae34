#include "egress/egress_proxy.hpp"

#include <sys/socket.h>

#include <cstring>
#include <future>

#include "common/logging.hpp"
#include "egress/egress_session.hpp"

namespace cellblock::kernel::egress {

std::string_view to_string(Decision decision) {
    switch (decision) {
        case Decision::allow_once:
            return "allow_once";
        case Decision::allow_session:
            return "allow_session";
        case Decision::deny:
            return "deny";
        case Decision::timeout:
            return "timeout";
    }
    return "unknown";
}

void EgressProxy::Impl::run() {
    while (true) {
        try {
            io.run();
            return;
        } catch (const std::exception& error) {
            log_event(LogLevel::error, "egress_proxy_handler_failed", {{"error", error.what()}});
        }
    }
}

void EgressProxy::Impl::stop() {
    {
        // Not held while joining: the proxy thread may be posting (a broker answering synchronously).
        std::lock_guard lock(stop_mutex);
        if (stopped) {
            return;
        }
        stopped = true;
    }
    if (std::this_thread::get_id() == thread.get_id()) {
        throw std::logic_error(
            "EgressProxy::stop() called from the proxy's own thread (an observer or broker)");
    }
    work.reset();
    io_owner->stop();
    if (thread.joinable()) {
        thread.join();
    }
    pending.clear();
    approval_waiters = 0;
    acceptor.reset();
    accept_pause.reset();
    // The handlers that never ran hold the open sessions: destroying the io_context destroys them, and
    // each reports its connection once, while the observer and the policy are still alive.
    io_owner.reset();
}

void EgressProxy::Impl::wait_for_posted() {
    auto ran = std::make_shared<std::promise<void>>();
    auto future = ran->get_future();
    post_if_running([ran] { ran->set_value(); });
    // After stop() nothing runs: the handler (and its promise) is destroyed, which ends the wait too.
    future.wait();
}

void EgressProxy::Impl::serve(UniqueFd listener) {
    auto shared_fd = std::make_shared<UniqueFd>(std::move(listener));
    post_if_running([this, shared_fd] { replace_listener(std::move(*shared_fd)); });
}

void EgressProxy::Impl::replace_listener(UniqueFd listener) {
    ++listener_generation;
    acceptor.reset();
    accepting_paused = false;
    sockaddr_storage local{};
    socklen_t length = sizeof(local);
    if (::getsockname(listener.get(), reinterpret_cast<sockaddr*>(&local), &length) != 0) {
        log_event(LogLevel::error, "egress_listener_rejected",
                  {{"error", std::string("getsockname: ") + std::strerror(errno)}});
        return;
    }
    const auto protocol = local.ss_family == AF_INET6 ? tcp::v6() : tcp::v4();
    acceptor.emplace(io);
    error_code error;
    acceptor->assign(protocol, listener.get(), error);
    if (error) {
        log_event(LogLevel::error, "egress_listener_rejected", {{"error", error.message()}});
        acceptor.reset();
        return;
    }
    listener.release();
    accept_next(listener_generation);
}

void EgressProxy::Impl::accept_next(std::uint64_t generation) {
    acceptor->async_accept([this, generation](error_code error, tcp::socket socket) {
        if (generation != listener_generation) {
            return;  // replaced by a newer worker's listener
        }
        if (error == asio::error::operation_aborted) {
            return;
        }
        if (error) {
            // Out of descriptors or memory: pause instead of spinning on the same error.
            log_event(LogLevel::warning, "egress_accept_failed", {{"error", error.message()}});
            accept_pause->expires_after(std::chrono::milliseconds(100));
            accept_pause->async_wait([this, generation](error_code) {
                if (generation == listener_generation && acceptor) {
                    accept_next(generation);
                }
            });
            return;
        }
        const auto session = std::make_shared<Session>(*this, std::move(socket));
        if (open_sessions > limits.max_connections) {
            session->refuse_busy();
        } else {
            session->start();
        }
        if (open_sessions >= limits.max_connections + max_refusing_sessions) {
            // Further connections wait in the listen backlog (the worker's connect() blocks) until a session
            // ends: whatever the worker opens, the proxy holds at most this many sessions.
            accepting_paused = true;
            return;
        }
        accept_next(generation);
    });
}

void EgressProxy::Impl::session_closed() {
    if (accepting_paused && acceptor && open_sessions < limits.max_connections + max_refusing_sessions) {
        accepting_paused = false;
        accept_next(listener_generation);
    }
}

EgressProxy::EgressProxy(EgressPolicy policy, PinnedHosts pinned, ApprovalBroker& broker,
                         EgressObserver& observer, ProxyLimits limits)
    : impl_(std::make_shared<Impl>(std::move(policy), std::move(pinned), broker, observer, limits)) {
    impl_->start();
}

EgressProxy::~EgressProxy() {
    stop();
}

void EgressProxy::serve(UniqueFd listener) {
    impl_->serve(std::move(listener));
}

void EgressProxy::stop() {
    impl_->stop();
}

std::size_t EgressProxy::waiting_for_approval() const noexcept {
    return impl_->approval_waiters.load();
}

void EgressProxy::wait_for_posted() {
    impl_->wait_for_posted();
}

}  // namespace cellblock::kernel::egress
