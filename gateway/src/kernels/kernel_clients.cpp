// One kernel's clients (kernels/kernel.hpp): the gateway's sockets to the kernel, each client's link
// (KernelClientLink: its DEALER sockets and offline buffer), IOPub fan-out, replies to the session that
// asked.
#include <algorithm>

#include "cellblock/gateway/common/crypto.hpp"
#include "cellblock/gateway/kernels/kernel.hpp"
#include "kernel_internal.hpp"

namespace cellblock::gateway {

using kernel_internal::buffered_size;
using kernel_internal::max_live_during_adoption;
using nlohmann::json;

namespace {
constexpr std::size_t max_detached_sessions = 32;
}  // namespace

// ----------------------------------------------------------------------------------------------
// KernelClientLink

KernelClientLink::KernelClientLink(std::string session_id, Kernel& kernel)
    : session_id_(std::move(session_id)), kernel_(kernel) {}

KernelClientLink::~KernelClientLink() {
    close();
}

void KernelClientLink::close() {
    for (auto* channel : {&shell_, &control_, &stdin_})
        if (*channel)
            (*channel)->close();
}

void KernelClientLink::attach(std::weak_ptr<KernelClient> client) {
    client_ = std::move(client);
    auto receiver = client_.lock();
    if (!receiver)
        return;
    if (overflowed_) {
        receiver->deliver(make_message(Channel::iopub, "stream",
                                       {{"name", "stderr"},
                                        {"text",
                                         "[cellblock-gateway] the oldest messages sent while this session "
                                         "was disconnected were dropped (offline buffer full)\n"}},
                                       session_id_));
    }
    std::deque<JupyterMessage> pending;
    pending.swap(offline_);
    offline_bytes_ = 0;
    overflowed_ = false;
    for (const JupyterMessage& message : pending)
        receiver->deliver(message);
}

void KernelClientLink::deliver_or_buffer(const JupyterMessage& message) {
    if (auto receiver = client_.lock()) {
        receiver->deliver(message);
        return;
    }
    const std::size_t size = buffered_size(message);
    const GatewayConfig& config = kernel_.config();
    if (config.offline_buffer_messages == 0 || size > config.offline_buffer_bytes) {
        overflowed_ = true;
        return;
    }
    // A full buffer drops its oldest messages: a returning client needs the newest ones to go on (the
    // execute_reply and the final idle status it is waiting for).
    while (!offline_.empty() && (offline_.size() >= config.offline_buffer_messages ||
                                 offline_bytes_ + size > config.offline_buffer_bytes)) {
        offline_bytes_ -= buffered_size(offline_.front());
        offline_.pop_front();
        overflowed_ = true;
    }
    offline_bytes_ += size;
    offline_.push_back(message);
}

void KernelClientLink::send(JupyterMessage&& message) {
    kernel_.touch();
    const std::shared_ptr<ZmqChannel>* channel = &shell_;
    if (message.channel == Channel::control)
        channel = &control_;
    if (message.channel == Channel::stdin_)
        channel = &stdin_;
    if (!*channel || !(*channel)->send(encode_wire(message, kernel_.signer())))
        kernel_.logger().warn("kernel_send_failed",
                              {{"kernel_id", kernel_.id()}, {"msg_type", message.msg_type}});
}

// ---------------------------------------------------------------------------------------------- Kernel

void Kernel::connect_gateway_sockets() {
    std::weak_ptr<Kernel> weak = weak_from_this();
    iopub_ = ZmqChannel::connect(
        io_, zmq_context_, zmq::socket_type::sub, endpoints_.endpoint(KernelEndpoints::iopub), "",
        [weak](std::vector<std::string>&& frames) {
            auto self = weak.lock();
            if (!self)
                return;
            try {
                JupyterMessage message = decode_wire(Channel::iopub, std::move(frames), self->signer_);
                std::string msg_id = message.msg_id;
                // After it went to the clients: a reply held for this message may follow it now (one held
                // for re-adoption releases its replies when it goes out, in handle_replay_reply).
                if (self->handle_iopub(std::move(message)))
                    self->hand_out_replies(
                        self->reply_order_.iopub_arrived(msg_id, std::chrono::steady_clock::now()));
            } catch (const MessageError& error) {
                self->logger_.warn("kernel_message_rejected",
                                   {{"kernel_id", self->id()}, {"error", error.what()}});
            }
        },
        socket_setup());
    probe_session_ = "cellblock-gateway-" + random_hex(8);
    auto probe_handler = [weak](Channel channel) {
        return [weak, channel](std::vector<std::string>&& frames) {
            auto self = weak.lock();
            if (!self)
                return;
            try {
                self->handle_probe_reply(decode_wire(channel, std::move(frames), self->signer_));
            } catch (const MessageError& error) {
                self->logger_.warn("kernel_message_rejected",
                                   {{"kernel_id", self->id()}, {"error", error.what()}});
            }
        };
    };
    probe_shell_ = ZmqChannel::connect(io_, zmq_context_, zmq::socket_type::dealer,
                                       endpoints_.endpoint(KernelEndpoints::shell), probe_session_,
                                       probe_handler(Channel::shell), socket_setup());
    probe_control_ = ZmqChannel::connect(io_, zmq_context_, zmq::socket_type::dealer,
                                         endpoints_.endpoint(KernelEndpoints::control), probe_session_,
                                         probe_handler(Channel::control), socket_setup());
}

ZmqChannel::SocketSetup Kernel::socket_setup() const {
    if (endpoints_.curve_server_key.empty())
        return {};
    return [server = endpoints_.curve_server_key, client_public = curve_client_public_,
            client_secret = curve_client_secret_](zmq::socket_t& socket) {
        socket.set(zmq::sockopt::curve_serverkey, server);
        socket.set(zmq::sockopt::curve_publickey, client_public);
        socket.set(zmq::sockopt::curve_secretkey, client_secret);
    };
}

void Kernel::close_sockets() {
    for (auto& [session_id, session] : sessions_)
        for (auto* channel : {&session->shell_, &session->control_, &session->stdin_})
            if (*channel)
                (*channel)->close();
    for (auto* channel : {&iopub_, &probe_shell_, &probe_control_})
        if (*channel)
            (*channel)->close();
}

bool Kernel::handle_iopub(JupyterMessage&& message) {
    last_iopub_id_ = message.msg_id;
    progress_changed_ = true;
    if (!iopub_seen_) {
        iopub_seen_ = true;
        if (kernel_info_answered_ && lifecycle_.launching())
            on_probe_complete();
    }
    // The gateway's own probe traffic (kernel_info during startup) is neither shown to clients nor counted as
    // activity or execution state.
    if (message.parent_header.find(probe_session_) != std::string::npos)
        return true;
    last_activity_ = std::chrono::system_clock::now();
    const bool adopting = this->adopting();
    if (adopting && live_during_adoption_.size() < max_live_during_adoption)
        live_during_adoption_.push_back(message);
    else if (adopting)
        backlog_lossy_ = true;  // announced to clients with the record, never a silent gap
    if (message.msg_type == "status") {
        json content = json::parse(message.content, nullptr, false);
        const std::string execution_state = content.is_object() ? content.value("execution_state", "") : "";
        // Shown only while ready (KernelLifecycle::client_state): an old process's last status messages
        // cannot hide "restarting" or "dead".
        if (execution_state == "busy" || execution_state == "idle")
            busy_ = execution_state == "busy";
    }
    // While the record is on its way, live output is held: clients get the record first, then this, in order.
    if (adopting)
        return false;
    keep_for_late_sessions(message);
    broadcast(message);
    return true;
}

void Kernel::hand_addressed(std::string session_id, JupyterMessage&& message) {
    // While the record is on its way the live output is held (handle_iopub), and so is what follows it.
    if (adopting() && addressed_during_adoption_.size() < max_live_during_adoption) {
        addressed_during_adoption_.push_back({std::move(session_id), std::move(message)});
        return;
    }
    // The outputs the kernel published before this message travel on another socket. A shell reply that
    // names the last of them waits for it (ReplyOrder); for anything else, what has arrived goes first (a
    // prompt's text before its input_request). Not for a reply that names its output: IOPub already received
    // may include what the kernel sent after the reply.
    std::string awaited = ReplyOrder::awaited_iopub(message);  // empty unless a shell reply
    if (iopub_ && awaited.empty())
        iopub_->flush_received();
    if (message.channel != Channel::shell) {
        const auto found = sessions_.find(session_id);
        if (found != sessions_.end())
            found->second->deliver_or_buffer(message);
        return;
    }
    hand_out_replies(reply_order_.reply_arrived({std::move(session_id), std::move(message)},
                                                std::move(awaited), std::chrono::steady_clock::now()));
}

void Kernel::hand_out_replies(const std::vector<ReplyOrder::Reply>& replies) {
    const std::size_t late = reply_order_.released_without_iopub();
    if (late != replies_released_late_) {
        logger_.warn("reply_before_its_output",
                     {{"kernel_id", id()},
                      {"detail", "the IOPub message published before a reply did not arrive in time"},
                      {"count", late - replies_released_late_}});
        replies_released_late_ = late;
    }
    for (auto& reply : replies) {
        const auto found = sessions_.find(reply.session_id);
        if (found != sessions_.end())
            found->second->deliver_or_buffer(reply.message);
    }
    const auto deadline = reply_order_.next_deadline();
    if (!deadline || reply_timer_armed_)
        return;
    reply_timer_armed_ = true;
    reply_timer_.expires_at(*deadline);
    reply_timer_.async_wait([weak = weak_from_this()](const boost::system::error_code& error) {
        auto self = weak.lock();
        if (!self || error)
            return;
        self->reply_timer_armed_ = false;
        self->hand_out_replies(self->reply_order_.expire(std::chrono::steady_clock::now()));
    });
}

void Kernel::broadcast(const JupyterMessage& message) {
    for (auto& [session_id, session] : sessions_)
        session->deliver_or_buffer(message);
}

void Kernel::notify_clients(const std::string& text) {
    broadcast(make_message(Channel::iopub, "stream", {{"name", "stderr"}, {"text", text}}, probe_session_));
}

void Kernel::broadcast_execution_state(const char* state) {
    broadcast(make_message(Channel::iopub, "status", {{"execution_state", state}}, probe_session_));
}

std::shared_ptr<ZmqChannel> Kernel::connect_dealer(int port, const std::string& identity, Channel channel,
                                                   const std::weak_ptr<KernelClientLink>& session) {
    std::weak_ptr<Kernel> weak = weak_from_this();
    return ZmqChannel::connect(
        io_, zmq_context_, zmq::socket_type::dealer, endpoints_.endpoint(port), identity,
        [weak, session, channel](std::vector<std::string>&& frames) {
            auto self = weak.lock();
            auto target = session.lock();
            if (!self || !target)
                return;
            try {
                JupyterMessage message = decode_wire(channel, std::move(frames), self->signer_);
                self->last_activity_ = std::chrono::system_clock::now();
                self->hand_addressed(target->session_id(), std::move(message));
            } catch (const MessageError& error) {
                self->logger_.warn("kernel_message_rejected",
                                   {{"kernel_id", self->id()}, {"error", error.what()}});
            }
        },
        socket_setup());
}

std::shared_ptr<KernelClientLink>& Kernel::slot_for(const std::string& session_id) {
    auto& slot = sessions_[session_id];
    if (!slot) {
        slot = std::make_shared<KernelClientLink>(session_id, *this);
        slot->shell_ = connect_dealer(KernelEndpoints::shell, session_id, Channel::shell, slot);
        slot->control_ = connect_dealer(KernelEndpoints::control, session_id, Channel::control, slot);
        slot->stdin_ = connect_dealer(KernelEndpoints::stdin_, session_id, Channel::stdin_, slot);
    }
    return slot;
}

std::shared_ptr<KernelClientLink> Kernel::attach(const std::string& session_id,
                                                 std::weak_ptr<KernelClient> client) {
    auto& slot = slot_for(session_id);
    // Buffered before the client is attached, so it gets what it missed first, then the live stream.
    hand_backlog(*slot);
    std::shared_ptr<KernelClient> previous = slot->attached_client_ ? slot->client_.lock() : nullptr;
    if (!slot->attached_client_)
        ++connections_;
    slot->attached_client_ = client.lock().get();
    // The new client is attached before the old one is told, so the old one's detach is recognised as stale.
    slot->attach(std::move(client));
    if (previous)
        previous->disconnect("replaced by a newer connection with the same session_id");
    return slot;
}

void Kernel::detach(const std::shared_ptr<KernelClientLink>& session, const KernelClient* client) {
    if (!session)
        return;
    if (session->attached_client_ != client || client == nullptr)
        return;
    session->client_.reset();
    session->attached_client_ = nullptr;
    session->detached_since_ = std::chrono::steady_clock::now();
    if (connections_ > 0)
        --connections_;
    // A session_id the client never chose cannot be resumed: drop its sockets right away.
    if (session->session_id().starts_with(KernelClientLink::anonymous_prefix))
        sessions_.erase(session->session_id());
    expire_detached_sessions();
}

void Kernel::expire_detached_sessions() {
    const auto now = std::chrono::steady_clock::now();
    const auto ttl = std::chrono::milliseconds(static_cast<long long>(config_.offline_session_ttl * 1000));
    std::vector<std::pair<std::chrono::steady_clock::time_point, std::string>> detached;
    for (auto it = sessions_.begin(); it != sessions_.end();) {
        if (!it->second->attached() && now - it->second->detached_since_ > ttl) {
            it = sessions_.erase(it);
            continue;
        }
        if (!it->second->attached())
            detached.emplace_back(it->second->detached_since_, it->first);
        ++it;
    }
    if (detached.size() > max_detached_sessions) {
        std::sort(detached.begin(), detached.end());
        for (std::size_t i = 0; i + max_detached_sessions < detached.size(); ++i)
            sessions_.erase(detached[i].second);
    }
}

}  // namespace cellblock::gateway
