#include "egress/egress_proxy.hpp"

#include <sys/socket.h>

#include <array>
#include <atomic>
#include <boost/asio/connect.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/http.hpp>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstring>
#include <future>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <thread>
#include <vector>

#include "common/logging.hpp"
#include "egress/egress_address.hpp"
#include "egress/tls_client_hello.hpp"

namespace cellblock::kernel::egress {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;
using error_code = boost::system::error_code;
using Clock = std::chrono::steady_clock;

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

namespace {

constexpr std::size_t relay_buffer_bytes = std::size_t{64} * 1024;
constexpr std::size_t max_response_head_bytes = std::size_t{64} * 1024;
constexpr auto refusal_linger = std::chrono::seconds(2);
// Sessions over max_connections answered 503 (each for up to refusal_linger) at once; beyond, accepting
// pauses.
constexpr std::size_t max_refusing_sessions = 16;
constexpr std::string_view message_prefix = "cellblock egress: ";
constexpr std::uint64_t unlimited_body = std::numeric_limits<std::uint64_t>::max();

bool forwarded_method(http::verb method) {
    switch (method) {
        case http::verb::connect:
        case http::verb::get:
        case http::verb::head:
        case http::verb::post:
        case http::verb::put:
        case http::verb::patch:
        case http::verb::delete_:
        case http::verb::options:
            return true;
        default:
            return false;
    }
}

struct Authority {
    std::string host;
    std::uint16_t port = 0;
};

class BadRequest : public std::runtime_error {
  public:
    using std::runtime_error::runtime_error;
};

std::uint16_t parse_port(std::string_view text, std::string_view what) {
    unsigned value = 0;
    const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
    if (text.empty() || error != std::errc{} || end != text.data() + text.size() || value < 1 ||
        value > 65535) {
        throw BadRequest("bad port \"" + std::string(text) + "\" in " + std::string(what));
    }
    return static_cast<std::uint16_t>(value);
}

// "host:port", "[v6]:port", or without the port when `default_port` is given.
Authority parse_authority(std::string_view text, std::optional<std::uint16_t> default_port,
                          std::string_view what) {
    std::string_view host = text;
    std::optional<std::string_view> port;
    if (text.starts_with('[')) {
        const auto close = text.find(']');
        if (close == std::string_view::npos) {
            throw BadRequest("unterminated [IPv6] address in " + std::string(what));
        }
        host = text.substr(1, close - 1);
        const auto rest = text.substr(close + 1);
        if (!rest.empty()) {
            if (!rest.starts_with(':')) {
                throw BadRequest("unexpected text after the [IPv6] address in " + std::string(what));
            }
            port = rest.substr(1);
        }
        if (host.find(':') == std::string_view::npos) {
            throw BadRequest("brackets around something that is not an IPv6 address in " + std::string(what));
        }
    } else if (const auto colon = text.rfind(':'); colon != std::string_view::npos) {
        host = text.substr(0, colon);
        port = text.substr(colon + 1);
        if (host.find(':') != std::string_view::npos) {
            throw BadRequest("an IPv6 address must be in brackets in " + std::string(what));
        }
    }
    Authority authority;
    try {
        authority.host = validated_host(host);
    } catch (const PolicyError& error) {
        throw BadRequest("bad host \"" + std::string(host) + "\" in " + std::string(what) + ": " +
                         error.what());
    }
    if (port) {
        authority.port = parse_port(*port, what);
    } else if (default_port) {
        authority.port = *default_port;
    } else {
        throw BadRequest(std::string(what) + " needs a port (host:port)");
    }
    return authority;
}

bool starts_with_nocase(std::string_view text, std::string_view prefix) {
    if (text.size() < prefix.size()) {
        return false;
    }
    for (std::size_t i = 0; i < prefix.size(); ++i) {
        if (std::tolower(static_cast<unsigned char>(text[i])) != prefix[i]) {
            return false;
        }
    }
    return true;
}

struct AbsoluteTarget {
    Authority authority;
    std::string origin_form;
};

AbsoluteTarget parse_absolute_target(std::string_view target) {
    if (starts_with_nocase(target, "https://")) {
        throw BadRequest("https:// URLs go through CONNECT, not as a plain proxy request");
    }
    if (!starts_with_nocase(target, "http://")) {
        throw BadRequest("this is a proxy: send an absolute http:// URL or CONNECT host:port, got \"" +
                         std::string(target.substr(0, 200)) + "\"");
    }
    auto rest = target.substr(7);
    const auto end = rest.find_first_of("/?#");
    const auto authority_text = rest.substr(0, end);
    if (authority_text.find('@') != std::string_view::npos) {
        throw BadRequest("user information in the URL is not accepted");
    }
    AbsoluteTarget parsed{parse_authority(authority_text, 80, "the URL"), {}};
    auto path = end == std::string_view::npos ? std::string_view{} : rest.substr(end);
    if (const auto fragment = path.find('#'); fragment != std::string_view::npos) {
        path = path.substr(0, fragment);
    }
    parsed.origin_form = path.starts_with('/') ? std::string(path) : "/" + std::string(path);
    return parsed;
}

double milliseconds_since(Clock::time_point start) {
    return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

std::string new_approval_id() {
    std::random_device random;
    std::uniform_int_distribution<int> digit(0, 15);
    std::string id = "ap-";
    for (int i = 0; i < 16; ++i) {
        id += "0123456789abcdef"[digit(random)];
    }
    return id;
}

std::string seconds_text(std::chrono::milliseconds duration) {
    const double seconds = std::chrono::duration<double>(duration).count();
    if (seconds == std::floor(seconds)) {
        return std::to_string(static_cast<long long>(seconds)) + " s";
    }
    auto text = std::to_string(seconds);
    text.erase(text.find_last_not_of('0') + 1);
    return text + " s";
}

}  // namespace

struct PendingApproval {
    explicit PendingApproval(asio::io_context& io) : timer(io) {}
    ApprovalRequest request;
    asio::steady_timer timer;
    bool decided = false;
    std::vector<std::function<void(Decision, const std::string&)>> waiters;
};

class Session;

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

    void run() {
        while (true) {
            try {
                io.run();
                return;
            } catch (const std::exception& error) {
                log_event(LogLevel::error, "egress_proxy_handler_failed", {{"error", error.what()}});
            }
        }
    }

    void stop() {
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

    // Posts `handler` unless the proxy stopped (the io_context is gone then). Thread-safe.
    template <typename Handler>
    void post_if_running(Handler&& handler) {
        std::lock_guard lock(stop_mutex);
        if (!stopped) {
            asio::post(io, std::forward<Handler>(handler));
        }
    }

    void wait_for_posted() {
        auto ran = std::make_shared<std::promise<void>>();
        auto future = ran->get_future();
        post_if_running([ran] { ran->set_value(); });
        // After stop() nothing runs: the handler (and its promise) is destroyed, which ends the wait too.
        future.wait();
    }

    void serve(UniqueFd listener) {
        auto shared_fd = std::make_shared<UniqueFd>(std::move(listener));
        post_if_running([this, shared_fd] { replace_listener(std::move(*shared_fd)); });
    }

    void replace_listener(UniqueFd listener) {
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

    void accept_next(std::uint64_t generation);
    // A session ended: accepting resumes if it was paused at the cap.
    void session_closed();

    void request_approval(const std::string& host, std::uint16_t port, const std::string& method,
                          std::function<void(Decision, const std::string&)> waiter) {
        auto& entry = pending[host];
        if (!entry) {
            entry = std::make_shared<PendingApproval>(io);
            entry->request = {new_approval_id(), host, port, method};
            entry->timer.expires_after(policy.approval_timeout());
            // Neither the timer nor the broker's callback owns the approval: the callback may outlive the
            // proxy (a broker keeps it), and nothing of the io_context may be destroyed after it.
            entry->timer.async_wait([this, weak_entry = std::weak_ptr(entry)](error_code error) {
                if (const auto held = weak_entry.lock(); held && !error) {
                    decide(held, Decision::timeout, "");
                }
            });
            entry->waiters.push_back(std::move(waiter));
            ++approval_waiters;
            const auto request = entry->request;
            observer.on_approval_requested(request,
                                           std::chrono::duration<double>(policy.approval_timeout()).count());
            std::weak_ptr<Impl> weak = weak_from_this();
            broker.request(request, [weak, host = request.host, id = request.id](Decision decision,
                                                                                 std::string decided_by) {
                if (const auto self = weak.lock()) {
                    self->post_if_running(
                        [raw = self.get(), host, id, decision, decided_by = std::move(decided_by)] {
                            if (const auto found = raw->pending.find(host);
                                found != raw->pending.end() && found->second->request.id == id) {
                                raw->decide(found->second, decision, decided_by);
                            }
                        });
                }
            });
            return;
        }
        entry->waiters.push_back(std::move(waiter));
        ++approval_waiters;
    }

    // By value: erasing the map's entry below must not destroy the approval while it is decided.
    void decide(std::shared_ptr<PendingApproval> entry,  // NOLINT(performance-unnecessary-value-param)
                Decision decision, const std::string& decided_by) {
        if (entry->decided) {
            return;
        }
        entry->decided = true;
        entry->timer.cancel();
        if (const auto found = pending.find(entry->request.host);
            found != pending.end() && found->second == entry) {
            pending.erase(found);
        }
        if (decision == Decision::allow_session) {
            policy.allow_for_session(entry->request.host);
        }
        observer.on_approval_decided(entry->request, decision, decided_by);
        auto waiters = std::move(entry->waiters);
        approval_waiters -= waiters.size();
        for (auto& waiter : waiters) {
            waiter(decision, decided_by);
        }
    }

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

namespace {

enum class Phase { head, deciding, connecting, client_hello, relay, refusing, closed };

}  // namespace

class Session : public std::enable_shared_from_this<Session> {
  public:
    Session(EgressProxy::Impl& proxy, tcp::socket client)
        : proxy_(proxy),
          client_(std::move(client)),
          upstream_(proxy.io),
          resolver_(proxy.io),
          deadline_(proxy.io) {
        ++proxy_.open_sessions;
    }

    ~Session() {
        --proxy_.open_sessions;
        proxy_.session_closed();
        record_.duration_ms = milliseconds_since(started_);
        if (!record_.allowed && record_.rule.empty()) {
            record_.rule = phase_ == Phase::deciding ? "held for approval when the proxy stopped"
                                                     : "closed before the request was decided";
        }
        try {
            log_event(record_.allowed ? LogLevel::info : LogLevel::warning, "egress_connection",
                      {{"host", record_.host},
                       {"port", record_.port},
                       {"method", record_.method},
                       {"bytes_up", record_.bytes_up},
                       {"bytes_down", record_.bytes_down},
                       {"duration_ms", record_.duration_ms},
                       {"allowed", record_.allowed},
                       {"rule", record_.rule},
                       {"error", record_.error}});
            proxy_.observer.on_connection(record_);
        } catch (const std::exception& error) {
            log_event(LogLevel::error, "egress_observer_failed", {{"error", error.what()}});
        }
    }

    void start() {
        arm(proxy_.limits.request_head,
            "no complete request head within " + seconds_text(proxy_.limits.request_head));
        parser_.emplace();
        parser_->header_limit(max_request_head_bytes);
        // Only the head is parsed; the body is relayed as it comes, so Beast's default body limit (which it
        // checks against Content-Length while reading the head) must not apply. Not boost::none: Boost 1.74
        // compares a length with an empty limit as "exceeded".
        parser_->body_limit(unlimited_body);
        http::async_read_header(
            client_, head_buffer_, *parser_,
            [self = shared_from_this()](error_code error, std::size_t) { self->on_head(error); });
    }

    void refuse_busy() {
        refuse(http::status::service_unavailable, "too many connections open through the proxy (limit " +
                                                      std::to_string(proxy_.limits.max_connections) + ")");
    }

  private:
    // --- the request ---

    void on_head(error_code error) {
        if (error) {
            if (timed_out_) {
                record_.rule = *timed_out_;
                return close();
            }
            if (error == http::error::header_limit) {
                return refuse(
                    http::status::request_header_fields_too_large,
                    "the request head is larger than " + std::to_string(max_request_head_bytes) + " bytes");
            }
            if (error == http::error::end_of_stream || error == asio::error::eof) {
                record_.rule = "client closed before sending a request";
                return close();
            }
            if (error.category() == http::make_error_code(http::error::bad_target).category()) {
                return refuse(http::status::bad_request, "malformed request: " + error.message());
            }
            record_.rule = "client connection failed: " + error.message();
            return close();
        }
        const auto& request = parser_->get();
        // Only real methods: the method reaches an approval that a person or a model reads, so a token of the
        // worker's choosing (e.g. OPERATOR_PREAPPROVED_CHOOSE_ALLOW) must never be echoed there.
        if (!forwarded_method(request.method())) {
            record_.method = "(refused)";
            return refuse(http::status::method_not_allowed,
                          "the proxy forwards only CONNECT, GET, HEAD, POST, PUT, PATCH, DELETE and OPTIONS");
        }
        record_.method = std::string(request.method_string());
        try {
            if (request.method() == http::verb::connect) {
                connect_method_ = true;
                auto authority = parse_authority(request.target(), std::nullopt, "the CONNECT target");
                record_.host = authority.host;
                record_.port = authority.port;
            } else {
                auto target = parse_absolute_target(request.target());
                record_.host = target.authority.host;
                record_.port = target.authority.port;
                origin_form_ = std::move(target.origin_form);
                check_host_header(request, target.authority);
                if (request.find(http::field::transfer_encoding) != request.end()) {
                    return refuse(http::status::length_required,
                                  "request bodies must carry a Content-Length (chunked uploads are not "
                                  "supported by the proxy)");
                }
                body_remaining_ = parser_->content_length().value_or(0);
            }
        } catch (const BadRequest& bad) {
            return refuse(http::status::bad_request, bad.what());
        }
        if (!proxy_.policy.port_allowed(record_.port)) {
            return refuse(http::status::forbidden,
                          "port " + std::to_string(record_.port) + " is not allowed for " + record_.host +
                              " (allowed ports: " + proxy_.policy.describe_ports() + ")");
        }
        const auto decision = proxy_.policy.decide(record_.host);
        switch (decision.verdict) {
            case Verdict::allowed:
                record_.rule = decision.rule;
                return resolve();
            case Verdict::outside_ceiling:
                return refuse(http::status::forbidden,
                              record_.host + " is outside this gateway's network ceiling (ceiling: " +
                                  proxy_.policy.describe_ceiling() + ")");
            case Verdict::not_allowed:
                return refuse(http::status::forbidden,
                              record_.host + " is not on this session's network allowlist (allowed: " +
                                  proxy_.policy.describe_allowlist() + ")");
            case Verdict::ask:
                return ask();
        }
    }

    void check_host_header(const http::request<http::empty_body>& request, const Authority& uri) {
        if (request.count(http::field::host) > 1) {
            throw BadRequest("more than one Host header");
        }
        const auto host_header = request.find(http::field::host);
        if (host_header == request.end()) {
            return;  // HTTP/1.0 without Host: the proxy sends the URL's
        }
        const auto header = parse_authority(host_header->value(), 80, "the Host header");
        if (header.host != uri.host || header.port != uri.port) {
            throw BadRequest("the Host header (" + std::string(host_header->value()) +
                             ") does not match the URL's host (" + uri.host + ":" + std::to_string(uri.port) +
                             ")");
        }
    }

    // --- approval ---

    void ask() {
        phase_ = Phase::deciding;
        deadline_.cancel();
        proxy_.request_approval(
            record_.host, record_.port, record_.method,
            [self = shared_from_this()](Decision decision, const std::string& decided_by) {
                self->on_decision(decision, decided_by);
            });
    }

    void on_decision(Decision decision, const std::string& decided_by) {
        if (phase_ != Phase::deciding) {
            return;
        }
        const std::string target = record_.host + ":" + std::to_string(record_.port);
        switch (decision) {
            case Decision::allow_once:
            case Decision::allow_session:
                record_.rule = "approval:" + std::string(to_string(decision)) + " by " + decided_by;
                return resolve();
            case Decision::deny:
                return refuse(http::status::forbidden,
                              "the request to " + target + " was denied by " +
                                  (decided_by.empty() ? "the approver" : decided_by));
            case Decision::timeout:
                return refuse(http::status::forbidden, "no decision within " +
                                                           seconds_text(proxy_.policy.approval_timeout()) +
                                                           " on the request to " + target + "; refused");
        }
    }

    // --- resolve and connect ---

    void resolve() {
        phase_ = Phase::connecting;
        arm(proxy_.limits.connect,
            "could not connect to " + record_.host + " within " + seconds_text(proxy_.limits.connect));
        if (const auto* addresses = proxy_.pinned.lookup(record_.host)) {
            // The operator's own statement: these addresses are exempt from the private-address refusal (not
            // from the operator's deny list).
            std::vector<tcp::endpoint> endpoints;
            for (const auto& address : *addresses) {
                if (const auto reason = proxy_.policy.denied(address)) {
                    return refuse_address(address, *reason);
                }
                endpoints.emplace_back(address, record_.port);
            }
            return connect(std::move(endpoints));
        }
        if (is_ip_literal(record_.host)) {
            const auto address = asio::ip::make_address(record_.host);
            if (const auto reason = refusal_reason(address)) {
                return refuse_address(address, *reason);
            }
            return connect({tcp::endpoint(address, record_.port)});
        }
        resolver_.async_resolve(
            record_.host, std::to_string(record_.port),
            [self = shared_from_this()](error_code error, const tcp::resolver::results_type& results) {
                self->on_resolved(error, results);
            });
    }

    // Why the proxy does not connect to `address`: the operator's deny list, then the ranges and the host's
    // own addresses (egress_address.hpp).
    std::optional<std::string> refusal_reason(const asio::ip::address& address) const {
        if (auto denied = proxy_.policy.denied(address)) {
            return denied;
        }
        return forbidden_address_reason(address, proxy_.host_addresses);
    }

    void on_resolved(error_code error, const tcp::resolver::results_type& results) {
        if (error) {
            if (timed_out_) {
                return refuse(http::status::gateway_timeout, *timed_out_);
            }
            return refuse(http::status::bad_gateway,
                          "cannot resolve " + record_.host + ": " + error.message(), true);
        }
        std::vector<tcp::endpoint> endpoints;
        std::optional<std::pair<asio::ip::address, std::string>> refused;
        for (const auto& entry : results) {
            const auto address = entry.endpoint().address();
            if (auto reason = refusal_reason(address)) {
                if (!refused) {
                    refused.emplace(address, std::move(*reason));
                }
                continue;
            }
            endpoints.push_back(entry.endpoint());
        }
        if (endpoints.empty()) {
            if (refused) {
                return refuse_address(refused->first, refused->second);
            }
            return refuse(http::status::bad_gateway, "cannot resolve " + record_.host + ": no address", true);
        }
        connect(std::move(endpoints));
    }

    void refuse_address(const asio::ip::address& address, const std::string& reason) {
        refuse(http::status::forbidden, record_.host + " resolves to " + address.to_string() + ", " + reason +
                                            "; the proxy does not connect to loopback, private, link-local, "
                                            "multicast or metadata addresses");
    }

    void connect(std::vector<tcp::endpoint> endpoints) {
        endpoints_ = std::move(endpoints);
        asio::async_connect(upstream_, endpoints_,
                            [self = shared_from_this()](error_code error, const tcp::endpoint&) {
                                self->on_connected(error);
                            });
    }

    void on_connected(error_code error) {
        if (error) {
            if (timed_out_) {
                return refuse(http::status::gateway_timeout, *timed_out_, true);
            }
            return refuse(http::status::bad_gateway,
                          "cannot connect to " + record_.host + ":" + std::to_string(record_.port) + ": " +
                              error.message(),
                          true);
        }
        record_.allowed = true;
        if (connect_method_) {
            return establish_tunnel();
        }
        forward_request();
    }

    // --- CONNECT: the tunnel and its ClientHello ---

    void establish_tunnel() {
        static constexpr std::string_view established = "HTTP/1.1 200 Connection established\r\n\r\n";
        phase_ = Phase::client_hello;
        arm(proxy_.limits.client_hello,
            "no complete TLS ClientHello within " + seconds_text(proxy_.limits.client_hello));
        // Bytes the client sent right after the CONNECT head are the start of its ClientHello.
        const auto leftover = head_buffer_.data();
        hello_.assign(static_cast<const char*>(leftover.data()), leftover.size());
        head_buffer_.consume(head_buffer_.size());
        asio::async_write(client_, asio::buffer(established),
                          [self = shared_from_this()](error_code error, std::size_t) {
                              if (error) {
                                  return self->fail(error);
                              }
                              self->check_client_hello();
                          });
    }

    void check_client_hello() {
        const auto parsed = parse_client_hello(hello_);
        switch (parsed.status) {
            case ClientHelloStatus::need_more:
                if (hello_.size() >= max_client_hello_bytes) {
                    return refuse_tunnel("the client's first bytes are not a TLS ClientHello of at most " +
                                         std::to_string(max_client_hello_bytes) + " bytes");
                }
                allocate_relay_buffers();
                client_.async_read_some(
                    asio::buffer(up_buffer_.data(),
                                 std::min(up_buffer_.size(), max_client_hello_bytes - hello_.size())),
                    [self = shared_from_this()](error_code error, std::size_t read) {
                        if (error) {
                            if (self->timed_out_) {
                                return self->refuse_tunnel(*self->timed_out_);
                            }
                            return self->refuse_tunnel(
                                "the client closed the tunnel before a whole TLS ClientHello");
                        }
                        self->hello_.append(self->up_buffer_.data(), read);
                        self->check_client_hello();
                    });
                return;
            case ClientHelloStatus::invalid:
                return refuse_tunnel("the client's first bytes are not a TLS ClientHello (" + parsed.error +
                                     ")");
            case ClientHelloStatus::complete:
                break;
        }
        if (!parsed.server_name) {
            return refuse_tunnel("the TLS ClientHello names no server (no SNI); the CONNECT host was " +
                                 record_.host);
        }
        if (normalize_host(*parsed.server_name) != record_.host) {
            return refuse_tunnel("the TLS ClientHello names " + *parsed.server_name +
                                 ", not the CONNECT host " + record_.host);
        }
        asio::async_write(upstream_, asio::buffer(hello_),
                          [self = shared_from_this()](error_code error, std::size_t written) {
                              if (error) {
                                  return self->fail(error);
                              }
                              self->record_.bytes_up += written;
                              self->hello_.clear();
                              self->start_relay(true);
                          });
    }

    // After "200 Connection established" no HTTP answer is possible: the tunnel is closed and the refusal
    // logged.
    void refuse_tunnel(const std::string& why) {
        record_.allowed = false;
        record_.rule = "refused: " + why;
        close();
    }

    // --- plain HTTP: one request, origin-form, Connection: close ---

    void forward_request() {
        phase_ = Phase::relay;
        arm(proxy_.limits.idle, "no data either way for " + seconds_text(proxy_.limits.idle));
        outgoing_head_.emplace(parser_->get());
        outgoing_head_->target(origin_form_);
        outgoing_head_->set(http::field::host, host_header_value());
        outgoing_head_->set(http::field::connection, "close");
        outgoing_head_->erase(http::field::proxy_connection);
        outgoing_head_->erase(http::field::proxy_authorization);
        outgoing_head_->erase(http::field::keep_alive);
        serializer_.emplace(*outgoing_head_);
        http::async_write_header(upstream_, *serializer_,
                                 [self = shared_from_this()](error_code error, std::size_t written) {
                                     if (error) {
                                         return self->fail(error);
                                     }
                                     self->record_.bytes_up += written;
                                     self->send_buffered_body();
                                 });
    }

    std::string host_header_value() const {
        const bool v6 = record_.host.find(':') != std::string::npos;
        std::string value = v6 ? "[" + record_.host + "]" : record_.host;
        if (record_.port != 80) {
            value += ":" + std::to_string(record_.port);
        }
        return value;
    }

    // The part of the body that arrived with the head, then the rest from the client.
    void send_buffered_body() {
        const auto buffered = std::min<std::uint64_t>(body_remaining_, head_buffer_.size());
        if (buffered == 0) {
            return start_relay(false);
        }
        asio::async_write(upstream_, asio::buffer(head_buffer_.data(), buffered),
                          [self = shared_from_this()](error_code error, std::size_t written) {
                              if (error) {
                                  return self->fail(error);
                              }
                              self->record_.bytes_up += written;
                              self->body_remaining_ -= written;
                              self->head_buffer_.consume(self->head_buffer_.size());
                              self->start_relay(false);
                          });
    }

    // --- relay ---

    struct Pipe {
        tcp::socket* from;
        tcp::socket* to;
        std::vector<char>* buffer;
        std::uint64_t* counter;
        std::optional<std::uint64_t>* remaining;  // plain HTTP's upload: the body's length
        bool done = false;
    };

    // A session holds its two relay buffers only from the moment its tunnel or request is let through: one
    // that is refused, held for approval or still sending its head costs no more than its socket and parser.
    void allocate_relay_buffers() {
        if (up_buffer_.empty())
            up_buffer_.resize(relay_buffer_bytes);
        if (down_buffer_.empty())
            down_buffer_.resize(relay_buffer_bytes);
    }

    void start_relay(bool tunnel) {
        allocate_relay_buffers();
        phase_ = Phase::relay;
        tunnel_ = tunnel;
        arm(proxy_.limits.idle, "no data either way for " + seconds_text(proxy_.limits.idle));
        up_ = Pipe{&client_, &upstream_, &up_buffer_, &record_.bytes_up, &upload_limit_};
        down_ = Pipe{&upstream_, &client_, &down_buffer_, &record_.bytes_down, &no_limit_};
        if (!tunnel) {
            upload_limit_ = body_remaining_;
        }
        pump(up_);
        if (tunnel) {
            return pump(down_);
        }
        read_response_head();
    }

    // Plain HTTP: the client is told `Connection: close` too (this connection carries one request), then the
    // rest of the response is streamed as it comes until the server closes.
    void read_response_head() {
        response_parser_.emplace();
        response_parser_->header_limit(max_response_head_bytes);
        response_parser_->body_limit(unlimited_body);  // as for the request: a 100 MB download is relayed
        http::async_read_header(upstream_, response_buffer_, *response_parser_,
                                [self = shared_from_this()](error_code error, std::size_t) {
                                    if (error) {
                                        if (self->phase_ == Phase::closed) {
                                            return;
                                        }
                                        // Nothing was sent to the client yet: it gets a readable 502.
                                        return self->refuse(http::status::bad_gateway,
                                                            "the response of " + self->record_.host +
                                                                " is not valid HTTP (" + error.message() +
                                                                ")",
                                                            true);
                                    }
                                    self->last_activity_ = Clock::now();
                                    self->send_response_head();
                                });
    }

    void send_response_head() {
        outgoing_response_.emplace(response_parser_->get());
        outgoing_response_->set(http::field::connection, "close");
        outgoing_response_->erase(http::field::keep_alive);
        outgoing_response_->erase(http::field::proxy_connection);
        response_serializer_.emplace(*outgoing_response_);
        http::async_write_header(client_, *response_serializer_,
                                 [self = shared_from_this()](error_code error, std::size_t written) {
                                     if (error) {
                                         return self->fail(error);
                                     }
                                     self->record_.bytes_down += written;
                                     self->send_buffered_response();
                                 });
    }

    // The part of the body that arrived with the response head, then the rest as it comes.
    void send_buffered_response() {
        if (response_buffer_.size() == 0) {
            return pump(down_);
        }
        asio::async_write(client_, response_buffer_.data(),
                          [self = shared_from_this()](error_code error, std::size_t written) {
                              if (error) {
                                  return self->fail(error);
                              }
                              self->record_.bytes_down += written;
                              self->response_buffer_.consume(self->response_buffer_.size());
                              self->pump(self->down_);
                          });
    }

    void pump(Pipe& pipe) {
        std::size_t wanted = pipe.buffer->size();
        if (pipe.remaining->has_value()) {
            wanted = static_cast<std::size_t>(std::min<std::uint64_t>(wanted, **pipe.remaining));
            if (wanted == 0) {
                return pipe_finished(pipe, false);
            }
        }
        pipe.from->async_read_some(asio::buffer(pipe.buffer->data(), wanted),
                                   [self = shared_from_this(), &pipe](error_code error, std::size_t read) {
                                       if (error) {
                                           if (error == asio::error::eof && self->phase_ == Phase::relay) {
                                               return self->pipe_finished(pipe, true);
                                           }
                                           return self->fail(error);
                                       }
                                       self->last_activity_ = Clock::now();
                                       asio::async_write(
                                           *pipe.to, asio::buffer(pipe.buffer->data(), read),
                                           [self, &pipe](error_code write_error, std::size_t written) {
                                               if (write_error) {
                                                   return self->fail(write_error);
                                               }
                                               self->last_activity_ = Clock::now();
                                               *pipe.counter += written;
                                               if (pipe.remaining->has_value()) {
                                                   **pipe.remaining -= written;
                                               }
                                               self->pump(pipe);
                                           });
                                   });
    }

    void pipe_finished(Pipe& pipe, bool end_of_stream) {
        pipe.done = true;
        if (!tunnel_) {
            // Plain HTTP: the upload ends with the body (the server answers and closes: Connection: close);
            // the exchange ends when the server closes. A client that closes early is noticed on the next
            // write.
            if (&pipe == &down_) {
                return close();
            }
            if (end_of_stream && upload_limit_.value_or(0) > 0) {
                record_.error = "the client closed before sending the whole request body";
                return close();
            }
            return;
        }
        if (end_of_stream) {
            error_code ignored;
            pipe.to->shutdown(tcp::socket::shutdown_send, ignored);
        }
        if (up_.done && down_.done) {
            close();
        }
    }

    // --- refusals, timeouts, end ---

    static std::string reason_phrase(http::status status, const std::string& message) {
        constexpr std::size_t max_reason_bytes = 400;
        std::string reason =
            std::string(http::obsolete_reason(status)) + ": " + std::string(message_prefix) + message;
        if (reason.size() > max_reason_bytes) {
            reason.resize(max_reason_bytes);
        }
        for (char& byte : reason) {  // one line of visible characters (RFC 9112 reason-phrase)
            const auto value = static_cast<unsigned char>(byte);
            if (value < 0x20 || value == 0x7f) {
                byte = ' ';
            }
        }
        return reason;
    }

    void refuse(http::status status, const std::string& message, bool policy_allowed = false) {
        if (phase_ == Phase::refusing || phase_ == Phase::closed) {
            return;
        }
        phase_ = Phase::refusing;
        // A refusal by the policy names itself as the rule; an allowed request that failed keeps its rule.
        record_.allowed = policy_allowed;
        (policy_allowed ? record_.error : record_.rule) = message;
        error_code ignored;
        upstream_.close(ignored);
        resolver_.cancel();
        auto response = std::make_shared<http::response<http::string_body>>(status, 11);
        response->set(http::field::content_type, "text/plain; charset=utf-8");
        response->set(http::field::connection, "close");
        response->body() = std::string(message_prefix) + message + "\n";
        // Clients of a CONNECT tunnel show only the status line ("Tunnel connection failed: 403 ..."), so the
        // reason phrase says why too.
        response->reason(reason_phrase(status, message));
        response->prepare_payload();
        arm(refusal_linger, "writing the refusal took too long");
        http::async_write(client_, *response,
                          [self = shared_from_this(), response](error_code error, std::size_t) {
                              if (error) {
                                  return self->close();
                              }
                              // Half-close and read what the client still sends, so the refusal is not lost
                              // to a reset.
                              error_code shutdown_error;
                              self->client_.shutdown(tcp::socket::shutdown_send, shutdown_error);
                              self->drain();
                          });
    }

    void drain() {
        client_.async_read_some(asio::buffer(drain_buffer_),
                                [self = shared_from_this()](error_code error, std::size_t) {
                                    if (error) {
                                        return self->close();
                                    }
                                    self->drain();
                                });
    }

    void fail(error_code error) {
        if (phase_ == Phase::closed) {
            return;
        }
        if (record_.error.empty() && error != asio::error::operation_aborted) {
            record_.error = error.message();
        }
        if (timed_out_ && record_.error.empty()) {
            record_.error = *timed_out_;
        }
        close();
    }

    void close() {
        if (phase_ == Phase::closed) {
            return;
        }
        phase_ = Phase::closed;
        error_code ignored;
        deadline_.cancel();
        resolver_.cancel();
        upstream_.close(ignored);
        client_.close(ignored);
    }

    // One timer per connection: the current phase's limit; in the relay, an idle limit measured from the last
    // byte either way.
    void arm(std::chrono::milliseconds limit, std::string reason) {
        deadline_reason_ = std::move(reason);
        deadline_limit_ = limit;
        last_activity_ = Clock::now();
        deadline_.expires_after(limit);
        deadline_.async_wait([self = shared_from_this(), generation = ++deadline_generation_](
                                 error_code error) { self->on_deadline(error, generation); });
    }

    void on_deadline(error_code error, std::uint64_t generation) {
        if (error || generation != deadline_generation_ || phase_ == Phase::closed) {
            return;
        }
        if (phase_ == Phase::relay) {
            const auto idle_until = last_activity_ + deadline_limit_;
            if (Clock::now() < idle_until) {
                deadline_.expires_at(idle_until);
                deadline_.async_wait([self = shared_from_this(), generation](error_code again) {
                    self->on_deadline(again, generation);
                });
                return;
            }
        }
        timed_out_ = deadline_reason_;
        error_code ignored;
        switch (phase_) {
            case Phase::connecting:  // the handlers answer 504
                resolver_.cancel();
                upstream_.close(ignored);
                return;
            case Phase::relay:
                record_.error = *timed_out_;
                return close();
            default:
                return close();
        }
    }

    EgressProxy::Impl& proxy_;
    tcp::socket client_;
    tcp::socket upstream_;
    tcp::resolver resolver_;
    asio::steady_timer deadline_;
    std::string deadline_reason_;
    std::chrono::milliseconds deadline_limit_{0};
    std::uint64_t deadline_generation_ = 0;
    std::optional<std::string> timed_out_;
    Clock::time_point last_activity_ = Clock::now();
    Clock::time_point started_ = Clock::now();
    Phase phase_ = Phase::head;

    beast::flat_buffer head_buffer_{max_request_head_bytes + relay_buffer_bytes};
    std::optional<http::request_parser<http::empty_body>> parser_;
    bool connect_method_ = false;
    std::string origin_form_;
    std::uint64_t body_remaining_ = 0;
    std::optional<http::request<http::empty_body>> outgoing_head_;
    std::optional<http::request_serializer<http::empty_body>> serializer_;
    beast::flat_buffer response_buffer_{max_response_head_bytes + relay_buffer_bytes};
    std::optional<http::response_parser<http::empty_body>> response_parser_;
    std::optional<http::response<http::empty_body>> outgoing_response_;
    std::optional<http::response_serializer<http::empty_body>> response_serializer_;
    std::vector<tcp::endpoint> endpoints_;
    std::string hello_;

    bool tunnel_ = false;
    std::vector<char> up_buffer_;           // empty until allocate_relay_buffers()
    std::vector<char> down_buffer_;         // likewise
    std::array<char, 256> drain_buffer_{};  // what a refused client still sends is read here and dropped
    std::optional<std::uint64_t> upload_limit_;
    std::optional<std::uint64_t> no_limit_;
    Pipe up_{};
    Pipe down_{};

    ConnectionRecord record_;
};

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
