#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <array>

#include "worker/worker_channel.hpp"

namespace cellblock::kernel {
namespace {

std::string stream_frame(char channel, std::string_view text) {
    const auto size = static_cast<std::uint32_t>(text.size() + 1);
    std::string frame = {static_cast<char>(size >> 24), static_cast<char>((size >> 16) & 0xff),
                         static_cast<char>((size >> 8) & 0xff), static_cast<char>(size & 0xff), channel};
    frame.append(text);
    return frame;
}

TEST(WorkerChannel, FramesRoundTripInPieces) {
    const nlohmann::json first = {{"type", "reply"}, {"id", 7}, {"content", {{"status", "ok"}}}};
    const nlohmann::json second = {{"type", "error"}, {"ename", "E"}, {"evalue", "caf\xC3\xA9"}};
    const std::string wire = encode_frame(first) + encode_frame(second);
    EXPECT_EQ(wire.substr(0, 4), std::string("\0\0\0", 3) + static_cast<char>(first.dump().size()));
    FrameDecoder decoder;
    for (char byte : wire) {
        decoder.append(std::string_view(&byte, 1));
        if (auto frame = decoder.next()) {
            ASSERT_EQ(frame->kind, WorkerFrame::Kind::message);
            if (frame->message["type"] == "reply") {
                EXPECT_EQ(frame->message, first);
            } else {
                EXPECT_EQ(frame->message, second);
            }
        }
    }
    EXPECT_TRUE(decoder.empty());
}

// Python-level output travels in band, unencoded, in the order it was written among the JSON frames.
TEST(WorkerChannel, StreamFramesCarryRawTextInOrder) {
    const nlohmann::json display = {{"type", "display_data"}, {"data", {{"text/plain", "x"}}}};
    const std::string wire = stream_frame('\x01', "a\n") + encode_frame(display) +
                             stream_frame('\x02', std::string("\xE2\x82", 2)) + stream_frame('\x01', "b\n");
    FrameDecoder decoder;
    std::vector<std::string> seen;
    for (char byte : wire) {
        decoder.append(std::string_view(&byte, 1));
        while (auto frame = decoder.next()) {
            switch (frame->kind) {
                case WorkerFrame::Kind::stdout_text:
                    seen.push_back("out:" + std::string(frame->text));
                    break;
                case WorkerFrame::Kind::stderr_text:
                    seen.push_back("err:" + std::string(frame->text));
                    break;
                case WorkerFrame::Kind::message:
                    seen.push_back(frame->message["type"].get<std::string>());
                    break;
            }
        }
    }
    EXPECT_EQ(seen, (std::vector<std::string>{"out:a\n", "display_data", "err:\xE2\x82", "out:b\n"}));
    EXPECT_TRUE(decoder.empty());
}

TEST(WorkerChannel, ALargeFrameIsReadWholeFromTheSocket) {
    std::array<int, 2> pair{};
    ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, pair.data()), 0);
    const int send_buffer = 1 << 20;
    ASSERT_EQ(::setsockopt(pair[1], SOL_SOCKET, SO_SNDBUF, &send_buffer, sizeof(send_buffer)), 0);
    const std::string text(300000, 'x');
    const std::string frame = stream_frame('\x01', text);
    ASSERT_TRUE(send_all(pair[1], frame));
    FrameDecoder decoder;
    EXPECT_EQ(decoder.read_from(pair[0]), static_cast<ssize_t>(frame.size()));
    const auto got = decoder.next();
    ASSERT_TRUE(got.has_value());
    EXPECT_EQ(got->kind, WorkerFrame::Kind::stdout_text);
    EXPECT_EQ(got->text, text);
    ::close(pair[0]);
    ::close(pair[1]);
}

TEST(WorkerChannel, OversizedFrameIsAProtocolError) {
    FrameDecoder decoder;
    decoder.append(std::string("\x7f\xff\xff\xff", 4));
    EXPECT_THROW(decoder.next(), ProtocolError);
}

TEST(WorkerChannel, NonObjectFrameIsAProtocolError) {
    FrameDecoder decoder;
    decoder.append(std::string("\0\0\0\x03[1]", 7));
    EXPECT_THROW(decoder.next(), ProtocolError);
    FrameDecoder untyped;
    untyped.append(std::string("\0\0\0\x02{}", 6));
    EXPECT_THROW(untyped.next(), ProtocolError);
}

TEST(WorkerChannel, MalformedStreamFramesAreProtocolErrors) {
    for (const std::string& wire : {std::string("\0\0\0\0", 4),          // empty body
                                    std::string("\0\0\0\x01\x01", 5),    // a stream frame without text
                                    std::string("\0\0\0\x03\x03hi", 7),  // unknown channel byte
                                    std::string("\0\0\0\x03 {}", 7)}) {  // JSON must start with '{'
        FrameDecoder decoder;
        decoder.append(wire);
        EXPECT_THROW(decoder.next(), ProtocolError) << testing::PrintToString(wire);
    }
}

}  // namespace
}  // namespace cellblock::kernel
