// The wire guard between a client and a stand-in for xeus (plain zmq sockets on the private endpoints):
// forwarding, re-signing, the xeus 2.4.1 fixups, stdin gating and shutdown, without a kernel or worker.
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <map>
#include <mutex>
#include <thread>
#include <zmq_addon.hpp>

#include "message_signer.hpp"
#include "wire_guard.hpp"

namespace cellblock::kernel {
namespace {

using nlohmann::json;
using Frames = std::vector<std::string>;

Frames receive(zmq::socket_t& socket, int timeout_ms = 3000) {
    zmq::pollitem_t item{socket.handle(), 0, ZMQ_POLLIN, 0};
    if (zmq::poll(&item, 1, std::chrono::milliseconds(timeout_ms)) <= 0) {
        return {};
    }
    std::vector<zmq::message_t> messages;
    (void)zmq::recv_multipart(socket, std::back_inserter(messages));
    Frames frames;
    for (const auto& message : messages) {
        frames.emplace_back(message.to_string());
    }
    return frames;
}

void send(zmq::socket_t& socket, const Frames& frames) {
    std::vector<zmq::message_t> messages;
    for (const auto& frame : frames) {
        messages.emplace_back(frame.data(), frame.size());
    }
    zmq::send_multipart(socket, messages);
}

std::size_t delimiter_of(const Frames& frames) {
    return static_cast<std::size_t>(std::find(frames.begin(), frames.end(), "<IDS|MSG>") - frames.begin());
}

class WireGuardRelay : public ::testing::Test {
  protected:
    void SetUp() override {
        dir = std::filesystem::temp_directory_path() / ("cbk-relay-" + std::to_string(::getpid()));
        std::filesystem::create_directories(dir);
        const std::string base = "ipc://" + (dir / "x").string();
        xeus_shell.bind(base + "-shell");
        xeus_control.bind(base + "-control");
        xeus_stdin.bind(base + "-stdin");
        xeus_iopub.bind(base + "-iopub");
        for (auto* socket : {&xeus_shell, &xeus_control, &xeus_stdin, &xeus_iopub}) {
            socket->set(zmq::sockopt::linger, 0);
        }
        connection.transport = "ipc";
        connection.ip = (dir / "public").string();
        connection.shell_port = 1;
        connection.control_port = 2;
        connection.stdin_port = 3;
        connection.iopub_port = 4;
        connection.hb_port = 5;
        connection.key = "relay-key";
        guard = std::make_unique<WireGuard>(
            connection,
            PrivateEndpoints{base + "-shell", base + "-control", base + "-stdin", base + "-iopub"},
            GuardActions{[this](const std::vector<std::string>& unanswered) {
                             std::lock_guard lock(actions_mutex);
                             interrupted_requests = unanswered;
                             ++interrupts;
                         },
                         [this] { ++shutdowns; },
                         [this](std::chrono::duration<double> idle) {
                             idle_at_expiry = idle.count();
                             ++lease_expiries;
                         },
                         [this](const std::string& msg_id, const json& metadata) {
                             std::lock_guard lock(actions_mutex);
                             execute_metadata[msg_id] = metadata;
                         },
                         [this](const json& content) {
                             std::lock_guard lock(actions_mutex);
                             approval_decisions.push_back(content);
                             return json{{"status", "ok"}, {"seen", content}};
                         }},
            options);
        guard->start();
        for (auto* socket : {&client_shell, &client_control, &client_stdin}) {
            socket->set(zmq::sockopt::routing_id, "client-1");
            socket->set(zmq::sockopt::linger, 0);
        }
        client_shell.connect(connection.endpoint(1));
        client_control.connect(connection.endpoint(2));
        client_stdin.connect(connection.endpoint(3));
        client_iopub.set(zmq::sockopt::subscribe, "");
        client_iopub.set(zmq::sockopt::linger, 0);
        client_iopub.connect(connection.endpoint(4));
        wait_for_iopub_path();
    }
    // PUB/SUB drops what is published before a subscription arrives, on both hops (fake xeus -> guard ->
    // client); publish probes until one comes through, so no test depends on how loaded the machine is.
    void wait_for_iopub_path() {
        const std::string header = json{{"msg_id", "probe"}, {"msg_type", "status"}, {"session", "x"}}.dump();
        const Frames probe = {
            "status", "<IDS|MSG>", "", header, "{}", "{}", R"({"execution_state":"starting"})"};
        for (int attempt = 0; attempt < 100 && receive(client_iopub, 50).empty(); ++attempt) {
            send(xeus_iopub, probe);
        }
        while (!receive(client_iopub, 100).empty()) {
        }
    }
    void TearDown() override {
        guard.reset();
        std::filesystem::remove_all(dir);
    }

    Frames signed_message(const std::string& msg_type, const json& content, const std::string& msg_id) {
        const std::string header =
            json{{"msg_id", msg_id}, {"msg_type", msg_type}, {"session", "s"},
                 {"username", "u"},  {"version", "5.3"},     {"date", "2026-01-01T00:00:00Z"}}
                .dump();
        const std::string body = content.dump();
        return {"<IDS|MSG>", signer.sign({header, "{}", "{}", body}), header, "{}", "{}", body};
    }
    // What xeus would send back for `request` (as the fake xeus ROUTER received it: identities first).
    Frames xeus_reply(const Frames& request, const std::string& msg_type, const json& content) {
        const std::size_t d = delimiter_of(request);
        Frames reply(request.begin(), request.begin() + static_cast<std::ptrdiff_t>(d));
        const std::string header = json{{"msg_id", "r"}, {"msg_type", msg_type}, {"session", "x"}}.dump();
        reply.insert(reply.end(), {"<IDS|MSG>", "", header, request[d + 2], "{}", content.dump()});
        return reply;
    }
    // xeus publishing a status for `request` (as the fake xeus ROUTER received it).
    void xeus_status(const Frames& request, const std::string& state) {
        const std::size_t d = delimiter_of(request);
        const std::string header = json{{"msg_id", "s-" + state}, {"msg_type", "status"}}.dump();
        send(xeus_iopub, {"status", "<IDS|MSG>", "", header, request[d + 2], "{}",
                          json{{"execution_state", state}}.dump()});
    }
    bool signature_valid(const Frames& frames) {
        const std::size_t d = delimiter_of(frames);
        return signer.verify(frames[d + 1], {frames[d + 2], frames[d + 3], frames[d + 4], frames[d + 5]});
    }

    std::filesystem::path dir;
    zmq::context_t context{1};
    zmq::socket_t xeus_shell{context, zmq::socket_type::router},
        xeus_control{context, zmq::socket_type::router}, xeus_stdin{context, zmq::socket_type::router},
        xeus_iopub{context, zmq::socket_type::pub};
    zmq::socket_t client_shell{context, zmq::socket_type::dealer},
        client_control{context, zmq::socket_type::dealer}, client_stdin{context, zmq::socket_type::dealer},
        client_iopub{context, zmq::socket_type::sub};
    ConnectionInfo connection;
    MessageSigner signer{"hmac-sha256", "relay-key"};
    std::unique_ptr<WireGuard> guard;
    GuardOptions options;
    std::atomic<int> interrupts{0}, shutdowns{0}, lease_expiries{0};
    std::mutex actions_mutex;
    std::vector<std::string> interrupted_requests;  // what the last interrupt was addressed to
    std::map<std::string, json> execute_metadata;   // execute_request metadata with a "cellblock" member
    std::vector<json> approval_decisions;           // cellblock_approval_decision_request contents
    std::atomic<double> idle_at_expiry{0};
};

TEST_F(WireGuardRelay, ForwardsVerifiedRequestsAndResignsAbortReplies) {
    send(client_shell, signed_message("execute_request", {{"code", "1"}}, "m1"));
    const Frames at_xeus = receive(xeus_shell);
    ASSERT_FALSE(at_xeus.empty());
    EXPECT_EQ(at_xeus[0], "cellblock-wire-guard");  // the guard's dealer
    EXPECT_EQ(at_xeus[1], "client-1");              // the client's identity, for routing the reply
    send(xeus_shell, xeus_reply(at_xeus, "execute_reply", {{"status", "error"}}));
    // An abort reply (xeus: {"status":"error"} without ename) arrives as "aborted", signed with the key.
    const Frames reply = receive(client_shell);
    ASSERT_FALSE(reply.empty());
    EXPECT_TRUE(signature_valid(reply));
    EXPECT_EQ(json::parse(reply[delimiter_of(reply) + 5]), (json{{"status", "aborted"}}));
    // ...wrapped in busy/idle for the aborted request, as clients expect for every request.
    std::vector<std::string> states;
    for (Frames status = receive(client_iopub); !status.empty(); status = receive(client_iopub, 300)) {
        const std::size_t d = delimiter_of(status);
        EXPECT_TRUE(signature_valid(status));
        EXPECT_EQ(json::parse(status[d + 3])["msg_id"], "m1");
        states.push_back(json::parse(status[d + 5])["execution_state"]);
    }
    EXPECT_EQ(states, (std::vector<std::string>{"busy", "idle"}));
}

// xeus's reply and its idle travel over two sockets; when the idle wins, the reply must still go out at once
// and in request order (a later request's reply must not overtake it), and the idle after it.
TEST_F(WireGuardRelay, IdleThatOvertakesItsReplyWaitsForIt) {
    send(client_shell, signed_message("kernel_info_request", json::object(), "k1"));
    const Frames k1 = receive(xeus_shell);
    ASSERT_FALSE(k1.empty());
    xeus_status(k1, "busy");
    xeus_status(k1, "idle");
    ::usleep(100000);  // the guard has read the idle before the reply exists
    send(xeus_shell, xeus_reply(k1, "kernel_info_reply", {{"status", "ok"}}));
    send(client_shell, signed_message("execute_request", {{"code", "1"}}, "e1"));
    const Frames e1 = receive(xeus_shell);
    ASSERT_FALSE(e1.empty());
    send(xeus_shell, xeus_reply(e1, "execute_reply", {{"status", "ok"}}));
    xeus_status(e1, "busy");
    xeus_status(e1, "idle");
    std::vector<std::string> replies;
    for (Frames reply = receive(client_shell); !reply.empty(); reply = receive(client_shell, 300)) {
        replies.push_back(json::parse(reply[delimiter_of(reply) + 2])["msg_type"]);
    }
    EXPECT_EQ(replies, (std::vector<std::string>{"kernel_info_reply", "execute_reply"}));
    std::vector<std::string> statuses;
    for (Frames message = receive(client_iopub); !message.empty(); message = receive(client_iopub, 300)) {
        const std::size_t d = delimiter_of(message);
        statuses.push_back(json::parse(message[d + 3])["msg_id"].get<std::string>() + ":" +
                           json::parse(message[d + 5])["execution_state"].get<std::string>());
    }
    EXPECT_EQ(statuses, (std::vector<std::string>{"k1:busy", "k1:idle", "e1:busy", "e1:idle"}));
}

// A comm message gets busy/idle but no reply: its idle is not held for one. (A hold limit far above the wait
// below makes a wrongly held idle miss it.)
class WireGuardLongHold : public WireGuardRelay {
  protected:
    void SetUp() override {
        options.reply_hold_limit = std::chrono::milliseconds(20000);
        WireGuardRelay::SetUp();
    }
};

TEST_F(WireGuardLongHold, CommMessageIdleIsNotHeld) {
    send(client_shell, signed_message("comm_msg", {{"comm_id", "c"}, {"data", json::object()}}, "c1"));
    const Frames request = receive(xeus_shell);
    ASSERT_FALSE(request.empty());
    xeus_status(request, "idle");
    const Frames idle = receive(client_iopub, 5000);
    ASSERT_FALSE(idle.empty()) << "the comm message's idle was held waiting for a reply that never comes";
    EXPECT_EQ(json::parse(idle[delimiter_of(idle) + 3])["msg_id"], "c1");
}

// An idle whose reply never comes does not block IOPub: it goes out, late.
TEST_F(WireGuardRelay, IdleWithoutReplyIsReleased) {
    send(client_shell, signed_message("execute_request", {{"code", "1"}}, "lost"));
    const Frames request = receive(xeus_shell);
    ASSERT_FALSE(request.empty());
    xeus_status(request, "idle");
    const Frames idle = receive(client_iopub, 3000);
    ASSERT_FALSE(idle.empty());
    EXPECT_EQ(json::parse(idle[delimiter_of(idle) + 3])["msg_id"], "lost");
}

TEST_F(WireGuardRelay, RefusedMessagesNeverReachXeus) {
    auto junk = signed_message("execute_request", {{"code", "1"}}, "j");
    junk[1] += "00";
    send(client_shell, junk);
    const auto replayed = signed_message("kernel_info_request", json::object(), "r");
    send(client_shell, replayed);
    EXPECT_FALSE(receive(xeus_shell).empty());  // the first copy of `replayed`
    send(client_shell, replayed);
    EXPECT_TRUE(receive(xeus_shell, 300).empty());
}

TEST_F(WireGuardRelay, InputRequestGetsPasswordAndOnlyPendingRepliesPass) {
    // No prompt pending: a stray input_reply is dropped.
    send(client_stdin, signed_message("input_reply", {{"value", "stray"}}, "s1"));
    EXPECT_TRUE(receive(xeus_stdin, 300).empty());

    send(client_shell, signed_message("execute_request", {{"code", "input()"}}, "m2"));
    const Frames at_xeus = receive(xeus_shell);
    ASSERT_FALSE(at_xeus.empty());
    // xeus routes input_request with the shell request's identities (guard dealer id, then client id).
    send(xeus_stdin, xeus_reply(at_xeus, "input_request", {{"prompt", "Password: "}, {"pwd", true}}));
    const Frames prompt = receive(client_stdin);
    ASSERT_FALSE(prompt.empty());
    EXPECT_TRUE(signature_valid(prompt));
    EXPECT_EQ(json::parse(prompt[delimiter_of(prompt) + 5]),
              (json{{"prompt", "Password: "}, {"password", true}}));

    // An interrupt answers the pending prompt with "" so the shell thread is released.
    guard->interrupt_pending_input();
    const Frames released = receive(xeus_stdin);
    ASSERT_FALSE(released.empty());
    EXPECT_EQ(json::parse(released[delimiter_of(released) + 5]), (json{{"value", ""}}));
    // ...and the client's late answer goes nowhere.
    send(client_stdin, signed_message("input_reply", {{"value", "late"}}, "s2"));
    EXPECT_TRUE(receive(xeus_stdin, 300).empty());
}

// The kernel's own IOPub messages (egress events, approval displays) come from other threads; the guard's
// thread sends them, signed, with the execute_request running at the time as their parent, and a publish
// never releases a pending input() prompt (only an interrupt does).
TEST_F(WireGuardRelay, KernelMessagesFromAnotherThreadGoOutWithTheRunningExecuteAsParent) {
    send(client_shell, signed_message("execute_request", {{"code", "input()"}}, "run-7"));
    const Frames at_xeus = receive(xeus_shell);
    ASSERT_FALSE(at_xeus.empty());
    send(xeus_stdin, xeus_reply(at_xeus, "input_request", {{"prompt", "> "}, {"password", false}}));
    ASSERT_FALSE(receive(client_stdin).empty());

    std::thread([this] {
        guard->publish("cellblock_egress", {{"event", "connection"}, {"host", "a.test"}});
    }).join();
    const Frames event = receive(client_iopub);
    ASSERT_FALSE(event.empty());
    EXPECT_TRUE(signature_valid(event));
    const std::size_t d = delimiter_of(event);
    EXPECT_EQ(json::parse(event[d + 2])["msg_type"], "cellblock_egress");
    EXPECT_EQ(json::parse(event[d + 3])["msg_id"], "run-7");
    EXPECT_EQ(json::parse(event[d + 5]), (json{{"event", "connection"}, {"host", "a.test"}}));
    EXPECT_TRUE(receive(xeus_stdin, 300).empty()) << "a publish must not answer the pending prompt";

    // Once the execute is answered, the kernel's messages have no parent.
    send(xeus_shell, xeus_reply(at_xeus, "execute_reply", {{"status", "ok"}}));
    xeus_status(at_xeus, "idle");
    ASSERT_FALSE(receive(client_shell).empty());
    while (!receive(client_iopub, 300).empty()) {
    }
    guard->publish("display_data", {{"data", {{"text/plain", "held"}}}});
    const Frames later = receive(client_iopub);
    ASSERT_FALSE(later.empty());
    EXPECT_EQ(json::parse(later[delimiter_of(later) + 2])["msg_type"], "display_data");
    EXPECT_EQ(json::parse(later[delimiter_of(later) + 3]), json::object());
}

TEST_F(WireGuardRelay, ApprovalDecisionIsAnsweredByTheGuard) {
    const json decision = {{"id", "a1"}, {"decision", "deny"}, {"decided_by", "agent api"}};
    send(client_control, signed_message("cellblock_approval_decision_request", decision, "d1"));
    const Frames reply = receive(client_control);
    ASSERT_FALSE(reply.empty());
    EXPECT_TRUE(signature_valid(reply));
    const std::size_t d = delimiter_of(reply);
    EXPECT_EQ(json::parse(reply[d + 2])["msg_type"], "cellblock_approval_decision_reply");
    EXPECT_EQ(json::parse(reply[d + 3])["msg_id"], "d1");
    EXPECT_EQ(json::parse(reply[d + 5]), (json{{"status", "ok"}, {"seen", decision}}));
    {
        std::lock_guard lock(actions_mutex);
        EXPECT_EQ(approval_decisions, std::vector<json>{decision});
    }
    EXPECT_TRUE(receive(xeus_control, 200).empty()) << "xeus never sees the decision";
}

TEST_F(WireGuardRelay, InterruptRequestIsActedOnAndReplyGetsStatus) {
    send(client_control, signed_message("interrupt_request", json::object(), "i1"));
    const Frames at_xeus = receive(xeus_control);
    ASSERT_FALSE(at_xeus.empty());
    EXPECT_EQ(interrupts.load(), 1);
    send(xeus_control, xeus_reply(at_xeus, "interrupt_reply", json::object()));
    const Frames reply = receive(client_control);
    ASSERT_FALSE(reply.empty());
    EXPECT_EQ(json::parse(reply[delimiter_of(reply) + 5])["status"], "ok");
}

// The interrupt is addressed to the request xeus has not answered yet (running, or about to run), so the
// kernel can keep it for a request whose code has not started; per-execute limits reach the kernel by msg_id.
TEST_F(WireGuardRelay, InterruptIsAddressedToTheUnansweredRequestAndLimitsArePosted) {
    Frames request = signed_message("execute_request", {{"code", "1"}}, "run-1");
    const json metadata = {{"cellblock", {{"timeout_s", 3}}}};
    request[4] = metadata.dump();  // delimiter, signature, header, parent_header, metadata, content
    request[1] = signer.sign({request[2], request[3], request[4], request[5]});
    send(client_shell, request);
    const Frames at_xeus = receive(xeus_shell);
    ASSERT_FALSE(at_xeus.empty());
    send(client_control, signed_message("interrupt_request", json::object(), "i3"));
    ASSERT_FALSE(receive(xeus_control).empty());
    {
        std::lock_guard lock(actions_mutex);
        EXPECT_EQ(interrupted_requests, (std::vector<std::string>{"run-1"}));
        ASSERT_EQ(execute_metadata.count("run-1"), 1u);
        EXPECT_EQ(execute_metadata["run-1"], metadata);
    }
    // The interpreter's outcome travels in the content; clients get it in the metadata, signed.
    send(xeus_shell,
         xeus_reply(at_xeus, "execute_reply",
                    {{"status", "ok"}, {"cellblock", {{"outcome", "ok"}, {"state_lost", false}}}}));
    xeus_status(at_xeus, "idle");
    const Frames reply = receive(client_shell);
    ASSERT_FALSE(reply.empty());
    EXPECT_TRUE(signature_valid(reply));
    const std::size_t d = delimiter_of(reply);
    EXPECT_EQ(json::parse(reply[d + 5]), (json{{"status", "ok"}}));
    EXPECT_EQ(json::parse(reply[d + 4])["cellblock"]["outcome"], "ok");
}

// The fixup path rebuilds the content frame; what is signed, sent and recorded is the rebuilt frame, and
// a status published afterwards is still read correctly (held replies are released by it).
TEST_F(WireGuardRelay, FixedUpReplyIsSignedAndSentWhole) {
    send(client_control, signed_message("interrupt_request", json::object(), "i2"));
    const Frames at_xeus = receive(xeus_control);
    ASSERT_FALSE(at_xeus.empty());
    send(xeus_control, xeus_reply(at_xeus, "interrupt_reply", {{"note", std::string(4096, 'x')}}));
    const Frames reply = receive(client_control);
    ASSERT_FALSE(reply.empty());
    EXPECT_TRUE(signature_valid(reply));
    EXPECT_EQ(json::parse(reply[delimiter_of(reply) + 5]),
              (json{{"note", std::string(4096, 'x')}, {"status", "ok"}}));
}

TEST_F(WireGuardRelay, ShutdownIsAnsweredByTheGuard) {
    send(client_control, signed_message("shutdown_request", {{"restart", true}}, "x1"));
    const Frames reply = receive(client_control);
    ASSERT_FALSE(reply.empty());
    EXPECT_TRUE(signature_valid(reply));
    const std::size_t d = delimiter_of(reply);
    EXPECT_EQ(json::parse(reply[d + 2])["msg_type"], "shutdown_reply");
    EXPECT_EQ(json::parse(reply[d + 3])["msg_id"], "x1");
    EXPECT_EQ(json::parse(reply[d + 5]), (json{{"status", "ok"}, {"restart", true}}));
    for (int i = 0; i < 100 && shutdowns.load() == 0; ++i) {
        ::usleep(10000);
    }
    EXPECT_EQ(shutdowns.load(), 1);
    EXPECT_TRUE(receive(xeus_control, 200).empty()) << "xeus never sees the shutdown";
}

TEST_F(WireGuardRelay, ReplayReturnsWhatClientsGotAndIsAnsweredByTheGuard) {
    send(client_shell, signed_message("execute_request", {{"code", "print()"}}, "m1"));
    const Frames at_xeus = receive(xeus_shell);
    ASSERT_FALSE(at_xeus.empty());
    const std::string request_header = at_xeus[delimiter_of(at_xeus) + 2];
    std::vector<std::string> stream_ids;
    for (int i = 0; i < 3; ++i) {
        stream_ids.push_back("s" + std::to_string(i));
        const std::string header = json{{"msg_id", stream_ids.back()}, {"msg_type", "stream"}}.dump();
        send(xeus_iopub, {"stream", "<IDS|MSG>", "", header, request_header, "{}",
                          json{{"name", "stdout"}, {"text", "line " + std::to_string(i) + "\n"}}.dump(),
                          std::string("\x00\x01", 2)});
        ASSERT_FALSE(receive(client_iopub).empty());
    }
    // An abort reply: what the client gets (and so the record keeps) is the fixed-up "aborted".
    send(xeus_shell, xeus_reply(at_xeus, "execute_reply", {{"status", "error"}}));
    ASSERT_FALSE(receive(client_shell).empty());

    const auto replay = [&](const json& after, const std::string& msg_id) {
        send(client_control, signed_message("cellblock_replay_request", {{"after", after}}, msg_id));
        const Frames reply = receive(client_control);
        EXPECT_FALSE(reply.empty());
        if (reply.empty()) {
            return json();
        }
        EXPECT_TRUE(signature_valid(reply));
        const std::size_t d = delimiter_of(reply);
        EXPECT_EQ(json::parse(reply[d + 2])["msg_type"], "cellblock_replay_reply");
        EXPECT_EQ(json::parse(reply[d + 3])["msg_id"], msg_id);
        return json::parse(reply[d + 5]);
    };
    // The outputs of m1, in order, as (channel, msg_type, text or status).
    const auto of_m1 = [](const json& content) {
        std::vector<std::string> seen;
        for (const auto& message : content["messages"]) {
            if (message["parent_header"].value("msg_id", "") != "m1") {
                continue;
            }
            const auto& body = message["content"];
            seen.push_back(
                message["channel"].get<std::string>() + ":" +
                message["header"]["msg_type"].get<std::string>() + ":" +
                (body.contains("text") ? body["text"].get<std::string>() : body.value("status", "")));
        }
        return seen;
    };

    const json all = replay(nullptr, "r1");
    EXPECT_EQ(all["status"], "ok");
    EXPECT_EQ(all["found"], true);
    EXPECT_EQ(all["dropped"], 0);
    EXPECT_EQ(of_m1(all), (std::vector<std::string>{
                              "iopub:stream:line 0\n", "iopub:stream:line 1\n", "iopub:stream:line 2\n",
                              "iopub:status:", "shell:execute_reply:aborted", "iopub:status:"}));
    for (const auto& message : all["messages"]) {
        if (message["header"].value("msg_id", "") == "s0") {
            EXPECT_EQ(message["buffers"], (json{"AAE="}));
        }
    }

    const json after_first = replay("s0", "r2");
    EXPECT_EQ(after_first["found"], true);
    const auto rest = of_m1(after_first);
    ASSERT_FALSE(rest.empty());
    EXPECT_EQ(rest.front(), "iopub:stream:line 1\n");
    EXPECT_EQ(rest.size(), of_m1(all).size() - 1);
    for (const auto& message : after_first["messages"]) {
        EXPECT_NE(message["header"]["msg_type"], "cellblock_replay_reply") << "a replay is never recorded";
    }

    const json unknown = replay("long-gone", "r3");
    EXPECT_EQ(unknown["found"], false);
    EXPECT_EQ(of_m1(unknown), of_m1(all));
    EXPECT_TRUE(receive(xeus_control, 200).empty()) << "xeus never sees a replay request";
}

TEST_F(WireGuardRelay, LeaseRequestWithoutALeaseIsAnsweredAndChangesNothing) {
    send(client_control, signed_message("cellblock_lease_request", json::object(), "l1"));
    const Frames reply = receive(client_control);
    ASSERT_FALSE(reply.empty());
    EXPECT_TRUE(signature_valid(reply));
    const std::size_t d = delimiter_of(reply);
    EXPECT_EQ(json::parse(reply[d + 2])["msg_type"], "cellblock_lease_reply");
    EXPECT_EQ(json::parse(reply[d + 5]), (json{{"status", "ok"}, {"lease_s", nullptr}}));
    EXPECT_TRUE(receive(xeus_control, 200).empty());
}

class WireGuardLease : public WireGuardRelay {
  protected:
    void SetUp() override {
        options.lease = std::chrono::milliseconds(3000);
        WireGuardRelay::SetUp();
    }
};

TEST_F(WireGuardLease, RenewedByRequestsThenExpiresWhenTheyStop) {
    // Renewed every 0.5 s for twice the lease: it must not expire.
    const auto renewing_until = std::chrono::steady_clock::now() + std::chrono::seconds(6);
    for (int i = 0; std::chrono::steady_clock::now() < renewing_until; ++i) {
        send(client_control,
             signed_message("cellblock_lease_request", json::object(), "l" + std::to_string(i)));
        const Frames reply = receive(client_control);
        ASSERT_FALSE(reply.empty()) << "lease request " << i;
        EXPECT_EQ(json::parse(reply[delimiter_of(reply) + 5]), (json{{"status", "ok"}, {"lease_s", 3}}));
        ::usleep(500000);
    }
    EXPECT_EQ(lease_expiries.load(), 0);
    EXPECT_TRUE(receive(xeus_control, 50).empty()) << "lease requests are not forwarded";
    // Silence: it expires, once, with the idle time it saw.
    const auto silent_since = std::chrono::steady_clock::now();
    while (lease_expiries.load() == 0 &&
           std::chrono::steady_clock::now() - silent_since < std::chrono::seconds(20)) {
        ::usleep(50000);
    }
    ASSERT_EQ(lease_expiries.load(), 1);
    EXPECT_GE(std::chrono::steady_clock::now() - silent_since, std::chrono::milliseconds(2000));
    EXPECT_GE(idle_at_expiry.load(), 3.0);
}

}  // namespace
}  // namespace cellblock::kernel
