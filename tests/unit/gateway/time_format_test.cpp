#include "cellblock/gateway/common/time_format.hpp"

#include <gtest/gtest.h>

#include <regex>

using namespace cellblock::gateway;
using namespace std::chrono;

TEST(TimeFormat, AlwaysSixFractionalDigitsAndZ) {
    const system_clock::time_point whole_second{seconds(1700000000)};
    EXPECT_EQ(format_iso8601_utc(whole_second), "2023-11-14T22:13:20.000000Z");
    EXPECT_EQ(format_iso8601_utc(whole_second + microseconds(7)), "2023-11-14T22:13:20.000007Z");
    EXPECT_EQ(format_iso8601_utc(whole_second + microseconds(999999)), "2023-11-14T22:13:20.999999Z");
}

TEST(TimeFormat, MatchesStrptimeFormatOfGatewayClient) {
    const std::regex shape(R"(^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{6}Z$)");
    for (int i = 0; i < 1000; ++i)
        EXPECT_TRUE(std::regex_match(format_iso8601_utc(system_clock::now()), shape));
}

TEST(TimeFormat, EpochAndBeforeEpoch) {
    EXPECT_EQ(format_iso8601_utc(system_clock::time_point{}), "1970-01-01T00:00:00.000000Z");
    EXPECT_EQ(format_iso8601_utc(system_clock::time_point{} - microseconds(1)),
              "1969-12-31T23:59:59.999999Z");
}

TEST(TimeFormat, ParsesWhatItFormatsAndRefusesAnythingElse) {
    const system_clock::time_point when{seconds(1700000000) + microseconds(123456)};
    EXPECT_EQ(parse_iso8601_utc(format_iso8601_utc(when)), when);
    EXPECT_EQ(parse_iso8601_utc("2023-11-14T22:13:20Z"), system_clock::time_point{seconds(1700000000)});
    EXPECT_EQ(parse_iso8601_utc("2023-11-14T22:13:20.5Z"),
              system_clock::time_point{seconds(1700000000) + milliseconds(500)});
    EXPECT_FALSE(parse_iso8601_utc("").has_value());
    EXPECT_FALSE(parse_iso8601_utc("2023-11-14 22:13:20").has_value());
    EXPECT_FALSE(parse_iso8601_utc("2023-11-14T22:13:20.000000Z trailing").has_value());
}
