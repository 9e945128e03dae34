// The kernel's Jupyter server: the xeus::xserver that owns the public sockets of the connection file and
// hands verified messages to xeus without a thread hop.
//
// Threads. The interpreter thread reads the shell socket itself and runs each request on the spot, so a
// request costs no hand-over between threads (kernel/README.md has the figures). The I/O thread (the one that
// calls start(), i.e. xeus::xkernel::start) polls control, stdin, heartbeat and a wake-up eventfd; it sleeps
// through ordinary executes. Control messages are dispatched to xeus on the I/O thread itself, so control is
// served while a cell runs. The sockets and the server's bookkeeping belong to whichever thread holds the
// server lock: the I/O thread holds it except while it waits in poll(2), and the interpreter thread takes it
// to read the shell socket and to send what xeus sends from there (replies, IOPub, input_request), in program
// order, so clients get, for every shell request, busy, outputs, reply, idle, as xeus produced them. Only the
// interpreter thread ever touches the shell socket. Messages of other threads (publish_kernel_message) are
// queued for the I/O thread and go out before the interpreter's next message.
//
// Inbound, every message is verified strictly (inbound_verifier.hpp); refused messages get no reply and are
// logged, and the server keeps serving. Outbound, the xeus 2.4.1 fixups (protocol_fixups.hpp) are applied
// to the JSON before it is serialized and signed. The server answers shutdown_request itself (shutdown
// never waits for a busy interpreter), acts on interrupt_request (xeus 2.4.1 ignores it), keeps the
// outbound record (outbound_record.hpp) and the orphan lease (lease.hpp), and answers the kernel's own
// control requests (cellblock_replay_request, cellblock_lease_request,
// cellblock_approval_decision_request, cellblock_file_request): xeus never sees those. The kernel's own IOPub
// messages (publish_kernel_message) are sent by the I/O thread too.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>
#include <xeus/xcontrol_messenger.hpp>
#include <xeus/xeus_context.hpp>
#include <xeus/xserver.hpp>
#include <zmq.hpp>

#include "common/unique_fd.hpp"
#include "server/connection_info.hpp"
#include "server/inbound_verifier.hpp"
#include "server/lease.hpp"
#include "server/outbound_record.hpp"

namespace cellblock::kernel {

struct ServerActions {
    // An interrupt_request arrived (message-mode interrupt); `unanswered` holds the msg_id of the oldest
    // shell request handed to the interpreter and not answered yet (the one running or about to run).
    std::function<void(const std::vector<std::string>& unanswered)> interrupt;
    // A shutdown_request was answered and the reply flushed; the process should stop now.
    std::function<void()> shutdown;
    // The lease expired (already logged, sockets closed); the process should stop the worker and exit.
    std::function<void(std::chrono::duration<double> idle)> lease_expired;
    // A verified execute_request whose metadata has a "cellblock" member (per-execute limits), posted
    // before the interpreter can take the request.
    std::function<void(const std::string& msg_id, const nlohmann::json& metadata)> execute_metadata;
    // A verified cellblock_approval_decision_request on control: its content -> the reply's content. Unset
    // (a kernel without a network policy): the reply says no approval is pending.
    std::function<nlohmann::json(const nlohmann::json& content)> approval_decision;
};

struct ServerOptions {
    RecordLimits record;                             // what cellblock_replay_request can return
    std::optional<std::chrono::milliseconds> lease;  // none: the kernel never stops on its own
    // Set: the public sockets are CurveZMQ servers with this secret key (Z85), so only clients that know the
    // kernel's public key connect and nothing on the wire is readable (a kernel reached over the network).
    std::optional<std::string> curve_secret_key;
    // The worker's workspace, whose files cellblock_file_request lists, reads, writes and deletes
    // (workspace_files.hpp). None: those requests are answered no_workspace.
    std::optional<std::filesystem::path> workspace;
};

// The public ports as bound (the real ones when the connection asked for port 0).
struct BoundPorts {
    int shell = 0, control = 0, stdin_channel = 0, iopub = 0, heartbeat = 0;
};

class KernelServer final : public xeus::xserver {
  public:
    // Binds the public sockets; throws on failure (e.g. port in use).
    KernelServer(const ConnectionInfo& connection, ServerActions actions, ServerOptions options = {});
    ~KernelServer() override;

    BoundPorts bound_ports() const;

    // A signal-mode interrupt (SIGINT) or the interpreter's time limit: if the interpreter thread waits
    // for an input_reply, answer it with "". Thread-safe.
    void interrupt_pending_input();

    // Publishes a message of the kernel's own on IOPub (signed and recorded like every IOPub message), whose
    // parent is the execute_request running when the I/O thread sends it (none: an empty parent).
    // Thread-safe. Dropped once the sockets are closed.
    void publish_kernel_message(std::string msg_type, nlohmann::json content);

    // For tests, which stand in for xeus's core: whether a shell message has reached the socket and waits
    // there unread (a request the client sent while the interpreter runs another). Interpreter thread only
    // (a shell listener), like every other use of the shell socket.
    bool shell_message_waiting();
    // For tests: stdin messages read and dropped so far (an input_reply no prompt waits for, or another
    // type), so a test knows a stray or late answer was dealt with. Thread-safe.
    std::uint64_t stdin_messages_dropped() const noexcept { return stdin_dropped_.load(); }

  private:
    // xeus::xserver. start() runs the I/O loop on the calling thread until stop(), shutdown_request or
    // lease expiry; the send/publish functions may be called from any thread.
    xeus::xcontrol_messenger& get_control_messenger_impl() override;
    void send_shell_impl(xeus::xmessage message) override;
    void send_control_impl(xeus::xmessage message) override;
    void send_stdin_impl(xeus::xmessage message) override;
    void publish_impl(xeus::xpub_message message, xeus::channel channel) override;
    void start_impl(xeus::xpub_message message) override;
    void abort_queue_impl(const listener& abort, long polling_interval) override;
    void stop_impl() override;
    void update_config_impl(xeus::xconfiguration& config) const override;

    // xeus's internal requests (its debugger's; cellblock has none) go straight to the interpreter.
    class ControlMessenger final : public xeus::xcontrol_messenger {
      public:
        explicit ControlMessenger(KernelServer& server) : server_(server) {}

      private:
        nlohmann::json send_to_shell_impl(const nlohmann::json& message) override;
        KernelServer& server_;
    };

    // What other threads hand the I/O thread, in the order they did.
    struct Outbound {
        enum class Kind { shell, control, stdin_channel, iopub, kernel_iopub };
        Kind kind = Kind::iopub;
        xeus::xmessage message;      // shell, control, stdin_channel
        xeus::xpub_message publish;  // iopub
        std::string msg_type;        // kernel_iopub
        nlohmann::json content;      // kernel_iopub
    };
    void enqueue(Outbound outbound);
    bool on_io_thread() const noexcept;
    // From the interpreter (or any non-I/O) thread: sends under the server lock, after what is queued.
    void send_now(Outbound outbound);
    // After a send on a ROUTER by a thread other than the I/O thread: that send may have taken in the command
    // that announced an inbound message (the I/O thread's poll(2) then never hears of it), so the I/O thread
    // is woken if the socket has a message to read. Server lock held.
    void keep_inbound_announced(int channel_index);
    void wake_io_thread();

    // I/O thread.
    struct Sockets;
    void run_io_loop();
    // Interpreter thread: reads shell, runs requests, until the server is destroyed.
    void run_interpreter();
    // stop_on_error: aborts the requests that were queued when xeus asked (abort_queue_impl).
    void abort_queued();
    // False if it stopped before the socket had nothing left.
    bool receive_all(int channel_index);
    void handle_inbound(int channel_index, std::vector<zmq::message_t>& frames);
    void send_queued();
    void send_outbound(Outbound& outbound);
    void send_xmessage(int channel_index, const xeus::xmessage_base& message,
                       const std::vector<std::string>* identities, const std::string& topic);
    // Signs, sends and (except on control) records; the texts move into the record. `msg_id` is the one in
    // `header`.
    void send_frames(int channel_index, std::vector<zmq::message_t>& frames, std::string msg_id,
                     std::string header, std::string parent_header, std::string metadata, std::string content,
                     const xeus::buffer_sequence& buffers);
    bool echo_heartbeat();
    void publish_status(const std::string& parent_header, const char* state);
    void send_own(int channel_index, const std::vector<std::string>& identities,
                  const std::string& parent_header, std::string_view msg_type, const nlohmann::json& content,
                  bool record);
    void answer_shutdown(const InboundVerdict& verdict, const std::vector<std::string>& identities,
                         int channel_index);
    // cellblock's own control requests, which xeus never sees: the table of them is control_service() in
    // kernel_server_io.cpp. Each answers with its reply's content; replies to them are not recorded.
    struct ControlService {
        std::string_view request, reply;
        nlohmann::json (KernelServer::*answer)(const InboundVerdict&);
    };
    static const ControlService* control_service(std::string_view msg_type);
    nlohmann::json replay_content(const InboundVerdict& verdict);
    nlohmann::json lease_content(const InboundVerdict& verdict);
    nlohmann::json approval_decision_content(const InboundVerdict& verdict);
    nlohmann::json file_content(const InboundVerdict& verdict);
    void deliver_input_reply(xeus::xmessage reply);
    void expire_lease();
    void close_sockets();
    void note_refusal(const InboundVerdict& verdict, const char* channel);
    void forget_awaited(const std::string& msg_id);
    int poll_timeout_ms() const;

    // The sockets the I/O loop polls, and which of them may have messages its poll(2) will not announce.
    enum PolledSocket { polled_control, polled_stdin, polled_heartbeat, polled_sockets };
    std::array<bool, polled_sockets> unread_{};

    MessageSigner signer_;
    InboundVerifier verifier_;
    ServerActions actions_;
    std::string session_id_;
    ConnectionInfo connection_;
    std::unique_ptr<Sockets> sockets_;
    ControlMessenger messenger_{*this};
    std::vector<unsigned long> refusals_;  // per InboundVerdict::Kind, for log-once
    OutboundRecord record_;
    std::string last_published_id_;  // msg_id of the last IOPub message sent (server lock); see send_xmessage
    std::optional<std::chrono::milliseconds> lease_duration_;
    std::optional<std::filesystem::path> workspace_;
    std::optional<Lease> lease_;  // from start(); server lock
    std::atomic<std::thread::id> io_thread_;
    std::atomic<bool> stopping_{false};

    // Shell requests handed to the interpreter whose reply has not gone out, oldest first (capped), and the
    // headers of the execute_requests among them (the parent of the kernel's own messages). Server lock.
    std::deque<std::string> awaiting_reply_;
    std::map<std::string, std::string, std::less<>> awaited_execute_headers_;

    // The server lock: the sockets and the bookkeeping both threads use (unread_, the record, the awaited
    // replies, the refusal counts, the verifier's replay memory, the lease). Held by the I/O thread except
    // while it polls; never taken while outbound_mutex_ or input_mutex_ is held (input_mutex_ may be taken
    // under it).
    std::mutex server_mutex_;

    // Other threads -> I/O thread. The eventfd is written only when the queue becomes non-empty.
    std::mutex outbound_mutex_;
    std::vector<Outbound> outbound_;
    UniqueFd wake_;

    // Verified shell requests read and not run yet (more than one only when a read found several, or when
    // stop_on_error drained the socket to abort what was queued). Interpreter thread.
    std::deque<xeus::xmessage> shell_queue_;
    // Set (and interpreter_wake_ written) when the server is destroyed; the wake-up also tells the
    // interpreter thread that the sockets were closed.
    std::atomic<bool> shell_closed_{false};
    UniqueFd interpreter_wake_;
    std::thread interpreter_;
    // stop_on_error: xeus asked (after the failing execute's reply, before its idle) to abort what is queued.
    // Only the requests queued by then are aborted: a client that saw the idle may already have sent the next
    // request, which must run. Interpreter thread; abort_queued_ is the count of requests queued when asked.
    listener pending_abort_;
    std::size_t abort_queued_ = 0;

    // The input() the interpreter thread waits for (xeus 2.4.1's send_stdin blocks until the answer).
    // Only an input_reply for a prompt that went out and is unanswered is taken, so a stale reply can
    // never answer a later prompt; an interrupt answers it with "".
    struct PendingInput {
        std::uint64_t generation = 0;  // of the prompt waited for; 0: none
        bool sent = false;
        std::optional<xeus::xmessage> answer;
    };
    std::mutex input_mutex_;
    std::condition_variable input_answered_;
    PendingInput input_;
    std::uint64_t input_generations_ = 0;
    std::atomic<std::uint64_t> stdin_dropped_{0};  // stdin_messages_dropped()
};

// xeus 2.4.1 builds its server through a plain function pointer (no state), with the context the kernel
// passed to xeus::xkernel. The kernel builds its KernelServer first (so a port in use fails before
// anything starts) and hands it over in this context; `take` is the server builder.
class ServerHandoff final : public xeus::xcontext {
  public:
    explicit ServerHandoff(std::unique_ptr<KernelServer> server) : server_(std::move(server)) {}
    static std::unique_ptr<xeus::xserver> take(xeus::xcontext& context, const xeus::xconfiguration& config,
                                               nlohmann::json::error_handler_t error_handler);

  private:
    std::unique_ptr<KernelServer> server_;
};

}  // namespace cellblock::kernel
