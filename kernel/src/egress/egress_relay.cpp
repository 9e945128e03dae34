// What a session relays once it is let through: a CONNECT tunnel (whose ClientHello must name the CONNECT
// host) or one plain HTTP request and its response, then bytes both ways until either side ends or the idle
// limit.
#include <boost/asio/write.hpp>

#include "egress/egress_session.hpp"
#include "egress/tls_client_hello.hpp"

namespace cellblock::kernel::egress {

void Session::establish_tunnel() {
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

void Session::check_client_hello() {
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
            return refuse_tunnel("the client's first bytes are not a TLS ClientHello (" + parsed.error + ")");
        case ClientHelloStatus::complete:
            break;
    }
    if (!parsed.server_name) {
        return refuse_tunnel("the TLS ClientHello names no server (no SNI); the CONNECT host was " +
                             record_.host);
    }
    if (normalize_host(*parsed.server_name) != record_.host) {
        return refuse_tunnel("the TLS ClientHello names " + *parsed.server_name + ", not the CONNECT host " +
                             record_.host);
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
void Session::refuse_tunnel(const std::string& why) {
    record_.allowed = false;
    record_.rule = "refused: " + why;
    close();
}

void Session::forward_request() {
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

std::string Session::host_header_value() const {
    const bool v6 = record_.host.find(':') != std::string::npos;
    std::string value = v6 ? "[" + record_.host + "]" : record_.host;
    if (record_.port != 80) {
        value += ":" + std::to_string(record_.port);
    }
    return value;
}

// The part of the body that arrived with the head, then the rest from the client.
void Session::send_buffered_body() {
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

// A session holds its two relay buffers only from the moment its tunnel or request is let through: one
// that is refused, held for approval or still sending its head costs no more than its socket and parser.
void Session::allocate_relay_buffers() {
    if (up_buffer_.empty())
        up_buffer_.resize(relay_buffer_bytes);
    if (down_buffer_.empty())
        down_buffer_.resize(relay_buffer_bytes);
}

void Session::start_relay(bool tunnel) {
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
void Session::read_response_head() {
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
                                                            " is not valid HTTP (" + error.message() + ")",
                                                        true);
                                }
                                self->last_activity_ = Clock::now();
                                self->send_response_head();
                            });
}

void Session::send_response_head() {
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
void Session::send_buffered_response() {
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

void Session::pump(Pipe& pipe) {
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

void Session::pipe_finished(Pipe& pipe, bool end_of_stream) {
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

}  // namespace cellblock::kernel::egress
