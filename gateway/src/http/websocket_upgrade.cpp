#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/beast/ssl.hpp>
#include <boost/beast/websocket.hpp>
#include <boost/beast/websocket/ssl.hpp>
#include <deque>
#include <utility>

#include "http_connection.hpp"

// The WebSocket transport after an upgrade (plain or TLS): Beast's stream behind WebSocketTransport, with
// the gateway's timeouts, pings and message limit, writes queued in order.

namespace cellblock::gateway::http_detail {

namespace beast = boost::beast;
namespace websocket = beast::websocket;
namespace net = boost::asio;
using tcp = net::ip::tcp;

namespace {

template <class NextLayer>
class BeastWebSocketTransport : public WebSocketTransport,
                                public std::enable_shared_from_this<BeastWebSocketTransport<NextLayer>> {
  public:
    BeastWebSocketTransport(NextLayer&& stream, HttpRequest request, std::string subprotocol,
                            const HttpServerContext& context)
        : ws_(std::move(stream)),
          request_(std::move(request)),
          subprotocol_(std::move(subprotocol)),
          context_(context) {}

    const HttpRequest& request() const { return request_; }

    void accept(std::function<void(beast::error_code)> done) {
        beast::get_lowest_layer(ws_).expires_never();
        websocket::stream_base::timeout timeouts{};
        timeouts.handshake_timeout = std::chrono::seconds(30);
        const double ping = context_.config.ws_ping_interval;
        // Beast pings after half the idle timeout and closes when the other half passes without any traffic.
        timeouts.idle_timeout = ping > 0 ? std::chrono::milliseconds(static_cast<long long>(ping * 2000))
                                         : websocket::stream_base::none();
        timeouts.keep_alive_pings = ping > 0;
        ws_.set_option(timeouts);
        ws_.read_message_max(context_.config.max_message_bytes);
        // One frame per message, as Jupyter Server sends: Beast would otherwise cut every message into 4 KiB
        // frames, so a 1 MiB stream message reached a client as 256 frames to parse and join (a Python
        // client spent more CPU on that than on the JSON).
        ws_.auto_fragment(false);
        ws_.set_option(
            websocket::stream_base::decorator([protocol = subprotocol_](websocket::response_type& response) {
                response.set(beast::http::field::server, server_name);
                if (!protocol.empty())
                    response.set(beast::http::field::sec_websocket_protocol, protocol);
            }));
        ws_.async_accept(request_,
                         [self = this->shared_from_this(), done = std::move(done)](beast::error_code error) {
                             if (!error) {
                                 self->counted_open_ = true;
                                 self->context_.metrics.websocket_accepted.increment();
                                 self->context_.metrics.websocket_open.add(1);
                             }
                             done(error);
                         });
    }

    void start(Handlers handlers) override {
        handlers_ = std::move(handlers);
        read_next();
    }

    void send(std::string payload, bool binary) override {
        if (closing_ || closed_)
            return;
        queued_bytes_ += payload.size();
        queue_.emplace_back(std::move(payload), binary);
        if (!writing_)
            write_next();
    }

    void close(const std::string& reason, bool policy_violation) override {
        if (closing_ || closed_)
            return;
        closing_ = true;
        close_reason_ = reason.substr(0, 120);  // a close frame's reason is limited to 123 bytes
        policy_violation_ = policy_violation;
        if (!writing_)
            send_close();
    }

    // A handler of this connection threw: close with 1011 (internal error).
    void fail_internally() {
        internal_error_ = true;
        close("internal error in the gateway", false);
    }

    std::size_t queued_bytes() const override { return queued_bytes_; }
    const std::string& subprotocol() const override { return subprotocol_; }

  private:
    void read_next() {
        ws_.async_read(read_buffer_, [self = this->shared_from_this()](beast::error_code error, std::size_t) {
            if (error) {
                if (!is_quiet_disconnect(error))
                    self->context_.logger.info("websocket_read_failed", {{"error", error.message()}});
                self->finish(error == websocket::error::closed ? "client closed the connection"
                                                               : error.message());
                return;
            }
            std::string payload = beast::buffers_to_string(self->read_buffer_.data());
            self->read_buffer_.consume(self->read_buffer_.size());
            if (self->handlers_.on_message) {
                try {
                    self->handlers_.on_message(std::move(payload), self->ws_.got_binary());
                } catch (const std::exception& failure) {
                    // One connection's failure: close it (1011) and keep the gateway serving.
                    self->context_.logger.error("websocket_handler_failed", {{"error", failure.what()}});
                    self->fail_internally();
                }
            }
            if (!self->closed_)
                self->read_next();
        });
    }

    void write_next() {
        if (queue_.empty()) {
            writing_ = false;
            if (closing_)
                send_close();
            return;
        }
        writing_ = true;
        ws_.binary(queue_.front().second);
        ws_.async_write(net::buffer(queue_.front().first), [self = this->shared_from_this()](
                                                               beast::error_code error, std::size_t written) {
            if (!error)
                self->context_.metrics.count_streamed(GatewayMetrics::transport_websocket, written);
            self->queued_bytes_ -= self->queue_.front().first.size();
            self->queue_.pop_front();
            if (error) {
                self->queue_.clear();
                self->queued_bytes_ = 0;
                self->writing_ = false;
                self->finish(error.message());
                return;
            }
            self->write_next();
        });
    }

    void send_close() {
        if (closed_ || close_sent_)
            return;
        close_sent_ = true;
        websocket::close_reason reason(internal_error_     ? websocket::close_code::internal_error
                                       : policy_violation_ ? websocket::close_code::policy_error
                                                           : websocket::close_code::normal,
                                       close_reason_);
        ws_.async_close(reason, [self = this->shared_from_this()](beast::error_code) {
            self->finish(self->close_reason_);
        });
    }

    void finish(const std::string& reason) {
        if (closed_)
            return;
        closed_ = true;
        if (std::exchange(counted_open_, false))
            context_.metrics.websocket_open.add(-1);
        auto on_closed = std::move(handlers_.on_closed);
        handlers_ = {};  // breaks the transport ↔ endpoint reference cycle
        if (on_closed)
            on_closed(reason);
        if (!close_sent_ && !writing_) {
            beast::error_code ignored;
            beast::get_lowest_layer(ws_).socket().shutdown(tcp::socket::shutdown_both, ignored);
        }
    }

    websocket::stream<NextLayer> ws_;
    HttpRequest request_;
    std::string subprotocol_;
    const HttpServerContext& context_;
    beast::flat_buffer read_buffer_;
    std::deque<std::pair<std::string, bool>> queue_;
    std::size_t queued_bytes_ = 0;
    bool writing_ = false;
    bool closing_ = false;
    bool close_sent_ = false;
    bool closed_ = false;
    bool policy_violation_ = false;
    bool internal_error_ = false;
    bool counted_open_ = false;  // in cellblock_websocket_connections_open until finish()
    std::string close_reason_;
    Handlers handlers_;
};

template <class Stream>
void upgrade(Stream&& stream, HttpRequest request, std::string subprotocol,
             const RequestContext& request_context, RestResource* resource,
             const HttpServerContext& context) {
    auto transport = std::make_shared<BeastWebSocketTransport<Stream>>(
        std::forward<Stream>(stream), std::move(request), std::move(subprotocol), context);
    context.auth.close_on_revocation(request_context.principal, transport,
                                     [weak = std::weak_ptr<WebSocketTransport>(transport)] {
                                         if (auto open = weak.lock())
                                             open->close("the token was revoked", true);
                                     });
    transport->accept([transport, resource, query = request_context.query, params = request_context.params,
                       path = request_context.path, base_url = request_context.base_url,
                       principal = request_context.principal,
                       &logger = context.logger](beast::error_code error) mutable {
        if (error) {
            logger.info("websocket_handshake_failed", {{"error", error.message()}});
            return;
        }
        RequestContext upgraded{transport->request(), std::move(path), std::move(query), std::move(params),
                                std::move(base_url)};
        upgraded.principal = std::move(principal);
        try {
            resource->on_upgraded(upgraded, transport);
        } catch (const std::exception& failure) {
            logger.error("websocket_handler_failed", {{"error", failure.what()}});
            transport->fail_internally();
        }
    });
}

}  // namespace

void upgrade_to_websocket(beast::tcp_stream&& stream, HttpRequest request, std::string subprotocol,
                          const RequestContext& request_context, RestResource* resource,
                          const HttpServerContext& context) {
    upgrade(std::move(stream), std::move(request), std::move(subprotocol), request_context, resource,
            context);
}

void upgrade_to_websocket(beast::ssl_stream<beast::tcp_stream>&& stream, HttpRequest request,
                          std::string subprotocol, const RequestContext& request_context,
                          RestResource* resource, const HttpServerContext& context) {
    upgrade(std::move(stream), std::move(request), std::move(subprotocol), request_context, resource,
            context);
}

}  // namespace cellblock::gateway::http_detail
