// One kernel (kernels/kernel.hpp): construction, launch and readiness, restart, shutdown, process exit and
// clean-up. Client links and IOPub fan-out are in kernel_clients.cpp, re-adoption after a gateway restart in
// kernel_replay.cpp.
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
constexpr auto kernel_info_retry = std::chrono::milliseconds(1000);
constexpr auto subscription_retry = std::chrono::milliseconds(20);
}  // namespace

void remove_workspace(const fs::path& directory, const Logger& logger) {
    try {
        sandbox::remove_tree(directory);
    } catch (const std::exception& error) {
        logger.warn("workspace_remove_failed", {{"path", directory.string()}, {"error", error.what()}});
    }
}

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
    process_adopted_ = false;
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
        // Another gateway's kernel, attached from the store, is that gateway's to end (a slow answer here is
        // no proof it is stuck): the manager lets it go instead. A process spawned here is this gateway's.
        if (process_ && !(launch_.owned_elsewhere && process_adopted_))
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

void Kernel::on_process_exit(InstanceExit exit) {
    const ProcessExit facts{exit.ended_externally, !ready_handlers_.empty()};
    const bool was_ready = lifecycle_.ready();
    const auto action = lifecycle_.process_exited(
        facts, [this] { return config_.autorestart && restarts_ < config_.restart_limit; },
        static_cast<bool>(may_restart_));
    const bool died_serving = action == ExitAction::auto_restart || action == ExitAction::die ||
                              action == ExitAction::ask || action == ExitAction::end_externally;
    if (died_serving)
        logger_.warn("kernel_died", {{"kernel_id", id()}, {"exit", exit.cause}, {"was_ready", was_ready}});
    act_on_exit(action, exit);
}

void Kernel::act_on_exit(ExitAction action, const InstanceExit& exit) {
    switch (action) {
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
            notify_clients("[cellblock-gateway] the kernel died: " + exit.cause + "\n");
            broadcast_execution_state("dead");
            return;
        case ExitAction::auto_restart:
            auto_restart();
            return;
        case ExitAction::die:
            broadcast_execution_state("dead");
            // Whoever waited while the store was asked (shown restarting) learns it will not come back.
            if (!ready_handlers_.empty())
                finish_readiness("the kernel died: " + exit.cause);
            return;
        case ExitAction::ask:
            // The answer comes later (the store is read off the io thread); until then the kernel is
            // `deciding`, shown as restarting, and a shutdown or restart meanwhile wins.
            may_restart_(*this, [weak = weak_from_this(), exit](bool restart) {
                if (auto self = weak.lock())
                    self->act_on_exit(self->lifecycle_.restart_decided(restart), exit);
            });
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

void Kernel::disconnect_clients(const std::string& reason) {
    for (auto& [session_id, session] : sessions_) {
        if (auto client = session->client_.lock())
            client->disconnect(reason);
        session->close();
    }
    sessions_.clear();
    connections_ = 0;
}

void Kernel::shutdown(const std::string& reason) {
    if (!lifecycle_.shutdown())
        return;
    probe_timer_.cancel();
    finish_readiness("kernel was shut down");
    disconnect_clients(reason);
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

}  // namespace cellblock::gateway
