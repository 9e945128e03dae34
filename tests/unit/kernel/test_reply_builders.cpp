#include <gtest/gtest.h>

#include "worker/reply_builders.hpp"

namespace cellblock::kernel {
namespace {

TEST(ReplyBuilders, ErrorReplyKeepsNameAndValueApart) {
    const auto reply =
        make_error_reply("NameError", "name 'x' is not defined", nlohmann::json::array({"tb"}));
    EXPECT_EQ(reply["status"], "error");
    EXPECT_EQ(reply["ename"], "NameError");
    EXPECT_EQ(reply["evalue"], "name 'x' is not defined");
    EXPECT_EQ(reply["traceback"], nlohmann::json::array({"tb"}));
    EXPECT_EQ(make_error_reply("WorkerDied", "killed by the memory limit")["traceback"],
              nlohmann::json::array({"WorkerDied: killed by the memory limit"}));
}

TEST(ReplyBuilders, OkReplyAlwaysHasPayloadAndUserExpressions) {
    const auto reply = make_execute_ok_reply(nullptr, nullptr);
    EXPECT_EQ(reply["status"], "ok");
    EXPECT_TRUE(reply["payload"].is_array());
    EXPECT_TRUE(reply["user_expressions"].is_object());
}

TEST(ReplyBuilders, KernelInfoDescribesIPythonFlavouredPython) {
    const auto reply = make_kernel_info_reply({"0.1.0", "3.11.2"});
    const auto& language = reply["language_info"];
    EXPECT_EQ(language["name"], "python");
    EXPECT_EQ(language["version"], "3.11.2");
    EXPECT_EQ(language["mimetype"], "text/x-python");
    EXPECT_EQ(language["file_extension"], ".py");
    EXPECT_EQ(language["pygments_lexer"], "ipython3");
    EXPECT_EQ(language["codemirror_mode"], (nlohmann::json{{"name", "ipython"}, {"version", 3}}));
    EXPECT_EQ(language["nbconvert_exporter"], "python");
    EXPECT_EQ(reply["implementation"], "cellblock");
    EXPECT_FALSE(reply["banner"].get<std::string>().empty());
    ASSERT_FALSE(reply["help_links"].empty());
    EXPECT_EQ(reply["help_links"][0]["url"], "https://docs.python.org/3.11");
}

TEST(ReplyBuilders, FallbacksAreWellFormed) {
    const auto complete = make_empty_complete_reply(4);
    EXPECT_EQ(complete["cursor_start"], 4);
    EXPECT_EQ(complete["cursor_end"], 4);
    EXPECT_TRUE(complete["matches"].empty());
    EXPECT_EQ(make_not_found_inspect_reply()["found"], false);
    EXPECT_EQ(make_unknown_is_complete_reply()["status"], "unknown");
}

}  // namespace
}  // namespace cellblock::kernel
