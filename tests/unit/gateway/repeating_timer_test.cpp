#include "cellblock/gateway/common/repeating_timer.hpp"

#include <gtest/gtest.h>

#include <boost/asio/io_context.hpp>
#include <limits>
#include <memory>
#include <stdexcept>
#include <thread>

using namespace cellblock::gateway;
using namespace std::chrono_literals;

TEST(RepeatingTimer, RunsAgainAfterEachRunUntilTheActionStopsIt) {
    boost::asio::io_context io;
    RepeatingTimer timer(io);
    int runs = 0;
    timer.start(1ms, [&] {
        if (++runs == 3)
            timer.stop();
    });
    EXPECT_TRUE(timer.running());
    io.run_for(2s);  // returns early once nothing is pending: the stopped timer leaves no work
    EXPECT_EQ(runs, 3);
    EXPECT_FALSE(timer.running());
}

TEST(RepeatingTimer, StartingAgainReplacesTheSchedule) {
    boost::asio::io_context io;
    RepeatingTimer timer(io);
    int first = 0, second = 0;
    timer.start(1ms, [&] { ++first; });
    timer.start(1ms, [&] {
        if (++second == 2)
            timer.stop();
    });
    io.run_for(2s);
    EXPECT_EQ(first, 0);
    EXPECT_EQ(second, 2);
}

// Both waits complete in one pass of the reactor, so both handlers are queued before either runs: cancelling
// the second timer from the first one's action does not withdraw its handler, and the timer itself must not
// run.
TEST(RepeatingTimer, AWaitAlreadyCompletedWhenStoppedDoesNotRunTheAction) {
    boost::asio::io_context io;
    RepeatingTimer first(io);
    RepeatingTimer second(io);
    int second_runs = 0;
    first.start(1ms, [&] {
        if (second.running())
            second.stop();
        else
            first.stop();
    });
    second.start(1ms, [&] {
        ++second_runs;
        first.stop();
        second.stop();
    });
    std::this_thread::sleep_for(20ms);
    io.run_for(2s);
    EXPECT_EQ(second_runs, 0);
}

// The same with the second timer destroyed: its queued handler must not touch it (ASan would report a
// use after free).
TEST(RepeatingTimer, AWaitAlreadyCompletedWhenDestroyedTouchesNothing) {
    boost::asio::io_context io;
    RepeatingTimer first(io);
    auto second = std::make_unique<RepeatingTimer>(io);
    int second_runs = 0;
    first.start(1ms, [&] {
        second.reset();
        first.stop();
    });
    second->start(1ms, [&] { ++second_runs; });
    std::this_thread::sleep_for(20ms);
    io.run_for(2s);
    EXPECT_EQ(second_runs, 0);
}

TEST(RepeatingTimer, RefusesIntervalsThatAreNotPositiveAndCapsHugeOnes) {
    boost::asio::io_context io;
    RepeatingTimer timer(io);
    EXPECT_THROW(timer.start(0s, [] {}), std::invalid_argument);
    EXPECT_THROW(timer.start(std::chrono::duration<double>(-1), [] {}), std::invalid_argument);
    EXPECT_THROW(timer.start(std::chrono::duration<double>(std::numeric_limits<double>::quiet_NaN()), [] {}),
                 std::invalid_argument);
    EXPECT_THROW(timer.start(std::chrono::duration<double>(std::numeric_limits<double>::infinity()), [] {}),
                 std::invalid_argument);
    int runs = 0;
    timer.start(std::chrono::duration<double>(1e300), [&] { ++runs; });  // defined: capped at 1e9 s
    EXPECT_TRUE(timer.running());
    io.run_for(20ms);
    EXPECT_EQ(runs, 0);
}
