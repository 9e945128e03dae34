#include "cellblock/gateway/http/http_server.hpp"

#include <string>
#include <system_error>

#include "http_connection.hpp"

// The listener: accepts while descriptors allow, admits each connection (connection_admission.cpp) and hands
// it to an HTTP connection (http_connection.cpp), over TLS when a certificate is configured.

namespace cellblock::gateway {

namespace net = boost::asio;
namespace ssl = net::ssl;
using tcp = net::ip::tcp;

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
        if (ssl_context_)
            http_detail::serve_connection(context_, std::move(*pending), std::move(socket), *ssl_context_);
        else
            http_detail::serve_connection(context_, std::move(*pending), std::move(socket));
        accept_next();
    });
}

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
