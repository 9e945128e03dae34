#include <gtest/gtest.h>

#include "server/history_manager.hpp"

namespace cellblock::kernel {
namespace {

using nlohmann::json;

class HistoryShapes : public ::testing::Test {
  protected:
    void SetUp() override {
        history.record(1, "x = 1", std::nullopt);
        history.record(2, "x + 1", "2");
        history.record(3, "print(x)", std::nullopt);
        history.record(4, "x + 1", "2");
    }
    HistoryManager history;
};

TEST_F(HistoryShapes, TailHasSessionLineInput) {
    const json reply = history.get_tail(2, true, false);
    EXPECT_EQ(reply["status"], "ok");
    EXPECT_EQ(reply["history"], (json::array({{1, 3, "print(x)"}, {1, 4, "x + 1"}})));
}

TEST_F(HistoryShapes, TailWithOutputNestsInputAndOutput) {
    const json reply = history.get_tail(2, true, true);
    EXPECT_EQ(reply["history"][0], (json::array({1, 3, {"print(x)", nullptr}})));
    EXPECT_EQ(reply["history"][1], (json::array({1, 4, {"x + 1", "2"}})));
}

TEST_F(HistoryShapes, TailLargerThanHistoryReturnsEverything) {
    EXPECT_EQ(history.get_tail(100, true, false)["history"].size(), 4u);
    EXPECT_EQ(history.get_tail(0, true, false)["history"].size(), 0u);
}

TEST_F(HistoryShapes, RangeStopIsExclusiveAndSessionZeroIsCurrent) {
    EXPECT_EQ(history.get_range(1, 2, 3, true, false)["history"], (json::array({{1, 2, "x + 1"}})));
    EXPECT_EQ(history.get_range(0, 2, 4, true, false)["history"].size(), 2u);
    EXPECT_EQ(history.get_range(-1, 1, 5, true, false)["history"].size(), 0u) << "no earlier sessions";
}

TEST_F(HistoryShapes, SearchUsesGlobsUniqueAndN) {
    EXPECT_EQ(history.search("x*", true, false, 10, false)["history"].size(), 3u);
    const json unique = history.search("x +*", true, false, 10, true)["history"];
    EXPECT_EQ(unique, (json::array({{1, 4, "x + 1"}}))) << "unique keeps the latest occurrence";
    EXPECT_EQ(history.search("*", true, false, 2, false)["history"],
              (json::array({{1, 3, "print(x)"}, {1, 4, "x + 1"}})))
        << "n keeps the latest matches, oldest first";
}

TEST_F(HistoryShapes, ProcessRequestDispatchesOnAccessType) {
    const json reply =
        history.process_request({{"hist_access_type", "tail"}, {"n", 1}, {"output", false}, {"raw", true}});
    EXPECT_EQ(reply["history"], (json::array({{1, 4, "x + 1"}})));
}

TEST_F(HistoryShapes, CoreStoreInputsIsIgnored) {
    // xeus's core stores every input as line 1; the interpreter's record() is the only source.
    history.store_inputs(0, 1, "ignored");
    EXPECT_EQ(history.get_tail(100, true, false)["history"].size(), 4u);
}

}  // namespace
}  // namespace cellblock::kernel
