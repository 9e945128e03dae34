#include "cellblock/gateway/jupyter/reply_order.hpp"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

using namespace cellblock::gateway;
using namespace std::chrono_literals;

namespace {

ReplyOrder::Reply reply(const std::string& session, const std::string& msg_id, const std::string& after_iopub,
                        Channel channel = Channel::shell) {
    JupyterMessage message;
    message.channel = channel;
    message.msg_id = msg_id;
    message.msg_type = "execute_reply";
    message.metadata =
        after_iopub.empty()
            ? "{}"
            : nlohmann::json{{"cellblock", {{"outcome", "ok"}, {"last_iopub_msg_id", after_iopub}}}}.dump();
    return {session, std::move(message)};
}

// As the gateway calls it: the awaited message worked out from the reply first.
std::vector<ReplyOrder::Reply> arrive(ReplyOrder& order, ReplyOrder::Reply reply,
                                      ReplyOrder::Clock::time_point now) {
    std::string awaited = ReplyOrder::awaited_iopub(reply.message);
    return order.reply_arrived(std::move(reply), std::move(awaited), now);
}

std::vector<std::string> ids(const std::vector<ReplyOrder::Reply>& replies) {
    std::vector<std::string> result;
    for (const auto& released : replies)
        result.push_back(released.session_id + ":" + released.message.msg_id);
    return result;
}

const ReplyOrder::Clock::time_point start{};

}  // namespace

TEST(ReplyOrder, AReplyWhoseOutputHasArrivedGoesAtOnce) {
    ReplyOrder order(2s);
    EXPECT_TRUE(ids(order.iopub_arrived("out-1", start)).empty());
    EXPECT_EQ(ids(arrive(order, reply("a", "r1", "out-1"), start)), std::vector<std::string>{"a:r1"});
    EXPECT_EQ(order.held(), 0U);
    EXPECT_FALSE(order.next_deadline());
}

TEST(ReplyOrder, AReplyWaitsForTheOutputPublishedBeforeIt) {
    ReplyOrder order(2s);
    order.iopub_arrived("busy-1", start);
    EXPECT_TRUE(ids(arrive(order, reply("a", "r1", "big-output"), start)).empty());
    EXPECT_EQ(order.held(), 1U);
    EXPECT_EQ(order.next_deadline(), start + 2s);
    EXPECT_TRUE(ids(order.iopub_arrived("other-output", start + 1ms)).empty());
    EXPECT_EQ(ids(order.iopub_arrived("big-output", start + 2ms)), std::vector<std::string>{"a:r1"});
    EXPECT_EQ(order.released_without_iopub(), 0U);
}

TEST(ReplyOrder, RepliesLeaveInTheOrderTheyCame) {
    ReplyOrder order(2s);
    arrive(order, reply("a", "r1", "out-1"), start);
    // r2's output has arrived, r3 names none: both still wait behind r1.
    order.iopub_arrived("out-0", start);
    EXPECT_TRUE(ids(arrive(order, reply("b", "r2", "out-0"), start)).empty());
    EXPECT_TRUE(ids(arrive(order, reply("a", "r3", ""), start)).empty());
    EXPECT_EQ(ids(order.iopub_arrived("out-1", start + 1ms)),
              (std::vector<std::string>{"a:r1", "b:r2", "a:r3"}));
}

TEST(ReplyOrder, AnOutputThatNeverComesDelaysTheReplyByThePatienceOnly) {
    ReplyOrder order(2s);
    arrive(order, reply("a", "r1", "dropped"), start);
    arrive(order, reply("a", "r2", "dropped-too"), start + 1s);
    EXPECT_TRUE(ids(order.expire(start + 1999ms)).empty());
    EXPECT_EQ(ids(order.expire(start + 2s)), std::vector<std::string>{"a:r1"});
    EXPECT_EQ(order.next_deadline(), start + 3s);
    EXPECT_EQ(ids(order.expire(start + 3s)), std::vector<std::string>{"a:r2"});
    EXPECT_EQ(order.released_without_iopub(), 2U);
}

TEST(ReplyOrder, RepliesWithoutANamedOutputAndOtherChannelsAreNotHeld) {
    ReplyOrder order(2s);
    EXPECT_EQ(ids(arrive(order, reply("a", "r1", ""), start)), std::vector<std::string>{"a:r1"});
    EXPECT_EQ(ReplyOrder::awaited_iopub(reply("a", "c1", "out", Channel::control).message), "");
    JupyterMessage odd;
    odd.metadata = R"({"cellblock": {"last_iopub_msg_id": 7}})";
    EXPECT_EQ(ReplyOrder::awaited_iopub(odd), "");
    odd.metadata = "not json, but mentions last_iopub_msg_id";
    EXPECT_EQ(ReplyOrder::awaited_iopub(odd), "");
    EXPECT_EQ(ReplyOrder::awaited_iopub(reply("a", "r1", "out-9").message), "out-9");
}

TEST(ReplyOrder, AnOutputLongScrolledPastIsWaitedForOnlyUntilTheDeadline) {
    ReplyOrder order(2s);
    order.iopub_arrived("early", start);
    for (int i = 0; i < 1000; ++i)
        order.iopub_arrived("flood-" + std::to_string(i), start);
    // Never lost, and never held longer than the patience.
    EXPECT_TRUE(ids(arrive(order, reply("a", "r1", "early"), start)).empty());
    EXPECT_EQ(ids(order.expire(start + 2s)), std::vector<std::string>{"a:r1"});
}
