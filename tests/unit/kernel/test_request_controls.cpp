#include <gtest/gtest.h>
#include <poll.h>

#include "worker/request_controls.hpp"

namespace cellblock::kernel {
namespace {

bool readable(int fd) {
    pollfd entry = {fd, POLLIN, 0};
    return ::poll(&entry, 1, 0) == 1;
}

TEST(RequestControls, InterruptForARequestNotStartedYetIsKeptForIt) {
    RequestControls controls;
    controls.interrupt({"queued"});
    EXPECT_TRUE(readable(controls.wakeup_fd()));
    controls.begin("queued");
    EXPECT_TRUE(controls.take_interrupt("queued"));
    EXPECT_FALSE(controls.take_interrupt("queued")) << "once per interrupt";
    controls.end();
}

TEST(RequestControls, InterruptForAnotherRequestDoesNotApply) {
    RequestControls controls;
    controls.interrupt({"first"});
    controls.begin("second");
    EXPECT_FALSE(controls.take_interrupt("second"));
    controls.end();
}

TEST(RequestControls, LateInterruptDoesNotHitTheNextRequest) {
    RequestControls controls;
    controls.begin("done");
    controls.end();
    controls.interrupt({});  // signal mode, nothing running
    controls.begin("next");
    EXPECT_FALSE(controls.take_interrupt("next"));
    controls.end();
}

TEST(RequestControls, SignalModeInterruptAppliesToTheRunningRequest) {
    RequestControls controls;
    controls.begin("running");
    controls.interrupt({});
    EXPECT_TRUE(controls.take_interrupt("running"));
    controls.drain_wakeup();
    EXPECT_FALSE(readable(controls.wakeup_fd()));
    controls.end();
}

TEST(RequestControls, ExecuteOptionsAreTakenByMsgId) {
    RequestControls controls;
    controls.post_options("a", parse_execute_options(nlohmann::json::parse(
                                   R"({"cellblock": {"timeout_s": 2.5, "output_bytes": 9}})")));
    const auto other = controls.take_options("b");
    EXPECT_FALSE(other.timeout_s);
    const auto options = controls.take_options("a");
    ASSERT_TRUE(options.timeout_s);
    EXPECT_EQ(*options.timeout_s, 2.5);
    ASSERT_TRUE(options.output_bytes);
    EXPECT_EQ(*options.output_bytes, 9u);
    EXPECT_FALSE(controls.take_options("a").timeout_s) << "taken once";
}

TEST(RequestControls, BadOptionValuesAreIgnored) {
    const auto options = parse_execute_options(
        nlohmann::json::parse(R"({"cellblock": {"timeout_s": -1, "output_bytes": "lots"}})"));
    EXPECT_FALSE(options.timeout_s);
    EXPECT_FALSE(options.output_bytes);
    EXPECT_FALSE(parse_execute_options(nlohmann::json::parse(R"({"cellblock": 3})")).timeout_s);
    EXPECT_FALSE(
        parse_execute_options(nlohmann::json::parse(R"({"cellblock": {"timeout_s": 0}})")).timeout_s);
    // Past 1.5e9 s the deadline's nanoseconds would overflow (a kernel without a time limit took any value).
    EXPECT_FALSE(
        parse_execute_options(nlohmann::json::parse(R"({"cellblock": {"timeout_s": 1e300}})")).timeout_s);
    EXPECT_TRUE(
        parse_execute_options(nlohmann::json::parse(R"({"cellblock": {"timeout_s": 1.5e9}})")).timeout_s);
}

}  // namespace
}  // namespace cellblock::kernel
