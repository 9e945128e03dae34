#pragma once
// One agent session: a kernel from the KernelManager (so it is listed in /api/kernels and a notebook can
// attach to it and watch), the session's limits, a queue of executes run one at a time, the history that
// becomes its notebook, and its audit trail. The session talks to its kernel as one more KernelClient with
// its own session_id.
#include <boost/asio/steady_timer.hpp>
#include <chrono>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cellblock/gateway/access/network_policy.hpp"
#include "cellblock/gateway/access/tenant_quotas.hpp"
#include "cellblock/gateway/agent/agent_config.hpp"
#include "cellblock/gateway/agent/approvals_book.hpp"
#include "cellblock/gateway/agent/execute_queue.hpp"
#include "cellblock/gateway/agent/execution.hpp"
#include "cellblock/gateway/agent/kernel_binding.hpp"
#include "cellblock/gateway/agent/live_events.hpp"
#include "cellblock/gateway/kernels/kernel.hpp"
#include "cellblock/gateway/kernels/kernel_manager.hpp"
#include "cellblock/gateway/observability/log.hpp"
#include "cellblock/gateway/observability/metrics.hpp"
#include "cellblock/gateway/store/store_writer.hpp"

namespace cellblock::gateway::agent {

// What every agent session shares (the io_context, logger, KernelManager, config and store writer); owned by
// the AgentService.
struct AgentSessionServices {
    boost::asio::io_context& io;
    const Logger& logger;
    KernelManager& kernels;
    const AgentConfig& config;
    StoreWriter& writer;
    GatewayMetrics& metrics;
    TenantQuotas& quotas;
};

class AgentSession : public KernelClient, public std::enable_shared_from_this<AgentSession> {
  public:
    struct Record {
        std::string id, name, created;
        AgentLimits limits;
        NetworkRequest network;   // checked against the ceiling at creation; none() = no network
        std::string tenant = {};  // whose session it is (principal.hpp); empty = the operator's
    };
    // Network approvals and the kernel's verdict on a decision (approvals_book.hpp).
    using Approval = agent::Approval;
    using DecisionResult = ApprovalDecisionResult;
    using Done = ExecuteQueue::Done;

    // `cells` is the history reloaded from the store (empty for a new session).
    AgentSession(AgentSessionServices& services, Record record, std::vector<nlohmann::json> cells);
    ~AgentSession() override;

    // Starts a kernel for the session unless it has a live one; `done` runs once it is ready.
    void ensure_kernel(Done done);
    // After a gateway restart: takes the re-adopted `kernel` (nullptr when it was lost, `lost_cause` says
    // why) and completes the execute that was running when the gateway stopped from the kernel's record.
    void resume(const std::shared_ptr<Kernel>& kernel, const std::string& lost_cause,
                std::vector<InflightExecute> inflight);
    // Queues an execute; returns a ticket for `abandon`.
    std::uint64_t execute(ExecuteRequest request, ExecuteHandlers handlers);
    // The client of `ticket` went away: a queued execute is dropped, a running one interrupted.
    void abandon(std::uint64_t ticket);
    // Restarts the kernel in place (variables gone, files kept) and clears the history; runs after queued
    // executes.
    void reset(std::string client_address, std::string token_id, Done done);
    // Shuts the kernel down and fails whatever is queued. The session is unusable afterwards. Its record is
    // written as deleted, unless `record_deletion` is false: another gateway deleted it and wrote that
    // already (and the retention may have purged it since; writing it again would bring a tombstone back).
    void close(const std::string& reason, bool record_deletion = true);

    nlohmann::json model() const;
    // Pending and decided approvals of this session, oldest first.
    nlohmann::json approvals() const;
    // Sends `decision` (allow_once, allow_session, deny) for a pending approval to the kernel on its control
    // channel and answers with the kernel's verdict.
    void decide_approval(const std::string& approval_id, const std::string& decision,
                         const std::string& decided_by, const std::string& client_address,
                         const std::string& token_id, std::function<void(DecisionResult)> done);
    // Sends a cellblock_file_request with `content` (contract/include/cellblock/contract/file_messages.hpp)
    // to the session's kernel on its control channel: the kernel owns the workspace, wherever it runs. `done`
    // gets the reply's content as sent (decoded by the caller, off the io thread), or nullopt and why: no
    // kernel, the kernel went away, or no answer within file_request_timeout.
    using FileAnswer =
        std::function<void(std::optional<std::string> reply_content, const std::string& failure)>;
    void file_request(const nlohmann::json& content, FileAnswer done);
    // A file moves in one message of at most about 683 MiB (contract::max_file_bytes in base64).
    static constexpr std::chrono::seconds file_request_timeout{60};
    // nbformat 4.5 notebook of the history; `only_ok` leaves out cells that failed or timed out.
    nlohmann::json notebook(bool only_ok) const;
    // Appends {"time", "session", ...entry} to the audit trail.
    void audit(const nlohmann::json& entry);
    void persist_record();

    const Record& record() const { return record_; }
    const std::string& id() const { return record_.id; }
    const std::string& name() const { return record_.name; }
    const std::string& tenant() const { return record_.tenant; }
    // The host directory the kernel's code sees as its cwd; nullopt without a live kernel.
    std::optional<std::filesystem::path> workspace() const;
    std::shared_ptr<Kernel> kernel() const { return binding_.kernel(); }
    // The session's cells as events for its live page (agent_api.cpp, .../events).
    LiveLog& live() { return live_; }
    bool busy() const { return executes_.busy(); }
    // Executes running or queued (what a tenant's `executes` quota counts, tenant_quotas.hpp).
    std::size_t executes_in_flight() const { return executes_.in_flight(); }
    std::size_t queued() const { return executes_.queued(); }
    // As many executes wait as the queue takes (ExecuteQueue::max_queued): the next is refused.
    bool queue_full() const { return executes_.full(); }
    bool closed() const { return closed_; }
    // The `ename` of an execute answered without running because the store did not answer in time (the agent
    // API answers it 503 store_unavailable).
    static constexpr std::string_view store_unavailable_ename = "StoreUnavailable";
    // The session's record is committed to the store (set once its creation is answered, and for sessions
    // loaded from the store): from then on a record missing from a shared store means the session was
    // deleted and purged through another gateway.
    void mark_record_committed() { record_committed_ = true; }
    bool record_committed() const { return record_committed_; }
    // What the session is doing, for /metrics (cellblock_agent_sessions): its kernel is being started or
    // readied (starting), it runs or has queued work (busy), it waits with a live kernel (idle), or it holds
    // no kernel now (without_kernel: the next execute starts one).
    enum class State { starting, busy, idle, without_kernel };
    State state() const;
    static std::string_view state_name(State state);
    std::chrono::steady_clock::time_point last_used() const;
    void touch() { last_used_ = std::chrono::steady_clock::now(); }

    // KernelClient: messages for our session_id (replies) and every IOPub message of the kernel.
    void deliver(const JupyterMessage& message) override;
    void disconnect(const std::string& reason) override;

  private:
    using Pending = ExecuteQueue::Pending;
    using Running = ExecuteQueue::Running;

    void run_next();
    // Calls `then(nullopt)` once this gateway holds the session's execute lease (other gateways on a shared
    // store serve the same session: one execute at a time across all of them; asked again when the holder's
    // release is heard, else every few milliseconds, while another holds it). The store is asked on its
    // reader thread: a store that does not answer or fails until `give_up` gives `then` the reason instead
    // (the execute answers 503 store_unavailable).
    void with_execute_lease(std::chrono::steady_clock::time_point give_up,
                            std::function<void(std::optional<std::string> unavailable)> then);
    void release_execute_lease();
    // Queues a store write made under the execute lease this gateway holds now. On a shared store `write`
    // gets the lease's fence and answers whether the store applied it (an embedded store: nullopt, answer
    // true); a refusal means another gateway took the lease since: logged once as lease_lost, and this
    // gateway stops believing it holds the lease.
    using FencedWrite = std::function<bool(SessionStore&, const std::optional<LeaseFence>&)>;
    void submit_under_execute_lease(FencedWrite write);
    void execute_lease_lost(std::int64_t token);
    // After a refusal: asks again when the holder's release is heard (StoreWriter::when_lease_released) or
    // its timer fires, whichever comes first.
    void ask_for_execute_lease_again(bool answered, std::chrono::steady_clock::time_point give_up,
                                     std::chrono::steady_clock::duration patience,
                                     std::function<void(std::optional<std::string>)> then);
    void keep_execute_lease(std::chrono::steady_clock::time_point give_up,
                            std::function<void(std::optional<std::string>)> then);
    void wait_for_lease_release(std::chrono::steady_clock::time_point give_up,
                                std::function<void(std::optional<std::string>)> then);
    void retry_execute_lease_now();
    // When an execute stops waiting for a store that does not answer: its time limit (at most
    // lease_store_limit) after it asks for the lease. Waiting behind other executes does not count, as their
    // time limits do not count against it.
    std::chrono::steady_clock::time_point store_give_up(const Pending& pending) const;
    static constexpr std::chrono::seconds lease_store_limit{10};
    void start_execute(Pending pending);
    void start_reset(Pending pending);
    // The time limit of `request`: its own, else the session's.
    double time_limit_of(const ExecuteRequest& request) const;
    // When the safety net interrupts an execute with time limit `timeout_s`: well after the kernel, which
    // enforces the limit itself, should have answered.
    std::chrono::milliseconds safety_net_after(double timeout_s) const;
    // Runs on_deadline `after` from now (the running execute's safety net).
    void arm_deadline(std::chrono::milliseconds after);
    static std::chrono::milliseconds seconds_to_ms(double seconds);
    void on_deadline();
    void on_grace_expired();
    void finish_execute();
    // The answer of `running` (answer_renderer.hpp) and its cell's outputs; consumes the state-lost notice.
    nlohmann::json build_answer(Running& running, nlohmann::json& cell_outputs);
    // The audit entry of an execute that ended.
    nlohmann::json execute_audit_entry(const Running& running, const nlohmann::json& answer) const;
    std::optional<std::string> save_output(const std::string& file_name, const std::string& text);
    void fail_pending(Pending& pending, const std::string& ename, const std::string& evalue);
    // The one metrics hook of an execute that ended: its outcome, and its duration when it reached a kernel.
    // `reached_kernel`: the answer's duration_ms is the execute's latency (sent to the kernel until
    // answered).
    // `kernel_outcome`: the kernel's execute_reply metadata cellblock.outcome ("" when no reply came).
    void count_execute(const nlohmann::json& answer, std::string_view kernel_outcome,
                       bool interrupted_by_client, bool reached_kernel);
    std::map<std::string, std::string> kernel_limit_environment() const;
    void attach_kernel(const std::shared_ptr<Kernel>& kernel);
    // ensure_kernel's first half: drops a bound kernel that is dead or no longer registered, and names the
    // kernel whose new process to ask the shared store for ("" = none).
    std::string kernel_to_reattach();
    // ensure_kernel's second half: waits for the bound kernel to be ready, or starts one.
    void bind_kernel();
    // Sends nothing: follows an execute the previous gateway sent (its answer goes to the history only).
    void resume_execute(const InflightExecute& inflight);
    // The one way out for every request the session holds: the running execute, the waiters for the
    // kernel (including an execute or reset whose kernel is still starting) and the queue.
    void fail_every_waiter(const std::string& cause);
    nlohmann::json runtime_info() const;
    // IOPub cellblock_egress from the kernel's proxy: connections and approvals into the audit trail,
    // approvals into approvals_ and the running execute's stream.
    void on_egress(const JupyterMessage& message);
    // Records a decision the kernel accepted from decide_approval: the audit entry and the streamed event,
    // unless its own approval_decided event came first.
    void record_decision(const std::string& approval_id, const std::string& decision,
                         const std::string& decided_by, const std::string& client_address,
                         const std::string& token_id);
    void stream_event(const nlohmann::json& event);
    // A cellblock_file_reply: answers the file_request it replies to.
    void on_file_reply(const JupyterMessage& message);
    // Answers every file_request still waiting with `cause`.
    void fail_file_requests(const std::string& cause);

    AgentSessionServices& services_;
    Record record_;
    std::vector<nlohmann::json> cells_;
    std::string link_session_id_;  // our session_id on the kernel (ZMQ routing identity)
    // The kernel, its link, the request for one in flight and its waiters (kernel_binding.hpp).
    KernelBinding binding_;
    bool state_lost_notice_ = false;  // tell the next answer that a new kernel replaced the old one
    std::string state_lost_cause_;    // why, when the gateway knows (a kernel lost across a restart)
    ExecuteQueue executes_;
    boost::asio::steady_timer deadline_timer_;
    boost::asio::steady_timer lease_timer_;
    bool holds_execute_lease_ = false;
    std::int64_t execute_lease_token_ = 0;       // the fencing token of that lease (SessionStore::try_lease)
    std::int64_t lost_lease_token_ = 0;          // the newest token whose loss was logged
    std::function<void()> execute_lease_retry_;  // the next ask after a refusal (timer or release heard)
    bool lease_wakeup_armed_ = false;            // a waiter for the lease's release is registered
    bool lease_release_heard_ = false;           // a release was heard since the last ask began
    // Releases of this session's lease still waiting behind their writes (release_execute_lease). The next
    // taking waits for them: PostgreSQL counts a lease per connection, so a release that came after a taking
    // on a reconnected connection would undo that taking.
    int lease_releases_pending_ = 0;
    // The newest of them while it can still be withdrawn (set to true: not sent, the lease kept by the next
    // execute; keep_execute_lease). Null once it went out, after the lease was lost, or once the store said
    // the lease is not held.
    std::shared_ptr<bool> unsent_release_;
    std::chrono::steady_clock::time_point last_used_ = std::chrono::steady_clock::now();
    bool closed_ = false;
    std::string deleted_at_;  // ISO 8601, set by close(): when the store may purge the session (retention)
    bool record_committed_ = false;
    ApprovalsBook approvals_;
    LiveLog live_;
    // The file requests sent and not answered, by msg_id, each with its time limit.
    struct FileWait {
        FileAnswer done;
        std::shared_ptr<boost::asio::steady_timer> timer;
    };
    std::map<std::string, FileWait> file_waits_;
};

}  // namespace cellblock::gateway::agent
