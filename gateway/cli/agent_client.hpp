#pragma once
// A blocking HTTP/1.1 client of the agent API for the `cellblock` CLI: one keep-alive connection, token auth,
// JSON errors turned into readable messages, and NDJSON responses read line by line as they arrive.
#include <boost/asio/io_context.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/core/tcp_stream.hpp>
#include <boost/beast/http.hpp>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>

namespace cellblock::cli {

namespace http = boost::beast::http;

// A failure worth one line on stderr (connection refused, 401, unknown session...).
class ClientError : public std::runtime_error {
  public:
    ClientError(const std::string& message, int status = 0, std::string reason = {})
        : std::runtime_error(message), status_(status), reason_(std::move(reason)) {}
    int status() const { return status_; }
    const std::string& reason() const { return reason_; }

  private:
    int status_;
    std::string reason_;
};

struct GatewayAddress {
    std::string host, port, base_path;  // base_path without a trailing '/', e.g. "" or "/gw"
    static GatewayAddress parse(const std::string& url);  // throws ClientError
    std::string describe() const { return "http://" + host + ":" + port + base_path; }
};

// Percent-encodes one path segment (RFC 3986 unreserved characters stay as they are).
std::string encode_path_segment(const std::string& segment);

class AgentClient {
  public:
    AgentClient(GatewayAddress address, std::string token);
    ~AgentClient();

    struct Response {
        int status = 0;
        std::string body;
        std::string content_type;
    };
    // Sends one request; `body` empty = no body. Throws ClientError only for transport failures.
    Response request(http::verb method, const std::string& path, const std::string& body = {},
                     const std::string& content_type = "application/json",
                     const std::string& accept = "application/json");
    // POSTs JSON and calls `on_line` for every NDJSON line as it arrives; returns the HTTP status. A non-2xx
    // status is returned with its body in `error_body`.
    int stream_lines(const std::string& path, const nlohmann::json& body,
                     const std::function<void(const std::string&)>& on_line, std::string& error_body);

    // Throws ClientError with the gateway's {"message"} for a non-2xx response.
    static void check(const Response& response, const std::string& what);

  private:
    void connect();
    http::request<http::string_body> make_request(http::verb method, const std::string& path,
                                                  const std::string& body, const std::string& content_type,
                                                  const std::string& accept) const;

    GatewayAddress address_;
    std::string token_;
    boost::asio::io_context io_;
    std::optional<boost::beast::tcp_stream> stream_;
    boost::beast::flat_buffer buffer_;
};

}  // namespace cellblock::cli
