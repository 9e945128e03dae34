// The wire guard owns the kernel's public Jupyter sockets (the ports in the connection file) and stands
// between clients and xeus, which listens only on private ipc:// endpoints with signing disabled.
//
// Inbound, every message is verified strictly (exact-length constant-time HMAC, replayed signatures
// refused, malformed frames refused); refused messages get no reply and are logged, and the guard keeps
// serving. Outbound, xeus's messages get the protocol fixups (protocol_fixups.hpp) and are signed with the
// real key. interrupt_request is acted on here (xeus 2.4.1 ignores it) and shutdown_request is answered
// here, so shutdown never waits for a busy shell thread.
//
// For a gateway that restarts while the kernel runs on, the guard also keeps the outbound record
// (outbound_record.hpp) and answers cellblock_replay_request from it, and holds the orphan lease
// (lease.hpp), renewed by every verified inbound message and by cellblock_lease_request. Both requests
// arrive on control and are answered here; xeus never sees them. So is cellblock_approval_decision_request
// (network approvals, EGRESS.md §4), and the kernel's own IOPub messages (publish()) go out from here: the
// guard's thread is the one that owns the public IOPub socket.
#pragma once

#include <chrono>
#include <deque>
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
#include <zmq.hpp>

#include "connection_info.hpp"
#include "lease.hpp"
#include "message_signer.hpp"
#include "outbound_record.hpp"

namespace cellblock::kernel {

// Where xeus listens (private side).
struct PrivateEndpoints {
    std::string shell, control, stdin_channel, iopub;
};

// The verdict on one inbound multipart message (frames as received from a ROUTER).
struct InboundVerdict {
    enum class Kind { accepted, malformed, bad_signature, replayed, bad_header };
    Kind kind = Kind::malformed;
    std::size_t delimiter = 0;  // index of "<IDS|MSG>" when accepted
    std::string msg_type;       // when accepted
};

const char* describe(InboundVerdict::Kind kind) noexcept;

// Signature, replay and structure checks; pure apart from the replay memory.
class InboundVerifier {
  public:
    InboundVerifier(const MessageSigner& signer, std::size_t replay_capacity)
        : signer_(signer), replays_(replay_capacity) {}
    InboundVerdict check(const std::vector<std::string_view>& frames);

  private:
    const MessageSigner& signer_;
    ReplayFilter replays_;
};

struct GuardActions {
    // An interrupt_request arrived (message-mode interrupt); `unanswered` holds the msg_id of the oldest
    // shell request forwarded to xeus and not answered yet (the one running or about to run), if any.
    std::function<void(const std::vector<std::string>& unanswered)> interrupt;
    // A shutdown_request was answered and the reply flushed; the process should stop now.
    std::function<void()> shutdown;
    // The lease expired (already logged, sockets closed); the process should stop the worker and exit.
    std::function<void(std::chrono::duration<double> idle)> lease_expired;
    // A verified execute_request whose metadata has a "cellblock" member (per-execute limits).
    std::function<void(const std::string& msg_id, const nlohmann::json& metadata)> execute_metadata;
    // A verified cellblock_approval_decision_request on control: its content -> the reply's content. Unset
    // (a kernel without a network policy): the reply says no approval is pending.
    std::function<nlohmann::json(const nlohmann::json& content)> approval_decision;
};

struct GuardOptions {
    RecordLimits record;                             // what cellblock_replay_request can return
    std::optional<std::chrono::milliseconds> lease;  // none: the kernel never stops on its own
    // How long a shell reply waits for its request's idle, or an idle for its reply (see HeldReply).
    std::chrono::milliseconds reply_hold_limit{200};
    // Set: the public sockets are CurveZMQ servers with this secret key (Z85), so only clients that know the
    // kernel's public key connect and nothing on the wire is readable (a kernel reached over the network).
    std::optional<std::string> curve_secret_key;
};

// The public ports as bound (the real ones when the connection asked for port 0).
struct BoundPorts {
    int shell = 0, control = 0, stdin_channel = 0, iopub = 0, heartbeat = 0;
};

class WireGuard {
  public:
    // Binds the public sockets and connects to xeus's private ones; throws on failure (e.g. port in use).
    WireGuard(const ConnectionInfo& connection, const PrivateEndpoints& xeus, GuardActions actions,
              GuardOptions options = {});
    ~WireGuard();
    WireGuard(const WireGuard&) = delete;
    WireGuard& operator=(const WireGuard&) = delete;

    // Only before start(): read from the sockets' last endpoints.
    BoundPorts bound_ports() const;

    // Runs the proxy loop on its own thread until destruction, shutdown_request or lease expiry. The lease
    // starts counting here.
    void start();

    // A signal-mode interrupt (SIGINT) reached the kernel: if the shell thread is blocked waiting for an
    // input_reply, release it. Thread-safe.
    void interrupt_pending_input();

    // Publishes a message of the kernel's own on IOPub (signed and recorded like every IOPub message), whose
    // parent is the execute_request running when the guard sends it (none: an empty parent). Thread-safe:
    // queued for the guard's thread, which owns the socket. Dropped once the sockets are closed.
    void publish(std::string msg_type, nlohmann::json content);

  private:
    struct Sockets;
    void run() noexcept;
    void relay_inbound(int channel_index);
    void relay_outbound(int channel_index);
    void echo_heartbeat();
    void publish_status(std::string_view parent_header, const char* state);
    void release_pending_input();
    void answer_shutdown(const std::vector<zmq::message_t>& frames, std::size_t delimiter, int channel_index);
    void answer_replay(const std::vector<zmq::message_t>& frames, std::size_t delimiter);
    void answer_lease(const std::vector<zmq::message_t>& frames, std::size_t delimiter);
    void answer_approval_decision(const std::vector<zmq::message_t>& frames, std::size_t delimiter);
    void publish_queued();
    void expire_lease();
    // Sends a message to the clients of `channel_index` and, on IOPub, shell and stdin, records it as sent.
    void send_to_clients(int channel_index, std::vector<zmq::message_t>& frames);
    void close_sockets();
    // A message of the guard's own, in reply to (or about) the request whose header is `parent_header`;
    // `identities` route it on a ROUTER, none means IOPub.
    std::vector<zmq::message_t> build_message(const std::vector<zmq::message_t>& identities,
                                              std::string_view parent_header, std::string_view msg_type,
                                              const nlohmann::json& content) const;
    void note_refusal(const InboundVerdict& verdict, const char* channel);
    // Sends the held shell replies to the request `parent_msg_id`, or those held past their deadline.
    void release_held_replies(std::string_view parent_msg_id);
    void release_expired_replies();
    int poll_timeout_ms() const;

    // Reply ordering. xeus sends a shell reply from its shell thread and the request's IOPub messages from
    // a publisher thread, over two sockets, so either can reach the guard first. Clients get, for every
    // shell request: busy, outputs, reply, idle. A reply that comes first waits for its idle (HeldReply);
    // an idle that comes first waits for its reply, and IOPub behind it waits too (HeldIopub). Both waits
    // end after reply_hold_limit: a late message beats none. Only requests (`*_request`) are awaited: comm
    // messages get busy/idle but no reply.
    struct HeldReply {
        std::string parent_msg_id;
        std::vector<zmq::message_t> frames;
        std::chrono::steady_clock::time_point deadline;
    };
    std::vector<HeldReply> held_replies_;
    struct HeldIopub {
        std::string parent_msg_id;
        bool reports_idle = false;
        std::vector<zmq::message_t> frames;
    };
    std::deque<HeldIopub> held_iopub_;
    std::chrono::steady_clock::time_point held_iopub_deadline_;
    // Shell requests forwarded to xeus whose reply has not come back, oldest first (capped).
    std::deque<std::string> awaiting_reply_;
    // The headers of the execute_requests among them: the parent of the kernel's own messages.
    std::map<std::string, std::string, std::less<>> awaited_execute_headers_;
    void route_iopub(HeldIopub message);
    void release_held_iopub();
    bool awaiting_reply(std::string_view msg_id) const;
    void forget_awaited(std::string_view msg_id);

    MessageSigner signer_;
    InboundVerifier verifier_;
    GuardActions actions_;
    std::string session_id_;
    std::unique_ptr<Sockets> sockets_;
    std::thread thread_;
    std::vector<unsigned long> refusals_;  // per InboundVerdict::Kind, for log-once
    OutboundRecord record_;
    std::optional<std::chrono::milliseconds> lease_duration_;
    std::chrono::milliseconds reply_hold_limit_;
    std::optional<Lease> lease_;  // from start(); touched only by the guard thread

    // The input_request xeus is blocked on (xeus 2.4.1 waits in a blocking recv with no cancel): its
    // routing identities and header. Only an input_reply while one is pending is forwarded, so a stale
    // reply can never answer a later prompt; an interrupt answers it with "" to free the shell thread.
    struct PendingInput {
        std::vector<std::string> identities;
        std::string header;
    };
    std::optional<PendingInput> pending_input_;
    std::mutex wake_mutex_;

    // publish(): messages from other threads, sent by the guard's thread (after a "publish" wake).
    struct Queued {
        std::string msg_type;
        nlohmann::json content;
    };
    std::mutex queued_mutex_;
    std::vector<Queued> queued_;
};

}  // namespace cellblock::kernel
