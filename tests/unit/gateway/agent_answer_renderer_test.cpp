#include <gtest/gtest.h>

#include "cellblock/gateway/agent/answer_renderer.hpp"

using namespace cellblock::gateway;
using namespace cellblock::gateway::agent;
using nlohmann::json;

namespace {
// An execute's collected output, fed as the kernel would send it (no kernel).
struct Collected {
    ExecutionCollector collector{"req-1", nullptr};
    void feed(Channel channel, const std::string& type, const json& content,
              const json& metadata = json::object()) {
        JupyterMessage message =
            make_message(channel, type, content, "kernel-session", json{{"msg_id", "req-1"}});
        message.metadata = metadata.dump();
        collector.consume(message);
    }
    void stdout_text(const std::string& text) {
        feed(Channel::iopub, "stream", {{"name", "stdout"}, {"text", text}});
    }
    void reply(const std::string& status, int count, const json& cellblock = json::object()) {
        feed(Channel::shell, "execute_reply", {{"status", status}, {"execution_count", count}},
             {{"cellblock", cellblock}});
        feed(Channel::iopub, "status", {{"execution_state", "idle"}});
    }
};

AnswerContext context_of(std::size_t inline_bytes = 1024) {
    AnswerContext context;
    context.session_id = "s-1";
    context.ticket = 9;
    context.inline_output_bytes = inline_bytes;
    context.saved_output_bytes = 4096;
    context.timeout_s = 2;
    context.interrupt_grace_s = 5;
    context.duration_ms = 12.5;
    return context;
}

// Saves nothing: records what it was asked to save and answers a path.
struct Saver {
    std::vector<std::pair<std::string, std::size_t>> saved;
    SaveOutput function() {
        return [this](const std::string& name, const std::string& text) -> std::optional<std::string> {
            saved.emplace_back(name, text.size());
            return ".cellblock/outputs/" + name;
        };
    }
};
}  // namespace

TEST(AgentAnswerRenderer, AnOkExecuteAnswersItsOutputsAsTheyAre) {
    Collected run;
    run.stdout_text("hello\n");
    run.feed(Channel::iopub, "execute_result",
             {{"data", {{"text/plain", "42"}}}, {"metadata", json::object()}, {"execution_count", 3}});
    run.reply("ok", 3);
    Saver saver;
    const RenderedAnswer rendered = render_answer(run.collector, context_of(), saver.function());
    const json& answer = rendered.answer;
    EXPECT_EQ(answer["session"], "s-1");
    EXPECT_EQ(answer["status"], "ok");
    EXPECT_EQ(answer["execution_count"], 3);
    EXPECT_EQ(answer["stdout"], "hello\n");
    EXPECT_EQ(answer["stderr"], "");
    EXPECT_EQ(answer["result"]["text/plain"], "42");
    EXPECT_TRUE(answer["error"].is_null());
    EXPECT_EQ(answer["duration_ms"], 12.5);
    EXPECT_EQ(answer["truncated"], false);
    EXPECT_EQ(answer["state_lost"], false);
    EXPECT_FALSE(answer.contains("saved"));
    EXPECT_FALSE(answer.contains("notice"));
    EXPECT_TRUE(saver.saved.empty());
    ASSERT_EQ(rendered.cell_outputs.size(), 2u);
    EXPECT_EQ(rendered.cell_outputs[0]["text"], "hello\n");
}

TEST(AgentAnswerRenderer, TextBeyondTheInlineCapIsShieldedAndSavedWhole) {
    Collected run;
    const std::string big(5000, 'x');
    run.stdout_text(big);
    run.feed(Channel::iopub, "execute_result",
             {{"data", {{"text/plain", "short"}, {"text/html", std::string(2000, 'h')}}},
              {"metadata", json::object()},
              {"execution_count", 4}});
    run.reply("ok", 4);
    Saver saver;
    const RenderedAnswer rendered = render_answer(run.collector, context_of(100), saver.function());
    const json& answer = rendered.answer;
    EXPECT_EQ(answer["truncated"], true);
    EXPECT_LT(answer["stdout"].get<std::string>().size(), big.size());
    EXPECT_NE(answer["stdout"].get<std::string>().find(".cellblock/outputs/4-stdout.txt"), std::string::npos);
    EXPECT_EQ(answer["saved"], json({{"stdout", ".cellblock/outputs/4-stdout.txt"}}));
    ASSERT_EQ(saver.saved.size(), 1u);
    EXPECT_EQ(saver.saved[0], std::make_pair(std::string("4-stdout.txt"), big.size()));
    // Large rich text stays out of the answer; text/plain stays.
    EXPECT_FALSE(answer["result"].contains("text/html"));
    EXPECT_EQ(answer["result"]["text/plain"], "short");
    // The cell keeps the shielded text, not the whole one.
    EXPECT_EQ(rendered.cell_outputs[0]["text"], answer["stdout"]);
}

TEST(AgentAnswerRenderer, WithoutAnExecutionCountSavedFilesAreNamedByTicket) {
    Collected run;
    run.stdout_text(std::string(300, 'y'));
    Saver saver;
    AnswerContext context = context_of(100);
    context.kernel_failure = "the kernel process died";
    const json answer = render_answer(run.collector, context, saver.function()).answer;
    ASSERT_EQ(saver.saved.size(), 1u);
    EXPECT_EQ(saver.saved[0].first, "t9-stdout.txt");
    EXPECT_EQ(answer["status"], "error");
    EXPECT_EQ(answer["error"]["ename"], "KernelDied");
    EXPECT_EQ(answer["error"]["evalue"], "the kernel process died");
    EXPECT_EQ(answer["state_lost"], true);
    EXPECT_EQ(answer["notice"],
              "the kernel was restarted: variables and imports from earlier executes are gone");
}

TEST(AgentAnswerRenderer, AnUnsavedOutputIsStillShieldedButNotNamed) {
    Collected run;
    run.stdout_text(std::string(300, 'z'));
    run.reply("ok", 1);
    const json answer =
        render_answer(run.collector, context_of(100), [](const std::string&, const std::string&) {
            return std::optional<std::string>();
        }).answer;
    EXPECT_EQ(answer["truncated"], true);
    EXPECT_FALSE(answer.contains("saved"));
}

TEST(AgentAnswerRenderer, TheKernelsTimeLimitIsATimeoutWhateverTheErrorSays) {
    Collected run;
    run.feed(
        Channel::iopub, "error",
        {{"ename", "KeyboardInterrupt"}, {"evalue", ""}, {"traceback", json::array({"\x1b[31mKI\x1b[0m"})}});
    run.reply("error", 2, {{"outcome", "time_limit"}, {"state_lost", false}});
    const json answer = render_answer(run.collector, context_of(), nullptr).answer;
    EXPECT_EQ(answer["status"], "timeout");
    EXPECT_EQ(answer["error"]["ename"], "TimeoutError");
    EXPECT_EQ(answer["error"]["evalue"],
              "the code ran longer than 2.0 s and was interrupted; the session's state is kept");
    EXPECT_EQ(answer["state_lost"], false);

    // A cell raising its own TimeoutError is an error like any other.
    Collected own;
    own.feed(Channel::iopub, "error",
             {{"ename", "TimeoutError"}, {"evalue", "socket"}, {"traceback", json::array()}});
    own.reply("error", 3);
    const json own_answer = render_answer(own.collector, context_of(), nullptr).answer;
    EXPECT_EQ(own_answer["status"], "error");
    EXPECT_EQ(own_answer["error"]["evalue"], "socket");
}

TEST(AgentAnswerRenderer, TheSafetyNetsRestartLosesTheState) {
    Collected run;
    AnswerContext context = context_of();
    context.timed_out = true;
    context.kernel_restarted = true;
    const json answer = render_answer(run.collector, context, nullptr).answer;
    EXPECT_EQ(answer["status"], "timeout");
    EXPECT_EQ(answer["state_lost"], true);
    EXPECT_EQ(answer["error"]["evalue"],
              "the code ran longer than 2.0 s and ignored the interrupt for 5.0 s; the kernel was restarted, "
              "so all "
              "state (variables, imports) was lost");
}

TEST(AgentAnswerRenderer, NoticesSayANewKernelAndTheKernelsOutputLimit) {
    Collected run;
    run.stdout_text("a");
    run.reply("ok", 1, {{"output_truncated", true}});
    AnswerContext context = context_of();
    context.state_lost_notice = true;
    context.state_lost_cause = "the kernel was lost across a gateway restart";
    const json answer = render_answer(run.collector, context, nullptr).answer;
    EXPECT_EQ(answer["state_lost"], true);
    EXPECT_EQ(answer["truncated"], true);
    EXPECT_EQ(
        answer["notice"],
        "a new kernel serves this session (the kernel was lost across a gateway restart): variables, imports "
        "and workspace files from earlier executes are gone; the output exceeded the 4096-byte limit for "
        "saved output: only its first and last bytes were kept (a marker in the text says how much was "
        "left out)");

    context.state_lost_cause.clear();
    EXPECT_NE(render_answer(run.collector, context, nullptr)
                  .answer["notice"]
                  .get<std::string>()
                  .find("(the previous one was shut down)"),
              std::string::npos);
}

TEST(AgentAnswerRenderer, AClientThatWentAwayIsTheNoticeOfAFailedExecute) {
    Collected run;
    run.feed(Channel::iopub, "error",
             {{"ename", "KeyboardInterrupt"}, {"evalue", ""}, {"traceback", json::array()}});
    run.reply("error", 1);
    AnswerContext context = context_of();
    context.interrupted_by_client = true;
    EXPECT_EQ(render_answer(run.collector, context, nullptr).answer["notice"],
              "interrupted because the client disconnected");
}

TEST(AgentAnswerRenderer, AnErrorAnswerOfAnExecuteThatNeverRan) {
    const json answer = error_answer("s-1", "SessionClosed", "the session was deleted");
    EXPECT_EQ(answer["status"], "error");
    EXPECT_TRUE(answer["execution_count"].is_null());
    EXPECT_EQ(answer["error"]["traceback"], "SessionClosed: the session was deleted");
    EXPECT_EQ(answer["duration_ms"], 0);
    EXPECT_EQ(answer["state_lost"], false);
}

TEST(AgentAnswerRenderer, TheAuditDigestHoldsSizesHashesAndHeadsNotTheText) {
    Collected run;
    run.stdout_text(std::string(2000, 'o'));
    run.feed(Channel::iopub, "display_data",
             {{"data", {{"image/png", "iVBOR"}, {"text/plain", "<Figure>"}}}, {"metadata", json::object()}});
    run.feed(Channel::iopub, "error",
             {{"ename", "ValueError"}, {"evalue", "bad"}, {"traceback", json::array()}});
    run.reply("error", 1);
    const json answer = render_answer(run.collector, context_of(), nullptr).answer;
    const json outputs = audit_outputs(run.collector, answer);
    EXPECT_EQ(outputs["stdout"]["bytes"], 2000);
    EXPECT_EQ(outputs["stdout"]["head"].get<std::string>().size(), 512u);
    EXPECT_EQ(outputs["stdout"]["sha256"].get<std::string>().size(), 64u);
    EXPECT_TRUE(outputs["stderr"].is_null());
    EXPECT_TRUE(outputs["result"].is_null());
    ASSERT_EQ(outputs["displays"].size(), 1u);
    EXPECT_EQ(outputs["displays"][0]["mime_types"], json({"image/png", "text/plain"}));
    EXPECT_EQ(outputs["error"], json({{"ename", "ValueError"}, {"evalue", "bad"}}));
}

TEST(AgentAnswerRenderer, TracebacksAreJoinedWithoutColours) {
    EXPECT_EQ(joined_traceback(json::array({"\x1b[31mone\x1b[0m", 7, "two"})), "one\ntwo");
    EXPECT_EQ(joined_traceback(json("not a list")), "");
}
