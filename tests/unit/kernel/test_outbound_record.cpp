// The outbound record behind cellblock_replay_request: what a gateway that was down gets back, in order,
// and how a gap is reported when the bounds dropped something.
#include <gtest/gtest.h>

#include <stdexcept>

#include "server/outbound_record.hpp"

namespace cellblock::kernel {
namespace {

using nlohmann::json;

RecordedMessage stream(const std::string& msg_id, const std::string& text,
                       const std::string& channel = "iopub") {
    return {channel,
            json{{"msg_id", msg_id}, {"msg_type", "stream"}}.dump(),
            json{{"msg_id", "request-1"}}.dump(),
            "{}",
            json{{"name", "stdout"}, {"text", text}}.dump(),
            {}};
}

std::string texts(const json& reply) {
    std::string joined;
    for (const auto& message : reply["messages"]) {
        joined += message["content"]["text"].get<std::string>();
    }
    return joined;
}

TEST(OutboundRecord, ReplaysEverythingInOrderWithPartsAsJson) {
    OutboundRecord record(RecordLimits{});
    for (int i = 0; i < 5; ++i) {
        record.add("m" + std::to_string(i), stream("m" + std::to_string(i), std::to_string(i)));
    }
    const json reply = record.replay(std::nullopt);
    EXPECT_EQ(reply["status"], "ok");
    EXPECT_EQ(reply["found"], true);
    EXPECT_EQ(reply["dropped"], 0);
    EXPECT_EQ(texts(reply), "01234");
    const json& first = reply["messages"][0];
    EXPECT_EQ(first["channel"], "iopub");
    EXPECT_EQ(first["header"]["msg_id"], "m0");
    EXPECT_EQ(first["parent_header"]["msg_id"], "request-1");
    EXPECT_EQ(first["metadata"], json::object());
    EXPECT_EQ(first["buffers"], json::array());
}

TEST(OutboundRecord, AfterAKnownMessageReturnsOnlyWhatFollowsIt) {
    OutboundRecord record(RecordLimits{});
    for (int i = 0; i < 5; ++i) {
        record.add("m" + std::to_string(i),
                   stream("m" + std::to_string(i), std::to_string(i), i == 3 ? "shell" : "iopub"));
    }
    json reply = record.replay("m1");
    EXPECT_EQ(reply["found"], true);
    EXPECT_EQ(texts(reply), "234");
    EXPECT_EQ(reply["messages"][1]["channel"], "shell");
    reply = record.replay("m4");  // the newest: nothing missed
    EXPECT_EQ(reply["found"], true);
    EXPECT_TRUE(reply["messages"].empty());
}

TEST(OutboundRecord, UnknownAfterReturnsEverythingAndSaysSo) {
    OutboundRecord record(RecordLimits{});
    record.add("m0", stream("m0", "a"));
    record.add("m1", stream("m1", "b"));
    for (const std::string unknown : {"never-sent", ""}) {
        const json reply = record.replay(unknown);
        EXPECT_EQ(reply["found"], false) << unknown;
        EXPECT_EQ(texts(reply), "ab") << unknown;
    }
}

TEST(OutboundRecord, CountBoundDropsOldestFirstAndCountsDrops) {
    OutboundRecord record(RecordLimits{1 << 20, 3});
    for (int i = 0; i < 7; ++i) {
        record.add("m" + std::to_string(i), stream("m" + std::to_string(i), std::to_string(i)));
    }
    EXPECT_EQ(record.size(), 3U);
    EXPECT_EQ(record.dropped(), 4U);
    json reply = record.replay(std::nullopt);
    EXPECT_EQ(texts(reply), "456");
    EXPECT_EQ(reply["dropped"], 4);
    // The gateway last saw m2, which is gone: it gets all that is left and learns of the gap.
    reply = record.replay("m2");
    EXPECT_EQ(reply["found"], false);
    EXPECT_EQ(texts(reply), "456");
    EXPECT_EQ(record.replay("m4")["found"], true);
}

TEST(OutboundRecord, ByteBoundDropsOldestAndAnOversizedMessageAtOnce) {
    const std::size_t one = stream("m0", std::string(100, 'x')).bytes();
    OutboundRecord record(RecordLimits{3 * one, 1000});
    for (int i = 0; i < 5; ++i) {
        record.add("m" + std::to_string(i), stream("m" + std::to_string(i), std::string(100, 'x')));
    }
    EXPECT_EQ(record.size(), 3U);
    EXPECT_LE(record.bytes(), 3 * one);
    EXPECT_EQ(record.dropped(), 2U);
    record.add("huge", stream("huge", std::string(4 * one, 'y')));
    EXPECT_EQ(record.size(), 0U)
        << "a message over the whole bound cannot be kept, nor can what it displaced";
    EXPECT_EQ(record.dropped(), 6U);
    EXPECT_EQ(record.bytes(), 0U);
    record.add("m9", stream("m9", "after"));
    EXPECT_EQ(texts(record.replay(std::nullopt)), "after");
}

TEST(OutboundRecord, ZeroDisablesRecording) {
    for (const RecordLimits limits : {RecordLimits{0, 10}, RecordLimits{1 << 20, 0}}) {
        OutboundRecord record(limits);
        record.add("m0", stream("m0", "a"));
        EXPECT_EQ(record.size(), 0U);
        EXPECT_TRUE(record.replay(std::nullopt)["messages"].empty());
    }
}

TEST(OutboundRecord, BuffersAreBase64) {
    OutboundRecord record(RecordLimits{});
    RecordedMessage message = stream("b0", "");
    message.buffers = {std::string("\x00\xff\x10", 3), "hello", ""};
    record.add("b0", std::move(message));
    const json reply = record.replay(std::nullopt);
    EXPECT_EQ(reply["messages"][0]["buffers"], (json{"AP8Q", "aGVsbG8=", ""}));
}

TEST(OutboundRecord, Base64MatchesRfc4648Vectors) {
    EXPECT_EQ(base64_encode(""), "");
    EXPECT_EQ(base64_encode("f"), "Zg==");
    EXPECT_EQ(base64_encode("fo"), "Zm8=");
    EXPECT_EQ(base64_encode("foo"), "Zm9v");
    EXPECT_EQ(base64_encode("foobar"), "Zm9vYmFy");
    // Long input: no line breaks (EVP_EncodeBlock, not the streaming encoder).
    EXPECT_EQ(base64_encode(std::string(300, 'a')).find('\n'), std::string::npos);
}

TEST(OutboundRecord, LimitsFromEnvironment) {
    const RecordLimits defaults = RecordLimits::from_environment(nullptr, nullptr);
    EXPECT_EQ(defaults.max_bytes, 8U * 1024 * 1024);
    EXPECT_EQ(defaults.max_messages, 10000U);
    const RecordLimits set = RecordLimits::from_environment("1000", "0");
    EXPECT_EQ(set.max_bytes, 1000U);
    EXPECT_FALSE(set.enabled());
    EXPECT_THROW(RecordLimits::from_environment("8MiB", nullptr), std::invalid_argument);
    EXPECT_THROW(RecordLimits::from_environment(nullptr, "-1"), std::invalid_argument);
    EXPECT_THROW(RecordLimits::from_environment("", nullptr), std::invalid_argument);
}

}  // namespace
}  // namespace cellblock::kernel
