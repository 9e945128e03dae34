#include <gtest/gtest.h>

#include "worker_channel.hpp"

namespace cellblock::kernel {
namespace {

TEST(WorkerChannel, FramesRoundTripInPieces) {
    const nlohmann::json first = {{"type", "reply"}, {"id", 7}, {"content", {{"status", "ok"}}}};
    const nlohmann::json second = {{"type", "error"}, {"ename", "E"}, {"evalue", "caf\xC3\xA9"}};
    const std::string wire = encode_frame(first) + encode_frame(second);
    EXPECT_EQ(wire.substr(0, 4), std::string("\0\0\0", 3) + static_cast<char>(first.dump().size()));
    FrameDecoder decoder;
    for (char byte : wire) {
        decoder.append(std::string_view(&byte, 1));
        if (auto message = decoder.next()) {
            if ((*message)["type"] == "reply") {
                EXPECT_EQ(*message, first);
            } else {
                EXPECT_EQ(*message, second);
            }
        }
    }
    EXPECT_TRUE(decoder.empty());
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

}  // namespace
}  // namespace cellblock::kernel
