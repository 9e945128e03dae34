#pragma once
// One running kernel: its process, connection file, HMAC key and ZMQ sockets, plus the WebSocket sessions
// attached to it. Each session_id gets its own shell/control/stdin DEALER sockets whose routing identity is
// the session_id, so the kernel's ROUTER sends replies and input_request only to the requester; IOPub arrives
// on one SUB socket and is fanned out to every session. Sessions outlive their WebSocket for a while so a
// reconnect with the same session_id gets the messages it missed.
#include <array>
#include <boost/asio/steady_timer.hpp>
#include <chrono>
#include <deque>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "cellblock/gateway/common/config.hpp"
#include "cellblock/gateway/jupyter/jupyter_message.hpp"
#include "cellblock/gateway/jupyter/kernelspec_registry.hpp"
#include "cellblock/gateway/jupyter/reply_order.hpp"
#include "cellblock/gateway/jupyter/zmq_channel.hpp"
#include "cellblock/gateway/kernels/kernel_lifecycle.hpp"
#include "cellblock/gateway/kernels/provisioner.hpp"
#include "cellblock/gateway/observability/log.hpp"
#include "cellblock/gateway/store/store.hpp"

namespace cellblock::gateway {

// Implemented by whatever carries messages to a client (the /channels WebSocket, the agent API).
class KernelClient {
  public:
    virtual ~KernelClient() = default;
    virtual void deliver(const JupyterMessage& message) = 0;
    // The kernel is going away (shut down, culled) or another connection took over this session_id.
    virtual void disconnect(const std::string& reason) = 0;
};

// Where a kernel's sockets live. A local kernel: ipc:// endpoints the gateway chose (no "pick a free port,
// close it, hope" race). A kernel that reported its connection (slurm): TCP ports it bound on its node,
// served over CurveZMQ with its own server key.
struct KernelEndpoints {
    std::string base;                // ipc path prefix; endpoint of port N is ipc://<base>-<N>
    std::string tcp_ip;              // set: tcp://<tcp_ip>:<tcp_ports[N]>
    std::array<int, 6> tcp_ports{};  // indexed by the constants below
    std::string curve_server_key;    // the kernel's CurveZMQ public key (Z85), with tcp
    std::string endpoint(int port) const {
        if (!tcp_ip.empty())
            return "tcp://" + tcp_ip + ":" + std::to_string(tcp_ports.at(static_cast<std::size_t>(port)));
        return "ipc://" + base + "-" + std::to_string(port);
    }
    // stdin_: `stdin` is a macro.
    // NOLINTNEXTLINE(readability-identifier-naming)
    static constexpr int shell = 1, iopub = 2, stdin_ = 3, control = 4, heartbeat = 5;
};

// Removes a tree that sandboxed code wrote (a workspace) without following its symlinks or crossing mounts
// (cellblock::sandbox::remove_tree); a failure is logged, never thrown.
void remove_workspace(const std::filesystem::path& directory, const Logger& logger);

class Kernel;

// One client's link to a kernel, keyed by the Jupyter session_id it connects with (a WebSocket client's, or
// an agent session's): its own DEALER sockets (shell, control, stdin) with that routing identity, and the
// buffer of messages kept while no client is attached. Not a /api/sessions session (JupyterSessionManager)
// nor an agent session (agent::AgentSession).
class KernelClientLink {
  public:
    KernelClientLink(std::string session_id, Kernel& kernel);
    ~KernelClientLink();
    // Closes this client's ZMQ sockets (also done by the destructor; a client may hold the link past its
    // kernel's shutdown, and open sockets keep the gateway's ZMQ context from terminating).
    void close();
    const std::string& session_id() const { return session_id_; }
    bool attached() const { return attached_client_ != nullptr; }
    // Prefix of session ids the gateway generates for clients that send no session_id.
    static constexpr std::string_view anonymous_prefix = "anonymous-";
    // Prefix of the session ids agent sessions use for their own link to the kernel; no client may take one.
    static constexpr std::string_view agent_prefix = "cellblock-agent-";
    void send(JupyterMessage&& message);

  private:
    friend class Kernel;
    void deliver_or_buffer(const JupyterMessage& message);
    void attach(std::weak_ptr<KernelClient> client);
    std::string session_id_;
    Kernel& kernel_;
    std::shared_ptr<ZmqChannel> shell_, control_, stdin_;
    std::weak_ptr<KernelClient> client_;
    const KernelClient* attached_client_ =
        nullptr;  // identity of the attached client, for stale-detach checks
    std::deque<JupyterMessage> offline_;
    std::size_t offline_bytes_ = 0;
    bool overflowed_ = false;
    std::chrono::steady_clock::time_point detached_since_ = std::chrono::steady_clock::now();
};

struct KernelLaunch {
    std::string id;
    KernelSpec spec;
    std::map<std::string, std::string> environment;  // the full environment of the kernel process
    std::filesystem::path runtime_dir;               // private 0700 directory for connection file and sockets
    std::filesystem::path workspace_dir;       // per-kernel CELLBLOCK_WORKSPACE, also the working directory
    std::shared_ptr<Provisioner> provisioner;  // where the process runs (provisioner.hpp)
    // Set when re-adopting a kernel started by an earlier gateway: its key, socket path prefix and creation
    // time (empty = new ones), and where the earlier gateway stopped reading IOPub.
    std::string key, endpoint_base, created, last_iopub_id;
    // Set when attaching a kernel another gateway started (a shared store), which may still serve it: the
    // re-adoption takes no client's identity awaiting a reply. The kernel's ROUTER hands an identity over to
    // its newest connection, so the reply would come here instead of to the gateway that sent the request.
    bool owned_elsewhere = false;
};

class Kernel : public std::enable_shared_from_this<Kernel> {
  public:
    using ReadyHandler = std::function<void(std::optional<std::string> error)>;

    Kernel(boost::asio::io_context& io, zmq::context_t& zmq_context, const Logger& logger,
           const GatewayConfig& config, KernelLaunch launch);
    ~Kernel();
    Kernel(const Kernel&) = delete;
    Kernel& operator=(const Kernel&) = delete;

    // Spawns the process; `on_ready` runs once the kernel answered kernel_info_request and IOPub delivers, or
    // with an error on failure/timeout.
    void start(ReadyHandler on_ready);
    // Re-adopts the running process `process` (started by an earlier gateway with this launch's key and
    // endpoints): connects, probes readiness like start(), then fetches the kernel's record of what it sent
    // while no gateway listened (cellblock_replay_request) before `on_ready` runs. Clients that attach soon
    // after get what they missed; `replayed_for` gives an interrupted execute its complete output.
    // A kernel that reported its connection (slurm) is re-adopted by its record's job and endpoints.
    void adopt(const KernelRecord& record, ReadyHandler on_ready);
    // Gateway exit that keeps the kernel running for the next gateway: closes this side's sockets and lets
    // the process (and its files) outlive this object.
    void release();
    // Renews the kernel's orphan lease (CELLBLOCK_LEASE_S), which it also renews on any other request.
    void renew_lease();
    // Every recorded message of a re-adopted kernel that answers the request `parent_msg_id`, oldest first.
    std::vector<JupyterMessage> replayed_for(const std::string& parent_msg_id) const;
    // What the store keeps of this kernel; `pooled` marks a warm-pool kernel not handed out yet.
    KernelRecord record(bool pooled) const;
    // The last IOPub message received; `take_progress` returns it once after each change.
    std::optional<std::string> take_progress();
    // Called after every spawn (start, restart, automatic restart): the process identity changed.
    void on_spawned(std::function<void(const Kernel&)> handler) { spawned_handler_ = std::move(handler); }
    // Asked before an automatic restart after the process died unexpectedly (a shared store: another gateway
    // may have deleted the kernel, or restarted it itself). The kernel is `deciding` until the handler calls
    // its second argument: true restarts it, false leaves it dead. Not set: restarted at once.
    using RestartDecision = std::function<void(bool restart)>;
    void on_unexpected_exit(std::function<void(const Kernel&, RestartDecision)> may_restart) {
        may_restart_ = std::move(may_restart);
    }
    // Called when a start or restart of the process fails, with the cause as /metrics names it
    // (GatewayMetrics::cause_*: spawn_failed, exited_during_start, start_timeout).
    void on_launch_failed(std::function<void(std::string_view cause)> handler) {
        launch_failed_handler_ = std::move(handler);
    }
    // Runs `handler` once the kernel is ready (at once if it already is).
    void when_ready(ReadyHandler handler);
    // Gateway exit: SIGTERM now; `finish_termination` waits up to `grace` and then SIGKILLs.
    void begin_termination();
    void finish_termination(std::chrono::milliseconds grace);
    // Closes every ZMQ socket of this kernel and its sessions (the ZMQ context cannot terminate while one is
    // open).
    void close_sockets();
    void interrupt();
    // The files and workspace belong to a live process or another gateway: never removed by this object.
    void disown_files() { cleaned_up_ = true; }
    // Restarts the process in place (same id, endpoints and key, so connected clients stay connected).
    void restart(ReadyHandler on_ready);
    // Asks the kernel to exit, then escalates to signals; clients are told `reason`.
    void shutdown(const std::string& reason);
    // Disconnects every client with `reason`; the process is left alone.
    void disconnect_clients(const std::string& reason);
    // Sends a stderr note on IOPub to every connected client (e.g. before a cull).
    void notify_clients(const std::string& text);

    // WebSocket sessions. Attaching a session_id that is already attached disconnects the older client.
    std::shared_ptr<KernelClientLink> attach(const std::string& session_id,
                                             std::weak_ptr<KernelClient> client);
    void detach(const std::shared_ptr<KernelClientLink>& session, const KernelClient* client);
    // Drops detached sessions older than the configured TTL; returns how many are left.
    void expire_detached_sessions();

    const std::string& id() const { return launch_.id; }
    // The tenant the kernel belongs to (principal.hpp); empty = the operator's. Set when it is handed to a
    // requester (a warm-pool kernel belongs to nobody until then) or re-adopted from its record.
    const std::string& tenant() const { return tenant_; }
    void set_tenant(std::string tenant) { tenant_ = std::move(tenant); }
    // The agent session this kernel runs for (empty: none, a Kernel Gateway client's kernel): a viewer link
    // of that session may watch the kernel's IOPub (KernelChannelsConnection, read-only).
    const std::string& agent_session() const { return agent_session_; }
    void set_agent_session(std::string id) { agent_session_ = std::move(id); }
    const std::string& spec_name() const { return launch_.spec.name; }
    const std::filesystem::path& workspace_dir() const { return launch_.workspace_dir; }
    KernelState state() const { return lifecycle_.client_state(busy_); }
    KernelPhase phase() const { return lifecycle_.phase(); }
    bool ready() const { return lifecycle_.ready(); }
    int connections() const { return connections_; }
    std::chrono::system_clock::time_point last_activity() const { return last_activity_; }
    void touch() { last_activity_ = std::chrono::system_clock::now(); }
    nlohmann::json model() const;

    // Called when the kernel is permanently gone (died past the restart limit, or shut down).
    void on_terminated(std::function<void(const std::string& id)> handler) {
        terminated_handler_ = std::move(handler);
    }

    // Used by KernelClientLink.
    std::shared_ptr<ZmqChannel> connect_dealer(int port, const std::string& identity, Channel channel,
                                               const std::weak_ptr<KernelClientLink>& session);
    const HmacSigner& signer() const { return signer_; }
    const GatewayConfig& config() const { return config_; }
    const Logger& logger() const { return logger_; }

  private:
    void write_connection_file();
    // spawn() + probe_readiness(); a failure marks the kernel dead and fails the waiting readiness handlers.
    void respawn(const char* what);
    void spawn();
    // A reporting provisioner (slurm): wait for the kernel's report until the launch deadline.
    void await_report();
    void on_connected(std::uint64_t generation, std::variant<ReportedConnection, std::string> result);
    bool reports_connection() const { return launch_.provisioner->reports_connection(); }
    // CurveZMQ client keys for the sockets to a kernel that serves CurveZMQ (none for ipc).
    ZmqChannel::SocketSetup socket_setup() const;
    void on_process_exit(InstanceExit exit);
    // Does what the lifecycle decided for an exit (at once, or once the store answered a restart question).
    void act_on_exit(ExitAction action, const InstanceExit& exit);
    void probe_readiness();
    void finish_readiness(const std::optional<std::string>& error);
    // False while the message is held for re-adoption (handed to clients after the kernel's record).
    bool handle_iopub(JupyterMessage&& message);
    bool adopting() const {
        return replay_phase_ == ReplayPhase::pending || replay_phase_ == ReplayPhase::awaiting;
    }
    // A message the kernel addressed to one client (a reply, an input request), in the order it came.
    void hand_addressed(std::string session_id, JupyterMessage&& message);
    void handle_probe_reply(JupyterMessage&& message);
    // Readiness reached: a re-adopted kernel still fetches its record before the handlers run.
    void on_probe_complete();
    void request_replay();
    // `ready`: the reply proves the kernel is alive; without one, readiness is probed with kernel_info.
    void handle_replay_reply(const nlohmann::json& content, bool ready);
    // The messages a session attaching now should get first (output sent while no gateway listened).
    void hand_backlog(KernelClientLink& session);
    // The sessions whose request is still under way at the end of `record` (a busy status without its idle).
    static std::set<std::string> sessions_awaiting_replies(const std::vector<JupyterMessage>& record);
    // The session's slot with its shell, control and stdin sockets, made if there is none.
    std::shared_ptr<KernelClientLink>& slot_for(const std::string& session_id);
    // After re-adoption, keeps live IOPub in the backlog for sessions that reconnect later (hand_backlog).
    void keep_for_late_sessions(const JupyterMessage& message);
    void watch_process();
    void broadcast(const JupyterMessage& message);
    // Delivers replies ReplyOrder released to their sessions, and keeps its timer armed while it holds some.
    void hand_out_replies(const std::vector<ReplyOrder::Reply>& replies);
    void auto_restart();
    void broadcast_execution_state(const char* state);
    void report_launch_failure(std::string_view cause) const {
        if (launch_failed_handler_)
            launch_failed_handler_(cause);
    }
    void connect_gateway_sockets();

    boost::asio::io_context& io_;
    zmq::context_t& zmq_context_;
    const Logger& logger_;
    const GatewayConfig& config_;
    KernelLaunch launch_;
    std::string tenant_;
    std::string agent_session_;
    KernelEndpoints endpoints_;
    HmacSigner signer_;
    std::filesystem::path connection_file_;
    std::unique_ptr<KernelInstance> process_;
    std::uint64_t launch_generation_ = 0;  // a report from an earlier launch is ignored
    std::string curve_client_public_, curve_client_secret_;
    std::shared_ptr<ZmqChannel> iopub_, probe_shell_, probe_control_;
    std::string probe_session_;
    std::map<std::string, std::shared_ptr<KernelClientLink>> sessions_;
    KernelLifecycle lifecycle_;
    bool busy_ = false;  // the kernel's last execution_state, shown while it is ready
    bool kernel_info_answered_ = false;
    bool iopub_seen_ = false;
    int restarts_ = 0;
    int connections_ = 0;
    std::chrono::system_clock::time_point last_activity_ = std::chrono::system_clock::now();
    std::chrono::steady_clock::time_point launch_deadline_;
    boost::asio::steady_timer probe_timer_;
    boost::asio::steady_timer shutdown_timer_;
    // Shell replies wait for the IOPub messages published before them, at most 2 s (reply_order.hpp).
    ReplyOrder reply_order_{std::chrono::seconds(2)};
    boost::asio::steady_timer reply_timer_;
    bool reply_timer_armed_ = false;
    std::size_t replies_released_late_ = 0;
    std::vector<ReadyHandler> ready_handlers_;
    std::function<void(const std::string&)> terminated_handler_;
    std::function<void(const Kernel&)> spawned_handler_;
    std::function<void(const Kernel&, RestartDecision)> may_restart_;
    std::function<void(std::string_view)> launch_failed_handler_;
    std::optional<ProcessIdentity> process_identity_;
    bool process_adopted_ = false;  // process_ was adopted (Kernel::adopt), not spawned here
    // The gateway's sockets to the kernel, its connection file (with the HMAC key), log, ipc endpoints and
    // workspace go when the process of a kernel that was shut down is gone, not when the last reference to
    // this object does: a WebSocket connection that lingers after its close frame holds the object for as
    // long as its peer keeps the socket (and an open ZMQ socket keeps the gateway from exiting).
    void clean_up_after_exit();
    bool cleaned_up_ = false;

    // Re-adoption. The phase of the record fetch is explicit, so a kernel that keeps no record (not a
    // cellblock kernel) is told apart from one whose answer is still on its way.
    enum class ReplayPhase { none, pending, awaiting, done };
    ReplayPhase replay_phase_ = ReplayPhase::none;
    std::string replay_request_id_;
    std::string replay_after_id_;  // the last IOPub message the previous gateway received
    std::vector<JupyterMessage> live_during_adoption_;  // IOPub received (and held) before the record arrived
    // Replies and input requests to clients received meanwhile: held too, they follow the output before them.
    std::vector<ReplyOrder::Reply> addressed_during_adoption_;
    std::vector<JupyterMessage> replayed_;  // everything the kernel recorded, plus the above
    // What clients missed (after last_iopub_id), then the live IOPub since, for sessions that come back
    // later.
    std::vector<JupyterMessage> backlog_;
    std::size_t backlog_bytes_ = 0;  // of the live messages added to it (bounded by offline_buffer_bytes)
    bool backlog_lossy_ = false;     // the record no longer reaches back that far
    std::chrono::steady_clock::time_point backlog_until_;
    std::set<std::string> backlog_served_;  // session_ids that got the backlog
    std::string last_iopub_id_;
    bool progress_changed_ = false;
};

}  // namespace cellblock::gateway
