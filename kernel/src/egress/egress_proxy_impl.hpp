// What the egress proxy's files (egress_proxy.cpp, egress_approvals.cpp, egress_session.cpp,
// egress_upstream.cpp, egress_relay.cpp) share and nothing else uses: EgressProxy::Impl, which owns the
// io_context thread, the listener and the approvals pending per host, the limits of a session's buffers and
// answers, and the names they use for Asio and Beast.
#pragma once

#include <atomic>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/beast/http.hpp>
#include <chrono>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "egress/egress_address.hpp"
#include "egress/egress_proxy.hpp"

namespace cellblock::kernel::egress {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;
using error_code = boost::system::error_code;
using Clock = std::chrono::steady_clock;

inline constexpr std::size_t relay_buffer_bytes = std::size_t{64} * 1024;
inline constexpr std::size_t max_response_head_bytes = std::size_t{64} * 1024;
inline constexpr auto refusal_linger = std::chrono::seconds(2);
// Sessions over max_connections answered 503 (each for up to refusal_linger) at once; beyond, accepting
// pauses.
inline constexpr std::size_t max_refusing_sessions = 16;
inline constexpr std::string_view message_prefix = "cellblock egress: ";
inline constexpr std::uint64_t unlimited_body = std::numeric_limits<std::uint64_t>::max();

struct PendingApproval {
    explicit PendingApproval(asio::io_context& io) : timer(io) {}
    ApprovalRequest request;
    asio::steady_timer timer;
    bool decided = false;
    std::vector<std::function<void(Decision, const std::string&)>> waiters;
};

class EgressProxy::Impl : public std::enable_shared_from_this<EgressProxy::Impl> {
  public:
    Impl(EgressPolicy policy_in, PinnedHosts pinned_in, ApprovalBroker& broker_in,
         EgressObserver& observer_in, ProxyLimits limits_in)
        : policy(std::move(policy_in)),
          pinned(std::move(pinned_in)),
          broker(broker_in),
          observer(observer_in),
          limits(limits_in) {}

    ~Impl() { stop(); }

    void start() {
        thread = std::thread([this] { run(); });
    }
    void run();
    void stop();

    // Posts `handler` unless the proxy stopped (the io_context is gone then). Thread-safe.
    template <typename Handler>
    void post_if_running(Handler&& handler) {
        std::lock_guard lock(stop_mutex);
        if (!stopped) {
            asio::post(io, std::forward<Handler>(handler));
        }
    }
    void wait_for_posted();

    // The listener (egress_proxy.cpp).
    void serve(UniqueFd listener);
    void replace_listener(UniqueFd listener);
    void accept_next(std::uint64_t generation);
    // A session ended: accepting resumes if it was paused at the cap.
    void session_closed();

    // Approvals, one pending per host whatever the number of sessions it holds (egress_approvals.cpp).
    void request_approval(const std::string& host, std::uint16_t port, const std::string& method,
                          std::function<void(Decision, const std::string&)> waiter);
    // By value: erasing the map's entry must not destroy the approval while it is decided.
    void decide(std::shared_ptr<PendingApproval> entry,  // NOLINT(performance-unnecessary-value-param)
                Decision decision, const std::string& decided_by);

    std::unique_ptr<asio::io_context> io_owner = std::make_unique<asio::io_context>();
    asio::io_context& io = *io_owner;
    std::optional<asio::executor_work_guard<asio::io_context::executor_type>> work{asio::make_work_guard(io)};
    EgressPolicy policy;
    PinnedHosts pinned;
    ApprovalBroker& broker;
    EgressObserver& observer;
    ProxyLimits limits;
    std::optional<tcp::acceptor> acceptor;
    std::uint64_t listener_generation = 0;
    std::optional<asio::steady_timer> accept_pause{std::in_place, io};
    // The host's own interface addresses, refused like private ones (egress_address.hpp).
    const std::vector<asio::ip::address> host_addresses = host_interface_addresses();
    std::size_t open_sessions = 0;  // Session objects alive (on the proxy thread only)
    bool accepting_paused = false;  // at max_connections + max_refusing_sessions
    std::map<std::string, std::shared_ptr<PendingApproval>> pending;  // one per host
    std::atomic<std::size_t> approval_waiters{0};                     // their waiters, for tests
    std::thread thread;
    std::mutex stop_mutex;
    bool stopped = false;
};

}  // namespace cellblock::kernel::egress
