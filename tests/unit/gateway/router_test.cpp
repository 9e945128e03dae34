#include "cellblock/gateway/http/router.hpp"

#include <gtest/gtest.h>

using namespace cellblock::gateway;

namespace {
class Recorder : public RestResource {
  public:
    explicit Recorder(std::string name) : name_(std::move(name)) {}
    void get(RequestContext& context, Responder respond) override {
        nlohmann::json body = {{"resource", name_}, {"params", context.params}, {"path", context.path}};
        respond(json_response(http::status::ok, body));
    }
    void post(RequestContext&, Responder) override {
        throw HttpError(http::status::bad_request, "bad input");
    }

  private:
    std::string name_;
};

HttpResponse dispatch(const Router& router, http::verb method, const std::string& path) {
    HttpRequest request{method, path, 11};
    RequestContext context{request, path, {}, {}, "/"};
    HttpResponse result;
    router.dispatch(context, [&result](HttpResponse response) { result = std::move(response); });
    return result;
}

Router make_router() {
    Router router;
    router.add("/api/kernels", std::make_shared<Recorder>("kernels"));
    router.add("/api/kernels/{kernel_id}", std::make_shared<Recorder>("kernel"));
    router.add("/api/kernels/{kernel_id}/channels", std::make_shared<Recorder>("channels"));
    router.add("/files/{path...}", std::make_shared<Recorder>("files"));
    return router;
}
}  // namespace

TEST(Router, MatchesLiteralAndPlaceholderSegments) {
    Router router = make_router();
    auto match = router.match("/api/kernels/abc-1/channels");
    ASSERT_TRUE(match);
    EXPECT_EQ(match->params.at("kernel_id"), "abc-1");
    EXPECT_TRUE(router.match("/api/kernels"));
    EXPECT_TRUE(router.match("/api/kernels/"));  // a trailing slash is the same resource
    EXPECT_FALSE(router.match("/api/kernels/a/b/c"));
    EXPECT_FALSE(router.match("/api"));
}

TEST(Router, RestPlaceholderTakesRemainingSegments) {
    Router router = make_router();
    auto match = router.match("/files/a/b/c.txt");
    ASSERT_TRUE(match);
    EXPECT_EQ(match->params.at("path"), "a/b/c.txt");
    EXPECT_FALSE(router.match("/files"));
}

TEST(Router, PlaceholdersArePercentDecoded) {
    Router router = make_router();
    EXPECT_EQ(router.match("/api/kernels/a%20b")->params.at("kernel_id"), "a b");
}

// One rule: the context's path is raw; every captured segment, of {name} and {name...} alike, is decoded
// exactly once by the router; a segment that hides a '/' or NUL or is not valid encoding is a 400.
TEST(Router, PathIsRawAndEveryCaptureIsDecodedOnce) {
    Router router = make_router();
    const auto response = dispatch(router, http::verb::get, "/files/my%20dir/a%2525b.txt");
    ASSERT_EQ(response.result(), http::status::ok);
    const auto body = nlohmann::json::parse(response.body());
    EXPECT_EQ(body["path"], "/files/my%20dir/a%2525b.txt");
    EXPECT_EQ(body["params"]["path"], "my dir/a%25b.txt");
    EXPECT_EQ(router.match("/api/kernels/a%2525b")->params.at("kernel_id"), "a%25b");
}

TEST(Router, CapturedSegmentsHidingASlashOrNulOrBadEscapesAre400) {
    Router router = make_router();
    for (const std::string path :
         {"/files/a%2F..%2F..%2Fx", "/files/ok/%2Fetc%2Fpasswd", "/files/nul%00byte", "/files/bad%zzescape",
          "/api/kernels/a%2Fb", "/api/kernels/a%00/channels"}) {
        const auto response = dispatch(router, http::verb::get, path);
        EXPECT_EQ(response.result(), http::status::bad_request) << path;
        EXPECT_EQ(nlohmann::json::parse(response.body())["reason"], "bad_path") << path;
    }
}

TEST(Router, UnknownPathIsJson404) {
    HttpResponse response = dispatch(make_router(), http::verb::get, "/nope");
    EXPECT_EQ(response.result(), http::status::not_found);
    auto body = nlohmann::json::parse(response.body());
    EXPECT_EQ(body["reason"], "Not Found");
    EXPECT_TRUE(body.contains("message"));
}

TEST(Router, UnimplementedMethodIs405WithAllow) {
    HttpResponse response = dispatch(make_router(), http::verb::delete_, "/api/kernels");
    EXPECT_EQ(response.result(), http::status::method_not_allowed);
    EXPECT_FALSE(response[http::field::allow].empty());
}

TEST(Router, HttpErrorBecomesJsonError) {
    HttpResponse response = dispatch(make_router(), http::verb::post, "/api/kernels");
    EXPECT_EQ(response.result(), http::status::bad_request);
    auto body = nlohmann::json::parse(response.body());
    EXPECT_EQ(body["reason"], "Bad Request");
    EXPECT_EQ(body["message"], "bad input");
}

TEST(Router, HeadIsGetWithoutBody) {
    HttpResponse response = dispatch(make_router(), http::verb::head, "/api/kernels");
    EXPECT_EQ(response.result(), http::status::ok);
    EXPECT_TRUE(response.body().empty());
    EXPECT_NE(response[http::field::content_length], "0");
}

TEST(Query, ParsesAndDecodes) {
    auto query = parse_query("session_id=a%2Fb&token=x+y&empty=&flag");
    EXPECT_EQ(query.at("session_id"), "a/b");
    EXPECT_EQ(query.at("token"), "x y");
    EXPECT_EQ(query.at("empty"), "");
    EXPECT_EQ(query.at("flag"), "");
    EXPECT_FALSE(url_decode("%zz", false));
    EXPECT_FALSE(url_decode("%4", false));
}

TEST(RequestBody, EmptyIsObjectAndGarbageIs400) {
    HttpRequest request{http::verb::post, "/", 11};
    RequestContext context{request, "/", {}, {}, "/"};
    EXPECT_EQ(context.json_body(), nlohmann::json::object());
    request.body() = "{\"name\": 1";
    EXPECT_THROW(context.json_body(), HttpError);
    request.body() = "[1]";
    EXPECT_THROW(context.json_body(), HttpError);
    request.body() = "{\"name\": \"\xff\"}";
    EXPECT_THROW(context.json_body(), HttpError);
}

// request_failed / request_unanswered log the target: never its query, where a browser's ?token= sits.
TEST(LoggableTarget, KeepsThePathAndDropsTheQuery) {
    EXPECT_EQ(loggable_target("/api/kernels/abc/channels?token=s3cret&session_id=1"),
              "/api/kernels/abc/channels");
    EXPECT_EQ(loggable_target("/api"), "/api");
    EXPECT_EQ(loggable_target("/?token=s3cret"), "/");
}
