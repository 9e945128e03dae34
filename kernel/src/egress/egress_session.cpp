#include "egress/egress_session.hpp"

#include <boost/asio/write.hpp>

#include "common/logging.hpp"

namespace cellblock::kernel::egress {

namespace {

double milliseconds_since(Clock::time_point start) {
    return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

}  // namespace

Session::Session(EgressProxy::Impl& proxy, tcp::socket client)
    : proxy_(proxy),
      client_(std::move(client)),
      upstream_(proxy.io),
      resolver_(proxy.io),
      deadline_(proxy.io) {
    ++proxy_.open_sessions;
}

Session::~Session() {
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

void Session::start() {
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

void Session::refuse_busy() {
    refuse(http::status::service_unavailable, "too many connections open through the proxy (limit " +
                                                  std::to_string(proxy_.limits.max_connections) + ")");
}

void Session::on_head(error_code error) {
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

std::string Session::reason_phrase(http::status status, const std::string& message) {
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

void Session::refuse(http::status status, const std::string& message, bool policy_allowed) {
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

void Session::drain() {
    client_.async_read_some(asio::buffer(drain_buffer_),
                            [self = shared_from_this()](error_code error, std::size_t) {
                                if (error) {
                                    return self->close();
                                }
                                self->drain();
                            });
}

void Session::fail(error_code error) {
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

void Session::close() {
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
void Session::arm(std::chrono::milliseconds limit, std::string reason) {
    deadline_reason_ = std::move(reason);
    deadline_limit_ = limit;
    last_activity_ = Clock::now();
    deadline_.expires_after(limit);
    deadline_.async_wait([self = shared_from_this(), generation = ++deadline_generation_](error_code error) {
        self->on_deadline(error, generation);
    });
}

void Session::on_deadline(error_code error, std::uint64_t generation) {
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

}  // namespace cellblock::kernel::egress
