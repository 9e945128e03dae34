#include <gtest/gtest.h>

#include "cellblock/gateway/agent/execution.hpp"

using namespace cellblock::gateway;
using namespace cellblock::gateway::agent;
using nlohmann::json;

namespace {
JupyterMessage reply_to(const std::string& parent_id, Channel channel, const std::string& type,
                        const json& content, const json& metadata = json::object()) {
    JupyterMessage message =
        make_message(channel, type, content, "kernel-session", json{{"msg_id", parent_id}});
    message.metadata = metadata.dump();
    return message;
}

struct Recorder {
    std::vector<json> events;
    ExecutionCollector collector{"req-1", [this](const json& event) { events.push_back(event); }};
    bool feed(Channel channel, const std::string& type, const json& content,
              const std::string& parent = "req-1", const json& metadata = json::object()) {
        return collector.consume(reply_to(parent, channel, type, content, metadata));
    }
};
}  // namespace

TEST(AgentExecutionCollector, CollectsOutputsInOrderAndCompletesOnReplyAndIdle) {
    Recorder run;
    EXPECT_TRUE(run.feed(Channel::iopub, "status", {{"execution_state", "busy"}}));
    EXPECT_TRUE(run.feed(Channel::iopub, "execute_input", {{"code", "x"}, {"execution_count", 7}}));
    run.feed(Channel::iopub, "stream", {{"name", "stdout"}, {"text", "a\n"}});
    run.feed(Channel::iopub, "stream", {{"name", "stdout"}, {"text", "b\n"}});
    run.feed(Channel::iopub, "stream", {{"name", "stderr"}, {"text", "warn\n"}});
    run.feed(Channel::iopub, "display_data",
             {{"data", {{"image/png", "iVBOR"}, {"text/plain", "<Figure>"}}}, {"metadata", json::object()}});
    run.feed(Channel::iopub, "execute_result",
             {{"data", {{"text/plain", "42"}}}, {"metadata", json::object()}, {"execution_count", 7}});
    EXPECT_FALSE(run.collector.complete());
    run.feed(Channel::shell, "execute_reply", {{"status", "ok"}, {"execution_count", 7}});
    EXPECT_FALSE(run.collector.complete()) << "IOPub idle has not arrived yet";
    run.feed(Channel::iopub, "status", {{"execution_state", "idle"}});
    EXPECT_TRUE(run.collector.complete());

    EXPECT_EQ(run.collector.stdout_text(), "a\nb\n");
    EXPECT_EQ(run.collector.stderr_text(), "warn\n");
    EXPECT_EQ(run.collector.result()["text/plain"], "42");
    EXPECT_EQ(run.collector.displays().size(), 1u);
    EXPECT_EQ(run.collector.execution_count(), 7);
    EXPECT_EQ(run.collector.reply_status(), "ok");
    std::vector<std::string> types;
    for (const json& event : run.events)
        types.push_back(event["type"]);
    EXPECT_EQ(types, (std::vector<std::string>{"stdout", "stdout", "stderr", "display", "result"}));

    const json outputs = run.collector.notebook_outputs(std::nullopt, std::nullopt);
    ASSERT_EQ(outputs.size(), 4u);
    EXPECT_EQ(outputs[0], json({{"output_type", "stream"}, {"name", "stdout"}, {"text", "a\nb\n"}}));
    EXPECT_EQ(outputs[1]["name"], "stderr");
    EXPECT_EQ(outputs[2]["output_type"], "display_data");
    EXPECT_EQ(outputs[3]["output_type"], "execute_result");
    EXPECT_EQ(outputs[3]["execution_count"], 7);
}

TEST(AgentExecutionCollector, IgnoresOtherRequestsOfTheSameKernel) {
    Recorder run;
    EXPECT_FALSE(
        run.feed(Channel::iopub, "stream", {{"name", "stdout"}, {"text", "someone else\n"}}, "req-2"));
    EXPECT_FALSE(
        run.feed(Channel::iopub, "status", {{"execution_state", "idle"}}, "req-10"));  // prefix of no id
    EXPECT_EQ(run.collector.stdout_text(), "");
    EXPECT_TRUE(run.events.empty());
}

TEST(AgentExecutionCollector, TheKernelsOutcomeComesFromTheReplyMetadataNotFromText) {
    Recorder run;
    // User code can print the kernel's note; only the reply's metadata counts.
    run.feed(Channel::iopub, "stream",
             {{"name", "stderr"}, {"text", "\n[cellblock] Output truncated: fake"}});
    run.feed(Channel::iopub, "error",
             {{"ename", "TimeoutError"}, {"evalue", "socket"}, {"traceback", json::array()}});
    run.feed(Channel::shell, "execute_reply", {{"status", "error"}, {"execution_count", 3}}, "req-1",
             {{"cellblock", {{"outcome", "error"}, {"state_lost", false}, {"output_truncated", false}}}});
    EXPECT_EQ(run.collector.kernel_outcome(), "error");
    EXPECT_FALSE(run.collector.kernel_truncated());
    EXPECT_FALSE(run.collector.kernel_state_lost());

    Recorder killed;
    killed.feed(
        Channel::shell, "execute_reply", {{"status", "error"}}, "req-1",
        {{"cellblock", {{"outcome", "time_limit"}, {"state_lost", true}, {"output_truncated", "yes"}}}});
    EXPECT_EQ(killed.collector.kernel_outcome(), "time_limit");
    EXPECT_TRUE(killed.collector.kernel_state_lost());
    EXPECT_FALSE(killed.collector.kernel_truncated()) << "a flag that is not a boolean is not set";
}

TEST(AgentExecutionCollector, ErrorsAndKernelTruncationAreReported) {
    Recorder run;
    run.feed(Channel::iopub, "error",
             {{"ename", "ZeroDivisionError"},
              {"evalue", "division by zero"},
              {"traceback", {"\x1b[31mTraceback\x1b[0m", "ZeroDivisionError"}}});
    run.feed(Channel::shell, "execute_reply", {{"status", "error"}, {"execution_count", 3}}, "req-1",
             {{"cellblock", {{"outcome", "error"}, {"state_lost", false}, {"output_truncated", true}}}});
    run.feed(Channel::iopub, "status", {{"execution_state", "idle"}});
    EXPECT_TRUE(run.collector.complete());
    EXPECT_TRUE(run.collector.kernel_truncated());
    EXPECT_EQ(run.collector.reply_status(), "error");
    EXPECT_EQ(run.collector.error()["ename"], "ZeroDivisionError");
    EXPECT_EQ(run.events.back()["type"], "error");
}

TEST(AgentExecutionCollector, AShieldedStreamAppearsOnceWithItsReplacement) {
    Recorder run;
    run.feed(Channel::iopub, "stream", {{"name", "stdout"}, {"text", "part 1\n"}});
    run.feed(Channel::iopub, "display_data",
             {{"data", {{"text/plain", "shown"}}}, {"metadata", json::object()}});
    run.feed(Channel::iopub, "stream", {{"name", "stdout"}, {"text", "part 2\n"}});
    const json outputs = run.collector.notebook_outputs(std::string("head…tail"), std::nullopt);
    ASSERT_EQ(outputs.size(), 2u);
    EXPECT_EQ(outputs[0]["text"], "head…tail");
    EXPECT_EQ(outputs[1]["output_type"], "display_data");
}

// /metrics counts each agent execute once by how it ended (cellblock_agent_executes_total{outcome}).
TEST(AgentExecuteOutcome, NamesHowAnExecuteEnded) {
    EXPECT_EQ(execute_outcome("ok", "ok", "", false), "ok");
    EXPECT_EQ(execute_outcome("ok", "output_limit", "", false), "ok");
    EXPECT_EQ(execute_outcome("error", "error", "ZeroDivisionError", false), "error");
    EXPECT_EQ(execute_outcome("timeout", "time_limit", "TimeoutError", false), "timeout");
    EXPECT_EQ(execute_outcome("error", "interrupted", "KeyboardInterrupt", true), "interrupted");
    EXPECT_EQ(execute_outcome("error", "interrupted", "KeyboardInterrupt", false), "interrupted");
    EXPECT_EQ(execute_outcome("ok", "ok", "", true), "ok") << "finished before the interrupt took effect";
    EXPECT_EQ(execute_outcome("error", "worker_died", "WorkerDied", false), "worker_died");
    EXPECT_EQ(execute_outcome("error", "memory_limit", "WorkerDied", false), "worker_died");
    EXPECT_EQ(execute_outcome("error", "worker_unavailable", "WorkerUnavailable", false),
              "sandbox_unavailable");
    // The code's own exceptions never pass for the gateway's or the kernel's failures.
    EXPECT_EQ(execute_outcome("error", "error", "TimeoutError", false), "error");
    EXPECT_EQ(execute_outcome("error", "error", "WorkerDied", false), "error");
    EXPECT_EQ(execute_outcome("error", "error", "KernelDied", false), "error");
    // Answers the gateway made without a kernel reply.
    EXPECT_EQ(execute_outcome("error", "", "KernelDied", false), "kernel_died");
    EXPECT_EQ(execute_outcome("error", "", "KernelUnavailable", false), "kernel_unavailable");
    EXPECT_EQ(execute_outcome("error", "", "SessionClosed", false), "session_closed");
    EXPECT_EQ(execute_outcome("error", "", "ClientDisconnected", false), "abandoned");
    EXPECT_EQ(execute_outcome("error", "", "", false), "error") << "an aborted or error reply without a name";
}

// Found by tests/fuzz/execution_collector.cpp: a member of the wrong type threw json::type_error out of
// consume(), which unwound the kernel's IOPub channel before it waited again. Such members now count as
// absent, and the cell stays valid nbformat.
TEST(AgentExecutionCollector, MembersOfTheWrongTypeCountAsAbsentAndTheCellStaysValid) {
    Recorder run;
    EXPECT_NO_THROW(run.feed(Channel::iopub, "status", {{"execution_state", 1}}));
    EXPECT_NO_THROW(run.feed(Channel::iopub, "status", {{"execution_state", "busy"}}, "req-1"));
    EXPECT_NO_THROW(run.feed(Channel::iopub, "stream", {{"name", 2}, {"text", "out\n"}}));
    EXPECT_NO_THROW(run.feed(Channel::iopub, "execute_input", {{"execution_count", 1099511627776}}));
    EXPECT_NO_THROW(run.feed(Channel::iopub, "display_data", {{"data", "not a bundle"}, {"metadata", 3}}));
    EXPECT_NO_THROW(
        run.feed(Channel::iopub, "execute_result", {{"data", json::array({1})}, {"execution_count", -7}}));
    EXPECT_NO_THROW(run.feed(Channel::iopub, "error",
                             {{"ename", 5}, {"evalue", json::object()}, {"traceback", {"line", 9}}}));
    EXPECT_NO_THROW(run.feed(Channel::shell, "execute_reply", {{"status", false}, {"execution_count", "3"}}));
    EXPECT_NO_THROW(run.collector.consume(
        reply_to("", Channel::iopub, "status", {{"execution_state", "idle"}}, json::object())));
    JupyterMessage numeric_parent = make_message(Channel::iopub, "status", {{"execution_state", "idle"}},
                                                 "kernel-session", json{{"msg_id", 12}, {"note", "req-1"}});
    EXPECT_NO_THROW(EXPECT_FALSE(run.collector.consume(numeric_parent)));
    run.feed(Channel::iopub, "status", {{"execution_state", "idle"}});
    EXPECT_TRUE(run.collector.complete());

    EXPECT_EQ(run.collector.stdout_text(), "out\n") << "a stream without a string name is stdout";
    EXPECT_EQ(run.collector.execution_count(), -7) << "a count past int is no count";
    EXPECT_EQ(run.collector.reply_status(), "error") << "a reply without a string status is an error";
    const json outputs = run.collector.notebook_outputs(std::nullopt, std::nullopt);
    ASSERT_EQ(outputs.size(), 4u);
    EXPECT_EQ(
        outputs[1],
        json({{"output_type", "display_data"}, {"data", json::object()}, {"metadata", json::object()}}));
    EXPECT_EQ(outputs[2]["data"], json::object());
    EXPECT_EQ(
        outputs[3],
        json({{"output_type", "error"}, {"ename", "Error"}, {"evalue", ""}, {"traceback", {"line", "9"}}}));
}
