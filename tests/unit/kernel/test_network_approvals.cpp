// NetworkApprovals: the proxy's events and approvals as IOPub messages, and decisions from the control
// channel passed to the held request (once), without a proxy or a socket.
#include <gtest/gtest.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "egress/network_approvals.hpp"

namespace cellblock::kernel {
namespace {

using nlohmann::json;

struct Published {
    std::string msg_type;
    json content;
};

class NetworkApprovalsTest : public ::testing::Test {
  protected:
    NetworkApprovals approvals;
    std::vector<Published> published;
    std::optional<NetworkApprovals::Connection> connection;
    std::vector<std::pair<egress::Decision, std::string>> answers;
    const egress::ApprovalRequest held{"ap-1", "files.test", 443, "CONNECT"};

    void SetUp() override {
        connection.emplace(approvals.connect([this](std::string msg_type, json content) {
            published.push_back({std::move(msg_type), std::move(content)});
        }));
    }
    void hold() {
        approvals.on_approval_requested(held, 120);
        approvals.request(held, [this](egress::Decision decision, std::string by) {
            answers.emplace_back(decision, std::move(by));
        });
    }
    json decide(const std::string& id, const std::string& decision, const std::string& by = "agent api") {
        return approvals.decide({{"id", id}, {"decision", decision}, {"decided_by", by}});
    }
};

TEST_F(NetworkApprovalsTest, AHeldRequestIsAnnouncedForMachinesAndPeople) {
    hold();
    ASSERT_EQ(published.size(), 2u);
    EXPECT_EQ(published[0].msg_type, "cellblock_egress");
    EXPECT_EQ(published[0].content, (json{{"event", "approval_requested"},
                                          {"id", "ap-1"},
                                          {"host", "files.test"},
                                          {"port", 443},
                                          {"method", "CONNECT"},
                                          {"timeout_s", 120}}));
    EXPECT_EQ(published[1].msg_type, "display_data");
    const json& display = published[1].content;
    EXPECT_EQ(display["transient"]["display_id"], "cellblock-approval-ap-1");
    EXPECT_EQ(
        display["data"]["text/plain"],
        "cellblock: network request to files.test:443 (CONNECT) is held for approval (id ap-1); no decision "
        "within 120 s denies it");
    EXPECT_EQ(display["data"]["application/vnd.cellblock.approval+json"], (json{{"id", "ap-1"},
                                                                                {"host", "files.test"},
                                                                                {"port", 443},
                                                                                {"method", "CONNECT"},
                                                                                {"timeout_s", 120}}));
    EXPECT_NE(display["data"]["text/html"].get<std::string>().find("<code>files.test:443</code>"),
              std::string::npos);
}

TEST_F(NetworkApprovalsTest, ADecisionReachesTheProxyOnceAndTheDisplayIsUpdated) {
    hold();
    EXPECT_EQ(decide("ap-1", "allow_once", "alice"), (json{{"status", "ok"}}));
    ASSERT_EQ(answers.size(), 1u);
    EXPECT_EQ(answers[0], std::make_pair(egress::Decision::allow_once, std::string("alice")));
    // Until the proxy reports the decision, a second one is refused: the first one stands.
    EXPECT_EQ(decide("ap-1", "deny")["ename"], "UnknownApproval");
    approvals.on_approval_decided(held, egress::Decision::allow_once, "alice");
    ASSERT_EQ(published.size(), 4u);
    EXPECT_EQ(published[2].content, (json{{"event", "approval_decided"},
                                          {"id", "ap-1"},
                                          {"host", "files.test"},
                                          {"port", 443},
                                          {"method", "CONNECT"},
                                          {"decision", "allow_once"},
                                          {"decided_by", "alice"}}));
    EXPECT_EQ(published[3].msg_type, "update_display_data");
    EXPECT_EQ(published[3].content["transient"]["display_id"], "cellblock-approval-ap-1");
    EXPECT_EQ(published[3].content["data"]["text/plain"],
              "cellblock: network request to files.test:443 (CONNECT): allowed once by alice");
    EXPECT_EQ(decide("ap-1", "deny")["ename"], "UnknownApproval");
    EXPECT_EQ(answers.size(), 1u);
}

TEST_F(NetworkApprovalsTest, ATimeOutIsShownAndLaterDecisionsAreRefused) {
    hold();
    approvals.on_approval_decided(held, egress::Decision::timeout, "");
    EXPECT_EQ(published.back().content["data"]["text/plain"],
              "cellblock: network request to files.test:443 (CONNECT): denied: no decision within 120 s");
    const json late = decide("ap-1", "allow_once");
    EXPECT_EQ(late["status"], "error");
    EXPECT_EQ(late["ename"], "UnknownApproval");
    EXPECT_TRUE(answers.empty());
}

TEST_F(NetworkApprovalsTest, ADecisionBeforeTheProxyHandsOverItsAnswerIsKept) {
    approvals.on_approval_requested(held, 5);
    EXPECT_EQ(decide("ap-1", "allow_session", "bob"), (json{{"status", "ok"}}));
    approvals.request(held, [this](egress::Decision decision, std::string by) {
        answers.emplace_back(decision, std::move(by));
    });
    ASSERT_EQ(answers.size(), 1u);
    EXPECT_EQ(answers[0], std::make_pair(egress::Decision::allow_session, std::string("bob")));
}

TEST_F(NetworkApprovalsTest, BadDecisionsAreRefusedWithoutEffect) {
    hold();
    EXPECT_EQ(decide("nope", "deny")["ename"], "UnknownApproval");
    EXPECT_EQ(decide("ap-1", "timeout")["ename"], "ValueError");  // time-outs are the proxy's alone
    EXPECT_EQ(approvals.decide({{"id", 7}, {"decision", "deny"}})["ename"], "ValueError");
    EXPECT_EQ(approvals.decide(json::array())["ename"], "ValueError");
    EXPECT_TRUE(answers.empty());
    EXPECT_EQ(decide("ap-1", "deny", "")["status"], "ok");
    EXPECT_EQ(answers.at(0).second, "an unnamed client");
}

TEST_F(NetworkApprovalsTest, ConnectionsAreReportedAndNothingIsPublishedOnceDisconnected) {
    egress::ConnectionRecord record;
    record.host = "allowed.test";
    record.port = 8080;
    record.method = "GET";
    record.bytes_up = 120;
    record.bytes_down = 4096;
    record.duration_ms = 12.5;
    record.allowed = true;
    record.rule = "allowed.test";
    approvals.on_connection(record);
    ASSERT_EQ(published.size(), 1u);
    EXPECT_EQ(published[0].content, (json{{"event", "connection"},
                                          {"host", "allowed.test"},
                                          {"port", 8080},
                                          {"method", "GET"},
                                          {"bytes_up", 120},
                                          {"bytes_down", 4096},
                                          {"duration_ms", 12.5},
                                          {"allowed", true},
                                          {"rule", "allowed.test"}}));
    connection.reset();
    approvals.on_connection(record);
    hold();
    EXPECT_EQ(published.size(), 1u);
}

}  // namespace
}  // namespace cellblock::kernel
