#pragma once
// The agent operations, once for every transport: creating and finding sessions, executing code, files,
// the notebook, the audit trail, reset and delete. Each operation validates its arguments with the same
// limits, caps and audit entries whichever client asked, and answers a value or an OperationError. The REST
// resources (agent_api.cpp) and the MCP tools (mcp_endpoint.cpp) only translate: their request into
// arguments, the answer or the error into their wire format (as jupyter_server's handlers sit over its
// managers).
#include <boost/asio/thread_pool.hpp>
#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "cellblock/gateway/access/principal.hpp"
#include "cellblock/gateway/agent/session_registry.hpp"
#include "cellblock/gateway/store/store.hpp"

namespace cellblock::gateway::agent {

// Why an operation refused, in terms each transport maps once: REST to an HTTP status
// (agent_api.cpp), MCP to a JSON-RPC error or a tool error (mcp_endpoint.cpp).
enum class OperationErrorKind {
    malformed,    // an argument is missing or of the wrong type (REST 400; MCP JSON-RPC -32602)
    refused,      // well-formed but not allowed: a limit above the session's, a path leaving the workspace,
                  // an invalid name (REST 400; MCP tool error)
    not_found,    // no such session or file (404)
    conflict,     // a session of that name exists (409)
    gone,         // the session was deleted while the operation waited (410)
    too_large,    // a file above the size cap (413)
    busy,         // the session's queue or the session count is at its cap (429)
    unavailable,  // the session has no kernel (503)
    internal,     // the gateway failed (500)
};

class OperationError : public std::runtime_error {
  public:
    // `reason` is the stable machine-readable word ("bad_limit", "unknown_session", ...); `detail` adds
    // fields to the error's JSON (e.g. {"limit": "timeout_s"}).
    OperationError(OperationErrorKind kind, std::string reason, const std::string& message,
                   nlohmann::json detail = nlohmann::json::object())
        : std::runtime_error(message), kind_(kind), reason_(std::move(reason)), detail_(std::move(detail)) {}
    OperationErrorKind kind() const { return kind_; }
    const std::string& reason() const { return reason_; }
    const nlohmann::json& detail() const { return detail_; }
    // {"reason", "message", ...detail}: the body of a REST error, the structured content of an MCP one.
    nlohmann::json to_json() const;

  private:
    OperationErrorKind kind_;
    std::string reason_;
    nlohmann::json detail_;
};

// An operation's answer: its value or why it was refused.
template <class Value>
class Outcome {
  public:
    Outcome(Value value) : state_(std::move(value)) {}
    Outcome(OperationError error) : state_(std::move(error)) {}
    bool ok() const { return std::holds_alternative<Value>(state_); }
    Value& value() { return std::get<Value>(state_); }
    const OperationError& error() const { return std::get<OperationError>(state_); }

  private:
    std::variant<Value, OperationError> state_;
};

// Who asked: the client's address and the transport ("http", "ndjson", "mcp"), for the audit trail, and the
// principal whose sessions the call may see and create (principal.hpp).
struct Caller {
    std::string address;
    std::string via;
    Principal principal = {};
};

struct WorkspaceFile {
    std::string path;  // relative to the workspace
    std::uint64_t size = 0;
};

struct ExecuteArguments {
    std::string code;
    std::optional<double> timeout_s;  // none: the session's limits.timeout_s
};

class AgentOperations {
  public:
    using SessionPtr = std::shared_ptr<AgentSession>;
    template <class Value>
    using Then = std::function<void(Outcome<Value>)>;

    AgentOperations(AgentSessionServices& services, AgentSessionRegistry& registry);

    // ---- sessions
    // `arguments`: {"name"?: string, "limits"?: {...}, "network"?: {"allow": [...], "ask": bool}}; answers
    // once the session's kernel is ready. A network policy beyond the gateway's ceiling is refused
    // ("network_not_allowed").
    void create_session(const nlohmann::json& arguments, const Caller& caller, Then<SessionPtr> then);
    // By id, then by name, among the sessions held here that `principal` sees; throws OperationError
    // not_found "unknown_session" (for another tenant's session too). On a shared store call `resolve`
    // first (AgentResource::prepare does).
    SessionPtr session(const Principal& principal, const std::string& id_or_name) const;
    // Calls `then` (io thread) once the registry agrees with the shared store on this session
    // (AgentSessionRegistry::resolve); at once on an embedded store.
    void resolve(const Principal& principal, const std::string& id_or_name, std::function<void()> then);
    // The session of that id or name, created with the default limits on first use of a name (MCP's
    // sessions appear on demand); an id of no session is "unknown_session" as everywhere else. Answers once
    // the session has a kernel.
    // `network` (MCP's argument) is the policy of a session created here; given for an existing session with
    // another policy, it is refused ("network_fixed": a session's network is fixed at creation).
    void session_or_create(const std::string& id_or_name, const Caller& caller, Then<SessionPtr> then,
                           const nlohmann::json& network = nullptr);
    // The sessions `principal` sees.
    std::vector<SessionPtr> sessions(const Principal& principal) const;
    // `deleted` runs once the deletion is in the store (other gateways on a shared store see it from then
    // on).
    void delete_session(const SessionPtr& session, const Caller& caller, const std::string& reason,
                        std::function<void()> deleted);
    // Restarts the session's interpreter (variables gone, files kept) after what is queued.
    void reset(const SessionPtr& session, const Caller& caller, Then<SessionPtr> then);

    // ---- execute
    // Reads {"code": string, "timeout_s"?: number > 0}; throws OperationError malformed. Needs no session,
    // so a malformed call is refused before a session is looked up or created.
    static ExecuteArguments parse_execute_arguments(const nlohmann::json& arguments);
    // Checks the session's queue cap and that timeout_s is within the session's limit, then queues the
    // execute; throws OperationError when refused. `handlers.on_done` gets the answer. Returns the ticket
    // for AgentSession::abandon.
    std::uint64_t execute(const SessionPtr& session, const ExecuteArguments& arguments, const Caller& caller,
                          ExecuteHandlers handlers);
    // The same in two steps, for a transport that must commit to an answer (start a stream) between the
    // check and the queueing: `check_execute` throws what `execute` would; `queue_checked` queues its
    // request and must follow it in the same turn of the io_context (nothing else may queue in between).
    ExecuteRequest check_execute(const SessionPtr& session, const ExecuteArguments& arguments,
                                 const Caller& caller) const;
    std::uint64_t queue_checked(const SessionPtr& session, ExecuteRequest request, ExecuteHandlers handlers);

    // ---- files: each waits for the session's kernel, which does the file work in the workspace it owns
    // (cellblock_file_request, agent_session_files.cpp), so a kernel on another host serves them too. Paths
    // are checked by workspace_path() here and by the kernel; sizes are capped by config.max_file_bytes here
    // and by the kernel (a write above it throws OperationError too_large); writes and deletes are audited.
    void list_files(const SessionPtr& session, Then<std::vector<WorkspaceFile>> then);
    void read_file(const SessionPtr& session, const std::string& path, Then<std::string> then);
    // Answers the workspace-relative path written.
    void write_file(const SessionPtr& session, const std::string& path, std::string bytes,
                    const Caller& caller, Then<std::string> then);
    void delete_file(const SessionPtr& session, const std::string& path, const Caller& caller,
                     Then<std::string> then);

    // ---- history
    // nbformat 4.5; `only_ok` leaves out cells that failed or timed out.
    nlohmann::json notebook(const SessionPtr& session, bool only_ok) const;
    // The audit entries matching `query` (its `session` is set here), including those still queued for
    // the store.
    void audit_trail(const SessionPtr& session, AuditQuery query, Then<std::vector<nlohmann::json>> then);

    // ---- network approvals (requests the session's kernel holds for a decision)
    nlohmann::json approvals(const SessionPtr& session) const;
    // Reads {"decision": "allow_once" | "allow_session" | "deny"}; throws OperationError (malformed
    // "missing_decision", refused "bad_decision").
    static std::string parse_decision(const nlohmann::json& arguments);
    // Sends the decision to the kernel and answers the approval as decided, or not_found
    // "unknown_approval", conflict "approval_decided", unavailable "kernel_unavailable".
    void decide_approval(const SessionPtr& session, const std::string& approval_id,
                         const std::string& decision, const Caller& caller, Then<nlohmann::json> then);

  private:
    // `adding` within the caller's tenant's quotas as this gateway counts them (an execute:
    // tenant_quotas.hpp), or OperationError busy "quota_exceeded".
    void admit(const Principal& principal, const TenantUsage& adding) const;
    // The "network" argument of a creation, checked against the ceiling; throws OperationError.
    NetworkRequest checked_network(const nlohmann::json& requested) const;
    // session_or_create once the registry is resolved.
    void found_or_created(const std::string& id_or_name, const Caller& caller, Then<SessionPtr> then,
                          const std::optional<NetworkRequest>& network);
    // found_or_created's new session `name`, once admitted within its tenant's quotas.
    void create_named(const std::string& name, const Caller& caller, Then<SessionPtr> then,
                      const std::optional<NetworkRequest>& network);

    AgentSessionServices& services_;
    AgentSessionRegistry& registry_;
    // The kernel's file replies (up to a file's size in base64) are decoded here, never on the io thread.
    boost::asio::thread_pool files_{1};
};

// A client's file path as a workspace-relative path: empty components collapse; throws OperationError
// refused "bad_path" for an empty path, a leading '/', "." or ".." components and NUL bytes.
std::string workspace_path(const std::string& path);

}  // namespace cellblock::gateway::agent
