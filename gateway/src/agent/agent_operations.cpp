#include "cellblock/gateway/agent/agent_operations.hpp"

#include <boost/asio/post.hpp>
#include <boost/asio/thread_pool.hpp>

#include "cellblock/contract/file_messages.hpp"
#include "cellblock/gateway/agent/output_shield.hpp"
#include "cellblock/gateway/http/rest_handlers.hpp"

namespace cellblock::gateway::agent {

using nlohmann::json;
using Kind = OperationErrorKind;

json OperationError::to_json() const {
    json body = {{"reason", reason_}, {"message", what()}};
    if (detail_.is_object())
        body.update(detail_);
    return body;
}

std::string workspace_path(const std::string& path) {
    if (path.find('\0') != std::string::npos)
        throw OperationError(Kind::refused, "bad_path", "file paths must not contain NUL bytes");
    // REST's route never yields a leading '/' (the router collapses empty segments); MCP's argument can.
    if (path.starts_with('/'))
        throw OperationError(Kind::refused, "bad_path",
                             "file paths are relative to the workspace (no leading '/')");
    std::string relative;
    for (const std::string& component : split_path(path)) {
        if (component == "." || component == "..")
            throw OperationError(Kind::refused, "bad_path",
                                 "file paths must stay inside the workspace ('.' and '..' are refused)");
        if (!relative.empty())
            relative.push_back('/');
        relative += component;
    }
    if (relative.empty())
        throw OperationError(Kind::refused, "bad_path", "empty file path");
    return relative;
}

namespace {

// The registry and the quotas answer in HTTP terms (they predate this layer); one place turns them into
// kinds.
OperationError from_registry(const HttpError& error) {
    switch (error.status()) {
        case http::status::too_many_requests:
            return {Kind::busy, error.reason(), error.what()};
        case http::status::conflict:
            return {Kind::conflict, error.reason(), error.what()};
        case http::status::gone:
            return {Kind::gone, error.reason(), error.what()};
        case http::status::service_unavailable:
            return {Kind::unavailable, error.reason(), error.what()};
        case http::status::bad_request:
            return {Kind::refused, error.reason(), error.what()};
        case http::status::not_found:
            return {Kind::not_found, error.reason(), error.what()};
        default:
            return {Kind::internal, error.reason().empty() ? "internal_error" : error.reason(), error.what()};
    }
}

// The kernel's refusal of a file request (contract/include/cellblock/contract/file_messages.hpp), with the
// reasons the file API answered when the gateway touched the workspace itself.
OperationError from_file_failure(contract::FileFailure failure, const std::string& message) {
    using Failure = contract::FileFailure;
    switch (failure) {
        case Failure::not_found:
            return {Kind::not_found, "file_not_found", message};
        case Failure::too_large:
            return {Kind::too_large, "file_too_large", message};
        case Failure::not_regular:
            return {Kind::refused, "not_a_regular_file", message};
        case Failure::bad_path:
            return {Kind::refused, "bad_path", message};
        case Failure::bad_request:
        case Failure::io:
        case Failure::no_workspace:
            break;
    }
    return {Kind::internal, "workspace_error", message};
}

// `reply` (a cellblock_file_reply's content) as `take` of it, or the refusal it says.
template <class Value>
Outcome<Value> decoded_reply(contract::FileOp op, const std::string& reply,
                             const std::function<Value(contract::FileReply&)>& take) {
    try {
        contract::FileReply decoded = contract::decode_file_reply(op, json::parse(reply));
        if (decoded.failure)
            return from_file_failure(*decoded.failure, decoded.message);
        return take(decoded);
    } catch (const OperationError& refused) {
        return refused;
    } catch (const std::exception& failure) {
        return OperationError(Kind::internal, "workspace_error",
                              std::string("unreadable reply of the kernel: ") + failure.what());
    }
}

// Asks the session's kernel, once it has one, to do `request` in its workspace (the kernel owns it, wherever
// it runs) and answers `take` of the reply, or the refusal. The reply is decoded on `files` (a worker thread:
// a read's reply carries up to contract::max_file_bytes in base64), never on the io thread; `then` runs back
// on the io thread. `take` must not touch the session (it is the io thread's).
template <class Value>
void ask_kernel(const std::shared_ptr<AgentSession>& session, boost::asio::thread_pool& files,
                boost::asio::io_context& io, const contract::FileRequest& request,
                AgentOperations::Then<Value> then, std::function<Value(contract::FileReply&)> take) {
    session->touch();
    session->ensure_kernel([session, &files, &io, content = contract::encode_file_request(request),
                            op = request.op, then = std::move(then),
                            take = std::move(take)](std::optional<std::string> error) mutable {
        if (error)
            return then(OperationError(Kind::unavailable, "kernel_unavailable",
                                       "the session has no kernel: " + *error));
        session->file_request(
            content, [&files, &io, op, then = std::move(then), take = std::move(take)](
                         std::optional<std::string> reply, const std::string& failure) mutable {
                if (!reply)
                    return then(OperationError(Kind::unavailable, "kernel_unavailable", failure));
                boost::asio::post(files, [&io, op, reply = std::move(*reply), then = std::move(then),
                                          take = std::move(take)]() mutable {
                    auto outcome = decoded_reply<Value>(op, reply, take);
                    boost::asio::post(io, [then = std::move(then), outcome = std::move(outcome)]() mutable {
                        then(std::move(outcome));
                    });
                });
            });
    });
}

// `then`, after recording `entry` in the session's audit trail when the operation succeeded.
AgentOperations::Then<std::string> audited(const std::shared_ptr<AgentSession>& session, json entry,
                                           AgentOperations::Then<std::string> then) {
    return [session, entry = std::move(entry), then = std::move(then)](Outcome<std::string> outcome) {
        if (outcome.ok())
            session->audit(entry);
        then(std::move(outcome));
    };
}

}  // namespace

AgentOperations::AgentOperations(AgentSessionServices& services, AgentSessionRegistry& registry)
    : services_(services), registry_(registry) {}

// ------------------------------------------------------------------------------------------------ sessions

void AgentOperations::create_session(const json& arguments, const Caller& caller, Then<SessionPtr> then) {
    std::string name;
    if (arguments.contains("name") && !arguments["name"].is_null()) {
        if (!arguments["name"].is_string())
            throw OperationError(Kind::malformed, "bad_type", "name must be a string");
        name = arguments["name"].get<std::string>();
    }
    AgentLimits limits;
    try {
        limits = parse_limits(arguments.contains("limits") ? arguments["limits"] : json(nullptr),
                              services_.config.default_limits, services_.config.max_limits);
    } catch (const LimitError& error) {
        throw OperationError(Kind::refused, "bad_limit", error.what(), {{"limit", error.field()}});
    }
    const NetworkRequest network =
        checked_network(arguments.contains("network") ? arguments["network"] : json(nullptr));
    services_.quotas.admit_session(
        caller.principal, static_cast<std::int64_t>(limits.memory_mb),
        [this, name, limits, network, caller,
         then = std::move(then)](std::optional<HttpError> refused) mutable {
            if (refused)
                return then(from_registry(*refused));
            registry_.create(name, caller.principal.tenant, limits, network, caller.address,
                             caller.principal.token_id,
                             [then = std::move(then)](SessionPtr session, std::optional<HttpError> error) {
                                 if (error)
                                     return then(from_registry(*error));
                                 then(std::move(session));
                             });
        });
}

AgentOperations::SessionPtr AgentOperations::session(const Principal& principal,
                                                     const std::string& id_or_name) const {
    auto found = registry_.find(principal, id_or_name);
    if (!found)
        throw OperationError(Kind::not_found, "unknown_session",
                             "no agent session with id or name '" + id_or_name + "'");
    return found;
}

void AgentOperations::admit(const Principal& principal, const TenantUsage& adding) const {
    try {
        services_.quotas.admit(principal, adding);
    } catch (const QuotaExceeded& exceeded) {
        throw OperationError(Kind::busy, "quota_exceeded", exceeded.what());
    }
}

NetworkRequest AgentOperations::checked_network(const json& requested) const {
    try {
        NetworkRequest network = parse_network_request(requested);
        check_within_ceiling(network, services_.kernels.network_ceiling());
        return network;
    } catch (const NetworkPolicyError& error) {
        if (error.kind() == NetworkPolicyError::Kind::malformed)
            throw OperationError(Kind::malformed, "bad_network", error.what());
        throw OperationError(Kind::refused, "network_not_allowed", error.what(),
                             {{"ceiling", services_.kernels.network_ceiling()}});
    }
}

void AgentOperations::resolve(const Principal& principal, const std::string& id_or_name,
                              std::function<void()> then) {
    registry_.resolve(principal.tenant, id_or_name, std::move(then));
}

void AgentOperations::session_or_create(const std::string& id_or_name, const Caller& caller,
                                        Then<SessionPtr> then, const json& network_argument) {
    std::optional<NetworkRequest> network;
    if (!network_argument.is_null())
        network = checked_network(network_argument);
    registry_.resolve(caller.principal.tenant, id_or_name,
                      [this, id_or_name, caller, then = std::move(then), network]() mutable {
                          found_or_created(id_or_name, caller, std::move(then), network);
                      });
}

void AgentOperations::found_or_created(const std::string& id_or_name, const Caller& caller,
                                       Then<SessionPtr> then, const std::optional<NetworkRequest>& network) {
    if (auto found = registry_.find(caller.principal, id_or_name)) {
        if (network && !(*network == found->record().network))
            return then(OperationError(
                Kind::conflict, "network_fixed",
                "session " + found->name() + " exists with network " +
                    (found->record().network.none() ? std::string("none")
                                                    : found->record().network.to_json().dump()) +
                    "; a session's network is fixed when it is created"));
        return then(std::move(found));
    }
    // Ids are made by the gateway, names by clients: an id that names no session is not created; nor is a
    // session by a principal that may not run one (an approver only reads).
    if (looks_like_kernel_id(id_or_name) || !caller.principal.may(Principal::Action::run))
        return then(OperationError(Kind::not_found, "unknown_session",
                                   "no agent session with id or name '" + id_or_name + "'"));
    services_.quotas.admit_session(caller.principal,
                                   static_cast<std::int64_t>(services_.config.default_limits.memory_mb),
                                   [this, id_or_name, caller, then = std::move(then),
                                    network](std::optional<HttpError> refused) mutable {
                                       if (refused)
                                           return then(from_registry(*refused));
                                       create_named(id_or_name, caller, std::move(then), network);
                                   });
}

void AgentOperations::create_named(const std::string& name, const Caller& caller, Then<SessionPtr> then,
                                   const std::optional<NetworkRequest>& network) {
    registry_.create(
        name, caller.principal.tenant, services_.config.default_limits, network.value_or(NetworkRequest{}),
        caller.address, caller.principal.token_id,
        [this, name, principal = caller.principal, then = std::move(then)](SessionPtr created,
                                                                           std::optional<HttpError> error) {
            // Two calls for a new name at once: the second finds the session the first is creating.
            if (error && error->status() == http::status::conflict)
                created = registry_.find(principal, name);
            if (!created)
                return then(error ? from_registry(*error)
                                  : OperationError(Kind::gone, "session_deleted",
                                                   "the session was deleted while it was being created"));
            created->ensure_kernel([created, then](std::optional<std::string> failure) {
                if (failure)
                    return then(OperationError(Kind::unavailable, "kernel_unavailable",
                                               "the session has no kernel: " + *failure));
                then(created);
            });
        });
}

std::vector<AgentOperations::SessionPtr> AgentOperations::sessions(const Principal& principal) const {
    std::vector<SessionPtr> seen = registry_.list();
    std::erase_if(seen, [&principal](const SessionPtr& session) {
        return !principal.sees_session(session->tenant(), session->id());
    });
    return seen;
}

void AgentOperations::delete_session(const SessionPtr& session, const Caller& caller,
                                     const std::string& reason, std::function<void()> deleted) {
    registry_.remove(session, reason, caller.address, caller.principal.token_id);
    services_.writer.after_pending(std::move(deleted));
}

void AgentOperations::reset(const SessionPtr& session, const Caller& caller, Then<SessionPtr> then) {
    session->reset(caller.address, caller.principal.token_id,
                   [session, then = std::move(then)](std::optional<std::string> error) {
                       if (error)
                           return then(OperationError(Kind::unavailable, "kernel_unavailable",
                                                      "reset failed: " + *error));
                       then(session);
                   });
}

// ------------------------------------------------------------------------------------------------ execute

ExecuteArguments AgentOperations::parse_execute_arguments(const json& arguments) {
    if (!arguments.contains("code"))
        throw OperationError(Kind::malformed, "missing_code", "missing \"code\": the Python source to run");
    if (!arguments["code"].is_string())
        throw OperationError(Kind::malformed, "bad_type", "\"code\" must be a string");
    ExecuteArguments parsed{arguments["code"].get<std::string>(), std::nullopt};
    if (arguments.contains("timeout_s") && !arguments["timeout_s"].is_null()) {
        const json& timeout = arguments["timeout_s"];
        if (!timeout.is_number() || timeout.get<double>() <= 0)
            throw OperationError(Kind::malformed, "bad_type",
                                 "\"timeout_s\" must be a number greater than 0");
        parsed.timeout_s = timeout.get<double>();
    }
    return parsed;
}

std::uint64_t AgentOperations::execute(const SessionPtr& session, const ExecuteArguments& arguments,
                                       const Caller& caller, ExecuteHandlers handlers) {
    return queue_checked(session, check_execute(session, arguments, caller), std::move(handlers));
}

ExecuteRequest AgentOperations::check_execute(const SessionPtr& session, const ExecuteArguments& arguments,
                                              const Caller& caller) const {
    admit(caller.principal, {0, 0, 1});
    if (session->queue_full())
        throw OperationError(
            Kind::busy, "session_busy",
            std::to_string(session->queued()) + " executes are already waiting in this session",
            {{"queued", session->queued()}});
    const double limit = session->record().limits.timeout_s;
    if (arguments.timeout_s && *arguments.timeout_s > limit)
        throw OperationError(Kind::refused, "bad_limit",
                             "timeout_s = " + json(*arguments.timeout_s).dump() +
                                 " exceeds the session's limits.timeout_s of " + json(limit).dump(),
                             {{"limit", "timeout_s"}});
    ExecuteRequest request;
    request.code = arguments.code;
    request.timeout_s = arguments.timeout_s.value_or(0);  // 0: the session's limit
    request.client_address = caller.address;
    request.client_kind = caller.via;
    request.token_id = caller.principal.token_id;
    return request;
}

std::uint64_t AgentOperations::queue_checked(const SessionPtr& session, ExecuteRequest request,
                                             ExecuteHandlers handlers) {
    return session->execute(std::move(request), std::move(handlers));
}

// ------------------------------------------------------------------------------------------------ files

void AgentOperations::list_files(const SessionPtr& session, Then<std::vector<WorkspaceFile>> then) {
    ask_kernel<std::vector<WorkspaceFile>>(session, files_, services_.io,
                                           {contract::FileOp::list, {}, {}, contract::max_file_bytes},
                                           std::move(then), [](contract::FileReply& reply) {
                                               std::vector<WorkspaceFile> files;
                                               files.reserve(reply.files.size());
                                               for (auto& entry : reply.files)
                                                   files.push_back({std::move(entry.path), entry.size});
                                               return files;
                                           });
}

void AgentOperations::read_file(const SessionPtr& session, const std::string& path, Then<std::string> then) {
    const std::string relative = workspace_path(path);
    const std::uint64_t cap = services_.config.max_file_bytes;
    ask_kernel<std::string>(
        session, files_, services_.io, {contract::FileOp::read, relative, {}, cap}, std::move(then),
        [relative, cap](contract::FileReply& reply) {
            // The kernel holds the file to the cap; a reply above it is refused all the same.
            if (reply.bytes.size() > cap)
                throw OperationError(Kind::too_large, "file_too_large",
                                     relative + ": exceeds the limit of " + std::to_string(cap) + " bytes");
            return std::move(reply.bytes);
        });
}

void AgentOperations::write_file(const SessionPtr& session, const std::string& path, std::string bytes,
                                 const Caller& caller, Then<std::string> then) {
    const std::string relative = workspace_path(path);
    const std::uint64_t cap = services_.config.max_file_bytes;
    if (bytes.size() > cap)
        throw OperationError(Kind::too_large, "file_too_large",
                             relative + ": " + std::to_string(bytes.size()) + " bytes exceeds the limit of " +
                                 std::to_string(cap));
    json entry = {{"event", "file_put"},        {"client", caller.address},
                  {"via", caller.via},          {"token_id", caller.principal.token_id},
                  {"path", relative},           {"bytes", bytes.size()},
                  {"sha256", sha256_hex(bytes)}};
    ask_kernel<std::string>(session, files_, services_.io,
                            {contract::FileOp::write, relative, std::move(bytes), cap},
                            audited(session, std::move(entry), std::move(then)),
                            [](contract::FileReply& reply) { return std::move(reply.path); });
}

void AgentOperations::delete_file(const SessionPtr& session, const std::string& path, const Caller& caller,
                                  Then<std::string> then) {
    const std::string relative = workspace_path(path);
    json entry = {{"event", "file_delete"},
                  {"client", caller.address},
                  {"via", caller.via},
                  {"token_id", caller.principal.token_id},
                  {"path", relative}};
    ask_kernel<std::string>(session, files_, services_.io,
                            {contract::FileOp::remove, relative, {}, contract::max_file_bytes},
                            audited(session, std::move(entry), std::move(then)),
                            [](contract::FileReply& reply) { return std::move(reply.path); });
}

// ------------------------------------------------------------------------------------------------ history

json AgentOperations::notebook(const SessionPtr& session, bool only_ok) const {
    return session->notebook(only_ok);
}

void AgentOperations::audit_trail(const SessionPtr& session, AuditQuery query, Then<std::vector<json>> then) {
    query.session = session->id();
    StoreWriter& writer = services_.writer;
    // Entries queued for the store are included: answer once the writer has reached this point.
    // Entries queued for the store are included: read (on the store's reader thread) once the writer has
    // reached this point.
    writer.after_pending([&writer, query = std::move(query), then = std::move(then)]() mutable {
        writer.read<std::vector<json>>(
            [query](SessionStore& store) { return store.audit(query); }, StoreWriter::default_read_limit,
            [then = std::move(then)](StoreAnswer<std::vector<json>> answer) {
                if (!answer.ok())
                    return then(OperationError(Kind::internal, "audit_unreadable",
                                               "cannot read the audit trail: " + answer.error));
                then(std::move(*answer.value));
            });
    });
}

// ------------------------------------------------------------------------------------------------ network

json AgentOperations::approvals(const SessionPtr& session) const {
    session->touch();
    return session->approvals();
}

std::string AgentOperations::parse_decision(const json& arguments) {
    if (!arguments.is_object() || !arguments.contains("decision"))
        throw OperationError(Kind::malformed, "missing_decision",
                             "missing \"decision\": allow_once, allow_session or deny");
    if (!arguments["decision"].is_string())
        throw OperationError(Kind::malformed, "bad_type", "\"decision\" must be a string");
    std::string decision = arguments["decision"].get<std::string>();
    if (decision != "allow_once" && decision != "allow_session" && decision != "deny")
        throw OperationError(
            Kind::refused, "bad_decision",
            "\"decision\" must be allow_once, allow_session or deny, not \"" + decision + "\"");
    return decision;
}

void AgentOperations::decide_approval(const SessionPtr& session, const std::string& approval_id,
                                      const std::string& decision, const Caller& caller, Then<json> then) {
    using Status = AgentSession::DecisionResult::Status;
    session->decide_approval(
        approval_id, decision, "agent api", caller.address, caller.principal.token_id,
        [then = std::move(then), approval_id](AgentSession::DecisionResult result) {
            switch (result.status) {
                case Status::ok:
                    return then(std::move(result.approval));
                case Status::unknown:
                    return then(OperationError(Kind::not_found, "unknown_approval", result.message,
                                               {{"approval", approval_id}}));
                case Status::already_decided:
                    return then(OperationError(Kind::conflict, "approval_decided", result.message,
                                               {{"approval", result.approval}}));
                case Status::kernel_refused:
                    return then(OperationError(Kind::conflict, "approval_decided", result.message,
                                               {{"approval", approval_id}}));
                case Status::no_kernel:
                case Status::no_answer:
                    break;
            }
            then(OperationError(Kind::unavailable, "kernel_unavailable", result.message));
        });
}

}  // namespace cellblock::gateway::agent
