#include <gtest/gtest.h>

#include "server/protocol_fixups.hpp"

namespace cellblock::kernel {
namespace {

using nlohmann::json;

TEST(ProtocolFixups, InputRequestGetsPasswordField) {
    json content = {{"prompt", "Password: "}, {"pwd", true}};
    EXPECT_EQ(fix_outbound(WireChannel::stdin_channel, "input_request", content), Fixup::modified);
    EXPECT_EQ(content, (json{{"prompt", "Password: "}, {"password", true}}));
    json plain = {{"prompt", "name? "}, {"pwd", false}};
    fix_outbound(WireChannel::stdin_channel, "input_request", plain);
    EXPECT_EQ(plain["password"], false);
}

TEST(ProtocolFixups, AbortedRequestsSayAborted) {
    json content = {{"status", "error"}};
    EXPECT_EQ(fix_outbound(WireChannel::shell, "execute_reply", content), Fixup::modified);
    EXPECT_EQ(content, (json{{"status", "aborted"}}));
}

TEST(ProtocolFixups, RealErrorsAreUntouched) {
    json content = {{"status", "error"},
                    {"ename", "ZeroDivisionError"},
                    {"evalue", "division by zero"},
                    {"traceback", json::array()}};
    const json before = content;
    EXPECT_EQ(fix_outbound(WireChannel::shell, "execute_reply", content), Fixup::unchanged);
    EXPECT_EQ(content, before);
    json ok = {{"status", "ok"}};
    EXPECT_EQ(fix_outbound(WireChannel::shell, "execute_reply", ok), Fixup::unchanged);
}

TEST(ProtocolFixups, InterruptReplyGetsStatus) {
    json content = json::object();
    EXPECT_EQ(fix_outbound(WireChannel::control, "interrupt_reply", content), Fixup::modified);
    EXPECT_EQ(content["status"], "ok");
}

TEST(ProtocolFixups, XeusInterruptBroadcastIsDropped) {
    json content = json::object();
    EXPECT_EQ(fix_outbound(WireChannel::iopub, "interrupt", content), Fixup::drop);
    json status = {{"execution_state", "idle"}};
    EXPECT_EQ(fix_outbound(WireChannel::iopub, "status", status), Fixup::unchanged);
}

}  // namespace
}  // namespace cellblock::kernel

namespace cellblock::kernel {
namespace {

TEST(ProtocolFixups, ExecuteOutcomeMovesFromContentToMetadata) {
    nlohmann::json content = {{"status", "ok"}, {"cellblock", {{"outcome", "ok"}, {"state_lost", false}}}};
    nlohmann::json metadata = {{"started", "t"}};
    EXPECT_TRUE(move_outcome_to_metadata(content, metadata));
    EXPECT_FALSE(content.contains("cellblock"));
    EXPECT_EQ(metadata["cellblock"]["outcome"], "ok");
    EXPECT_EQ(metadata["started"], "t") << "other metadata is kept";

    nlohmann::json discarded = nlohmann::json::value_t::discarded;
    nlohmann::json again = {{"cellblock", {{"outcome", "error"}}}};
    EXPECT_TRUE(move_outcome_to_metadata(again, discarded));
    EXPECT_EQ(discarded["cellblock"]["outcome"], "error");

    nlohmann::json plain = {{"status", "ok"}};
    EXPECT_FALSE(move_outcome_to_metadata(plain, metadata));
}

}  // namespace
}  // namespace cellblock::kernel
