#include <gtest/gtest.h>

#include "cellblock/gateway/agent/agent_api.hpp"
#include "cellblock/gateway/agent/session_registry.hpp"

using namespace cellblock::gateway;
using namespace cellblock::gateway::agent;

namespace {
std::string refusal(const std::string& decoded) {
    try {
        workspace_relative_path(decoded);
    } catch (const HttpError& error) {
        EXPECT_EQ(error.status(), http::status::bad_request);
        return error.reason();
    }
    return "";
}

// The files route as the agent API registers it: the router decodes, the handler checks.
class FilePathEcho : public RestResource {
  public:
    void get(RequestContext& context, Responder respond) override {
        respond(
            json_response(http::status::ok, {{"relative", workspace_relative_path(context.param("path"))}}));
    }
};

std::pair<http::status, nlohmann::json> through_files_route(const std::string& raw_rest) {
    Router router;
    router.add("/agent/v1/sessions/{session}/files/{path...}", std::make_shared<FilePathEcho>());
    const std::string path = "/agent/v1/sessions/s/files/" + raw_rest;
    HttpRequest request{http::verb::get, path, 11};
    RequestContext context{request, path, {}, {}, "/"};
    HttpResponse result;
    router.dispatch(context, [&result](HttpResponse response) { result = std::move(response); });
    return {result.result(), nlohmann::json::parse(result.body())};
}
}  // namespace

TEST(AgentFilePaths, PercentEscapesAreDecodedPerSegmentOnce) {
    EXPECT_EQ(through_files_route("data/sales.csv").second["relative"], "data/sales.csv");
    EXPECT_EQ(through_files_route("data/my%20file.csv").second["relative"], "data/my file.csv");
    EXPECT_EQ(through_files_route("a//b").second["relative"], "a/b");       // empty segments collapse
    EXPECT_EQ(through_files_route("a%2525b").second["relative"], "a%25b");  // decoded once, not twice
    EXPECT_EQ(workspace_relative_path("a//b"), "a/b");
}

TEST(AgentFilePaths, EscapesAreRefused) {
    for (const std::string raw : {"..", "a/../../x", "%2E%2E/x", "./x", "%2Fetc%2Fpasswd", "a%2F..%2F..%2Fx",
                                  "nul%00byte", "bad%zzescape"}) {
        const auto [status, body] = through_files_route(raw);
        EXPECT_EQ(status, http::status::bad_request) << raw;
        EXPECT_EQ(body["reason"], "bad_path") << raw;
    }
    EXPECT_EQ(refusal(".."), "bad_path");
    EXPECT_EQ(refusal("a/../../x"), "bad_path");
    EXPECT_EQ(refusal("./x"), "bad_path");
    EXPECT_EQ(refusal(std::string("nul\0byte", 8)), "bad_path");
    EXPECT_EQ(refusal(""), "bad_path");
}

TEST(AgentSessionNames, OnlySimpleNamesThatCannotBeMistakenForIds) {
    EXPECT_TRUE(valid_session_name("sales"));
    EXPECT_TRUE(valid_session_name("team.a_b-1"));
    EXPECT_FALSE(valid_session_name(""));
    EXPECT_FALSE(valid_session_name("-leading-dash"));
    EXPECT_FALSE(valid_session_name("../up"));
    EXPECT_FALSE(valid_session_name("with space"));
    EXPECT_FALSE(valid_session_name(std::string(65, 'a')));
    EXPECT_FALSE(valid_session_name("123e4567-e89b-12d3-a456-426614174000"));
}
