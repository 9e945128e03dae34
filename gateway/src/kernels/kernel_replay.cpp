// One kernel across a gateway restart (kernels/kernel.hpp): what the store keeps for the next gateway, the
// release that leaves the process running, and the re-adoption that fetches the kernel's record of what it
// sent while no gateway listened and hands it to the clients that come back.
#include <boost/asio/steady_timer.hpp>

#include "cellblock/gateway/common/crypto.hpp"
#include "cellblock/gateway/kernels/kernel.hpp"
#include "kernel_internal.hpp"

namespace cellblock::gateway {

using kernel_internal::buffered_size;
using kernel_internal::max_live_during_adoption;
using nlohmann::json;

namespace {
// How long a re-adopted kernel gets to send its record before it is served without one (a kernel that is not
// cellblock-kernel never answers cellblock_replay_request).
constexpr auto replay_answer_timeout = std::chrono::seconds(5);
constexpr auto subscription_settle = std::chrono::milliseconds(100);
// Sessions of the gateway's own probes: their traffic is never shown to clients, also when replayed.
constexpr std::string_view probe_session_prefix = "cellblock-gateway-";

std::string parent_field(const JupyterMessage& message, const char* field) {
    const json parent = json::parse(message.parent_header, nullptr, false);
    return parent.is_object() ? parent.value(field, std::string()) : std::string();
}

std::optional<Channel> channel_named(std::string_view name) {
    if (name == "iopub")
        return Channel::iopub;
    if (name == "shell")
        return Channel::shell;
    if (name == "stdin")
        return Channel::stdin_;
    if (name == "control")
        return Channel::control;
    return std::nullopt;
}
}  // namespace

void Kernel::adopt(const KernelRecord& record, ReadyHandler on_ready) {
    ready_handlers_.push_back(std::move(on_ready));
    const ProcessIdentity& process = record.process;
    try {
        if (reports_connection()) {
            const json& where = record.provisioner;
            const json& ports = where.at("ports");
            endpoints_.tcp_ip = where.at("ip").get<std::string>();
            endpoints_.tcp_ports = {0,
                                    ports.at(0).get<int>(),
                                    ports.at(1).get<int>(),
                                    ports.at(2).get<int>(),
                                    ports.at(3).get<int>(),
                                    ports.at(4).get<int>()};
            endpoints_.curve_server_key = where.at("curve_public_key").get<std::string>();
            process_ = launch_.provisioner->adopt(where, id(), launch_.runtime_dir);
            connect_gateway_sockets();
        } else {
            connect_gateway_sockets();
            process_ = adopt_local_process(io_, process.pid);
            // The pidfd now pins the process; a pid reused since the identity was read is caught here.
            if (!process.alive())
                throw std::runtime_error("process " + std::to_string(process.pid) +
                                         " is no longer the kernel");
        }
    } catch (const std::exception& error) {
        if (process_)
            process_->release();  // not ours to kill: it may be a stranger that reused the pid
        process_.reset();
        lifecycle_.launch_failed();
        finish_readiness(std::string("cannot re-adopt the kernel: ") + error.what());
        return;
    }
    if (!reports_connection())
        process_identity_ = process;
    process_adopted_ = true;
    watch_process();
    replay_phase_ = ReplayPhase::pending;
    replay_after_id_ = last_iopub_id_;
    kernel_info_answered_ = false;
    iopub_seen_ = false;
    busy_ = false;
    launch_deadline_ =
        std::chrono::steady_clock::now() +
        std::chrono::milliseconds(static_cast<long long>(config_.kernel_launch_timeout * 1000));
    logger_.info("kernel_adopting", {{"kernel_id", id()}, {"instance", process_->describe()}});
    // No kernel_info probe: it would wait behind a cell that is still running on the shell thread. The wire
    // guard answers the record request on control at once; it goes out once the IOPub subscription (an ipc
    // connect) has had time to reach the kernel, and what arrives live meanwhile is merged by msg_id.
    probe_timer_.expires_after(subscription_settle);
    probe_timer_.async_wait([weak = weak_from_this()](const boost::system::error_code& error) {
        if (error)
            return;
        if (auto self = weak.lock())
            self->request_replay();
    });
}

void Kernel::release() {
    lifecycle_.release();
    terminated_handler_ = nullptr;
    spawned_handler_ = nullptr;
    probe_timer_.cancel();
    shutdown_timer_.cancel();
    if (process_)
        process_->release();
    // Clients are not told: their connections end with the gateway, and an agent's running execute must stay
    // in flight for the next gateway to complete.
    close_sockets();
}

void Kernel::renew_lease() {
    if (lifecycle_.ending() || !probe_control_ || !process_ || !process_->running())
        return;
    probe_control_->send(encode_wire(
        make_message(Channel::control, "cellblock_lease_request", json::object(), probe_session_), signer_));
}

KernelRecord Kernel::record(bool pooled) const {
    KernelRecord record;
    record.id = id();
    record.spec_name = launch_.spec.name;
    record.key = signer_.key();
    record.endpoint_base = endpoints_.base;
    record.connection_file = connection_file_.string();
    record.workspace_dir = launch_.workspace_dir.string();
    record.log_file = (launch_.runtime_dir / ("kernel-" + id() + ".log")).string();
    record.environment = launch_.environment;
    if (process_identity_)
        record.process = *process_identity_;
    record.pooled = pooled;
    record.last_iopub_id = last_iopub_id_;
    record.created = launch_.created;
    record.tenant = tenant_;
    if (reports_connection() && process_ && !endpoints_.tcp_ip.empty()) {
        record.provisioner = process_->describe();
        record.provisioner["ip"] = endpoints_.tcp_ip;
        record.provisioner["ports"] = {
            endpoints_.tcp_ports[KernelEndpoints::shell], endpoints_.tcp_ports[KernelEndpoints::iopub],
            endpoints_.tcp_ports[KernelEndpoints::stdin_], endpoints_.tcp_ports[KernelEndpoints::control],
            endpoints_.tcp_ports[KernelEndpoints::heartbeat]};
        record.provisioner["curve_public_key"] = endpoints_.curve_server_key;
    }
    return record;
}

std::optional<std::string> Kernel::take_progress() {
    if (!progress_changed_)
        return std::nullopt;
    progress_changed_ = false;
    return last_iopub_id_;
}

std::vector<JupyterMessage> Kernel::replayed_for(const std::string& parent_msg_id) const {
    std::vector<JupyterMessage> answers;
    for (const JupyterMessage& message : replayed_)
        if (parent_field(message, "msg_id") == parent_msg_id)
            answers.push_back(message);
    return answers;
}

void Kernel::on_probe_complete() {
    if (replay_phase_ == ReplayPhase::pending) {
        request_replay();
        return;
    }
    if (replay_phase_ == ReplayPhase::awaiting)
        return;
    finish_readiness(std::nullopt);
}

void Kernel::request_replay() {
    replay_phase_ = ReplayPhase::awaiting;
    probe_timer_.cancel();
    JupyterMessage request =
        make_message(Channel::control, "cellblock_replay_request", {{"after", nullptr}}, probe_session_);
    replay_request_id_ = request.msg_id;
    probe_control_->send(encode_wire(request, signer_));
    probe_timer_.expires_after(replay_answer_timeout);
    probe_timer_.async_wait([weak = weak_from_this()](const boost::system::error_code& error) {
        if (error)
            return;
        auto self = weak.lock();
        if (!self || self->replay_phase_ != ReplayPhase::awaiting)
            return;
        self->logger_.warn("kernel_keeps_no_record",
                           {{"kernel_id", self->id()},
                            {"note",
                             "no answer to cellblock_replay_request: output sent while no gateway "
                             "listened is lost"}});
        // Not a cellblock kernel (or not answering): readiness as for a started one, by kernel_info.
        self->handle_replay_reply({{"messages", json::array()}, {"found", false}}, false);
        self->probe_readiness();
    });
}

void Kernel::handle_replay_reply(const json& content, bool ready) {
    if (replay_phase_ != ReplayPhase::awaiting)
        return;
    std::set<std::string> recorded_ids;
    std::vector<JupyterMessage> recorded;
    std::optional<std::size_t> resume_at;  // index in `recorded` of the first message clients missed
    if (replay_after_id_.empty())
        resume_at = 0;
    const json& messages =
        content.contains("messages") && content["messages"].is_array() ? content["messages"] : json::array();
    for (const json& entry : messages) {
        if (!entry.is_object())
            continue;
        auto channel = channel_named(entry.value("channel", std::string()));
        if (!channel || !entry.contains("header") || !entry["header"].is_object())
            continue;
        JupyterMessage message;
        message.channel = *channel;
        message.header = entry["header"].dump();
        message.parent_header = entry.value("parent_header", json::object()).dump();
        message.metadata = entry.value("metadata", json::object()).dump();
        message.content = entry.value("content", json::object()).dump();
        message.msg_id = entry["header"].value("msg_id", std::string());
        message.msg_type = entry["header"].value("msg_type", std::string());
        if (entry.contains("buffers") && entry["buffers"].is_array())
            for (const json& buffer : entry["buffers"])
                if (buffer.is_string())
                    message.buffers.push_back(base64_decode(buffer.get<std::string>()).value_or(""));
        const bool seen_before = message.msg_id == replay_after_id_;
        if (!parent_field(message, "session").starts_with(probe_session_prefix)) {
            recorded_ids.insert(message.msg_id);
            recorded.push_back(std::move(message));
        }
        if (seen_before)
            resume_at = recorded.size();
    }
    backlog_lossy_ = backlog_lossy_ || !resume_at.has_value();
    const std::size_t first_missed = resume_at.value_or(0);
    // What arrived live while the record was on its way and is in it keeps the record's place (the kernel's
    // order: a recorded reply after the output before it); what the kernel sent after answering follows.
    std::vector<JupyterMessage> live_only;
    for (const JupyterMessage& message : live_during_adoption_)
        if (!recorded_ids.contains(message.msg_id))
            live_only.push_back(message);
    replayed_ = recorded;
    replayed_.insert(replayed_.end(), live_only.begin(), live_only.end());
    backlog_.assign(recorded.begin() + static_cast<std::ptrdiff_t>(std::min(first_missed, recorded.size())),
                    recorded.end());
    backlog_.insert(backlog_.end(), live_only.begin(), live_only.end());
    backlog_until_ = std::chrono::steady_clock::now() +
                     std::chrono::milliseconds(static_cast<long long>(config_.offline_session_ttl * 1000));
    replay_phase_ = ReplayPhase::done;
    // A kernel still running a cell is busy, not idle: its last status says which.
    for (auto it = replayed_.rbegin(); it != replayed_.rend(); ++it) {
        if (it->channel != Channel::iopub || it->msg_type != "status")
            continue;
        const json status = json::parse(it->content, nullptr, false);
        if (status.is_object() && status.value("execution_state", "") == "busy")
            busy_ = true;
        break;
    }
    logger_.info("kernel_adopted", {{"kernel_id", id()},
                                    {"recorded", recorded.size()},
                                    {"missed", backlog_.size() - live_only.size()},
                                    {"lossy", backlog_lossy_},
                                    {"dropped_by_kernel", content.value("dropped", 0)}});
    // The previous gateway's clients still waiting for a reply get their sockets now, before they reconnect:
    // the kernel addresses a reply by session_id, and one sent while no socket has that identity is lost.
    // Their slots keep the record and then everything live, in order, as for a client that disconnected.
    // Not those of a kernel another gateway started: that gateway may still be waiting on them.
    if (!launch_.owned_elsewhere)
        for (const std::string& session_id : sessions_awaiting_replies(replayed_))
            if (!session_id.starts_with(KernelClientLink::anonymous_prefix))
                slot_for(session_id);
    // Sessions that attached while the record was on its way get it now (with the live output held
    // meanwhile), then what the kernel addressed to them meanwhile: a reply never before its output.
    for (auto& [session_id, session] : sessions_)
        hand_backlog(*session);
    for (const JupyterMessage& message : live_during_adoption_)
        hand_out_replies(reply_order_.iopub_arrived(message.msg_id, std::chrono::steady_clock::now()));
    auto addressed = std::move(addressed_during_adoption_);
    addressed_during_adoption_.clear();
    // Also a reply that is in the record: the record went to a session only if the session_id it attached
    // with is the one in the reply's parent header, and a client that chose none attached under another.
    for (auto& [session_id, message] : addressed)
        hand_addressed(std::move(session_id), std::move(message));
    if (ready)
        finish_readiness(std::nullopt);
}

std::set<std::string> Kernel::sessions_awaiting_replies(const std::vector<JupyterMessage>& record) {
    // A request is under way from its busy status until its idle one; the session that sent it awaits a
    // reply.
    std::map<std::string, std::string> running;  // request msg_id -> its session
    for (const JupyterMessage& message : record) {
        if (message.channel != Channel::iopub || message.msg_type != "status")
            continue;
        const std::string request = parent_field(message, "msg_id");
        const json status = json::parse(message.content, nullptr, false);
        const std::string state = status.is_object() ? status.value("execution_state", "") : "";
        if (state == "busy")
            running[request] = parent_field(message, "session");
        else if (state == "idle")
            running.erase(request);
    }
    std::set<std::string> sessions;
    for (const auto& [request, session] : running)
        if (!session.empty() && !session.starts_with(probe_session_prefix))
            sessions.insert(session);
    return sessions;
}

void Kernel::hand_backlog(KernelClientLink& session) {
    if (replay_phase_ != ReplayPhase::done || backlog_served_.contains(session.session_id()) ||
        std::chrono::steady_clock::now() > backlog_until_)
        return;
    backlog_served_.insert(session.session_id());
    if (backlog_lossy_)
        session.deliver_or_buffer(make_message(
            Channel::iopub, "stream",
            {{"name", "stderr"},
             {"text",
              "[cellblock-gateway] the gateway restarted and the kernel's record no longer reaches "
              "back to where it stopped: some output sent while no gateway listened is lost\n"}},
            probe_session_));
    auto hand = [&](const JupyterMessage& message) {
        // Replies and input requests go only to the session that asked, as the kernel addressed them.
        if (message.channel != Channel::iopub && parent_field(message, "session") != session.session_id())
            return;
        session.deliver_or_buffer(message);
    };
    for (const JupyterMessage& message : backlog_)
        hand(message);
}

void Kernel::keep_for_late_sessions(const JupyterMessage& message) {
    // A client of the previous gateway may reconnect after the record arrived: what the kernel published
    // since, broadcast to the sessions attached then, is its too, within the backlog's window and as much of
    // it as one offline session's buffer holds.
    if (replay_phase_ != ReplayPhase::done)
        return;
    if (std::chrono::steady_clock::now() > backlog_until_) {
        std::vector<JupyterMessage>().swap(backlog_);  // the window is over: no session gets it any more
        return;
    }
    const std::size_t size = buffered_size(message);
    if (backlog_.size() < max_live_during_adoption && backlog_bytes_ + size <= config_.offline_buffer_bytes) {
        backlog_.push_back(message);
        backlog_bytes_ += size;
    } else {
        backlog_lossy_ = true;  // a late session is told of the gap, never handed a silent one
    }
}

}  // namespace cellblock::gateway
