// Issue 13, defect 3: an exception thrown in a handler's asynchronous continuation costs that one request (a
// 500 with the JSON error body and a log line), never the io_context loop and with it the gateway.
#include <gtest/gtest.h>

#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <thread>

#include "cellblock/gateway/access/auth.hpp"
#include "cellblock/gateway/http/http_server.hpp"
#include "cellblock/gateway/http/router.hpp"

using namespace cellblock::gateway;
namespace net = boost::asio;
using tcp = net::ip::tcp;

namespace {

// Answers later, from a continuation posted to the io_context, which throws instead of answering.
class ThrowsLater : public RestResource {
  public:
    explicit ThrowsLater(net::io_context& io) : io_(io) {}
    void get(RequestContext&, Responder respond) override {
        net::post(io_, [respond = std::move(respond)]() mutable {
            throw std::runtime_error("continuation failed on purpose");
            respond(json_response(http::status::ok, {{"unreachable", true}}));
        });
    }

  private:
    net::io_context& io_;
};

class Answers : public RestResource {
  public:
    void get(RequestContext&, Responder respond) override {
        respond(json_response(http::status::ok, {{"alive", true}}));
    }
};

// The answer to GET `target`, or a 599 carrying the client's error (no answer within 10 s, connection
// closed).
http::response<http::string_body> fetch(std::uint16_t port, const std::string& target) try {
    net::io_context client_io;
    boost::beast::tcp_stream stream(client_io);
    stream.expires_after(std::chrono::seconds(10));
    stream.connect(tcp::endpoint(net::ip::make_address("127.0.0.1"), port));
    http::request<http::empty_body> request{http::verb::get, target, 11};
    request.set(http::field::host, "127.0.0.1");
    request.set(http::field::authorization, "token secret");
    http::write(stream, request);
    boost::beast::flat_buffer buffer;
    http::response<http::string_body> response;
    http::read(stream, buffer, response);
    return response;
} catch (const std::exception& error) {
    http::response<http::string_body> failure{static_cast<http::status>(599), 11};
    failure.body() = std::string("no answer: ") + error.what();
    return failure;
}

TEST(HttpServerFailure, AnExceptionInAContinuationCostsOneRequestNotTheProcess) {
    net::io_context io(1);
    GatewayConfig config;
    const Logger logger(LogLevel::warning);
    const TokenAuthenticator auth("secret");
    const CorsPolicy cors(config);
    Router router;
    router.add("/throws-later", std::make_shared<ThrowsLater>(io));
    router.add("/answers", std::make_shared<Answers>());
    GatewayMetrics metrics;
    HttpServer server(io, logger, config, router, auth, cors, metrics);
    const std::uint16_t port = server.listen("127.0.0.1", 0);

    testing::internal::CaptureStderr();
    std::thread loop([&] { run_serving(io, logger); });
    const auto failed = fetch(port, "/throws-later");
    const auto next = fetch(port, "/answers");
    net::post(io, [&] {
        server.stop();
        io.stop();
    });
    loop.join();
    const std::string log = testing::internal::GetCapturedStderr();

    ASSERT_EQ(failed.result(), http::status::internal_server_error) << failed.body();
    const auto body = nlohmann::json::parse(failed.body());
    EXPECT_TRUE(body.contains("reason") && body["reason"].is_string()) << failed.body();
    EXPECT_TRUE(body.contains("message") && body["message"].is_string()) << failed.body();
    EXPECT_EQ(next.result(), http::status::ok) << "the loop kept serving after the failure";
    EXPECT_NE(log.find("\"handler_failed\""), std::string::npos) << log;
    EXPECT_NE(log.find("continuation failed on purpose"), std::string::npos) << log;
    EXPECT_NE(log.find("\"request_unanswered\""), std::string::npos) << log;
}

}  // namespace
