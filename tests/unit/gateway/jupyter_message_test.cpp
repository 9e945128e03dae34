#include "cellblock/gateway/jupyter/jupyter_message.hpp"

#include <gtest/gtest.h>

#include <array>
#include <chrono>
#include <cstdint>

#include "cellblock/gateway/common/time_format.hpp"

using namespace cellblock::gateway;
using nlohmann::json;

namespace {
JupyterMessage sample(std::vector<std::string> buffers = {}) {
    JupyterMessage message = make_message(Channel::iopub, "display_data",
                                          {{"data", {{"text/plain", "42"}}}, {"metadata", json::object()}},
                                          "s1", {{"msg_id", "parent-1"}});
    message.buffers = std::move(buffers);
    return message;
}

std::uint32_t be32(const std::string& data, std::size_t at) {
    return (std::uint32_t(static_cast<unsigned char>(data[at])) << 24) |
           (std::uint32_t(static_cast<unsigned char>(data[at + 1])) << 16) |
           (std::uint32_t(static_cast<unsigned char>(data[at + 2])) << 8) |
           std::uint32_t(static_cast<unsigned char>(data[at + 3]));
}
}  // namespace

TEST(LegacyFormat, TextFrameCarriesTopLevelFields) {
    JupyterMessage message = sample();
    WebSocketFrame frame = encode_legacy(message);
    ASSERT_FALSE(frame.binary);
    json decoded = json::parse(frame.payload);
    EXPECT_EQ(decoded["msg_id"], message.msg_id);
    EXPECT_EQ(decoded["msg_type"], "display_data");
    EXPECT_EQ(decoded["channel"], "iopub");
    EXPECT_EQ(decoded["header"]["msg_id"], message.msg_id);
    EXPECT_EQ(decoded["parent_header"]["msg_id"], "parent-1");
    EXPECT_EQ(decoded["content"]["data"]["text/plain"], "42");
    EXPECT_EQ(decoded["buffers"], json::array());
}

TEST(LegacyFormat, BinaryEnvelopeOnlyWithBuffers) {
    WebSocketFrame frame = encode_legacy(sample({"abc", std::string("\0\1", 2)}));
    ASSERT_TRUE(frame.binary);
    const std::string& data = frame.payload;
    ASSERT_EQ(be32(data, 0), 3u);  // 1 + number of buffers
    const std::uint32_t json_start = be32(data, 4), first_buffer = be32(data, 8),
                        second_buffer = be32(data, 12);
    EXPECT_EQ(json_start, 16u);
    json decoded = json::parse(data.substr(json_start, first_buffer - json_start));
    EXPECT_EQ(decoded["channel"], "iopub");
    EXPECT_FALSE(decoded.contains("buffers"));
    EXPECT_EQ(data.substr(first_buffer, second_buffer - first_buffer), "abc");
    EXPECT_EQ(data.substr(second_buffer), std::string("\0\1", 2));
}

TEST(LegacyFormat, ClientBinaryEnvelopeRoundTrip) {
    JupyterMessage message = make_message(Channel::shell, "comm_msg", {{"data", json::object()}}, "s");
    message.buffers = {"abc", std::string("\0\1", 2)};
    JupyterMessage back = decode_legacy_binary(encode_legacy(message).payload);
    EXPECT_EQ(back.channel, Channel::shell);
    EXPECT_EQ(back.msg_id, message.msg_id);
    EXPECT_EQ(back.buffers, message.buffers);
}

TEST(LegacyFormat, AcceptsClientQuirks) {
    // No channel (E2B), buffers {} (AutoGen/OpenHands), empty session, no date, no msg_id.
    JupyterMessage message = decode_legacy_text(
        R"({"header":{"msg_type":"execute_request","session":"","username":""},"parent_header":null,
            "metadata":{},"content":{"code":"1"},"buffers":{}})");
    EXPECT_EQ(message.channel, Channel::shell);
    EXPECT_EQ(message.msg_type, "execute_request");
    EXPECT_FALSE(message.msg_id.empty());
    json header = json::parse(message.header);
    EXPECT_TRUE(header["date"].is_string());
    EXPECT_EQ(header["version"], "5.3");
    EXPECT_EQ(message.parent_header, "{}");
}

TEST(LegacyFormat, EpochFloatDateBecomesIsoString) {
    JupyterMessage message = decode_legacy_text(
        R"({"header":{"msg_id":"m","msg_type":"kernel_info_request","date":1700000000.5},"channel":"shell"})");
    EXPECT_EQ(json::parse(message.header)["date"], "2023-11-14T22:13:20.500000Z");
}

TEST(LegacyFormat, EpochDateOutsideTheClockIsReplacedByNow) {
    // 1e300 s would overflow system_clock's integer duration (undefined behaviour;
    // tests/fuzz/websocket_message).
    for (const char* date : {"1e300", "-1e300", "1e10", "-5"}) {
        JupyterMessage message = decode_legacy_text(
            std::string(R"({"header":{"msg_id":"m","msg_type":"kernel_info_request","date":)") + date + "}}");
        const auto parsed = parse_iso8601_utc(json::parse(message.header)["date"].get<std::string>());
        ASSERT_TRUE(parsed.has_value()) << date;
        EXPECT_LT(std::chrono::abs(std::chrono::system_clock::now() - *parsed), std::chrono::minutes(10))
            << date;
    }
}

TEST(LegacyFormat, InfersChannelFromMessageType) {
    EXPECT_EQ(decode_legacy_text(R"({"header":{"msg_type":"input_reply"}})").channel, Channel::stdin_);
    EXPECT_EQ(decode_legacy_text(R"({"header":{"msg_type":"interrupt_request"}})").channel, Channel::control);
    EXPECT_EQ(decode_legacy_text(R"({"header":{"msg_type":"shutdown_request"}})").channel, Channel::control);
    EXPECT_EQ(decode_legacy_text(R"({"header":{"msg_type":"complete_request"}})").channel, Channel::shell);
}

TEST(LegacyFormat, RejectsMalformedMessages) {
    EXPECT_THROW(decode_legacy_text("{nope"), MessageError);
    EXPECT_THROW(decode_legacy_text("[1,2]"), MessageError);
    EXPECT_THROW(decode_legacy_text(R"({"header":{"msg_id":"x"}})"), MessageError);  // no msg_type
    EXPECT_THROW(decode_legacy_text(R"({"header":{"msg_type":"x"},"channel":"iopub"})"), MessageError);
    EXPECT_THROW(decode_legacy_text(R"({"header":{"msg_type":"x"},"content":[1]})"), MessageError);
    EXPECT_THROW(decode_legacy_text("{\"header\":{\"msg_type\":\"\xff\"}}"), MessageError);
    EXPECT_THROW(decode_legacy_binary(std::string("\0\0\0\x09garbage", 11)), MessageError);
    EXPECT_THROW(decode_legacy_binary("ab"), MessageError);
}

namespace {
std::uint64_t le64(const std::string& data, std::size_t at) {
    std::uint64_t value = 0;
    for (int i = 7; i >= 0; --i)
        value = (value << 8) | static_cast<unsigned char>(data[at + static_cast<std::size_t>(i)]);
    return value;
}
}  // namespace

TEST(V1Format, LayoutFollowsTheSpec) {
    WebSocketFrame frame = encode_v1(sample({"buf"}));
    ASSERT_TRUE(frame.binary);
    const std::string& data = frame.payload;
    const std::uint64_t count = le64(data, 0);
    ASSERT_EQ(count, 7u);  // k + 2 with k = 4 parts + 1 buffer
    std::vector<std::uint64_t> offsets;
    for (std::uint64_t i = 0; i < count; ++i)
        offsets.push_back(le64(data, 8 * (i + 1)));
    EXPECT_EQ(offsets[0], 8 * (5 + 3));
    EXPECT_EQ(offsets.back(), data.size());
    EXPECT_EQ(data.substr(offsets[0], offsets[1] - offsets[0]), "iopub");
    EXPECT_EQ(json::parse(data.substr(offsets[1], offsets[2] - offsets[1]))["msg_type"], "display_data");
    EXPECT_EQ(json::parse(data.substr(offsets[2], offsets[3] - offsets[2]))["msg_id"], "parent-1");
    EXPECT_EQ(data.substr(offsets[5], offsets[6] - offsets[5]), "buf");
}

TEST(V1Format, ClientFramesRoundTrip) {
    JupyterMessage message = make_message(Channel::control, "interrupt_request", json::object(), "s");
    message.buffers = {"b1", "b2"};
    JupyterMessage back = decode_v1(encode_v1(message).payload);
    EXPECT_EQ(back.channel, Channel::control);
    EXPECT_EQ(back.msg_id, message.msg_id);
    EXPECT_EQ(back.msg_type, "interrupt_request");
    EXPECT_EQ(back.buffers, message.buffers);
    EXPECT_EQ(json::parse(back.content), json::object());
}

TEST(V1Format, RejectsTruncatedAndInconsistentFrames) {
    std::string frame =
        encode_v1(make_message(Channel::shell, "kernel_info_request", json::object(), "s")).payload;
    EXPECT_THROW(decode_v1(frame.substr(0, 20)), MessageError);
    EXPECT_THROW(decode_v1(frame.substr(0, frame.size() - 3)), MessageError);
    std::string huge_count = frame;
    huge_count[7] = '\x7f';
    EXPECT_THROW(decode_v1(huge_count), MessageError);
    EXPECT_THROW(decode_v1(""), MessageError);
}

TEST(WireFormat, NonStringHeaderFieldIsAMessageError) {
    // The callers in kernel.cpp catch MessageError only: anything else escapes the ZMQ read handler
    // (tests/fuzz/gateway_wire_decode).
    HmacSigner signer(random_hex(32));
    for (const char* header :
         {R"({"msg_id":7,"msg_type":"status"})", R"({"msg_id":"m","msg_type":["status"]})"}) {
        const std::array<std::string_view, 4> parts = {header, "{}", "{}", R"({"execution_state":"idle"})"};
        std::vector<std::string> frames = {"<IDS|MSG>", signer.sign(parts)};
        frames.insert(frames.end(), parts.begin(), parts.end());
        EXPECT_THROW(decode_wire(Channel::iopub, std::move(frames), signer), MessageError) << header;
    }
}

TEST(WireFormat, SignedRoundTripAndSignatureCheck) {
    HmacSigner signer(random_hex(32));
    JupyterMessage message = make_message(Channel::shell, "execute_request", {{"code", "1+1"}}, "s");
    std::vector<std::string> frames = encode_wire(message, signer);
    ASSERT_EQ(frames[0], "<IDS|MSG>");
    frames.insert(frames.begin(), "routing-identity");  // identities before the delimiter are skipped
    JupyterMessage back = decode_wire(Channel::shell, std::vector<std::string>(frames), signer);
    EXPECT_EQ(back.msg_id, message.msg_id);
    EXPECT_EQ(back.content, message.content);
    frames[6] = R"({"code":"rm -rf /"})";
    EXPECT_THROW(decode_wire(Channel::shell, std::move(frames), signer), MessageError);
    EXPECT_THROW(decode_wire(Channel::shell, {"no", "delimiter"}, signer), MessageError);
}

TEST(MessageMembers, AMemberOfAnotherTypeOrRangeCountsAsAbsent) {
    const auto content = nlohmann::json::parse(
        R"({"name": "stdout", "state": 1, "data": {"text/plain": "1"}, "list": [1], "count": 7,
            "huge": 1099511627776, "negative": -3, "float": 1.5, "flag": true, "not_flag": "true"})");
    EXPECT_EQ(string_member(content, "name"), "stdout");
    EXPECT_EQ(string_member(content, "state", "idle"), "idle");
    EXPECT_EQ(string_member(content, "missing", "x"), "x");
    EXPECT_EQ(object_member(content, "data")["text/plain"], "1");
    EXPECT_EQ(object_member(content, "list"), nlohmann::json::object());
    EXPECT_EQ(int_member(content, "count"), 7);
    EXPECT_EQ(int_member(content, "negative"), -3);
    EXPECT_EQ(int_member(content, "huge"), std::nullopt);
    EXPECT_EQ(int_member(content, "float"), std::nullopt);
    EXPECT_TRUE(bool_member(content, "flag"));
    EXPECT_FALSE(bool_member(content, "not_flag"));
    EXPECT_TRUE(bool_member(content, "missing", true));
    for (const auto& not_an_object : {nlohmann::json::array({1}), nlohmann::json("text"), nlohmann::json()}) {
        EXPECT_EQ(string_member(not_an_object, "name", "none"), "none");
        EXPECT_EQ(object_member(not_an_object, "data"), nlohmann::json::object());
        EXPECT_EQ(int_member(not_an_object, "count"), std::nullopt);
    }
    EXPECT_EQ(string_member(nlohmann::json::parse("{", nullptr, false), "name", "none"), "none");
}
