#include <gtest/gtest.h>

#include <string>

#include "common/utf8_decoder.hpp"

namespace cellblock::kernel {
namespace {

const std::string replacement = "\xEF\xBF\xBD";

TEST(Utf8StreamDecoder, PassesAsciiAndValidText) {
    Utf8StreamDecoder decoder;
    EXPECT_EQ(decoder.feed("hello\n"), "hello\n");
    EXPECT_EQ(decoder.feed("h\xC3\xA9llo \xE2\x82\xAC \xF0\x9F\x98\x80"),
              "h\xC3\xA9llo \xE2\x82\xAC \xF0\x9F\x98\x80");
    EXPECT_FALSE(decoder.has_pending());
}

TEST(Utf8StreamDecoder, KeepsSequencesSplitAcrossReads) {
    Utf8StreamDecoder decoder;
    const std::string emoji = "\xF0\x9F\x98\x80";  // 4 bytes
    EXPECT_EQ(decoder.feed("a" + emoji.substr(0, 1)), "a");
    EXPECT_TRUE(decoder.has_pending());
    EXPECT_EQ(decoder.feed(emoji.substr(1, 2)), "");
    EXPECT_EQ(decoder.feed(emoji.substr(3) + "b"), emoji + "b");
    EXPECT_FALSE(decoder.has_pending());
}

TEST(Utf8StreamDecoder, ReplacesInvalidBytes) {
    Utf8StreamDecoder decoder;
    EXPECT_EQ(decoder.feed("bad:\xFF\xFE end"), "bad:" + replacement + replacement + " end");
    EXPECT_EQ(decoder.feed("\xC0\x80"), replacement + replacement) << "overlong encodings are invalid";
    EXPECT_EQ(decoder.feed("\xED\xA0\x80x"), replacement + replacement + replacement + "x")
        << "surrogates are invalid";
    EXPECT_EQ(decoder.feed("\xE2\x82z"), replacement + "z") << "a truncated sequence followed by ASCII";
}

TEST(Utf8StreamDecoder, FinishFlushesAnIncompleteTail) {
    Utf8StreamDecoder decoder;
    EXPECT_EQ(decoder.feed("x\xE2\x82"), "x");
    EXPECT_EQ(decoder.finish(), replacement);
    EXPECT_EQ(decoder.finish(), "");
}

// Reading straight into the text buffer must give exactly what feed() gives, wherever a read ends.
TEST(Utf8StreamDecoder, DecodingInPlaceMatchesFeedWhereverAReadEnds) {
    const std::string input =
        "plain ascii, longer than a word: \xC3\xA9\xE2\x82\xAC\xF0\x9F\x98\x80 then bad \xFF"
        "\xFE, overlong \xC0\x80, surrogate \xED\xA0\x80, cut \xE2\x82z, 0123456789abcdef \xF0\x9F";
    for (std::size_t cut = 0; cut <= input.size(); ++cut) {
        Utf8StreamDecoder by_feed;
        std::string expected = "kept ";
        expected += by_feed.feed(input.substr(0, cut));
        expected += by_feed.feed(input.substr(cut));
        expected += by_feed.finish();

        Utf8StreamDecoder in_place;
        std::string text = "kept ";
        for (const auto& chunk : {input.substr(0, cut), input.substr(cut)}) {
            const std::size_t from = text.size();
            text += chunk;
            in_place.decode_appended(text, from);
        }
        text += in_place.finish();
        EXPECT_EQ(text, expected) << "cut at " << cut;
    }
}

TEST(Utf8Prefix, CutsOnCodePointBoundaries) {
    const std::string text =
        "ab\xE2\x82\xAC"
        "cd";  // a b € c d
    EXPECT_EQ(utf8_prefix(text, 100), text);
    EXPECT_EQ(utf8_prefix(text, 2), "ab");
    EXPECT_EQ(utf8_prefix(text, 3), "ab");
    EXPECT_EQ(utf8_prefix(text, 4), "ab");
    EXPECT_EQ(utf8_prefix(text, 5), "ab\xE2\x82\xAC");
}

}  // namespace
}  // namespace cellblock::kernel
