#include <gtest/gtest.h>

#include <random>
#include <string>

#include "common/json_text.hpp"

namespace cellblock::kernel {
namespace {

using nlohmann::json;

std::string nlohmann_dump(const json& value) {
    return value.dump(-1, ' ', false, json::error_handler_t::replace);
}

void expect_same_as_nlohmann(const json& value) {
    EXPECT_EQ(dump_json(value), nlohmann_dump(value));
}

TEST(DumpJson, SmallMessagesAreNlohmannsDump) {
    expect_same_as_nlohmann(json::parse(R"({"msg_id":"a1","n":[1,2.5,-3,true,false,null],"o":{},"e":[]})"));
    expect_same_as_nlohmann(json("short \"quoted\" \\ \n"));
    expect_same_as_nlohmann(json(1e300));
    expect_same_as_nlohmann(json());
}

TEST(DumpJson, LongTextIsWrittenAsNlohmannWritesIt) {
    const std::string plain(1 << 20, 'x');
    EXPECT_EQ(dump_json(json({{"name", "stdout"}, {"text", plain + "\n"}})),
              R"({"name":"stdout","text":")" + plain + R"(\n"})");
    std::string every_byte;
    for (int round = 0; round < 3; ++round) {
        for (int byte = 0; byte < 256; ++byte) {
            every_byte.push_back(static_cast<char>(byte));
            every_byte += "plain text between";
        }
    }
    expect_same_as_nlohmann(json({{"text", every_byte}}));
    expect_same_as_nlohmann(json::array({every_byte, json({{"data", {{"text/plain", every_byte}}}}), 7}));
}

TEST(DumpJson, EverySpecialByteIsFoundAtEveryPlaceInAWord) {
    for (const char special : {'\0', '\n', '\x1f', '"', '\\', '\x7f', '\x80', '\xff', ' ', '~'}) {
        for (std::size_t place = 0; place < 24; ++place) {
            std::string text(80, 'a');
            text[place] = special;
            text[place + 40] = special;
            expect_same_as_nlohmann(json(text));
        }
    }
}

TEST(DumpJson, BrokenUtf8BecomesTheSameReplacementCharacters) {
    const std::string padding(100, 'a');
    // cut sequences before ASCII, at the end, overlong forms, surrogates, lone continuation bytes, and valid
    // text around them
    for (const std::string broken : {"\xE2\x82", "\xF0\x9F\x98", "\xC0\xAF", "\xED\xA0\x80", "\x80\x80",
                                     "\xFF", "h\xC3\xA9llo \xE2\x82\xAC \xF0\x9F\x98\x80", "\xC3"}) {
        expect_same_as_nlohmann(json(padding + broken + "z" + padding));
        expect_same_as_nlohmann(json(padding + broken));
        expect_same_as_nlohmann(json(broken + padding + broken + "\"" + broken));
    }
}

TEST(DumpJson, LongKeysAndNestedValues) {
    const std::string key = std::string(80, 'k') + "\t\"\xC3\xA9";
    expect_same_as_nlohmann(
        json({{key, std::string(100, 'v')}, {"b", {{"c", json::array({std::string(70, '\\')})}}}}));
}

TEST(DumpJson, RandomTextIsNlohmannsDump) {
    std::mt19937 random(20261203);
    // Mostly plain ASCII, with escapes, high bytes and valid sequences mixed in, as program output has them.
    const std::string alphabet =
        std::string("abc xyz 0123\n\t\r\"\\\x01\x1f\x7f") + "\xC3\xA9\xE2\x82\xAC\xF0\x9F\x98\x80\x80\xFF";
    for (int trial = 0; trial < 500; ++trial) {
        std::string text;
        const auto length = std::uniform_int_distribution<std::size_t>(0, 400)(random);
        for (std::size_t i = 0; i < length; ++i) {
            text.push_back(
                alphabet[std::uniform_int_distribution<std::size_t>(0, alphabet.size() - 1)(random)]);
        }
        expect_same_as_nlohmann(json({{"text", text}, {"list", {text, 1}}}));
    }
}

}  // namespace
}  // namespace cellblock::kernel
