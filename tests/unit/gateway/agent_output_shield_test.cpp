#include <gtest/gtest.h>

#include "cellblock/gateway/agent/output_shield.hpp"

using namespace cellblock::gateway::agent;

TEST(AgentStripAnsi, RemovesColourAndCursorSequences) {
    EXPECT_EQ(strip_ansi("\x1b[0;31mZeroDivisionError\x1b[0m: division by zero"),
              "ZeroDivisionError: division by zero");
    EXPECT_EQ(strip_ansi("a\x1b[38;5;196mb\x1b[1;32;40mc"), "abc");
    EXPECT_EQ(strip_ansi("\x1b]0;title\x07text"), "text");
    EXPECT_EQ(strip_ansi("\x1b]8;;http://x\x1b\\link"), "link");
    EXPECT_EQ(strip_ansi("\x1b(Bplain"), "plain");
    EXPECT_EQ(strip_ansi("no escapes, ünïcode kept"), "no escapes, ünïcode kept");
    EXPECT_EQ(strip_ansi("trailing escape\x1b"), "trailing escape");
}

TEST(AgentUtf8, HeadAndTailNeverSplitACharacter) {
    const std::string text = "aé€😀z";  // 1 + 2 + 3 + 4 + 1 bytes
    EXPECT_EQ(utf8_head(text, 2), "a");
    EXPECT_EQ(utf8_head(text, 3), "aé");
    EXPECT_EQ(utf8_head(text, 100), text);
    EXPECT_EQ(utf8_tail(text, 4), "z");
    EXPECT_EQ(utf8_tail(text, 5), "😀z");
    EXPECT_TRUE(is_valid_utf8(text));
    EXPECT_FALSE(is_valid_utf8("\xff"));
    EXPECT_FALSE(is_valid_utf8("\xc0\xaf"));                  // overlong '/'
    EXPECT_FALSE(is_valid_utf8("\xed\xa0\x80"));              // a surrogate
    EXPECT_FALSE(is_valid_utf8(std::string("\xe2\x82", 2)));  // cut short
}

TEST(AgentShield, ShortTextIsUntouched) {
    const ShieldedText shielded = shield_text("hello\n", 100, std::string("out.txt"));
    EXPECT_FALSE(shielded.shortened);
    EXPECT_EQ(shielded.text, "hello\n");
}

TEST(AgentShield, LongTextKeepsHeadAndTailAndNamesTheSavedFile) {
    const std::string text = "HEAD" + std::string(100000, 'x') + "TAIL";
    const ShieldedText shielded = shield_text(text, 1000, std::string(".cellblock/outputs/3-stdout.txt"));
    EXPECT_TRUE(shielded.shortened);
    EXPECT_EQ(shielded.original_bytes, text.size());
    EXPECT_TRUE(shielded.text.starts_with("HEAD"));
    EXPECT_TRUE(shielded.text.ends_with("TAIL"));
    EXPECT_NE(shielded.text.find(".cellblock/outputs/3-stdout.txt"), std::string::npos);
    EXPECT_NE(shielded.text.find(std::to_string(text.size() - 1000) + " of " + std::to_string(text.size())),
              std::string::npos);
    EXPECT_LT(shielded.text.size(), 1200u);
}

TEST(AgentShield, WithoutSavedFileTheMarkerSaysOnlyWhatWasOmitted) {
    const ShieldedText shielded = shield_text(std::string(5000, 'y'), 100, std::nullopt);
    EXPECT_TRUE(shielded.shortened);
    EXPECT_EQ(shielded.text.find("workspace file"), std::string::npos);
}

TEST(AgentDigest, Sha256MatchesKnownVectors) {
    EXPECT_EQ(sha256_hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
    EXPECT_EQ(sha256_hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}
