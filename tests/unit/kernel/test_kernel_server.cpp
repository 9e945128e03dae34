// The kernel server between a real client (zmq sockets on the public endpoints) and a stand-in for xeus's
// kernel core (listeners registered on the server, replying through it as xeus does): verification,
// signing, the xeus 2.4.1 fixups, order, stdin gating, control while a request runs, and the requests the
// server answers itself, without a kernel or worker.
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <filesystem>
#include <future>
#include <map>
#include <mutex>
#include <thread>
#include <xeus/xguid.hpp>
#include <zmq_addon.hpp>

#include "server/inbound_verifier.hpp"
#include "server/kernel_server.hpp"

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

json part(const Frames& frames, std::size_t offset) {
    return json::parse(frames[delimiter_of(frames) + offset]);
}

json header_for(const std::string& msg_type) {
    return {{"msg_id", std::string(xeus::new_xguid().c_str())}, {"msg_type", msg_type}, {"session", "core"}};
}

// A message xeus's core would send in reply to `request`.
xeus::xmessage reply_to(const xeus::xmessage& request, const std::string& msg_type, json content,
                        json metadata = json::object()) {
    return xeus::xmessage(request.identities(), header_for(msg_type), request.header(), std::move(metadata),
                          std::move(content), {});
}

xeus::xpub_message published_for(const xeus::xmessage& request, const std::string& msg_type, json content) {
    return xeus::xpub_message("kernel_core.test." + msg_type, header_for(msg_type), request.header(),
                              json::object(), std::move(content), {});
}

std::string msg_id(const xeus::xmessage& message) {
    return message.header().value("msg_id", "");
}

// Polls `condition` until it holds (true) or 5 s passed (false): the tests wait for what they can observe,
// never for a guessed while.
template <typename Condition>
bool within_5s(Condition condition) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (!condition()) {
        if (std::chrono::steady_clock::now() >= deadline) {
            return false;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return true;
}

class KernelServerTest : public ::testing::Test {
  protected:
    void SetUp() override {
        dir = std::filesystem::temp_directory_path() / ("cbk-server-" + std::to_string(::getpid()));
        std::filesystem::create_directories(dir);
        connection.transport = "ipc";
        connection.ip = (dir / "public").string();
        connection.shell_port = 1;
        connection.control_port = 2;
        connection.stdin_port = 3;
        connection.iopub_port = 4;
        connection.hb_port = 5;
        connection.key = "server-key";
        server =
            std::make_unique<KernelServer>(connection,
                                           ServerActions{[this](const std::vector<std::string>& unanswered) {
                                                             std::lock_guard lock(mutex);
                                                             interrupted_requests = unanswered;
                                                             ++interrupts;
                                                         },
                                                         [this] { ++shutdowns; },
                                                         [this](std::chrono::duration<double> idle) {
                                                             idle_at_expiry = idle.count();
                                                             ++lease_expiries;
                                                         },
                                                         [this](const std::string& id, const json& metadata) {
                                                             std::lock_guard lock(mutex);
                                                             execute_metadata[id] = metadata;
                                                         },
                                                         [this](const json& content) {
                                                             std::lock_guard lock(mutex);
                                                             approval_decisions.push_back(content);
                                                             return json{{"status", "ok"}, {"seen", content}};
                                                         }},
                                           options);
        // The stand-in for xeus's core: records what reaches it and answers with the test's handlers.
        server->register_shell_listener([this](xeus::xmessage message) {
            {
                std::lock_guard lock(mutex);
                shell_seen.push_back(msg_id(message));
            }
            shell_seen_changed.notify_all();
            if (on_shell) {
                on_shell(message);
            }
        });
        server->register_control_listener([this](xeus::xmessage message) {
            {
                std::lock_guard lock(mutex);
                control_seen.push_back(message.header().value("msg_type", ""));
            }
            if (on_control) {
                on_control(message);
            }
        });
        server->register_stdin_listener([this](xeus::xmessage message) {
            std::lock_guard lock(mutex);
            input_values.push_back(message.content().value("value", "?"));
        });
        io_thread = std::thread([this] {
            server->start(xeus::xpub_message("kernel_core.test.status", header_for("status"), json::object(),
                                             json::object(), {{"execution_state", "starting"}}, {}));
        });
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
    // PUB/SUB drops what is published before the subscription arrives; publish probes until one comes
    // through, so no test depends on how loaded the machine is.
    void wait_for_iopub_path() {
        for (int attempt = 0; attempt < 100 && receive(client_iopub, 50).empty(); ++attempt) {
            server->publish_kernel_message("probe", json::object());
        }
        while (!receive(client_iopub, 100).empty()) {
        }
    }
    void TearDown() override {
        server->stop();
        io_thread.join();
        server.reset();
        std::filesystem::remove_all(dir);
    }

    Frames signed_message(const std::string& msg_type, const json& content, const std::string& id,
                          const json& metadata = json::object()) {
        const std::string header =
            json{{"msg_id", id},    {"msg_type", msg_type}, {"session", "s"},
                 {"username", "u"}, {"version", "5.3"},     {"date", "2026-01-01T00:00:00Z"}}
                .dump();
        const std::string body = content.dump(), meta = metadata.dump();
        return {"<IDS|MSG>", signer.sign({header, "{}", meta, body}), header, "{}", meta, body};
    }
    bool signature_valid(const Frames& frames) {
        const std::size_t d = delimiter_of(frames);
        return signer.verify(frames[d + 1], {frames[d + 2], frames[d + 3], frames[d + 4], frames[d + 5]});
    }
    bool wait_for_shell(std::size_t count) {
        std::unique_lock lock(mutex);
        return shell_seen_changed.wait_for(lock, std::chrono::seconds(5),
                                           [&] { return shell_seen.size() >= count; });
    }
    json control_request(const std::string& msg_type, const json& content, const std::string& id) {
        send(client_control, signed_message(msg_type, content, id));
        const Frames reply = receive(client_control);
        EXPECT_FALSE(reply.empty()) << msg_type;
        if (reply.empty()) {
            return json();
        }
        EXPECT_TRUE(signature_valid(reply));
        EXPECT_EQ(part(reply, 3)["msg_id"], id);
        return json{{"msg_type", part(reply, 2)["msg_type"]}, {"content", part(reply, 5)}};
    }
    // What clients got so far, in the order the server sent it, as "channel:parent:msg_type[:detail]".
    std::vector<std::string> sent_order(const std::string& replay_id) {
        const json reply = control_request("cellblock_replay_request", {{"after", nullptr}}, replay_id);
        std::vector<std::string> order;
        for (const auto& message : reply["content"]["messages"]) {
            const std::string type = message["header"]["msg_type"];
            const std::string parent = message["parent_header"].value("msg_id", "");
            if (parent.empty()) {
                continue;  // probes and the starting status
            }
            std::string entry = message["channel"].get<std::string>() + ":" + parent + ":" + type;
            if (type == "status") {
                entry += ":" + message["content"]["execution_state"].get<std::string>();
            } else if (message["content"].contains("status")) {
                entry += ":" + message["content"]["status"].get<std::string>();
            }
            order.push_back(entry);
        }
        return order;
    }

    std::filesystem::path dir;
    zmq::context_t context{1};
    zmq::socket_t client_shell{context, zmq::socket_type::dealer},
        client_control{context, zmq::socket_type::dealer}, client_stdin{context, zmq::socket_type::dealer},
        client_iopub{context, zmq::socket_type::sub};
    ConnectionInfo connection;
    MessageSigner signer{"hmac-sha256", "server-key"};
    ServerOptions options;
    std::unique_ptr<KernelServer> server;
    std::thread io_thread;
    std::function<void(const xeus::xmessage&)> on_shell, on_control;
    std::atomic<int> interrupts{0}, shutdowns{0}, lease_expiries{0};
    std::mutex mutex;
    std::condition_variable shell_seen_changed;
    std::vector<std::string> shell_seen, control_seen, input_values;
    std::vector<std::string> interrupted_requests;  // what the last interrupt was addressed to
    std::map<std::string, json> execute_metadata;   // execute_request metadata with a "cellblock" member
    std::vector<json> approval_decisions;           // cellblock_approval_decision_request contents
    std::atomic<double> idle_at_expiry{0};
};

// What xeus's core does for every shell request, in program order on the interpreter thread.
void behave_like_xeus(KernelServer& server, const xeus::xmessage& request, const std::string& reply_type) {
    server.publish(published_for(request, "status", {{"execution_state", "busy"}}), xeus::channel::SHELL);
    server.publish(published_for(request, "stream", {{"name", "stdout"}, {"text", "out\n"}}),
                   xeus::channel::SHELL);
    server.send_shell(reply_to(request, reply_type, {{"status", "ok"}}));
    server.publish(published_for(request, "status", {{"execution_state", "idle"}}), xeus::channel::SHELL);
}

TEST_F(KernelServerTest, VerifiedRequestsReachTheInterpreterAndAbortRepliesAreFixedAndSigned) {
    on_shell = [this](const xeus::xmessage& request) {
        EXPECT_EQ(request.identities(), std::vector<std::string>{"client-1"});
        EXPECT_EQ(request.content(), (json{{"code", "1"}}));
        server->send_shell(reply_to(request, "execute_reply", {{"status", "error"}}));
    };
    send(client_shell, signed_message("execute_request", {{"code", "1"}}, "m1"));
    // An abort reply (xeus: {"status":"error"} without ename) arrives as "aborted", signed with the key.
    const Frames reply = receive(client_shell);
    ASSERT_FALSE(reply.empty());
    EXPECT_TRUE(signature_valid(reply));
    EXPECT_EQ(part(reply, 5), (json{{"status", "aborted"}}));
    // ...wrapped in busy/idle for the aborted request, as clients expect for every request.
    std::vector<std::string> states;
    for (Frames status = receive(client_iopub); !status.empty(); status = receive(client_iopub, 300)) {
        EXPECT_TRUE(signature_valid(status));
        EXPECT_EQ(part(status, 3)["msg_id"], "m1");
        states.push_back(part(status, 5)["execution_state"]);
    }
    EXPECT_EQ(states, (std::vector<std::string>{"busy", "idle"}));
}

// What the interpreter thread sends reaches clients in the order it was sent (busy, outputs, reply, idle
// for each request, requests in order) without any holding: the record holds what was sent, in order.
TEST_F(KernelServerTest, MessagesGoOutInTheOrderXeusSentThem) {
    on_shell = [this](const xeus::xmessage& request) {
        behave_like_xeus(
            *server, request,
            request.header()["msg_type"] == "kernel_info_request" ? "kernel_info_reply" : "execute_reply");
    };
    send(client_shell, signed_message("kernel_info_request", json::object(), "k1"));
    send(client_shell, signed_message("execute_request", {{"code", "1"}}, "e1"));
    std::vector<std::string> replies;
    for (int i = 0; i < 2; ++i) {
        const Frames reply = receive(client_shell);
        ASSERT_FALSE(reply.empty());
        replies.push_back(part(reply, 2)["msg_type"]);
    }
    EXPECT_EQ(replies, (std::vector<std::string>{"kernel_info_reply", "execute_reply"}));
    // The last message, e1's idle, goes out after its reply (as a client would, wait for it before asking).
    bool idle_seen = false;
    while (!idle_seen) {
        const Frames message = receive(client_iopub);
        ASSERT_FALSE(message.empty()) << "no idle for e1";
        idle_seen = part(message, 3).value("msg_id", "") == "e1" &&
                    part(message, 5).value("execution_state", "") == "idle";
    }
    ASSERT_TRUE(idle_seen);
    EXPECT_EQ(
        sent_order("r1"),
        (std::vector<std::string>{"iopub:k1:status:busy", "iopub:k1:stream", "shell:k1:kernel_info_reply:ok",
                                  "iopub:k1:status:idle", "iopub:e1:status:busy", "iopub:e1:stream",
                                  "shell:e1:execute_reply:ok", "iopub:e1:status:idle"}));
}

// IOPub and shell are separate sockets, so a client can receive a reply before a large output sent ahead of
// it; each shell reply names the IOPub message published last before it, for the client to wait for.
TEST_F(KernelServerTest, EachShellReplyNamesTheIOPubMessagePublishedLastBeforeIt) {
    on_shell = [this](const xeus::xmessage& request) { behave_like_xeus(*server, request, "execute_reply"); };
    for (const char* request_id : {"e1", "e2"}) {
        send(client_shell, signed_message("execute_request", {{"code", "1"}}, request_id));
        const Frames reply = receive(client_shell);
        ASSERT_FALSE(reply.empty());
        EXPECT_TRUE(signature_valid(reply));
        std::string stream_id;
        for (Frames message = receive(client_iopub); !message.empty(); message = receive(client_iopub)) {
            if (part(message, 3).value("msg_id", "") != request_id)
                continue;
            if (part(message, 2)["msg_type"] == "stream")
                stream_id = part(message, 2)["msg_id"];
            if (part(message, 5).value("execution_state", "") == "idle")
                break;
        }
        ASSERT_FALSE(stream_id.empty());
        EXPECT_EQ(part(reply, 4)["cellblock"]["last_iopub_msg_id"], stream_id) << request_id;
    }
}

// Requests that arrive while the interpreter thread sends replies (a client that does not wait for each
// reply) are all served: a reply sent on the shell ROUTER from the interpreter thread may take in the command
// that announced the next request, and the I/O thread must still hear of that request.
TEST_F(KernelServerTest, RequestsArrivingWhileRepliesAreSentAreAllAnswered) {
    on_shell = [this](const xeus::xmessage& request) {
        // Over a millisecond between sends, so libzmq takes in pending commands on each one.
        std::this_thread::sleep_for(std::chrono::microseconds(1200));
        server->send_shell(reply_to(request, "execute_reply", {{"status", "ok"}}));
    };
    constexpr int requests = 200;
    std::thread sender([this] {
        for (int i = 0; i < requests; ++i) {
            send(client_shell, signed_message("execute_request", {{"code", "1"}}, "p" + std::to_string(i)));
            std::this_thread::sleep_for(std::chrono::microseconds(i % 7 == 0 ? 2500 : 300));
        }
    });
    int answered = 0;
    for (; answered < requests; ++answered) {
        const Frames reply = receive(client_shell, 5000);
        if (reply.empty()) {
            break;
        }
        ASSERT_EQ(part(reply, 3)["msg_id"], "p" + std::to_string(answered));
    }
    sender.join();
    EXPECT_EQ(answered, requests) << "the kernel stopped answering: a request was never read";
}

// stop_on_error: the failing execute finishes (its idle) before the queued requests are aborted, each
// with busy, aborted reply, idle.
TEST_F(KernelServerTest, QueuedRequestsAreAbortedAfterTheFailingExecute) {
    std::promise<void> queued_promise;
    auto queued = queued_promise.get_future().share();
    on_shell = [this, queued](const xeus::xmessage& request) {
        queued.wait();
        // a2 reached the server before the failing execute's reply: it waits in the shell socket, unread.
        EXPECT_TRUE(within_5s([this] { return server->shell_message_waiting(); })) << "a2 never arrived";
        server->publish(published_for(request, "status", {{"execution_state", "busy"}}),
                        xeus::channel::SHELL);
        server->send_shell(reply_to(request, "execute_reply",
                                    {{"status", "error"}, {"ename", "ZeroDivisionError"}, {"evalue", ""}}));
        server->abort_queue(
            [this](xeus::xmessage aborted) {
                server->send_shell(reply_to(aborted, "execute_reply", {{"status", "error"}}));
            },
            50);
        server->publish(published_for(request, "status", {{"execution_state", "idle"}}),
                        xeus::channel::SHELL);
    };
    send(client_shell, signed_message("execute_request", {{"code", "1/0"}}, "e1"));
    ASSERT_TRUE(wait_for_shell(1));
    send(client_shell, signed_message("execute_request", {{"code", "2"}}, "a2"));
    queued_promise.set_value();  // e1's handler goes on once a2 is queued behind it
    for (int i = 0; i < 2; ++i) {
        ASSERT_FALSE(receive(client_shell).empty());
    }
    EXPECT_EQ(sent_order("r1"),
              (std::vector<std::string>{"iopub:e1:status:busy", "shell:e1:execute_reply:error",
                                        "iopub:e1:status:idle", "iopub:a2:status:busy",
                                        "shell:a2:execute_reply:aborted", "iopub:a2:status:idle"}));
}

// stop_on_error aborts what was queued when the execute failed, not a request the client sent after it saw
// the failing execute's idle (the interpreter thread sends that idle itself and may still be returning from
// the execute when the next request arrives).
TEST_F(KernelServerTest, RequestSentAfterTheFailingExecutesIdleRuns) {
    std::promise<void> next_queued_promise;
    auto next_queued = next_queued_promise.get_future().share();
    on_shell = [this, next_queued](const xeus::xmessage& request) {
        if (msg_id(request) != "e1") {
            behave_like_xeus(*server, request, "execute_reply");
            return;
        }
        server->publish(published_for(request, "status", {{"execution_state", "busy"}}),
                        xeus::channel::SHELL);
        server->send_shell(reply_to(request, "execute_reply",
                                    {{"status", "error"}, {"ename", "ZeroDivisionError"}, {"evalue", ""}}));
        server->abort_queue(
            [this](xeus::xmessage aborted) {
                server->send_shell(reply_to(aborted, "execute_reply", {{"status", "error"}}));
            },
            50);
        server->publish(published_for(request, "status", {{"execution_state", "idle"}}),
                        xeus::channel::SHELL);
        // Still inside the failing execute when the next request is queued: n2 waits in the shell socket.
        next_queued.wait();
        EXPECT_TRUE(within_5s([this] { return server->shell_message_waiting(); })) << "n2 never arrived";
    };
    send(client_shell, signed_message("execute_request", {{"code", "1/0"}}, "e1"));
    ASSERT_FALSE(receive(client_shell).empty());
    bool idle_seen = false;
    while (!idle_seen) {
        const Frames message = receive(client_iopub);
        ASSERT_FALSE(message.empty()) << "no idle for e1";
        idle_seen = part(message, 3).value("msg_id", "") == "e1" &&
                    part(message, 5).value("execution_state", "") == "idle";
    }
    send(client_shell, signed_message("execute_request", {{"code", "2"}}, "n2"));
    next_queued_promise.set_value();  // e1's handler returns once n2 is queued
    const Frames reply = receive(client_shell);
    ASSERT_FALSE(reply.empty());
    EXPECT_EQ(part(reply, 3)["msg_id"], "n2");
    EXPECT_EQ(part(reply, 5)["status"], "ok") << "a request sent after the error's idle was aborted";
}

TEST_F(KernelServerTest, RefusedMessagesNeverReachTheInterpreter) {
    auto junk = signed_message("execute_request", {{"code", "1"}}, "j");
    junk[1] += "00";
    send(client_shell, junk);
    const auto replayed = signed_message("kernel_info_request", json::object(), "r");
    send(client_shell, replayed);
    ASSERT_TRUE(wait_for_shell(1));
    send(client_shell, replayed);
    auto unparsable = signed_message("execute_request", {{"code", "1"}}, "u");
    unparsable[5] = "{not json";
    unparsable[1] = signer.sign({unparsable[2], unparsable[3], unparsable[4], unparsable[5]});
    send(client_shell, unparsable);
    send(client_shell, signed_message("kernel_info_request", json::object(), "last"));
    ASSERT_TRUE(wait_for_shell(2));
    std::lock_guard lock(mutex);
    EXPECT_EQ(shell_seen, (std::vector<std::string>{"r", "last"}));
}

TEST_F(KernelServerTest, InputRequestGetsPasswordAndOnlyPendingRepliesPass) {
    // No prompt pending: a stray input_reply is dropped.
    send(client_stdin, signed_message("input_reply", {{"value", "stray"}}, "s1"));
    // stdin and shell are two sockets: the stray reply is dropped before the request that prompts is sent.
    ASSERT_TRUE(within_5s([this] { return server->stdin_messages_dropped() == 1; })) << "the stray was kept";
    std::promise<void> second_prompt_done;
    on_shell = [this, &second_prompt_done](const xeus::xmessage& request) {
        // xeus::blocking_input_request: send_stdin blocks until the answer reached the stdin listener.
        server->send_stdin(reply_to(request, "input_request", {{"prompt", "Password: "}, {"pwd", true}}));
        server->send_stdin(reply_to(request, "input_request", {{"prompt", "> "}, {"pwd", false}}));
        second_prompt_done.set_value();
    };
    send(client_shell, signed_message("execute_request", {{"code", "input()"}}, "m2"));
    const Frames prompt = receive(client_stdin);
    ASSERT_FALSE(prompt.empty());
    EXPECT_TRUE(signature_valid(prompt));
    EXPECT_EQ(part(prompt, 5), (json{{"prompt", "Password: "}, {"password", true}}));
    EXPECT_EQ(part(prompt, 3)["msg_id"], "m2");
    send(client_stdin, signed_message("input_reply", {{"value", "secret"}}, "s2"));
    ASSERT_FALSE(receive(client_stdin).empty());  // the second prompt
    // An interrupt answers the pending prompt with "" so the interpreter thread is released...
    server->interrupt_pending_input();
    ASSERT_EQ(second_prompt_done.get_future().wait_for(std::chrono::seconds(5)), std::future_status::ready);
    // ...and the client's late answer goes nowhere.
    send(client_stdin, signed_message("input_reply", {{"value", "late"}}, "s3"));
    ASSERT_TRUE(within_5s([this] { return server->stdin_messages_dropped() == 2; }))
        << "the late one was kept";
    std::lock_guard lock(mutex);
    EXPECT_EQ(input_values, (std::vector<std::string>{"secret", ""}));
}

// Control is served on the I/O thread while the interpreter thread runs a request: the interrupt reaches
// the kernel addressed to the running request, whose per-execute limits were posted before it ran.
TEST_F(KernelServerTest, ControlIsServedWhileARequestRunsAndInterruptsAreAddressedToIt) {
    std::promise<void> interrupted_promise;
    auto interrupted = interrupted_promise.get_future().share();
    on_shell = [this, interrupted](const xeus::xmessage& request) {
        interrupted.wait();
        server->send_shell(
            reply_to(request, "execute_reply",
                     {{"status", "ok"}, {"cellblock", {{"outcome", "ok"}, {"state_lost", false}}}}));
    };
    on_control = [this](const xeus::xmessage& request) {
        server->send_control(reply_to(request, "interrupt_reply", json::object()));
    };
    const json metadata = {{"cellblock", {{"timeout_s", 3}}}};
    send(client_shell, signed_message("execute_request", {{"code", "1"}}, "run-1", metadata));
    ASSERT_TRUE(wait_for_shell(1));
    const json reply = control_request("interrupt_request", json::object(), "i3");
    EXPECT_EQ(reply["content"], (json{{"status", "ok"}}));  // xeus's {} gets its status
    {
        std::lock_guard lock(mutex);
        EXPECT_EQ(interrupts.load(), 1);
        EXPECT_EQ(interrupted_requests, (std::vector<std::string>{"run-1"}));
        ASSERT_EQ(execute_metadata.count("run-1"), 1u);
        EXPECT_EQ(execute_metadata["run-1"], metadata);
    }
    interrupted_promise.set_value();
    // The interpreter's outcome travels in the content; clients get it in the metadata, signed.
    const Frames execute_reply = receive(client_shell);
    ASSERT_FALSE(execute_reply.empty());
    EXPECT_TRUE(signature_valid(execute_reply));
    EXPECT_EQ(part(execute_reply, 5), (json{{"status", "ok"}}));
    EXPECT_EQ(part(execute_reply, 4)["cellblock"]["outcome"], "ok");
}

// The kernel's own IOPub messages (egress events, approval displays) come from other threads; the I/O
// thread sends them, signed, with the execute_request running at the time as their parent.
TEST_F(KernelServerTest, KernelMessagesFromAnotherThreadGoOutWithTheRunningExecuteAsParent) {
    std::promise<void> release_promise;
    auto release = release_promise.get_future().share();
    on_shell = [this, release](const xeus::xmessage& request) {
        release.wait();
        server->send_shell(reply_to(request, "execute_reply", {{"status", "ok"}}));
    };
    send(client_shell, signed_message("execute_request", {{"code", "x"}}, "run-7"));
    ASSERT_TRUE(wait_for_shell(1));
    std::thread([this] {
        server->publish_kernel_message("cellblock_egress", {{"event", "connection"}, {"host", "a.test"}});
    }).join();
    const Frames event = receive(client_iopub);
    ASSERT_FALSE(event.empty());
    EXPECT_TRUE(signature_valid(event));
    EXPECT_EQ(part(event, 2)["msg_type"], "cellblock_egress");
    EXPECT_EQ(part(event, 3)["msg_id"], "run-7");
    EXPECT_EQ(part(event, 5), (json{{"event", "connection"}, {"host", "a.test"}}));

    release_promise.set_value();
    ASSERT_FALSE(receive(client_shell).empty());
    // Once the execute is answered, the kernel's messages have no parent.
    server->publish_kernel_message("display_data", {{"data", {{"text/plain", "later"}}}});
    const Frames later = receive(client_iopub);
    ASSERT_FALSE(later.empty());
    EXPECT_EQ(part(later, 2)["msg_type"], "display_data");
    EXPECT_EQ(part(later, 3), json::object());
}

TEST_F(KernelServerTest, ApprovalDecisionIsAnsweredByTheServer) {
    const json decision = {{"id", "a1"}, {"decision", "deny"}, {"decided_by", "agent api"}};
    const json reply = control_request("cellblock_approval_decision_request", decision, "d1");
    EXPECT_EQ(reply["msg_type"], "cellblock_approval_decision_reply");
    EXPECT_EQ(reply["content"], (json{{"status", "ok"}, {"seen", decision}}));
    std::lock_guard lock(mutex);
    EXPECT_EQ(approval_decisions, std::vector<json>{decision});
    EXPECT_TRUE(control_seen.empty()) << "xeus never sees the decision";
}

// The fixup path rebuilds the content; what is signed, sent and recorded is the rebuilt content.
TEST_F(KernelServerTest, FixedUpReplyIsSignedAndSentWhole) {
    on_control = [this](const xeus::xmessage& request) {
        server->send_control(reply_to(request, "interrupt_reply", {{"note", std::string(4096, 'x')}}));
    };
    const json reply = control_request("interrupt_request", json::object(), "i2");
    EXPECT_EQ(reply["content"], (json{{"note", std::string(4096, 'x')}, {"status", "ok"}}));
}

TEST_F(KernelServerTest, ShutdownIsAnsweredByTheServer) {
    const json reply = control_request("shutdown_request", {{"restart", true}}, "x1");
    EXPECT_EQ(reply["msg_type"], "shutdown_reply");
    EXPECT_EQ(reply["content"], (json{{"status", "ok"}, {"restart", true}}));
    ASSERT_TRUE(within_5s([this] { return shutdowns.load() > 0; }))
        << "the shutdown never reached the kernel";
    EXPECT_EQ(shutdowns.load(), 1);
    std::lock_guard lock(mutex);
    EXPECT_TRUE(control_seen.empty()) << "xeus never sees the shutdown";
}

TEST_F(KernelServerTest, ReplayReturnsWhatClientsGotAndIsAnsweredByTheServer) {
    on_shell = [this](const xeus::xmessage& request) {
        for (int i = 0; i < 3; ++i) {
            xeus::buffer_sequence buffers{xeus::binary_buffer{'\x00', '\x01'}};
            server->publish(
                xeus::xpub_message("stream", {{"msg_id", "s" + std::to_string(i)}, {"msg_type", "stream"}},
                                   request.header(), json::object(),
                                   {{"name", "stdout"}, {"text", "line " + std::to_string(i) + "\n"}},
                                   std::move(buffers)),
                xeus::channel::SHELL);
        }
        // An abort reply: what the client gets (and so the record keeps) is the fixed-up "aborted".
        server->send_shell(reply_to(request, "execute_reply", {{"status", "error"}}));
    };
    send(client_shell, signed_message("execute_request", {{"code", "print()"}}, "m1"));
    ASSERT_FALSE(receive(client_shell).empty());

    const json all = control_request("cellblock_replay_request", {{"after", nullptr}}, "r1")["content"];
    EXPECT_EQ(all["status"], "ok");
    EXPECT_EQ(all["found"], true);
    EXPECT_EQ(all["dropped"], 0);
    EXPECT_EQ(sent_order("r2"),
              (std::vector<std::string>{"iopub:m1:stream", "iopub:m1:stream", "iopub:m1:stream",
                                        "iopub:m1:status:busy", "shell:m1:execute_reply:aborted",
                                        "iopub:m1:status:idle"}));
    bool buffer_seen = false;
    for (const auto& message : all["messages"]) {
        if (message["header"].value("msg_id", "") == "s0") {
            EXPECT_EQ(message["buffers"], (json{"AAE="}));
            buffer_seen = true;
        }
        EXPECT_NE(message["header"]["msg_type"], "cellblock_replay_reply") << "a replay is never recorded";
    }
    EXPECT_TRUE(buffer_seen);

    const json after_first = control_request("cellblock_replay_request", {{"after", "s0"}}, "r3")["content"];
    EXPECT_EQ(after_first["found"], true);
    ASSERT_FALSE(after_first["messages"].empty());
    EXPECT_EQ(after_first["messages"][0]["header"]["msg_id"], "s1");

    const json unknown =
        control_request("cellblock_replay_request", {{"after", "long-gone"}}, "r4")["content"];
    EXPECT_EQ(unknown["found"], false);
    EXPECT_EQ(unknown["messages"].size(), all["messages"].size());
    std::lock_guard lock(mutex);
    EXPECT_TRUE(control_seen.empty()) << "xeus never sees a replay request";
}

TEST_F(KernelServerTest, LeaseRequestWithoutALeaseIsAnsweredAndChangesNothing) {
    const json reply = control_request("cellblock_lease_request", json::object(), "l1");
    EXPECT_EQ(reply["msg_type"], "cellblock_lease_reply");
    EXPECT_EQ(reply["content"], (json{{"status", "ok"}, {"lease_s", nullptr}}));
    std::lock_guard lock(mutex);
    EXPECT_TRUE(control_seen.empty());
}

TEST_F(KernelServerTest, HeartbeatIsEchoed) {
    zmq::socket_t heartbeat(context, zmq::socket_type::req);
    heartbeat.set(zmq::sockopt::linger, 0);
    heartbeat.connect(connection.endpoint(5));
    send(heartbeat, {"ping"});
    EXPECT_EQ(receive(heartbeat), Frames{"ping"});
}

// xeus asks the server for its configuration when the kernel is built; on ipc (the gateway's transport)
// the endpoints have no TCP port to read back.
TEST_F(KernelServerTest, ConfigurationOnIpcNamesTheConnectionPorts) {
    xeus::xconfiguration config;
    server->update_config(config);
    EXPECT_EQ(config.m_transport, "ipc");
    EXPECT_EQ(config.m_shell_port, "1");
    EXPECT_EQ(config.m_hb_port, "5");
    EXPECT_EQ(config.m_key, "server-key");
}

class KernelServerLease : public KernelServerTest {
  protected:
    void SetUp() override {
        options.lease = std::chrono::milliseconds(3000);
        KernelServerTest::SetUp();
    }
};

TEST_F(KernelServerLease, RenewedByRequestsThenExpiresWhenTheyStop) {
    // Renewed every 0.5 s for twice the lease: it must not expire.
    const auto renewing_until = std::chrono::steady_clock::now() + std::chrono::seconds(6);
    for (int i = 0; std::chrono::steady_clock::now() < renewing_until; ++i) {
        const json reply =
            control_request("cellblock_lease_request", json::object(), "l" + std::to_string(i));
        EXPECT_EQ(reply["content"], (json{{"status", "ok"}, {"lease_s", 3}}));
        ::usleep(500000);
    }
    EXPECT_EQ(lease_expiries.load(), 0);
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
