#include "cellblock/gateway/agent/agent_session.hpp"
#include "cellblock/gateway/common/time_format.hpp"

// AgentSession's network side: IOPub cellblock_egress from the kernel's proxy into the audit trail and the
// approvals book (approvals_book.hpp), and decisions sent to the kernel. The rest of AgentSession:
// agent_session.cpp.

namespace cellblock::gateway::agent {

using nlohmann::json;

void AgentSession::stream_event(const json& event) {
    live_.cell_event(event);
    if (Running* running = executes_.running(); running && running->pending.handlers.on_event)
        running->pending.handlers.on_event(event);
}

void AgentSession::on_egress(const JupyterMessage& message) {
    const json content = json::parse(message.content, nullptr, false);
    if (!content.is_object())
        return;
    const std::string event = string_member(content, "event");
    const std::string now = format_iso8601_utc(std::chrono::system_clock::now());
    auto text = [&content](const char* key) { return string_member(content, key); };
    auto number = [&content](const char* key) {
        return content.contains(key) && content[key].is_number() ? content[key] : json(0);
    };
    const auto kernel = binding_.kernel();
    const json kernel_id = kernel ? json(kernel->id()) : json(nullptr);
    if (event == "connection") {
        audit({{"event", "network_connection"},
               {"host", text("host")},
               {"port", number("port")},
               {"method", text("method")},
               {"bytes_up", number("bytes_up")},
               {"bytes_down", number("bytes_down")},
               {"duration_ms", number("duration_ms")},
               {"allowed", bool_member(content, "allowed")},
               {"rule", text("rule")},
               {"kernel_id", kernel_id}});
        return;
    }
    if (event == "approval_requested") {
        const std::string approval_id = text("id");
        if (approval_id.empty() || approvals_.find(approval_id))
            return;  // a replayed record after a gateway restart: already known
        Approval approval;
        approval.id = approval_id;
        approval.host = text("host");
        approval.port = number("port").get<int>();
        approval.method = text("method");
        approval.timeout_s = number("timeout_s").get<double>();
        approval.requested = now;
        approval.kernel_id = kernel ? kernel->id() : std::string();
        audit({{"event", "network_approval"},
               {"state", "requested"},
               {"id", approval.id},
               {"host", approval.host},
               {"port", approval.port},
               {"method", approval.method},
               {"timeout_s", approval.timeout_s},
               {"kernel_id", kernel_id}});
        const json streamed = approval.to_event(id());
        approvals_.add(std::move(approval));
        services_.logger.info("network_approval_requested", {{"session", id()}, {"approval", streamed}});
        stream_event(streamed);
        return;
    }
    if (event == "approval_decided") {
        const std::string approval_id = text("id");
        Approval* approval = approvals_.find(approval_id);
        const std::string decision = text("decision");
        const std::string decided_by = text("decided_by");
        if (approval && !approval->decided.empty() && approval->decision == decision)
            return;  // recorded when the kernel answered our decision
        audit({{"event", "network_approval"},
               {"state", "decided"},
               {"id", approval_id},
               {"host", text("host")},
               {"port", number("port")},
               {"method", text("method")},
               {"decision", decision},
               {"decided_by", decided_by},
               {"client", approval ? json(approval->asking_client) : json(nullptr)},
               {"token_id", approval ? json(approval->asking_token_id) : json(nullptr)},
               {"kernel_id", kernel_id}});
        if (!approval)
            return;
        approval->decide(decision, decided_by, now);
        stream_event(approval->to_event(id()));
    }
}

void AgentSession::decide_approval(const std::string& approval_id, const std::string& decision,
                                   const std::string& decided_by, const std::string& client_address,
                                   const std::string& token_id, std::function<void(DecisionResult)> done) {
    using Status = DecisionResult::Status;
    touch();
    Approval* approval = approvals_.find(approval_id);
    if (!approval)
        return done({Status::unknown, "no approval " + approval_id + " in this session", nullptr});
    if (!approval->decision.empty())
        return done(DecisionResult::decided_before(*approval));
    const auto kernel = binding_.kernel();
    const auto link = binding_.link();
    if (!kernel || !link || kernel->id() != approval->kernel_id)
        return done({Status::no_kernel, "the kernel that held this request is gone", nullptr});
    approval->asking_client = client_address;
    approval->asking_token_id = token_id;
    JupyterMessage request = make_message(
        Channel::control, "cellblock_approval_decision_request",
        {{"id", approval_id}, {"decision", decision}, {"decided_by", decided_by}}, link_session_id_);
    const std::string msg_id = request.msg_id;
    auto timer = std::make_shared<boost::asio::steady_timer>(services_.io);
    auto shared_done = std::make_shared<std::function<void(DecisionResult)>>(std::move(done));
    std::weak_ptr<AgentSession> weak = weak_from_this();
    approvals_.await_decision(msg_id, [weak, timer, shared_done, approval_id, decision, decided_by,
                                       client_address, token_id](const json& reply) {
        timer->cancel();
        auto self = weak.lock();
        if (!self)
            return;
        Approval* known = self->approvals_.find(approval_id);
        if (string_member(reply, "status") != "ok") {
            const std::string why = reply.is_object() ? string_member(reply, "evalue", "refused")
                                                      : std::string("unreadable reply");
            // Decided meanwhile (the time limit, a person in a notebook): the kernel says it is not pending.
            if (known && !known->decision.empty())
                return (*shared_done)(DecisionResult::decided_before(*known));
            return (*shared_done)(
                {Status::kernel_refused, "the kernel refused the decision: " + why, nullptr});
        }
        self->record_decision(approval_id, decision, decided_by, client_address, token_id);
        (*shared_done)({Status::ok, "", known ? known->to_json() : json(nullptr)});
    });
    link->send(std::move(request));
    timer->expires_after(std::chrono::seconds(10));
    timer->async_wait([weak, msg_id, shared_done](const boost::system::error_code& error) {
        if (error)
            return;
        auto self = weak.lock();
        if (!self || !self->approvals_.forget_decision(msg_id))
            return;
        (*shared_done)({Status::no_answer, "the kernel did not answer the decision within 10 s", nullptr});
    });
}

void AgentSession::record_decision(const std::string& approval_id, const std::string& decision,
                                   const std::string& decided_by, const std::string& client_address,
                                   const std::string& token_id) {
    Approval* known = approvals_.find(approval_id);
    if (!known || !known->decision.empty())
        return;  // dropped as one of the oldest, or the kernel's approval_decided event recorded it first
    known->decide(decision, decided_by, format_iso8601_utc(std::chrono::system_clock::now()));
    audit({{"event", "network_approval"},
           {"state", "decided"},
           {"id", approval_id},
           {"host", known->host},
           {"port", known->port},
           {"method", known->method},
           {"decision", decision},
           {"decided_by", decided_by},
           {"client", client_address},
           {"token_id", token_id},
           {"kernel_id", known->kernel_id}});
    stream_event(known->to_event(id()));
}

}  // namespace cellblock::gateway::agent
