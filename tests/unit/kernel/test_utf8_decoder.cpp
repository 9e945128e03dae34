#include <gtest/gtest.h>

#include <string>

#include "utf8_decoder.hpp"

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
