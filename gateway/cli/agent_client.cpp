#include "agent_client.hpp"

#include <boost/asio/connect.hpp>
#include <boost/asio/ip/tcp.hpp>

namespace cellblock::cli {

namespace beast = boost::beast;
namespace net = boost::asio;
using tcp = net::ip::tcp;
using nlohmann::json;

namespace {
constexpr auto connect_timeout = std::chrono::seconds(10);
constexpr std::uint64_t max_response_bytes = 2ull << 30;
}  // namespace

GatewayAddress GatewayAddress::parse(const std::string& url) {
    constexpr std::string_view scheme = "http://";
    if (url.starts_with("https://"))
        throw ClientError(
            "https URLs are not supported by this client; use the gateway's http URL (or a local TLS proxy)");
    if (!url.starts_with(scheme))
        throw ClientError("the gateway URL must start with http:// (got '" + url + "')");
    std::string rest = url.substr(scheme.size());
    GatewayAddress address;
    const auto slash = rest.find('/');
    std::string authority = rest.substr(0, slash);
    address.base_path = slash == std::string::npos ? "" : rest.substr(slash);
    while (address.base_path.ends_with('/'))
        address.base_path.pop_back();
    if (authority.starts_with('[')) {  // [IPv6]:port
        const auto close = authority.find(']');
        if (close == std::string::npos)
            throw ClientError("malformed IPv6 address in '" + url + "'");
        address.host = authority.substr(1, close - 1);
        address.port =
            close + 2 <= authority.size() && authority[close + 1] == ':' ? authority.substr(close + 2) : "80";
    } else {
        const auto colon = authority.rfind(':');
        address.host = authority.substr(0, colon);
        address.port = colon == std::string::npos ? "80" : authority.substr(colon + 1);
    }
    if (address.host.empty() || address.port.empty())
        throw ClientError("no host or port in '" + url + "'");
    return address;
}

std::string encode_path_segment(const std::string& segment) {
    static constexpr char hex[] = "0123456789ABCDEF";
    std::string out;
    for (unsigned char c : segment) {
        if (std::isalnum(c) || c == '-' || c == '.' || c == '_' || c == '~') {
            out.push_back(static_cast<char>(c));
        } else {
            out.push_back('%');
            out.push_back(hex[c >> 4]);
            out.push_back(hex[c & 0x0F]);
        }
    }
    return out;
}

AgentClient::AgentClient(GatewayAddress address, std::string token)
    : address_(std::move(address)), token_(std::move(token)) {}

AgentClient::~AgentClient() {
    if (stream_) {
        beast::error_code ignored;
        stream_->socket().shutdown(tcp::socket::shutdown_both, ignored);
    }
}

void AgentClient::connect() {
    if (stream_ && stream_->socket().is_open())
        return;
    tcp::resolver resolver(io_);
    beast::error_code error;
    const auto endpoints = resolver.resolve(address_.host, address_.port, error);
    if (error)
        throw ClientError("cannot resolve " + address_.host + ": " + error.message());
    stream_.emplace(io_);
    stream_->expires_after(connect_timeout);
    stream_->connect(endpoints, error);
    if (error)
        throw ClientError("cannot connect to " + address_.describe() + ": " + error.message() +
                          " (is cellblock-gateway running? set --url or CELLBLOCK_URL)");
    stream_->socket().set_option(tcp::no_delay(true));
    stream_->expires_never();
    buffer_.clear();
}

http::request<http::string_body> AgentClient::make_request(http::verb method, const std::string& path,
                                                           const std::string& body,
                                                           const std::string& content_type,
                                                           const std::string& accept) const {
    http::request<http::string_body> request{method, address_.base_path + path, 11};
    request.set(http::field::host, address_.host);
    request.set(http::field::user_agent, "cellblock-cli/" CELLBLOCK_VERSION);
    request.set(http::field::accept, accept);
    if (!token_.empty())
        request.set(http::field::authorization, "token " + token_);
    if (!body.empty() || method == http::verb::post || method == http::verb::put) {
        request.set(http::field::content_type, content_type);
        request.body() = body;
    }
    request.keep_alive(true);
    request.prepare_payload();
    return request;
}

AgentClient::Response AgentClient::request(http::verb method, const std::string& path,
                                           const std::string& body, const std::string& content_type,
                                           const std::string& accept) {
    for (int attempt = 0; attempt < 2; ++attempt) {
        connect();
        beast::error_code error;
        http::write(*stream_, make_request(method, path, body, content_type, accept), error);
        http::response_parser<http::string_body> parser;
        parser.body_limit(max_response_bytes);
        if (!error)
            http::read(*stream_, buffer_, parser, error);
        if (error) {
            stream_.reset();  // a keep-alive connection the server closed: reconnect once
            if (attempt == 0 && (error == http::error::end_of_stream ||
                                 error == net::error::connection_reset || error == net::error::broken_pipe))
                continue;
            throw ClientError("request to " + address_.describe() + path + " failed: " + error.message());
        }
        auto response = parser.release();
        if (!response.keep_alive())
            stream_.reset();
        return {static_cast<int>(response.result_int()), std::move(response.body()),
                std::string(response[http::field::content_type])};
    }
    throw ClientError("request to " + address_.describe() + path + " failed");
}

int AgentClient::stream_lines(const std::string& path, const json& body,
                              const std::function<void(const std::string&)>& on_line,
                              std::string& error_body) {
    connect();
    beast::error_code error;
    http::write(*stream_,
                make_request(http::verb::post, path, body.dump(), "application/json", "application/x-ndjson"),
                error);
    if (error)
        throw ClientError("request to " + address_.describe() + path + " failed: " + error.message());
    http::response_parser<http::string_body> parser;
    parser.body_limit(max_response_bytes);
    http::read_header(*stream_, buffer_, parser, error);
    if (error)
        throw ClientError("request to " + address_.describe() + path + " failed: " + error.message());
    const int status = static_cast<int>(parser.get().result_int());
    std::size_t consumed = 0;
    while (!parser.is_done()) {
        http::read_some(*stream_, buffer_, parser, error);
        if (error) {
            stream_.reset();
            throw ClientError("the gateway closed the stream early: " + error.message());
        }
        if (status / 100 != 2)
            continue;
        std::string& text = parser.get().body();
        for (auto newline = text.find('\n', consumed); newline != std::string::npos;
             newline = text.find('\n', consumed)) {
            on_line(text.substr(consumed, newline - consumed));
            consumed = newline + 1;
        }
    }
    if (status / 100 != 2)
        error_body = parser.get().body();
    if (!parser.get().keep_alive())
        stream_.reset();
    return status;
}

void AgentClient::check(const Response& response, const std::string& what) {
    if (response.status / 100 == 2)
        return;
    std::string message = response.body;
    std::string reason;
    const json parsed = json::parse(response.body, nullptr, false);
    if (parsed.is_object()) {
        message = parsed.value("message", response.body);
        reason = parsed.value("reason", "");
    }
    if (response.status == 401 || response.status == 403)
        message += " (set --token or CELLBLOCK_TOKEN to the gateway's token)";
    throw ClientError(what + ": " + message + " (HTTP " + std::to_string(response.status) + ")",
                      response.status, reason);
}

}  // namespace cellblock::cli
