#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "cellblock/gateway/agent/live_events.hpp"

using namespace cellblock::gateway::agent;
using nlohmann::json;

namespace {

// What a reader of `log` gets from `after_id` on: (id, type) of each event.
std::vector<std::pair<std::uint64_t, std::string>> read_from(LiveLog& log, std::uint64_t after_id) {
    std::vector<std::pair<std::uint64_t, std::string>> seen;
    LiveLog::Reader reader;
    reader.on_event = [&seen](std::uint64_t id, const std::string& data) {
        seen.emplace_back(id, json::parse(data).at("type").get<std::string>());
    };
    log.unsubscribe(log.subscribe(after_id, std::move(reader)));
    return seen;
}

void one_cell(LiveLog& log, const std::string& text) {
    log.cell_started("print()");
    log.cell_event({{"type", "stdout"}, {"text", text}});
    log.cell_finished({{"status", "ok"}});
}

}  // namespace

TEST(AgentLiveLog, IdsGrowFromTheGenerationAndAResumeGetsOnlyWhatFollows) {
    LiveLog log(1024, 5000);
    one_cell(log, "a");
    const auto all = read_from(log, 0);
    ASSERT_EQ(all.size(), 3U);
    EXPECT_EQ(all.front().first, 5001U);
    EXPECT_EQ(log.last_id(), 5003U);
    EXPECT_EQ(read_from(log, 5001), (decltype(all){{5002, "stdout"}, {5003, "end"}}));
    EXPECT_TRUE(read_from(log, 5003).empty());
}

TEST(AgentLiveLog, AReaderOfAnEarlierLogGetsAResyncThenEverythingOnce) {
    // The log before a gateway restart, and the one after it, seeded from the store with the same cell.
    LiveLog before(1024, 1000);
    one_cell(before, "a");
    const std::uint64_t seen_before = before.last_id();
    LiveLog after(1024, 9000);
    after.seed({json{{"source", "print()"}, {"outputs", json::array()}}});
    one_cell(after, "b");

    const auto resumed = read_from(after, seen_before);
    ASSERT_EQ(resumed.size(), 5U);
    EXPECT_EQ(resumed[0], (std::pair<std::uint64_t, std::string>{9000, "resync"}));
    EXPECT_EQ(resumed[1], (std::pair<std::uint64_t, std::string>{9001, "recorded"}));
    EXPECT_EQ(resumed.back().first, after.last_id());
    EXPECT_GT(resumed[0].first, seen_before) << "a page drops ids at or below the last it applied";
    // An id past this log's newest (a reader from a log whose clock ran ahead) starts over the same way.
    EXPECT_EQ(read_from(after, after.last_id() + 1).front().second, "resync");
    // A reader that saw the resync and dropped before the rest resumes without another.
    EXPECT_EQ(read_from(after, 9000).front().second, "recorded");
}

TEST(AgentLiveLog, TheClockGenerationFitsAJavaScriptNumber) {
    const std::uint64_t generation = LiveLog::clock_generation();
    EXPECT_GT(generation, 1'700'000'000'000'000U);  // microseconds since the epoch, after 2023
    EXPECT_LT(generation, 1ULL << 53);
}
