#pragma once
// Internal to gateway/src/http/: what the listener (http_server.cpp), the HTTP connection
// (http_connection.cpp) and the WebSocket upgrade (websocket_upgrade.cpp) share. Not part of the gateway's
// headers.
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/ssl/context.hpp>
#include <boost/beast/core/error.hpp>
#include <boost/beast/core/tcp_stream.hpp>
#include <boost/beast/ssl/ssl_stream.hpp>
#include <string>
#include <string_view>

#include "cellblock/gateway/http/connection_admission.hpp"
#include "cellblock/gateway/http/http_server.hpp"
#include "cellblock/gateway/http/router.hpp"

namespace cellblock::gateway::http_detail {

inline constexpr std::string_view server_name = "cellblock-gateway";

// A client that went away (or a deadline that passed): ends the connection without a log line.
bool is_quiet_disconnect(const boost::beast::error_code& error);

// Serves one accepted connection until it closes (http_connection.cpp); over TLS with `ssl_context`.
void serve_connection(const HttpServerContext& context, ConnectionAdmission::PendingSlot pending,
                      boost::asio::ip::tcp::socket socket);
void serve_connection(const HttpServerContext& context, ConnectionAdmission::PendingSlot pending,
                      boost::asio::ip::tcp::socket socket, boost::asio::ssl::context& ssl_context);

// Hands a connection whose upgrade `resource` accepted to a WebSocket transport (websocket_upgrade.cpp): the
// handshake, then resource->on_upgraded; the transport closes when the principal's token is revoked.
void upgrade_to_websocket(boost::beast::tcp_stream&& stream, HttpRequest request, std::string subprotocol,
                          const RequestContext& request_context, RestResource* resource,
                          const HttpServerContext& context);
void upgrade_to_websocket(boost::beast::ssl_stream<boost::beast::tcp_stream>&& stream, HttpRequest request,
                          std::string subprotocol, const RequestContext& request_context,
                          RestResource* resource, const HttpServerContext& context);

}  // namespace cellblock::gateway::http_detail
