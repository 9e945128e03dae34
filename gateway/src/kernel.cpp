#include "cellblock/gateway/kernel.hpp"

#include <sys/stat.h>

#include <boost/asio/post.hpp>
#include <csignal>
#include <fstream>

#include "cellblock/gateway/time_format.hpp"

namespace cellblock::gateway {

using nlohmann::json;
namespace fs = std::filesystem;

namespace {
constexpr std::size_t max_detached_sessions = 32;
constexpr auto kernel_info_retry = std::chrono::milliseconds(1000);
constexpr auto subscription_retry = std::chrono::milliseconds(20);
}  // namespace

std::string_view kernel_state_name(KernelState state) {
    switch (state) {
        case KernelState::starting:
            return "starting";
        case KernelState::idle:
            return "idle";
        case KernelState::busy:
            return "busy";
        case KernelState::restarting:
            return "restarting";
        case KernelState::dead:
            return "dead";
    }
    return "unknown";
}

// ----------------------------------------------------------------------------------------------
// KernelSession

KernelSession::KernelSession(std::string session_id, Kernel& kernel)
    : session_id_(std::move(session_id)), kernel_(kernel) {}

KernelSession::~KernelSession() {
    for (auto* channel : {&shell_, &control_, &stdin_})
        if (*channel)
            (*channel)->close();
}

void KernelSession::attach(std::weak_ptr<KernelClient> client) {
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

namespace {
std::size_t buffered_size(const JupyterMessage& message) {
    return message.header.size() + message.parent_header.size() + message.metadata.size() +
           message.content.size();
}
}  // namespace

void KernelSession::deliver_or_buffer(const JupyterMessage& message) {
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

void KernelSession::send(JupyterMessage&& message) {
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

Kernel::Kernel(boost::asio::io_context& io, zmq::context_t& zmq_context, const Logger& logger,
               const GatewayConfig& config, KernelLaunch launch)
    : io_(io),
      zmq_context_(zmq_context),
      logger_(logger),
      config_(config),
      launch_(std::move(launch)),
      signer_(random_hex(32)),  // 256-bit key, fresh per kernel
      probe_timer_(io),
      shutdown_timer_(io) {
    endpoints_.base = (launch_.runtime_dir / ("k-" + launch_.id.substr(0, 8) + random_hex(4))).string();
    connection_file_ = launch_.runtime_dir / ("kernel-" + launch_.id + ".json");
}

Kernel::~Kernel() {
    for (auto& [id, session] : sessions_)
        if (auto client = session->client_.lock())
            client->disconnect("kernel removed");
    sessions_.clear();
    for (auto* channel : {&iopub_, &probe_shell_, &probe_control_})
        if (*channel)
            (*channel)->close();
    process_.reset();
    std::error_code ignored;
    fs::remove(connection_file_, ignored);
    fs::remove(launch_.runtime_dir / ("kernel-" + id() + ".log"), ignored);
    for (int port = 1; port <= 5; ++port)
        fs::remove(endpoints_.base + "-" + std::to_string(port), ignored);
    if (!launch_.workspace_dir.empty())
        fs::remove_all(launch_.workspace_dir, ignored);
}

json Kernel::model() const {
    return {{"id", launch_.id},
            {"name", launch_.spec.name},
            {"last_activity", format_iso8601_utc(last_activity_)},
            {"execution_state", kernel_state_name(state_)},
            {"connections", connections_}};
}

void Kernel::write_connection_file() {
    const json connection = {{"transport", "ipc"},
                             {"ip", endpoints_.base},
                             {"shell_port", KernelEndpoints::shell},
                             {"iopub_port", KernelEndpoints::iopub},
                             {"stdin_port", KernelEndpoints::stdin_},
                             {"control_port", KernelEndpoints::control},
                             {"hb_port", KernelEndpoints::heartbeat},
                             {"key", signer_.key()},
                             {"signature_scheme", "hmac-sha256"},
                             {"kernel_name", launch_.spec.name}};
    // Created 0600 before anything is written: the key must never be readable by others, even briefly.
    const int fd = ::open(connection_file_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0)
        throw std::system_error(errno, std::generic_category(), "cannot create " + connection_file_.string());
    const std::string text = connection.dump(2);
    const ssize_t written = ::write(fd, text.data(), text.size());
    const int saved = errno;
    ::close(fd);
    if (written != static_cast<ssize_t>(text.size()))
        throw std::system_error(saved, std::generic_category(), "cannot write " + connection_file_.string());
}

void Kernel::connect_gateway_sockets() {
    std::weak_ptr<Kernel> weak = weak_from_this();
    iopub_ = ZmqChannel::connect(
        io_, zmq_context_, zmq::socket_type::sub, endpoints_.endpoint(KernelEndpoints::iopub), "",
        [weak](std::vector<std::string>&& frames) {
            auto self = weak.lock();
            if (!self)
                return;
            try {
                self->handle_iopub(decode_wire(Channel::iopub, std::move(frames), self->signer_));
            } catch (const MessageError& error) {
                self->logger_.warn("kernel_message_rejected",
                                   {{"kernel_id", self->id()}, {"error", error.what()}});
            }
        });
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
                                       probe_handler(Channel::shell));
    probe_control_ = ZmqChannel::connect(io_, zmq_context_, zmq::socket_type::dealer,
                                         endpoints_.endpoint(KernelEndpoints::control), probe_session_,
                                         probe_handler(Channel::control));
}

void Kernel::start(ReadyHandler on_ready) {
    ready_handlers_.push_back(std::move(on_ready));
    try {
        write_connection_file();
        connect_gateway_sockets();
        spawn();
    } catch (const std::exception& error) {
        state_ = KernelState::dead;
        finish_readiness(std::string("kernel failed to start: ") + error.what());
        return;
    }
    probe_readiness();
}

void Kernel::when_ready(ReadyHandler handler) {
    if (ready_) {
        handler(std::nullopt);
        return;
    }
    if (state_ == KernelState::dead) {
        handler(std::string("kernel is dead"));
        return;
    }
    ready_handlers_.push_back(std::move(handler));
}

void Kernel::begin_termination() {
    shutting_down_ = true;
    terminated_handler_ = nullptr;
    for (auto& [session_id, session] : sessions_)
        if (auto client = session->client_.lock())
            client->disconnect("gateway shutting down");
    if (process_)
        process_->signal_group(SIGTERM);
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

void Kernel::finish_termination(std::chrono::milliseconds grace) {
    if (process_)
        process_->wait_for_exit(grace);
    process_.reset();
}

void Kernel::spawn() {
    std::vector<std::string> argv = launch_.spec.argv();
    for (std::string& argument : argv) {
        for (auto [placeholder, value] :
             {std::pair<std::string, std::string>{"{connection_file}", connection_file_.string()},
              {"{resource_dir}", launch_.spec.directory.string()}}) {
            for (auto at = argument.find(placeholder); at != std::string::npos;
                 at = argument.find(placeholder))
                argument.replace(at, placeholder.size(), value);
        }
    }
    kernel_info_answered_ = false;
    iopub_seen_ = false;
    ready_ = false;
    launch_deadline_ =
        std::chrono::steady_clock::now() +
        std::chrono::milliseconds(static_cast<long long>(config_.kernel_launch_timeout * 1000));
    const std::string output_file = logger_.enabled(LogLevel::debug)
                                        ? std::string()
                                        : (launch_.runtime_dir / ("kernel-" + id() + ".log")).string();
    process_ = std::make_unique<ChildProcess>(io_, argv, launch_.environment, launch_.workspace_dir.string(),
                                              output_file);
    logger_.info("kernel_spawned",
                 {{"kernel_id", id()}, {"pid", process_->pid()}, {"spec", launch_.spec.name}});
    std::weak_ptr<Kernel> weak = weak_from_this();
    process_->on_exit([weak, this_io = &io_](ProcessExit exit) {
        // Deferred: the ChildProcess that reports the exit may be replaced by the handler.
        boost::asio::post(*this_io, [weak, exit] {
            if (auto self = weak.lock())
                self->on_process_exit(exit);
        });
    });
}

void Kernel::respawn(const char* what) {
    try {
        spawn();
        probe_readiness();
    } catch (const std::exception& error) {
        state_ = KernelState::dead;
        finish_readiness(std::string(what) + ": " + error.what());
    }
}

void Kernel::probe_readiness() {
    if (ready_ || shutting_down_)
        return;
    if (std::chrono::steady_clock::now() > launch_deadline_) {
        logger_.warn("kernel_start_timeout", {{"kernel_id", id()}});
        state_ = KernelState::dead;
        finish_readiness("kernel did not answer kernel_info_request within " +
                         std::to_string(static_cast<int>(config_.kernel_launch_timeout)) + " s");
        if (process_)
            process_->signal_group(SIGKILL);
        return;
    }
    // One kernel_info_request goes out at once (libzmq queues it until the kernel binds). Once it is
    // answered, a few more are sent until one of their IOPub status messages arrives: that proves our SUB
    // subscription reached the kernel, so no client misses the first outputs.
    probe_shell_->send(encode_wire(
        make_message(Channel::shell, "kernel_info_request", json::object(), probe_session_), signer_));
    probe_timer_.expires_after(kernel_info_answered_ ? std::chrono::milliseconds(subscription_retry)
                                                     : std::chrono::milliseconds(kernel_info_retry));
    probe_timer_.async_wait([weak = weak_from_this()](const boost::system::error_code& error) {
        if (error)
            return;
        if (auto self = weak.lock())
            self->probe_readiness();
    });
}

void Kernel::handle_probe_reply(JupyterMessage&& message) {
    if (message.msg_type != "kernel_info_reply" || ready_)
        return;
    if (!kernel_info_answered_) {
        kernel_info_answered_ = true;
        if (!iopub_seen_) {  // switch to the fast subscription retry
            probe_timer_.cancel();
            probe_timer_.expires_after(subscription_retry);
            probe_timer_.async_wait([weak = weak_from_this()](const boost::system::error_code& error) {
                if (error)
                    return;
                if (auto self = weak.lock())
                    self->probe_readiness();
            });
        }
    }
    if (iopub_seen_)
        finish_readiness(std::nullopt);
}

void Kernel::finish_readiness(std::optional<std::string> error) {
    probe_timer_.cancel();
    if (!error) {
        ready_ = true;
        if (state_ == KernelState::starting || state_ == KernelState::restarting)
            state_ = KernelState::idle;
        logger_.info("kernel_ready", {{"kernel_id", id()}});
    }
    auto handlers = std::move(ready_handlers_);
    ready_handlers_.clear();
    for (auto& handler : handlers)
        if (handler)
            handler(error);
}

void Kernel::handle_iopub(JupyterMessage&& message) {
    if (!iopub_seen_) {
        iopub_seen_ = true;
        if (kernel_info_answered_ && !ready_)
            finish_readiness(std::nullopt);
    }
    // The gateway's own probe traffic (kernel_info during startup) is neither shown to clients nor counted as
    // activity or execution state.
    if (message.parent_header.find(probe_session_) != std::string::npos)
        return;
    last_activity_ = std::chrono::system_clock::now();
    if (message.msg_type == "status") {
        json content = json::parse(message.content, nullptr, false);
        const std::string execution_state = content.is_object() ? content.value("execution_state", "") : "";
        // While a restart is pending the old process's last status messages must not hide "restarting".
        if (restart_requested_ || state_ == KernelState::dead) {
        } else if (execution_state == "busy") {
            state_ = KernelState::busy;
        } else if (execution_state == "idle") {
            state_ = KernelState::idle;
        }
    }
    broadcast(message);
}

void Kernel::broadcast(const JupyterMessage& message) {
    for (auto& [session_id, session] : sessions_)
        session->deliver_or_buffer(message);
}

void Kernel::notify_clients(const std::string& text) {
    broadcast(make_message(Channel::iopub, "stream", {{"name", "stderr"}, {"text", text}}, probe_session_));
}

void Kernel::on_process_exit(ProcessExit exit) {
    if (shutting_down_) {
        shutdown_timer_.cancel();
        if (terminated_handler_)
            terminated_handler_(id());
        return;
    }
    const bool was_ready = ready_;
    ready_ = false;
    if (restart_requested_) {
        // A REST restart: the old process is gone, start the new one. The kill timer armed for the old
        // process must not fire on its replacement.
        shutdown_timer_.cancel();
        restart_requested_ = false;
        respawn("restart failed");
        return;
    }
    if (!ready_handlers_.empty()) {
        // Died before it ever became ready, or during a requested restart.
        logger_.warn("kernel_died_during_start", {{"kernel_id", id()}, {"exit", exit.describe()}});
        state_ = KernelState::dead;
        broadcast(make_message(Channel::iopub, "status", {{"execution_state", "dead"}}, probe_session_));
        finish_readiness("kernel " + exit.describe() + " before it answered kernel_info_request");
        return;
    }
    logger_.warn("kernel_died", {{"kernel_id", id()}, {"exit", exit.describe()}, {"was_ready", was_ready}});
    if (config_.autorestart && restarts_ < config_.restart_limit) {
        ++restarts_;
        state_ = KernelState::restarting;
        broadcast(
            make_message(Channel::iopub, "status", {{"execution_state", "restarting"}}, probe_session_));
        ready_handlers_.push_back([weak = weak_from_this()](std::optional<std::string> error) {
            auto self = weak.lock();
            if (!self)
                return;
            if (!error) {
                // The probe's own status traffic is hidden, so say explicitly that the revived kernel is
                // usable.
                self->broadcast(make_message(Channel::iopub, "status", {{"execution_state", "idle"}},
                                             self->probe_session_));
                return;
            }
            self->state_ = KernelState::dead;
            self->broadcast(
                make_message(Channel::iopub, "status", {{"execution_state", "dead"}}, self->probe_session_));
        });
        respawn("automatic restart failed");
        return;
    }
    state_ = KernelState::dead;
    broadcast(make_message(Channel::iopub, "status", {{"execution_state", "dead"}}, probe_session_));
}

void Kernel::interrupt() {
    touch();
    if (launch_.spec.interrupt_mode() == "message") {
        probe_control_->send(encode_wire(
            make_message(Channel::control, "interrupt_request", json::object(), probe_session_), signer_));
    } else if (process_) {
        process_->signal_group(SIGINT);
    }
}

void Kernel::restart(ReadyHandler on_ready) {
    touch();
    restarts_ = 0;
    ready_handlers_.push_back(std::move(on_ready));
    state_ = KernelState::restarting;
    ready_ = false;
    if (!process_ || !process_->running()) {
        respawn("restart failed");
        return;
    }
    restart_requested_ = true;
    probe_control_->send(encode_wire(
        make_message(Channel::control, "shutdown_request", {{"restart", true}}, probe_session_), signer_));
    // A kernel that ignores the request is killed; the exit handler then spawns the replacement.
    shutdown_timer_.expires_after(std::chrono::milliseconds(1500));
    shutdown_timer_.async_wait([weak = weak_from_this()](const boost::system::error_code& error) {
        if (error)
            return;
        if (auto self = weak.lock())
            if (self->process_)
                self->process_->signal_group(SIGKILL);
    });
}

void Kernel::shutdown(const std::string& reason) {
    if (shutting_down_)
        return;
    shutting_down_ = true;
    probe_timer_.cancel();
    finish_readiness("kernel was shut down");
    for (auto& [session_id, session] : sessions_)
        if (auto client = session->client_.lock())
            client->disconnect(reason);
    sessions_.clear();
    connections_ = 0;
    state_ = KernelState::dead;
    if (!process_ || !process_->running()) {
        if (terminated_handler_)
            terminated_handler_(id());
        return;
    }
    probe_control_->send(encode_wire(
        make_message(Channel::control, "shutdown_request", {{"restart", false}}, probe_session_), signer_));
    // Escalate: shutdown_request, then SIGTERM after 1 s, then SIGKILL after 2 s. The timers hold a strong
    // reference so the process is reaped even after the manager forgot the kernel.
    shutdown_timer_.expires_after(std::chrono::seconds(1));
    shutdown_timer_.async_wait([self = shared_from_this()](const boost::system::error_code& error) {
        if (error || !self->process_ || !self->process_->running())
            return;
        self->process_->signal_group(SIGTERM);
        self->shutdown_timer_.expires_after(std::chrono::seconds(1));
        self->shutdown_timer_.async_wait([self](const boost::system::error_code& second_error) {
            if (second_error)
                return;
            self->process_.reset();  // SIGKILL and reap
            if (self->terminated_handler_)
                self->terminated_handler_(self->id());
        });
    });
}

std::shared_ptr<ZmqChannel> Kernel::connect_dealer(int port, const std::string& identity, Channel channel,
                                                   std::weak_ptr<KernelSession> session) {
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
                // The kernel publishes outputs before it replies, but they travel on
                // another socket: hand out IOPub that already arrived first, so clients
                // that stop at execute_reply (OpenHands) do not lose the tail.
                if (self->iopub_)
                    self->iopub_->flush_received();
                target->deliver_or_buffer(message);
            } catch (const MessageError& error) {
                self->logger_.warn("kernel_message_rejected",
                                   {{"kernel_id", self->id()}, {"error", error.what()}});
            }
        });
}

std::shared_ptr<KernelSession> Kernel::attach(const std::string& session_id,
                                              std::weak_ptr<KernelClient> client) {
    auto& slot = sessions_[session_id];
    if (!slot) {
        slot = std::make_shared<KernelSession>(session_id, *this);
        slot->shell_ = connect_dealer(KernelEndpoints::shell, session_id, Channel::shell, slot);
        slot->control_ = connect_dealer(KernelEndpoints::control, session_id, Channel::control, slot);
        slot->stdin_ = connect_dealer(KernelEndpoints::stdin_, session_id, Channel::stdin_, slot);
    }
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

void Kernel::detach(const std::shared_ptr<KernelSession>& session, const KernelClient* client) {
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
    if (session->session_id().starts_with(KernelSession::anonymous_prefix))
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
