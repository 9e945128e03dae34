#include "cellblock/gateway/agent/agent_api.hpp"
#include "cellblock/gateway/agent/session_registry.hpp"

#include <gtest/gtest.h>

using namespace cellblock::gateway;
using namespace cellblock::gateway::agent;

namespace {
std::string refusal(const std::string& raw) {
    try {
        workspace_relative_path(raw);
    } catch (const HttpError& error) {
        EXPECT_EQ(error.status(), http::status::bad_request);
        return error.reason();
    }
    return "";
}
}  // namespace

TEST(AgentFilePaths, PercentEscapesAreDecodedPerSegment) {
    EXPECT_EQ(workspace_relative_path("data/sales.csv"), "data/sales.csv");
    EXPECT_EQ(workspace_relative_path("data/my%20file.csv"), "data/my file.csv");
    EXPECT_EQ(workspace_relative_path("a//b"), "a/b");  // empty segments collapse
}

TEST(AgentFilePaths, EscapesAreRefused) {
    EXPECT_EQ(refusal(".."), "bad_path");
    EXPECT_EQ(refusal("a/../../x"), "bad_path");
    EXPECT_EQ(refusal("%2E%2E/x"), "bad_path");
    EXPECT_EQ(refusal("./x"), "bad_path");
    EXPECT_EQ(refusal("%2Fetc%2Fpasswd"), "bad_path");      // an absolute path smuggled in one segment
    EXPECT_EQ(refusal("a%2F..%2F..%2Fx"), "bad_path");      // an encoded slash
    EXPECT_EQ(refusal("nul%00byte"), "bad_path");
    EXPECT_EQ(refusal("bad%zzescape"), "bad_path");
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
