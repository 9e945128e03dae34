#include "cellblock/gateway/kernels/kernel.hpp"

#include <sys/stat.h>

#include <boost/asio/post.hpp>
#include <csignal>
#include <fstream>

#include "cellblock/gateway/common/crypto.hpp"
#include "cellblock/gateway/common/time_format.hpp"
#include "cellblock/gateway/observability/metrics.hpp"
#include "cellblock/sandbox/sandbox.hpp"

namespace cellblock::gateway {

using nlohmann::json;
namespace fs = std::filesystem;

namespace {
constexpr std::size_t max_detached_sessions = 32;
constexpr auto kernel_info_retry = std::chrono::milliseconds(1000);
constexpr auto subscription_retry = std::chrono::milliseconds(20);
// How long a re-adopted kernel gets to send its record before it is served without one (a kernel that is not
// cellblock-kernel never answers cellblock_replay_request).
constexpr auto replay_answer_timeout = std::chrono::seconds(5);
constexpr std::size_t max_live_during_adoption = 10000;
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

void remove_workspace(const fs::path& directory, const Logger& logger) {
    try {
        sandbox::remove_tree(directory);
    } catch (const std::exception& error) {
        logger.warn("workspace_remove_failed", {{"path", directory.string()}, {"error", error.what()}});
    }
}

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

namespace {
std::size_t buffered_size(const JupyterMessage& message) {
    return message.header.size() + message.parent_header.size() + message.metadata.size() +
           message.content.size();
}
}  // namespace

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

Kernel::Kernel(boost::asio::io_context& io, zmq::context_t& zmq_context, const Logger& logger,
               const GatewayConfig& config, KernelLaunch launch)
    : io_(io),
      zmq_context_(zmq_context),
      logger_(logger),
      config_(config),
      launch_(std::move(launch)),
      signer_(launch_.key.empty() ? random_hex(32) : launch_.key),  // 256-bit key, fresh per kernel
      probe_timer_(io),
      shutdown_timer_(io),
      reply_timer_(io) {
    endpoints_.base = launch_.endpoint_base.empty()
                          ? (launch_.runtime_dir / ("k-" + launch_.id.substr(0, 8) + random_hex(4))).string()
                          : launch_.endpoint_base;
    connection_file_ = launch_.runtime_dir / ("kernel-" + launch_.id + ".json");
    if (launch_.created.empty())
        launch_.created = format_iso8601_utc(std::chrono::system_clock::now());
    last_iopub_id_ = launch_.last_iopub_id;
    if (!launch_.provisioner)
        throw std::invalid_argument("kernel " + launch_.id + " has no provisioner");
    if (reports_connection()) {
        // This gateway's CurveZMQ client keys towards this kernel (the kernel authenticates messages by HMAC;
        // Curve makes the link unreadable on the wire).
        std::array<char, 41> public_key{}, secret_key{};
        if (zmq_curve_keypair(public_key.data(), secret_key.data()) != 0)
            throw std::runtime_error(std::string("zmq_curve_keypair: ") + zmq_strerror(zmq_errno()));
        curve_client_public_ = public_key.data();
        curve_client_secret_ = secret_key.data();
    }
}

Kernel::~Kernel() {
    if (lifecycle_.phase() == KernelPhase::released)
        return;  // the process and its files belong to the next gateway
    for (auto& [id, session] : sessions_)
        if (auto client = session->client_.lock())
            client->disconnect("kernel removed");
    sessions_.clear();
    for (auto* channel : {&iopub_, &probe_shell_, &probe_control_})
        if (*channel)
            (*channel)->close();
    process_.reset();
    clean_up_after_exit();
}

void Kernel::clean_up_after_exit() {
    if (cleaned_up_ || lifecycle_.phase() == KernelPhase::released)
        return;
    cleaned_up_ = true;
    for (auto* channel : {&iopub_, &probe_shell_, &probe_control_})
        if (*channel)
            (*channel)->close();
    std::error_code ignored;
    fs::remove(connection_file_, ignored);
    fs::remove(launch_.runtime_dir / ("kernel-" + id() + ".log"), ignored);
    for (int port = 1; port <= 5; ++port)
        fs::remove(endpoints_.base + "-" + std::to_string(port), ignored);
    if (!launch_.workspace_dir.empty())
        remove_workspace(launch_.workspace_dir, logger_);
}

json Kernel::model() const {
    json model = {{"id", launch_.id},
                  {"name", launch_.spec.name},
                  {"last_activity", format_iso8601_utc(last_activity_)},
                  {"execution_state", kernel_state_name(state())},
                  {"connections", connections_}};
    if (!tenant_.empty())
        model["tenant"] = tenant_;
    // Where a kernel not local to the gateway runs, and while it starts, what it waits for (a pending job's
    // reason from Slurm).
    if (reports_connection() && process_) {
        model["provisioner"] = process_->describe();
        if (lifecycle_.launching())
            model["provisioner"]["waiting_for"] = process_->waiting_for();
    }
    return model;
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

void Kernel::start(ReadyHandler on_ready) {
    ready_handlers_.push_back(std::move(on_ready));
    try {
        if (!reports_connection()) {
            write_connection_file();
            connect_gateway_sockets();
        }
        spawn();
    } catch (const std::exception& error) {
        lifecycle_.launch_failed();
        report_launch_failure(GatewayMetrics::cause_spawn_failed);
        finish_readiness(std::string("kernel failed to start: ") + error.what());
        return;
    }
    if (reports_connection())
        await_report();
    else
        probe_readiness();
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

void Kernel::await_report() {
    probe_timer_.expires_at(launch_deadline_);
    probe_timer_.async_wait([weak = weak_from_this()](const boost::system::error_code& error) {
        if (error)
            return;
        auto self = weak.lock();
        if (!self || !self->lifecycle_.launching())
            return;
        const std::string waiting = self->process_ ? self->process_->waiting_for() : std::string();
        self->logger_.warn("kernel_start_timeout", {{"kernel_id", self->id()}, {"waiting_for", waiting}});
        self->lifecycle_.launch_failed();
        self->report_launch_failure(GatewayMetrics::cause_start_timeout);
        if (self->process_)
            self->process_->signal(SIGKILL);
        self->finish_readiness("the kernel did not report its connection within " +
                               std::to_string(static_cast<int>(self->config_.kernel_launch_timeout)) + " s" +
                               (waiting.empty() ? std::string() : ": " + waiting));
    });
}

void Kernel::on_connected(std::uint64_t generation, std::variant<ReportedConnection, std::string> result) {
    if (generation != launch_generation_ || !lifecycle_.launching())
        return;
    if (auto* failure = std::get_if<std::string>(&result)) {
        probe_timer_.cancel();
        lifecycle_.launch_failed();
        report_launch_failure(GatewayMetrics::cause_spawn_failed);
        if (process_)
            process_->signal(SIGKILL);
        finish_readiness(*failure);
        return;
    }
    const ReportedConnection& connection = std::get<ReportedConnection>(result);
    endpoints_.tcp_ip = connection.ip;
    endpoints_.tcp_ports = {
        0, connection.shell, connection.iopub, connection.stdin_, connection.control, connection.heartbeat};
    endpoints_.curve_server_key = connection.curve_public_key;
    signer_ = HmacSigner(connection.key);
    logger_.info("kernel_reported", {{"kernel_id", id()},
                                     {"host", connection.host},
                                     {"ip", connection.ip},
                                     {"shell_port", connection.shell}});
    // A restart reached a new process (new ports, key): every socket to the old one is replaced.
    for (auto* channel : {&iopub_, &probe_shell_, &probe_control_})
        if (*channel)
            (*channel)->close();
    try {
        connect_gateway_sockets();
        for (auto& [session_id, session] : sessions_) {
            for (auto* channel : {&session->shell_, &session->control_, &session->stdin_})
                if (*channel)
                    (*channel)->close();
            session->shell_ = connect_dealer(KernelEndpoints::shell, session_id, Channel::shell, session);
            session->control_ =
                connect_dealer(KernelEndpoints::control, session_id, Channel::control, session);
            session->stdin_ = connect_dealer(KernelEndpoints::stdin_, session_id, Channel::stdin_, session);
        }
    } catch (const std::exception& error) {
        probe_timer_.cancel();
        lifecycle_.launch_failed();
        report_launch_failure(GatewayMetrics::cause_spawn_failed);
        if (process_)
            process_->signal(SIGKILL);
        finish_readiness(std::string("cannot connect to the reported kernel: ") + error.what());
        return;
    }
    if (spawned_handler_)
        spawned_handler_(*this);
    probe_timer_.cancel();
    probe_readiness();
}

void Kernel::when_ready(ReadyHandler handler) {
    if (lifecycle_.ready()) {
        handler(std::nullopt);
        return;
    }
    if (state() == KernelState::dead) {
        handler(std::string("kernel is dead"));
        return;
    }
    ready_handlers_.push_back(std::move(handler));
}

void Kernel::begin_termination() {
    lifecycle_.shutdown();
    terminated_handler_ = nullptr;
    for (auto& [session_id, session] : sessions_)
        if (auto client = session->client_.lock())
            client->disconnect("gateway shutting down");
    if (process_)
        process_->signal(SIGTERM);
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
    clean_up_after_exit();
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
    busy_ = false;
    launch_deadline_ =
        std::chrono::steady_clock::now() +
        std::chrono::milliseconds(static_cast<long long>(config_.kernel_launch_timeout * 1000));
    const std::string output_file = logger_.enabled(LogLevel::debug)
                                        ? std::string()
                                        : (launch_.runtime_dir / ("kernel-" + id() + ".log")).string();
    InstanceLaunch instance{
        id(), argv, launch_.environment, launch_.workspace_dir, output_file, launch_.runtime_dir};
    const std::uint64_t generation = ++launch_generation_;
    process_.reset();
    process_ =
        launch_.provisioner->launch(instance, [weak = weak_from_this(), this_io = &io_, generation](
                                                  std::variant<ReportedConnection, std::string> result) {
            boost::asio::post(*this_io, [weak, generation, result = std::move(result)]() mutable {
                if (auto self = weak.lock())
                    self->on_connected(generation, std::move(result));
            });
        });
    logger_.info("kernel_spawned",
                 {{"kernel_id", id()}, {"instance", process_->describe()}, {"spec", launch_.spec.name}});
    process_identity_ = process_->process_identity();
    watch_process();
    // A reporting kernel is recorded once it reported (on_connected): only then is it reachable.
    if (spawned_handler_ && !reports_connection())
        spawned_handler_(*this);
}

void Kernel::watch_process() {
    std::weak_ptr<Kernel> weak = weak_from_this();
    process_->on_exit([weak, this_io = &io_](const InstanceExit& exit) {
        // Deferred: the ChildProcess that reports the exit may be replaced by the handler.
        boost::asio::post(*this_io, [weak, exit] {
            if (auto self = weak.lock())
                self->on_process_exit(exit);
        });
    });
}

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

void Kernel::respawn(const char* what) {
    try {
        spawn();
        if (reports_connection())
            await_report();
        else
            probe_readiness();
    } catch (const std::exception& error) {
        lifecycle_.launch_failed();
        report_launch_failure(GatewayMetrics::cause_spawn_failed);
        finish_readiness(std::string(what) + ": " + error.what());
    }
}

void Kernel::probe_readiness() {
    if (!lifecycle_.launching())
        return;
    if (std::chrono::steady_clock::now() > launch_deadline_) {
        logger_.warn("kernel_start_timeout", {{"kernel_id", id()}});
        lifecycle_.launch_failed();
        report_launch_failure(GatewayMetrics::cause_start_timeout);
        finish_readiness("kernel did not answer kernel_info_request within " +
                         std::to_string(static_cast<int>(config_.kernel_launch_timeout)) + " s");
        if (process_)
            process_->signal(SIGKILL);
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
    if (message.msg_type == "cellblock_replay_reply" &&
        message.parent_header.find(replay_request_id_) != std::string::npos && !replay_request_id_.empty()) {
        const json content = json::parse(message.content, nullptr, false);
        handle_replay_reply(content.is_object() ? content : json::object(), true);
        return;
    }
    if (message.msg_type != "kernel_info_reply" || !lifecycle_.launching())
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
        on_probe_complete();
}

void Kernel::finish_readiness(const std::optional<std::string>& error) {
    probe_timer_.cancel();
    if (!error && lifecycle_.became_ready())
        logger_.info("kernel_ready", {{"kernel_id", id()}});
    auto handlers = std::move(ready_handlers_);
    ready_handlers_.clear();
    for (auto& handler : handlers)
        if (handler)
            handler(error);
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

void Kernel::on_process_exit(InstanceExit exit) {
    const ProcessExit facts{exit.ended_externally, !ready_handlers_.empty()};
    const bool was_ready = lifecycle_.ready();
    switch (lifecycle_.process_exited(facts, [this] {
        return config_.autorestart && restarts_ < config_.restart_limit &&
               (!may_restart_ || may_restart_(*this));
    })) {
        case ExitAction::ignore:
            return;
        case ExitAction::finish_stop:
            shutdown_timer_.cancel();
            clean_up_after_exit();
            if (terminated_handler_)
                terminated_handler_(id());
            return;
        case ExitAction::respawn:
            // The kill timer armed for the old process must not fire on its replacement.
            shutdown_timer_.cancel();
            respawn("restart failed");
            return;
        case ExitAction::fail_start:
            logger_.warn("kernel_died_during_start", {{"kernel_id", id()}, {"exit", exit.cause}});
            report_launch_failure(GatewayMetrics::cause_exited_during_start);
            broadcast_execution_state("dead");
            finish_readiness(exit.ended_externally
                                 ? exit.cause
                                 : "kernel " + exit.cause + " before it answered kernel_info_request");
            return;
        case ExitAction::end_externally:
            // Clients are told why; it is not started again behind the scheduler's or operator's back.
            logger_.warn("kernel_died",
                         {{"kernel_id", id()}, {"exit", exit.cause}, {"was_ready", was_ready}});
            notify_clients("[cellblock-gateway] the kernel died: " + exit.cause + "\n");
            broadcast_execution_state("dead");
            return;
        case ExitAction::auto_restart:
            logger_.warn("kernel_died",
                         {{"kernel_id", id()}, {"exit", exit.cause}, {"was_ready", was_ready}});
            auto_restart();
            return;
        case ExitAction::die:
            logger_.warn("kernel_died",
                         {{"kernel_id", id()}, {"exit", exit.cause}, {"was_ready", was_ready}});
            broadcast_execution_state("dead");
            return;
    }
}

void Kernel::auto_restart() {
    ++restarts_;
    broadcast_execution_state("restarting");
    ready_handlers_.push_back([weak = weak_from_this()](const std::optional<std::string>& error) {
        // The probe's own status traffic is hidden, so say explicitly whether the revived kernel is usable.
        if (auto self = weak.lock())
            self->broadcast_execution_state(error ? "dead" : "idle");
    });
    respawn("automatic restart failed");
}

void Kernel::broadcast_execution_state(const char* state) {
    broadcast(make_message(Channel::iopub, "status", {{"execution_state", state}}, probe_session_));
}

void Kernel::interrupt() {
    touch();
    // A reporting kernel (slurm) is interrupted by message: its kernel server acts on interrupt_request, and
    // no scheduler round trip is needed.
    if (launch_.spec.interrupt_mode() == "message" || reports_connection()) {
        if (probe_control_)
            probe_control_->send(encode_wire(
                make_message(Channel::control, "interrupt_request", json::object(), probe_session_),
                signer_));
    } else if (process_) {
        process_->signal(SIGINT);
    }
}

void Kernel::restart(ReadyHandler on_ready) {
    touch();
    const bool running = process_ && process_->running();
    if (!lifecycle_.restart(running)) {
        on_ready(std::string("kernel is shutting down"));
        return;
    }
    restarts_ = 0;
    ready_handlers_.push_back(std::move(on_ready));
    if (!running) {
        respawn("restart failed");
        return;
    }
    if (probe_control_)
        probe_control_->send(encode_wire(
            make_message(Channel::control, "shutdown_request", {{"restart", true}}, probe_session_),
            signer_));
    // A kernel that ignores the request is killed; the exit handler then spawns the replacement.
    shutdown_timer_.expires_after(std::chrono::milliseconds(1500));
    shutdown_timer_.async_wait([weak = weak_from_this()](const boost::system::error_code& error) {
        if (error)
            return;
        if (auto self = weak.lock())
            if (self->process_)
                self->process_->signal(SIGKILL);
    });
}

void Kernel::shutdown(const std::string& reason) {
    if (!lifecycle_.shutdown())
        return;
    probe_timer_.cancel();
    finish_readiness("kernel was shut down");
    for (auto& [session_id, session] : sessions_) {
        if (auto client = session->client_.lock())
            client->disconnect(reason);
        session->close();
    }
    sessions_.clear();
    connections_ = 0;
    if (!process_ || !process_->running()) {
        on_process_exit(InstanceExit{});  // stopping -> stopped: the clean-up the exit would have done
        return;
    }
    // A kernel that never reported (a pending Slurm job) has no control socket yet: signals only.
    if (probe_control_)
        probe_control_->send(encode_wire(
            make_message(Channel::control, "shutdown_request", {{"restart", false}}, probe_session_),
            signer_));
    // Escalate: shutdown_request, then SIGTERM after 1 s, then SIGKILL after 2 s. The timers hold a strong
    // reference so the process is reaped even after the manager forgot the kernel.
    shutdown_timer_.expires_after(std::chrono::seconds(1));
    shutdown_timer_.async_wait([self = shared_from_this()](const boost::system::error_code& error) {
        if (error || !self->process_ || !self->process_->running())
            return;
        self->process_->signal(SIGTERM);
        self->shutdown_timer_.expires_after(std::chrono::seconds(1));
        self->shutdown_timer_.async_wait([self](const boost::system::error_code& second_error) {
            if (second_error)
                return;
            self->process_.reset();  // SIGKILL and reap
            self->clean_up_after_exit();
            if (self->terminated_handler_)
                self->terminated_handler_(self->id());
        });
    });
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
