#include "cellblock/gateway/http/http_server.hpp"

#include <boost/asio/ssl/stream.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/beast/ssl.hpp>
#include <boost/beast/websocket.hpp>
#include <boost/beast/websocket/ssl.hpp>
#include <deque>
#include <type_traits>

namespace cellblock::gateway {

namespace beast = boost::beast;
namespace websocket = beast::websocket;
namespace net = boost::asio;
namespace ssl = net::ssl;
using tcp = net::ip::tcp;
using nlohmann::json;

namespace {

// An authenticated keep-alive connection that sends nothing for this long is dropped; it also bounds reading
// a request body and writing a response. Before authentication the shorter --header-timeout applies.
constexpr auto request_timeout = std::chrono::seconds(60);
constexpr std::string_view server_name = "cellblock-gateway";

template <class Stream>
constexpr bool is_tls = !std::is_same_v<Stream, beast::tcp_stream>;

bool is_quiet_disconnect(const beast::error_code& error) {
    return error == net::error::eof || error == net::error::connection_reset ||
           error == net::error::operation_aborted || error == beast::error::timeout ||
           error == websocket::error::closed || error == net::ssl::error::stream_truncated ||
           error == net::error::broken_pipe;
}

// ------------------------------------------------------------------------------------------ WebSocket
// transport

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

// ------------------------------------------------------------------------------------------ HTTP connection

template <class Stream>
class HttpConnection : public std::enable_shared_from_this<HttpConnection<Stream>> {
  public:
    template <class... Args>
    HttpConnection(const HttpServerContext& context, ConnectionAdmission::PendingSlot pending,
                   Args&&... stream_arguments)
        : stream_(std::forward<Args>(stream_arguments)...), context_(context), pending_(std::move(pending)) {}

    void run() {
        if (pending_)
            pending_->on_close_request([weak = this->weak_from_this()] {
                // Over a cap on pending connections, the oldest makes room for a newer one: its read ends
                // with an error and the connection goes away.
                if (auto self = weak.lock())
                    beast::get_lowest_layer(self->stream_).close();
            });
        if constexpr (is_tls<Stream>) {
            beast::get_lowest_layer(stream_).expires_after(header_deadline());
            stream_.async_handshake(
                ssl::stream_base::server, [self = this->shared_from_this()](beast::error_code error) {
                    if (error) {
                        self->context_.logger.info("tls_handshake_failed", {{"error", error.message()}});
                        return;
                    }
                    self->read_request();
                });
        } else {
            read_request();
        }
    }

  private:
    std::chrono::milliseconds header_deadline() const {
        return std::chrono::milliseconds(static_cast<long long>(context_.config.header_timeout * 1000));
    }

    void read_request() {
        parser_.emplace();
        parser_->body_limit(context_.config.max_body_bytes);
        parser_->header_limit(64 * 1024);
        if (pending_)
            beast::get_lowest_layer(stream_).expires_after(header_deadline());
        else
            beast::get_lowest_layer(stream_).expires_after(request_timeout);
        http::async_read_header(stream_, buffer_, *parser_,
                                [self = this->shared_from_this()](beast::error_code error, std::size_t) {
                                    self->on_header(error);
                                });
    }

    void on_header(beast::error_code error) {
        if (error || parser_->is_done())
            return on_request(error);
        // A body is read only for a client that holds the token: without it nobody makes us buffer (or wait
        // for) max_body_bytes. Unread, the body makes the connection unusable, so it is closed after the
        // answer.
        if (auto answer = answer_before_body())
            return write(std::move(*answer), false);
        beast::get_lowest_layer(stream_).expires_after(request_timeout);
        http::async_read(stream_, buffer_, *parser_,
                         [self = this->shared_from_this()](beast::error_code body_error, std::size_t) {
                             self->on_request(body_error);
                         });
    }

    // What handle_request would answer without the token (a preflight, a foreign Origin, no or a wrong
    // token), decided on the headers alone; nullopt for a request whose body is to be read.
    std::optional<HttpResponse> answer_before_body() const {
        const auto& header = parser_->get();
        if (header.method() == http::verb::options)
            return empty_response(http::status::ok);
        if (!context_.cors.origin_allowed(header)) {
            if (websocket::is_upgrade(header))
                return json_error(http::status::forbidden, "Origin not allowed");
            return json_error(http::status::not_found, "Not Found");
        }
        const std::string_view target = header.target();
        const auto query_start = target.find('?');
        if (!context_.auth.authorized(
                header, parse_query(query_start == std::string_view::npos ? std::string_view{}
                                                                          : target.substr(query_start + 1))))
            return context_.auth.refusal(header);
        return std::nullopt;
    }

    void on_request(beast::error_code error) {
        if (error == http::error::end_of_stream || is_quiet_disconnect(error))
            return close_connection();
        if (error == http::error::body_limit) {
            return write(json_error(http::status::payload_too_large,
                                    "Request body exceeds " + std::to_string(context_.config.max_body_bytes) +
                                        " bytes"),
                         false);
        }
        if (error == http::error::header_limit) {
            return write(
                json_error(http::status::request_header_fields_too_large, "Request headers too large"),
                false);
        }
        if (error) {
            context_.logger.info("http_bad_request", {{"error", error.message()}});
            return write(json_error(http::status::bad_request, "Malformed HTTP request: " + error.message()),
                         false);
        }
        request_ = parser_->release();
        handle_request();
    }

    void handle_request() {
        const bool keep_alive = request_.keep_alive();
        const std::string_view target = request_.target();
        const auto query_start = target.find('?');
        const std::string_view raw_path = target.substr(0, query_start);
        auto query = parse_query(query_start == std::string_view::npos ? std::string_view{}
                                                                       : target.substr(query_start + 1));

        const std::string& base_url = context_.config.base_url;
        const std::string base_prefix =
            base_url.ends_with('/') ? base_url.substr(0, base_url.size() - 1) : base_url;
        if (!raw_path.starts_with(base_prefix) ||
            (raw_path.size() > base_prefix.size() && raw_path[base_prefix.size()] != '/')) {
            return write(json_error(http::status::not_found, "Not Found"), keep_alive);
        }
        RequestContext request_context{request_,
                                       std::string(raw_path.substr(base_prefix.size())),
                                       std::move(query),
                                       {},
                                       base_prefix + "/"};
        if (request_context.path.empty())
            request_context.path = "/";

        // CORS preflight never needs a token.
        if (request_.method() == http::verb::options)
            return write(empty_response(http::status::ok), keep_alive);
        const bool upgrade = websocket::is_upgrade(request_);
        if (!context_.cors.origin_allowed(request_)) {
            // Kernel Gateway answers a foreign Origin with 404 on REST and 403 on the WebSocket.
            if (upgrade)
                return write(json_error(http::status::forbidden, "Origin not allowed"), false);
            return write(json_error(http::status::not_found, "Not Found"), keep_alive);
        }
        auto principal = context_.auth.authenticate(request_, request_context.query);
        if (!principal)
            return write(context_.auth.refusal(request_), upgrade ? false : keep_alive);
        request_context.principal = *principal;
        if (!principal->is_operator() && principal->token_id != watched_token_) {
            // A revoked token's open stream ends with its connection (its next request would be refused).
            watched_token_ = principal->token_id;
            context_.auth.close_on_revocation(
                *principal, this->weak_from_this(), [weak = this->weak_from_this()] {
                    if (auto self = weak.lock()) {
                        beast::error_code ignored;
                        beast::get_lowest_layer(self->stream_).socket().close(ignored);
                    }
                });
        }
        pending_.reset();  // authenticated: no longer counted against the caps on unauthenticated connections
        if (upgrade)
            return handle_upgrade(request_context);

        request_context.client_address = client_address();
        auto completion = std::make_shared<RequestCompletion>(this->shared_from_this(), keep_alive);
        request_context.start_stream = [completion](HttpResponse head) {
            return completion->stream(std::move(head));
        };
        context_.router.dispatch(request_context, [completion](HttpResponse response) {
            completion->answer(std::move(response));
        });
    }

    // One per dispatched request, shared by its Responder and StreamStarter: answers the request exactly
    // once, and with a 500 if the handler lets go of both without answering — which is what happens when an
    // exception unwinds the asynchronous continuation that held them (run_serving keeps the loop going; issue
    // 13).
    class RequestCompletion {
      public:
        RequestCompletion(std::shared_ptr<HttpConnection> connection, bool keep_alive)
            : connection_(std::move(connection)), io_(connection_->context_.io), keep_alive_(keep_alive) {}
        RequestCompletion(const RequestCompletion&) = delete;
        RequestCompletion& operator=(const RequestCompletion&) = delete;
        ~RequestCompletion() {
            // At shutdown (the io_context stopped) pending handlers are destroyed unanswered on purpose.
            // The server (and the context the connection refers to) may be gone by then: only io_ is asked.
            if (answered_ || io_.stopped())
                return;
            try {
                connection_->context_.logger.error(
                    "request_unanswered",
                    {{"method", std::string(connection_->request_.method_string())},
                     {"target", loggable_target(connection_->request_.target())},
                     {"cause", std::uncaught_exceptions() > 0 ? "an exception in its handler (handler_failed)"
                                                              : "its handler dropped it"}});
                connection_->write(json_error(http::status::internal_server_error,
                                              "The request failed inside the gateway; its log says why."),
                                   false);
            } catch (...) {
                // A destructor must not throw; the connection then closes without an answer.
            }
        }
        void answer(HttpResponse response) {
            if (std::exchange(answered_, true))
                return;  // a handler bug must not write twice
            if (response.result() == http::status::internal_server_error)
                connection_->context_.logger.error(
                    "request_failed", {{"method", std::string(connection_->request_.method_string())},
                                       {"target", loggable_target(connection_->request_.target())},
                                       {"response", response.body().substr(0, 500)}});
            connection_->write(std::move(response), keep_alive_);
        }
        std::shared_ptr<ResponseStream> stream(HttpResponse head) {
            answered_ = true;
            return connection_->begin_stream(std::move(head), keep_alive_);
        }

      private:
        std::shared_ptr<HttpConnection> connection_;
        net::io_context& io_;  // outlives the server and every handler (main's first object)
        bool keep_alive_;
        bool answered_ = false;
    };

    std::string client_address() {
        beast::error_code error;
        auto endpoint = beast::get_lowest_layer(stream_).socket().remote_endpoint(error);
        return error ? std::string() : endpoint.address().to_string();
    }

    // ---- Streamed responses (ResponseStream): chunked body pieces written in order; while the body is being
    // produced the socket is read, so a client that goes away is noticed even when nothing is being written.
    class StreamAdapter final : public ResponseStream {
      public:
        explicit StreamAdapter(std::shared_ptr<HttpConnection> connection)
            : connection_(std::move(connection)) {}
        ~StreamAdapter() override { finish(); }
        void write(std::string data) override {
            if (connection_)
                connection_->stream_write(std::move(data));
        }
        void finish() override {
            if (auto connection = std::exchange(connection_, nullptr))
                connection->stream_finish();
        }
        void on_disconnect(std::function<void()> handler) override {
            if (connection_)
                connection_->streaming_.disconnect_handler = std::move(handler);
        }
        bool client_gone() const override { return !connection_ || connection_->streaming_.broken; }

      private:
        std::shared_ptr<HttpConnection> connection_;
    };

    struct StreamState {
        std::optional<http::response<http::empty_body>> head;
        std::optional<http::response_serializer<http::empty_body>> serializer;
        std::deque<std::string> queue;
        std::function<void()> disconnect_handler;
        bool chunked = true, keep_alive = false, writing = false, finishing = false, last_sent = false,
             complete = false, broken = false, watching = false;
        void reset() {  // the serializer is not assignable, so the state is reset field by field
            serializer.reset();
            head.reset();
            queue.clear();
            disconnect_handler = nullptr;
            chunked = true;
            keep_alive = writing = finishing = last_sent = complete = broken = watching = false;
        }
    };

    std::shared_ptr<ResponseStream> begin_stream(HttpResponse source, bool keep_alive) {
        streaming_.reset();
        const bool http10 = request_.version() == 10;
        source.set(http::field::server, server_name);
        context_.cors.apply(source);
        streaming_.head.emplace(source.result(), http10 ? 10 : 11);
        for (const auto& field : source)
            if (field.name() != http::field::content_length)
                streaming_.head->insert(field.name_string(), field.value());
        // HTTP/1.0 has no chunked encoding: the body then ends with the connection.
        streaming_.chunked = !http10;
        streaming_.keep_alive = keep_alive && !http10;
        streaming_.head->keep_alive(streaming_.keep_alive);
        if (streaming_.chunked)
            streaming_.head->chunked(true);
        streaming_.serializer.emplace(*streaming_.head);
        beast::get_lowest_layer(stream_).expires_never();
        streaming_.writing = true;
        http::async_write_header(stream_, *streaming_.serializer,
                                 [self = this->shared_from_this()](beast::error_code error, std::size_t) {
                                     self->streaming_.writing = false;
                                     if (error)
                                         return self->stream_failed();
                                     self->stream_pump();
                                 });
        if constexpr (!is_tls<Stream>) {
            if (buffer_.size() == 0)
                watch_for_disconnect();
        }
        return std::make_shared<StreamAdapter>(this->shared_from_this());
    }

    void watch_for_disconnect() {
        streaming_.watching = true;
        stream_.async_read_some(buffer_.prepare(4096), [self = this->shared_from_this()](
                                                           beast::error_code error, std::size_t bytes) {
            self->streaming_.watching = false;
            if (!error) {
                // A pipelined next request: keep it for read_request(); stop watching.
                self->buffer_.commit(bytes);
                if (self->streaming_.complete)
                    self->after_stream();
                return;
            }
            if (error == net::error::operation_aborted && self->streaming_.complete)
                return self->after_stream();
            self->stream_failed();
        });
    }

    void stream_write(std::string data) {
        if (streaming_.broken || streaming_.finishing || data.empty())
            return;  // an empty chunk would end the body
        streaming_.queue.push_back(std::move(data));
        stream_pump();
    }

    void stream_finish() {
        if (streaming_.finishing)
            return;
        streaming_.finishing = true;
        stream_pump();
    }

    void stream_pump() {
        if (streaming_.writing || streaming_.broken)
            return;
        auto on_written = [self = this->shared_from_this()](beast::error_code error, std::size_t) {
            self->streaming_.writing = false;
            if (!error && !self->streaming_.queue.empty())
                self->context_.metrics.count_streamed(GatewayMetrics::transport_http_stream,
                                                      self->streaming_.queue.front().size());
            if (!self->streaming_.queue.empty())
                self->streaming_.queue.pop_front();
            if (error)
                return self->stream_failed();
            self->stream_pump();
        };
        if (!streaming_.queue.empty()) {
            streaming_.writing = true;
            const net::const_buffer data = net::buffer(streaming_.queue.front());
            if (streaming_.chunked)
                net::async_write(stream_, http::make_chunk(data), std::move(on_written));
            else
                net::async_write(stream_, data, std::move(on_written));
            return;
        }
        if (!streaming_.finishing || streaming_.last_sent)
            return;
        streaming_.last_sent = true;
        if (!streaming_.chunked)
            return stream_complete();
        streaming_.writing = true;
        net::async_write(stream_, http::make_chunk_last(),
                         [self = this->shared_from_this()](beast::error_code error, std::size_t) {
                             self->streaming_.writing = false;
                             if (error)
                                 return self->stream_failed();
                             self->stream_complete();
                         });
    }

    void stream_complete() {
        streaming_.complete = true;
        if (!streaming_.keep_alive) {
            streaming_.disconnect_handler = nullptr;
            return close_connection();
        }
        if (streaming_.watching) {
            beast::error_code ignored;
            beast::get_lowest_layer(stream_).socket().cancel(ignored);  // the watch's handler continues
            return;
        }
        after_stream();
    }

    void after_stream() {
        streaming_.reset();
        read_request();
    }

    void stream_failed() {
        if (streaming_.broken)
            return;
        streaming_.broken = true;
        streaming_.queue.clear();
        auto handler = std::move(streaming_.disconnect_handler);
        streaming_.disconnect_handler = nullptr;
        beast::error_code ignored;
        beast::get_lowest_layer(stream_).socket().shutdown(tcp::socket::shutdown_both, ignored);
        if (handler && !streaming_.complete)
            handler();
    }

    void handle_upgrade(RequestContext& request_context) {
        auto match = context_.router.match(request_context.path);
        if (!match || !match->resource->accepts_websocket())
            return write(
                json_error(http::status::not_found, "No WebSocket endpoint at " + request_context.path),
                false);
        if (!match->refusal.empty())
            return write(json_error(http::status::bad_request, match->refusal, "bad_path"), false);
        request_context.params = match->params;
        RestResource* resource = match->resource;
        if (auto refusal = principal_refusal(*resource, request_context, http::verb::connect))
            return write(std::move(*refusal), false);
        // What the endpoint must read first (a kernel another gateway runs) is read off the io thread.
        try {
            resource->prepare(request_context,
                              [self = this->shared_from_this(), resource](RequestContext& ready) {
                                  self->upgrade(ready, resource);
                              });
        } catch (const HttpError& error) {
            write(json_error(error.status(), error.what(), error.reason()), false);
        }
    }

    void upgrade(RequestContext& request_context, RestResource* resource) {
        if (auto refusal = resource->check_upgrade(request_context))
            return write(std::move(*refusal), false);
        const std::string subprotocol = resource->select_subprotocol(request_context);
        auto transport = std::make_shared<BeastWebSocketTransport<Stream>>(
            std::move(stream_), std::move(request_), subprotocol, context_);
        context_.auth.close_on_revocation(request_context.principal, transport,
                                          [weak = std::weak_ptr<WebSocketTransport>(transport)] {
                                              if (auto open = weak.lock())
                                                  open->close("the token was revoked", true);
                                          });
        transport->accept([transport, resource, query = request_context.query,
                           params = request_context.params, path = request_context.path,
                           base_url = request_context.base_url, principal = request_context.principal,
                           &logger = context_.logger](beast::error_code error) mutable {
            if (error) {
                logger.info("websocket_handshake_failed", {{"error", error.message()}});
                return;
            }
            RequestContext upgraded{transport->request(), std::move(path), std::move(query),
                                    std::move(params), std::move(base_url)};
            upgraded.principal = std::move(principal);
            try {
                resource->on_upgraded(upgraded, transport);
            } catch (const std::exception& failure) {
                logger.error("websocket_handler_failed", {{"error", failure.what()}});
                transport->fail_internally();
            }
        });
    }

    void write(HttpResponse response, bool keep_alive) {
        response.version(request_.version() == 10 ? 10 : 11);
        response.keep_alive(keep_alive);
        response.set(http::field::server, server_name);
        context_.cors.apply(response);
        if (!response.has_content_length() && response.result() != http::status::no_content)
            response.prepare_payload();
        auto shared_response = std::make_shared<HttpResponse>(std::move(response));
        beast::get_lowest_layer(stream_).expires_after(request_timeout);
        http::async_write(
            stream_, *shared_response,
            [self = this->shared_from_this(), shared_response](beast::error_code error, std::size_t) {
                if (error || shared_response->need_eof())
                    return self->close_connection();
                self->read_request();
            });
    }

    void close_connection() {
        beast::error_code ignored;
        if constexpr (is_tls<Stream>) {
            beast::get_lowest_layer(stream_).expires_after(std::chrono::seconds(5));
            stream_.async_shutdown([self = this->shared_from_this()](beast::error_code) {
                beast::error_code ignored_inner;
                beast::get_lowest_layer(self->stream_).socket().close(ignored_inner);
            });
        } else {
            stream_.socket().shutdown(tcp::socket::shutdown_send, ignored);
        }
    }

    Stream stream_;
    std::string watched_token_;  // the tenant token whose revocation closes this connection (if any)
    StreamState streaming_;
    const HttpServerContext& context_;
    beast::flat_buffer buffer_;
    std::optional<http::request_parser<http::string_body>> parser_;
    HttpRequest request_;
    // Held until the first authenticated request; set = the short header deadline applies.
    std::optional<ConnectionAdmission::PendingSlot> pending_;
};

}  // namespace

HttpServer::HttpServer(net::io_context& io, const Logger& logger, const GatewayConfig& config,
                       const Router& router, const TokenAuthenticator& auth, const CorsPolicy& cors,
                       GatewayMetrics& metrics)
    : io_(io),
      context_{io, logger, config, router, auth, cors, metrics},
      admission_(io, logger, config),
      acceptor_(io),
      accept_retry_(io) {
    if (!config.certfile.empty()) {
        ssl_context_.emplace(ssl::context::tls_server);
        ssl_context_->set_options(ssl::context::default_workarounds | ssl::context::no_sslv2 |
                                  ssl::context::no_sslv3 | ssl::context::no_tlsv1 | ssl::context::no_tlsv1_1);
        ssl_context_->use_certificate_chain_file(config.certfile);
        ssl_context_->use_private_key_file(config.keyfile.empty() ? config.certfile : config.keyfile,
                                           ssl::context::pem);
        if (!config.client_ca.empty()) {
            ssl_context_->load_verify_file(config.client_ca);
            ssl_context_->set_verify_mode(ssl::verify_peer | ssl::verify_fail_if_no_peer_cert);
        }
    }
}

std::uint16_t HttpServer::listen(const std::string& ip, std::uint16_t port) {
    boost::system::error_code error;
    const auto address = net::ip::make_address(ip, error);
    if (error)
        throw std::system_error(error, "invalid --ip '" + ip + "'");
    const tcp::endpoint endpoint(address, port);
    acceptor_.open(endpoint.protocol());
    acceptor_.set_option(net::socket_base::reuse_address(true));
    acceptor_.bind(endpoint, error);
    if (error)
        throw std::system_error(error, "cannot listen on " + ip + ":" + std::to_string(port));
    acceptor_.listen(net::socket_base::max_listen_connections);
    accept_next();
    return acceptor_.local_endpoint().port();
}

void HttpServer::stop() {
    boost::system::error_code ignored;
    acceptor_.close(ignored);
    accept_retry_.cancel();
}

void HttpServer::accept_later() {
    accept_retry_.expires_after(std::chrono::milliseconds(100));
    accept_retry_.async_wait([this](boost::system::error_code timer_error) {
        if (!timer_error)
            accept_next();
    });
}

void HttpServer::accept_next() {
    if (!acceptor_.is_open())
        return;
    // New connections wait in the listen backlog while descriptors are short, so a kernel start still finds
    // some.
    if (!admission_.may_accept())
        return accept_later();
    acceptor_.async_accept([this](boost::system::error_code error, tcp::socket socket) {
        if (error == net::error::operation_aborted)
            return;
        if (error) {
            // E.g. EMFILE: keep serving the open connections and try again shortly.
            context_.logger.warn("accept_failed", {{"error", error.message()}});
            return accept_later();
        }
        const auto peer = socket.remote_endpoint(error);
        auto pending = admission_.admit(error ? std::string() : peer.address().to_string());
        if (!pending) {
            socket.close(error);  // over a cap, and no older pending connection to close (logged)
            return accept_next();
        }
        // Nagle + delayed ACK costs a Jupyter round trip 40 ms; every message here is latency-sensitive.
        socket.set_option(tcp::no_delay(true), error);
        if (ssl_context_) {
            std::make_shared<HttpConnection<beast::ssl_stream<beast::tcp_stream>>>(
                context_, std::move(*pending), std::move(socket), *ssl_context_)
                ->run();
        } else {
            std::make_shared<HttpConnection<beast::tcp_stream>>(context_, std::move(*pending),
                                                                std::move(socket))
                ->run();
        }
        accept_next();
    });
}

}  // namespace cellblock::gateway

namespace cellblock::gateway {

void run_serving(net::io_context& io, const Logger& logger) {
    while (true) {
        try {
            io.run();
            return;
        } catch (const std::exception& error) {
            // The continuation that threw is gone (with it any Responder it held: that request gets a 500);
            // everything else keeps running.
            logger.error("handler_failed", {{"error", error.what()}});
        } catch (...) {
            logger.error("handler_failed", {{"error", "a non-standard exception"}});
        }
    }
}

}  // namespace cellblock::gateway
