#pragma once
// The listening socket and the per-connection HTTP/WebSocket state machines (Beast, one class per connection,
// fully async on one io_context). TLS is used for every connection when a certificate is configured.
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/ssl/context.hpp>
#include <boost/asio/steady_timer.hpp>
#include <memory>
#include <optional>

#include "cellblock/gateway/access/auth.hpp"
#include "cellblock/gateway/common/config.hpp"
#include "cellblock/gateway/http/connection_admission.hpp"
#include "cellblock/gateway/http/router.hpp"
#include "cellblock/gateway/observability/log.hpp"
#include "cellblock/gateway/observability/metrics.hpp"

namespace cellblock::gateway {

// What every connection needs; owned by HttpServer.
struct HttpServerContext {
    boost::asio::io_context& io;
    const Logger& logger;
    const GatewayConfig& config;
    const Router& router;
    const TokenAuthenticator& auth;
    const CorsPolicy& cors;
    GatewayMetrics& metrics;  // WebSocket connections, bytes streamed to clients
};

class HttpServer {
  public:
    HttpServer(boost::asio::io_context& io, const Logger& logger, const GatewayConfig& config,
               const Router& router, const TokenAuthenticator& auth, const CorsPolicy& cors,
               GatewayMetrics& metrics);
    // Binds and starts accepting; throws std::system_error with context. Returns the bound port (useful for
    // 0).
    std::uint16_t listen(const std::string& ip, std::uint16_t port);
    void stop();
    bool tls() const { return ssl_context_.has_value(); }

  private:
    void accept_next();
    void accept_later();  // after a failed accept or while descriptors are short
    boost::asio::io_context& io_;
    HttpServerContext context_;
    ConnectionAdmission admission_;
    boost::asio::ip::tcp::acceptor acceptor_;
    boost::asio::steady_timer accept_retry_;
    std::optional<boost::asio::ssl::context> ssl_context_;
};

// Runs `io` until it is stopped. An exception that escapes a completion handler is logged (handler_failed)
// and the loop goes on: a handler's failure costs its request (answered 500, see RequestCompletion), never
// the process with every kernel.
void run_serving(boost::asio::io_context& io, const Logger& logger);

}  // namespace cellblock::gateway
