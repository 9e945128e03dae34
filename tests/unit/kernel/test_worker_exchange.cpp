// The worker exchange without xeus: the real worker runtime (share/cellblock/worker), confined by the
// sandbox as the kernel runs it, driven through WorkerExchange with a sink that records what a client
// would be sent, in order.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "worker/worker_exchange.hpp"

namespace cellblock::kernel {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using Clock = std::chrono::steady_clock;

struct Published {
    std::string kind;  // stream, display_data, update_display_data, clear_output, execute_result, error
    std::string name;  // stream name / ename
    std::string text;  // stream text / evalue
    json data;
};

class RecordingSink final : public ExchangeSink {
  public:
    void stream(const std::string& name, std::string text) override {
        EXPECT_FALSE(text.empty());
        events.push_back({"stream", name, text, nullptr});
        if (on_stream) {
            on_stream(text);
        }
    }
    void display_data(json data, json, json) override {
        events.push_back({"display_data", "", "", data});
        if (on_display) {
            on_display();
        }
    }
    void update_display_data(json data, json, json) override {
        events.push_back({"update_display_data", "", "", data});
    }
    void clear_output(bool) override { events.push_back({"clear_output", "", "", nullptr}); }
    void execute_result(int, json data, json) override { events.push_back({"execute_result", "", "", data}); }
    void error(const std::string& ename, const std::string& evalue,
               const std::vector<std::string>&) override {
        events.push_back({"error", ename, evalue, nullptr});
    }
    std::string input(const std::string& prompt, bool) override {
        prompts.push_back(prompt);
        return input_answer;
    }
    bool can_release_input() const override { return false; }
    void release_input() override {}

    // Stream events of `name` merged (text is batched, so how it is split is not behaviour).
    std::string text(const std::string& name) const {
        std::string all;
        for (const auto& event : events) {
            if (event.kind == "stream" && event.name == name) {
                all += event.text;
            }
        }
        return all;
    }
    // Stream text published before the first event of `kind`.
    std::string stream_text_before(const std::string& kind) const {
        std::string all;
        for (const auto& event : events) {
            if (event.kind == kind) {
                break;
            }
            all += event.kind == "stream" ? event.text : "";
        }
        return all;
    }
    // Event kinds in order, consecutive stream events of one stream counted once.
    std::vector<std::string> kinds() const {
        std::vector<std::string> out;
        for (const auto& event : events) {
            const std::string kind = event.kind == "stream" ? "stream:" + event.name : event.kind;
            if (out.empty() || out.back() != kind || event.kind != "stream") {
                out.push_back(kind);
            }
        }
        return out;
    }

    std::vector<Published> events;
    std::vector<std::string> prompts;
    std::string input_answer;
    std::function<void(const std::string&)> on_stream;
    std::function<void()> on_display;
};

// A kernel that is slow to read: its thread is off the worker's fds for a while after a display (a loaded
// machine, a slow client behind the sink).
void stall_after_each_display(RecordingSink& sink, std::chrono::milliseconds stall) {
    sink.on_display = [stall] { std::this_thread::sleep_for(stall); };
}

std::string outcome(const ExecuteResult& result) {
    return result.reply.at("cellblock").at("outcome").get<std::string>();
}
bool state_lost(const ExecuteResult& result) {
    return result.reply.at("cellblock").at("state_lost").get<bool>();
}
double seconds_since(Clock::time_point start) {
    return std::chrono::duration<double>(Clock::now() - start).count();
}

class WorkerExchangeTest : public ::testing::Test {
  protected:
    void SetUp() override {
        ASSERT_EQ(::geteuid(), 0u) << "confined workers need root (run the suite as root)";
        std::string pattern = (fs::temp_directory_path() / "cellblock-exchange-XXXXXX").string();
        ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
        root_ = pattern;
        fs::create_directory(root_ / "workspace");
        // The default policy with uids of its own, apart from the other units and the batteries.
        std::ifstream source(CELLBLOCK_DEFAULT_POLICY_SOURCE);
        json policy = json::parse(source);
        policy["uid_range"] = {{"first", 281600}, {"count", 400}};
        std::ofstream(root_ / "policy.json") << policy.dump();

        WorkerLaunchSpec spec;
        spec.worker_script = CELLBLOCK_WORKER_SCRIPT;
        spec.policy_file = root_ / "policy.json";
        spec.workspace = root_ / "workspace";
        supervisor_ = std::make_unique<WorkerSupervisor>(spec);
        supervisor_->start();
        limits_.timeout_s = 60;
        limits_.interrupt_grace_s = 1;
        limits_.output_bytes = 1 << 20;
    }
    void TearDown() override {
        exchange_.reset();
        supervisor_.reset();
        fs::remove_all(root_);
    }

    WorkerExchange& exchange() {
        if (!exchange_) {
            exchange_ = std::make_unique<WorkerExchange>(*supervisor_, controls_, ExchangeSettings{limits_});
        }
        return *exchange_;
    }

    ExecuteResult execute(const std::string& code, RecordingSink& sink, bool allow_stdin = false) {
        ExecuteRequest request;
        request.msg_id = "msg-" + std::to_string(++requests_);
        request.code = code;
        request.execution_count = requests_;
        request.allow_stdin = allow_stdin;
        return exchange().execute(request, sink);
    }
    std::string last_msg_id() const { return "msg-" + std::to_string(requests_); }

    fs::path root_;
    ExecutionLimits limits_;
    RequestControls controls_;
    std::unique_ptr<WorkerSupervisor> supervisor_;
    std::unique_ptr<WorkerExchange> exchange_;
    int requests_ = 0;
};

TEST_F(WorkerExchangeTest, StreamTextIsPublishedBeforeTheDisplayAndResultThatFollowIt) {
    RecordingSink sink;
    const auto result = execute(
        "from IPython.display import display\n"
        "print('a')\n"
        "display('shown')\n"
        "print('b')\n"
        "6 * 7",
        sink);
    ASSERT_EQ(result.reply.at("status"), "ok") << result.reply.dump();
    EXPECT_EQ(outcome(result), "ok");
    EXPECT_EQ(sink.kinds(),
              (std::vector<std::string>{"stream:stdout", "display_data", "stream:stdout", "execute_result"}));
    EXPECT_EQ(sink.stream_text_before("display_data"), "a\n");
    EXPECT_EQ(sink.events.back().data.at("text/plain"), "42");
    EXPECT_EQ(sink.text("stdout"), "a\nb\n");
    EXPECT_EQ(result.result_text, "42");
}

// Whole, in order, and all of it before the result, by construction: Python-level text is in band.
TEST_F(WorkerExchangeTest, ALargePrintArrivesWholeAndInOrder) {
    limits_.output_bytes =
        8 << 20;  // all of it streamed (past half the limit, only a tail is kept, for the end)
    RecordingSink sink;
    const auto result = execute("print('x' * 300000)\nprint('y' * 300000)\n1 + 1", sink);
    ASSERT_EQ(result.reply.at("status"), "ok") << result.reply.dump();
    EXPECT_EQ(sink.text("stdout"), std::string(300000, 'x') + "\n" + std::string(300000, 'y') + "\n");
    EXPECT_TRUE(sink.stream_text_before("execute_result") == sink.text("stdout")) << "text after the result";
    EXPECT_EQ(result.result_text, "2");
}

// The order does not rest on the kernel reading in time: while it is away for far longer than any wait of
// the worker (PROTOCOL.md), the tail of a large print and the stderr line still come before the result.
TEST_F(WorkerExchangeTest, PrintDisplayPrintResultKeepTheirOrderWhenTheKernelIsSlowToRead) {
    RecordingSink sink;
    stall_after_each_display(sink, std::chrono::milliseconds(1000));
    const auto result = execute(
        "import sys\n"
        "from IPython.display import display\n"
        "print('a')\n"
        "display('shown')\n"
        "print('b' * 200000)\n"
        "print('warning', file=sys.stderr)\n"
        "6 * 7",
        sink);
    ASSERT_EQ(result.reply.at("status"), "ok") << result.reply.dump();
    EXPECT_EQ(sink.kinds(), (std::vector<std::string>{"stream:stdout", "display_data", "stream:stdout",
                                                      "stream:stderr", "execute_result"}));
    EXPECT_TRUE(sink.text("stdout") == "a\n" + std::string(200000, 'b') + "\n") << sink.text("stdout").size();
    EXPECT_EQ(sink.text("stderr"), "warning\n");
}

// fd-level text (a subprocess) keeps its place among Python-level text and frames: written before a display,
// it comes before it; written after a print, after it, even when both wait for a slow kernel together.
TEST_F(WorkerExchangeTest, SubprocessOutputKeepsItsPlaceAmongPrintsAndDisplays) {
    RecordingSink sink;
    stall_after_each_display(sink, std::chrono::milliseconds(400));
    const auto result = execute(
        "import os\n"
        "from IPython.display import display\n"
        "os.system('echo sub-before')\n"
        "display('shown')\n"
        "print('py-after')\n"
        "os.system('echo sub-after')\n",
        sink);
    ASSERT_EQ(result.reply.at("status"), "ok") << result.reply.dump();
    EXPECT_EQ(sink.stream_text_before("display_data"), "sub-before\n");
    EXPECT_EQ(sink.text("stdout"), "sub-before\npy-after\nsub-after\n");
}

TEST_F(WorkerExchangeTest, ASilentExecutePublishesNoStream) {
    RecordingSink sink;
    ExecuteRequest request;
    request.msg_id = "msg-silent";
    request.code = "import os, sys\nprint('out')\nprint('err', file=sys.stderr)\nos.system('echo sub')\n5";
    request.silent = true;
    const auto result = exchange().execute(request, sink);
    EXPECT_EQ(result.reply.at("status"), "ok") << result.reply.dump();
    EXPECT_TRUE(sink.events.empty()) << sink.events.size() << " event(s), the first: " << sink.events[0].kind;
    RecordingSink next;
    execute("print('seen')", next);
    EXPECT_EQ(next.text("stdout"), "seen\n");  // nothing of the silent execute is left over for the next one
}

TEST_F(WorkerExchangeTest, TextCutAcrossReadsAndInvalidBytesArriveAsValidUtf8) {
    RecordingSink sink;
    // 'é' is two bytes: at an odd offset one of them ends a pipe read now and then; b'\xff' is not UTF-8.
    const auto result = execute(
        "import os, sys\n"
        "sys.stdout.write('.' + 'é' * 200000)\n"
        "sys.stdout.flush()\n"
        "os.write(1, b'<\\xff>')",
        sink);
    ASSERT_EQ(result.reply.at("status"), "ok") << result.reply.dump();
    std::string expected = ".";
    for (int i = 0; i < 200000; ++i) {
        expected += "é";
    }
    expected += "<\xEF\xBF\xBD>";
    EXPECT_EQ(sink.text("stdout"), expected);
}

TEST_F(WorkerExchangeTest, TheTimeLimitInterruptsACellAndKeepsTheWorker) {
    limits_.timeout_s = 1;
    RecordingSink first;
    ASSERT_EQ(execute("kept = 'still here'", first).reply.at("status"), "ok");
    RecordingSink sink;
    const auto started = Clock::now();
    const auto result = execute("import time\ntime.sleep(30)", sink);
    EXPECT_LT(seconds_since(started), 15.0);
    EXPECT_EQ(result.reply.value("ename", ""), "TimeoutError") << result.reply.dump();
    EXPECT_EQ(outcome(result), "time_limit");
    EXPECT_FALSE(state_lost(result));
    RecordingSink next;
    const auto after = execute("kept", next);
    EXPECT_EQ(after.result_text, "'still here'");
}

TEST_F(WorkerExchangeTest, TheTimeLimitKillsACellThatSwallowsTheInterrupt) {
    // Long enough for the code to be inside its try on a loaded machine (else the interrupt ends it).
    limits_.timeout_s = 3;
    RecordingSink first;
    ASSERT_EQ(execute("lost = 1\nimport time", first).reply.at("status"), "ok");
    RecordingSink sink;
    const auto started = Clock::now();
    const auto result = execute(
        "while True:\n"
        "    try:\n"
        "        time.sleep(100)\n"
        "    except KeyboardInterrupt:\n"
        "        pass",
        sink);
    EXPECT_LT(seconds_since(started), 15.0);
    EXPECT_EQ(result.reply.value("ename", ""), "WorkerDied") << result.reply.dump();
    EXPECT_EQ(outcome(result), "time_limit");
    EXPECT_TRUE(state_lost(result));
    EXPECT_NE(result.reply.at("evalue").get<std::string>().find("time limit"), std::string::npos);
    RecordingSink next;
    const auto after = execute("lost", next);
    EXPECT_EQ(after.reply.value("ename", ""), "NameError") << after.reply.dump();
}

TEST_F(WorkerExchangeTest, AnInterruptEndsTheCellAndKeepsTheWorker) {
    RecordingSink first;
    ASSERT_EQ(execute("kept = 5", first).reply.at("status"), "ok");
    RecordingSink sink;
    sink.on_stream = [this](const std::string& text) {
        if (text.find("started") != std::string::npos) {
            controls_.interrupt({last_msg_id()});
        }
    };
    const auto result = execute("import time\nprint('started', flush=True)\ntime.sleep(60)", sink);
    EXPECT_EQ(result.reply.value("ename", ""), "KeyboardInterrupt") << result.reply.dump();
    EXPECT_EQ(outcome(result), "interrupted");
    EXPECT_FALSE(state_lost(result));
    RecordingSink next;
    EXPECT_EQ(execute("kept * 2", next).result_text, "10");
}

TEST_F(WorkerExchangeTest, ASwallowedInterruptKillsTheWorkerAfterTheGracePeriod) {
    RecordingSink first;
    ASSERT_EQ(execute("lost = 1", first).reply.at("status"), "ok");
    RecordingSink sink;
    Clock::time_point interrupted_at{};
    sink.on_stream = [&](const std::string& text) {
        // Printed inside the try, so the interrupt cannot land before the code catches it.
        if (interrupted_at == Clock::time_point{} && text.find("waiting") != std::string::npos) {
            interrupted_at = Clock::now();
            controls_.interrupt({last_msg_id()});
        }
    };
    const auto result = execute(
        "import time\n"
        "while True:\n"
        "    try:\n"
        "        print('waiting', flush=True)\n"
        "        time.sleep(100)\n"
        "    except KeyboardInterrupt:\n"
        "        print('caught', flush=True)",
        sink);
    ASSERT_NE(interrupted_at, Clock::time_point{});
    const double after_interrupt = seconds_since(interrupted_at);
    EXPECT_GE(after_interrupt, limits_.interrupt_grace_s * 0.9) << result.reply.dump();
    EXPECT_LT(after_interrupt, 10.0);  // the kernel's 60 s time limit did not end it
    EXPECT_EQ(result.reply.value("ename", ""), "KeyboardInterrupt") << result.reply.dump();
    EXPECT_EQ(outcome(result), "interrupted");
    EXPECT_TRUE(state_lost(result));
    EXPECT_NE(sink.text("stdout").find("caught"), std::string::npos);
    ASSERT_FALSE(sink.events.empty());
    EXPECT_EQ(sink.events.back().kind, "error");
    RecordingSink next;
    EXPECT_EQ(execute("6 * 7", next).result_text, "42");
    RecordingSink gone;
    EXPECT_EQ(execute("lost", gone).reply.value("ename", ""), "NameError");
}

TEST_F(WorkerExchangeTest, TheOutputLimitKeepsTheHeadAndTheTail) {
    limits_.output_bytes = 4000;
    RecordingSink sink;
    const auto result = execute("for i in range(5000):\n    print(f'line {i}')", sink);
    ASSERT_EQ(result.reply.at("status"), "ok") << result.reply.dump();
    EXPECT_EQ(outcome(result), "output_limit");
    EXPECT_TRUE(result.reply.at("cellblock").at("output_truncated").get<bool>());
    const std::string text = sink.text("stdout");
    EXPECT_EQ(text.rfind("line 0\nline 1\nline 2\n", 0), 0u) << text.substr(0, 80);
    EXPECT_TRUE(text.ends_with("line 4998\nline 4999\n")) << text.substr(text.size() - 80);
    EXPECT_NE(text.find("[cellblock] Output truncated: "), std::string::npos);
    EXPECT_EQ(text.find("line 2500\n"), std::string::npos);  // the middle is left out
    EXPECT_LT(text.size(), 4000u + 300u);                    // the limit plus the marker
}

TEST_F(WorkerExchangeTest, InputIsAnsweredThroughTheSink) {
    RecordingSink sink;
    sink.input_answer = "abc";
    const auto result = execute("print('got', input('name? '))", sink, /*allow_stdin=*/true);
    ASSERT_EQ(result.reply.at("status"), "ok") << result.reply.dump();
    EXPECT_EQ(sink.prompts, std::vector<std::string>{"name? "});
    EXPECT_EQ(sink.text("stdout"), "got abc\n");
}

// User code can write to the channel (fd 3): a frame with a field of the wrong type, or a malformed stream
// frame, ends the worker at once, instead of leaving the cell running until its time limit.
class WronglyTypedFrameTest : public WorkerExchangeTest, public ::testing::WithParamInterface<const char*> {};

TEST_P(WronglyTypedFrameTest, IsAProtocolErrorThatEndsTheWorker) {
    limits_.timeout_s = 30;
    RecordingSink sink;
    const auto started = Clock::now();
    const auto result = execute(std::string("import os, struct, time\n"
                                            "body = b'") +
                                    GetParam() +
                                    "'\n"
                                    "os.write(3, struct.pack('>I', len(body)) + body)\n"
                                    "time.sleep(60)",
                                sink);
    EXPECT_LT(seconds_since(started), 10.0);
    EXPECT_EQ(result.reply.value("ename", ""), "WorkerDied") << result.reply.dump();
    EXPECT_NE(result.reply.at("evalue").get<std::string>().find("protocol error"), std::string::npos)
        << result.reply.dump();
    EXPECT_EQ(outcome(result), "worker_died");
    EXPECT_TRUE(state_lost(result));
    RecordingSink next;
    EXPECT_EQ(execute("6 * 7", next).result_text, "42");
}

INSTANTIATE_TEST_SUITE_P(Frames, WronglyTypedFrameTest,
                         ::testing::Values(R"({"type": "display_data", "data": "not an object"})",
                                           R"({"type": "clear_output", "wait": "yes"})",
                                           R"({"type": "error", "ename": 7})",
                                           R"({"type": "reply", "id": "1", "content": {}})", R"({"type": 3})",
                                           // stream frames: empty body, no text, unknown channel byte
                                           "", R"(\x01)", R"(\x03text)"));

TEST_F(WorkerExchangeTest, AssistRequestsReturnTheWorkersContent) {
    const auto content =
        exchange().assist({{"type", "complete"}, {"code", "import o"}, {"cursor_pos", 8}}, "assist-1");
    ASSERT_TRUE(content.has_value());
    const auto matches = content->at("matches");
    EXPECT_NE(std::find(matches.begin(), matches.end(), "os"), matches.end()) << matches.dump();
}

}  // namespace
}  // namespace cellblock::kernel
