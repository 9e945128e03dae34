#include "http_connection.hpp"

#include <boost/asio/ssl/stream.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/beast/ssl.hpp>
#include <boost/beast/websocket.hpp>
#include <deque>
#include <type_traits>

// One HTTP connection (plain or TLS): the header deadline before authentication, answers decided on the
// headers alone, routing, streamed responses, and the hand-over of a WebSocket upgrade
// (websocket_upgrade.cpp).

namespace cellblock::gateway::http_detail {

namespace beast = boost::beast;
namespace websocket = beast::websocket;
namespace net = boost::asio;
namespace ssl = net::ssl;
using tcp = net::ip::tcp;

namespace {

// An authenticated keep-alive connection that sends nothing for this long is dropped; it also bounds reading
// a request body and writing a response. Before authentication the shorter --header-timeout applies.
constexpr auto request_timeout = std::chrono::seconds(60);

template <class Stream>
constexpr bool is_tls = !std::is_same_v<Stream, beast::tcp_stream>;

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
        upgrade_to_websocket(std::move(stream_), std::move(request_), subprotocol, request_context, resource,
                             context_);
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

bool is_quiet_disconnect(const beast::error_code& error) {
    return error == net::error::eof || error == net::error::connection_reset ||
           error == net::error::operation_aborted || error == beast::error::timeout ||
           error == websocket::error::closed || error == net::ssl::error::stream_truncated ||
           error == net::error::broken_pipe;
}

void serve_connection(const HttpServerContext& context, ConnectionAdmission::PendingSlot pending,
                      tcp::socket socket) {
    std::make_shared<HttpConnection<beast::tcp_stream>>(context, std::move(pending), std::move(socket))
        ->run();
}

void serve_connection(const HttpServerContext& context, ConnectionAdmission::PendingSlot pending,
                      tcp::socket socket, ssl::context& ssl_context) {
    std::make_shared<HttpConnection<beast::ssl_stream<beast::tcp_stream>>>(context, std::move(pending),
                                                                           std::move(socket), ssl_context)
        ->run();
}

}  // namespace cellblock::gateway::http_detail
