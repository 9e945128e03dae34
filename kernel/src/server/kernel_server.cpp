#include "server/kernel_server.hpp"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <ctime>
#include <iterator>
#include <stdexcept>
#include <xeus/xguid.hpp>
#include <xeus/xmiddleware.hpp>
#include <zmq_addon.hpp>

#include "common/json_text.hpp"
#include "common/logging.hpp"
#include "launch/heap_policy.hpp"
#include "server/kernel_server_sockets.hpp"
#include "server/protocol_fixups.hpp"

namespace cellblock::kernel {
namespace {

constexpr std::size_t replay_capacity = 16384;
constexpr int linger_ms = 1000;

}  // namespace

KernelServer::KernelServer(const ConnectionInfo& connection, ServerActions actions, ServerOptions options)
    : signer_(connection.signature_scheme, connection.key),
      verifier_(signer_, replay_capacity),
      actions_(std::move(actions)),
      session_id_(xeus::new_xguid().c_str()),
      connection_(connection),
      sockets_(std::make_unique<Sockets>()),
      refusals_(InboundVerdict::kinds, 0),
      record_(options.record),
      lease_duration_(options.lease),
      workspace_(options.workspace),
      wake_(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)),
      interpreter_wake_(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {
    if (!wake_ || !interpreter_wake_) {
        throw std::runtime_error(std::string("kernel server: eventfd: ") + std::strerror(errno));
    }
    auto& s = *sockets_;
    const std::array<int, 3> ports = {connection.shell_port, connection.control_port, connection.stdin_port};
    const auto curve_server = [&options](zmq::socket_t& socket) {
        if (!options.curve_secret_key) {
            return;
        }
        socket.set(zmq::sockopt::curve_server, true);
        socket.set(zmq::sockopt::curve_secretkey, *options.curve_secret_key);
    };
    for (std::size_t i = 0; i < 3; ++i) {
        curve_server(s.routers[i]);
        s.routers[i].set(zmq::sockopt::linger, linger_ms);
        // A client that reconnects under its old identity (a restarted gateway, whose predecessor's
        // connection the kernel may not have seen close yet) takes the identity over instead of being
        // silently dropped.
        s.routers[i].set(zmq::sockopt::router_handover, true);
        s.routers[i].bind(connection.endpoint(ports[i]));
    }
    curve_server(s.publisher);
    curve_server(s.heartbeat);
    s.publisher.set(zmq::sockopt::linger, linger_ms);
    s.publisher.bind(connection.endpoint(connection.iopub_port));
    s.heartbeat.set(zmq::sockopt::linger, 0);
    s.heartbeat.bind(connection.endpoint(connection.hb_port));
}

void signal_eventfd(int fd) {
    const std::uint64_t one = 1;
    // Fails only when the counter is saturated, and then the fd is readable anyway.
    if (::write(fd, &one, sizeof(one)) != sizeof(one) && errno != EAGAIN) {
        log_event(LogLevel::error, "kernel_server_wake_failed", {{"error", std::strerror(errno)}});
    }
}

void drain_eventfd(int fd) {
    std::uint64_t count = 0;
    if (::read(fd, &count, sizeof(count)) < 0 && errno != EAGAIN) {
        log_event(LogLevel::error, "kernel_server_wake_failed", {{"error", std::strerror(errno)}});
    }
}

KernelServer::~KernelServer() {
    shell_closed_ = true;
    signal_eventfd(interpreter_wake_.get());
    {
        std::lock_guard lock(input_mutex_);
        stopping_ = true;
    }
    input_answered_.notify_all();
    if (interpreter_.joinable()) {
        interpreter_.join();
    }
    sockets_->close_all();
}

BoundPorts KernelServer::bound_ports() const {
    // "tcp://127.0.0.1:5555"; an ipc endpoint has no port (0).
    const auto port_of = [](const zmq::socket_t& socket) {
        const std::string endpoint = socket.get(zmq::sockopt::last_endpoint);
        const auto colon = endpoint.rfind(':');
        const std::string digits = colon == std::string::npos ? std::string() : endpoint.substr(colon + 1);
        if (digits.empty() || digits.size() > 5 ||
            !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) {
            return 0;
        }
        return std::stoi(digits);
    };
    const auto& s = *sockets_;
    return {port_of(s.routers[0]), port_of(s.routers[1]), port_of(s.routers[2]), port_of(s.publisher),
            port_of(s.heartbeat)};
}

// ---- any thread -------------------------------------------------------------------------------------------

bool KernelServer::on_io_thread() const noexcept {
    return io_thread_.load() == std::this_thread::get_id();
}

void KernelServer::wake_io_thread() {
    signal_eventfd(wake_.get());
}

void KernelServer::enqueue(Outbound outbound) {
    bool was_empty = false;
    {
        std::lock_guard lock(outbound_mutex_);
        was_empty = outbound_.empty();
        outbound_.push_back(std::move(outbound));
    }
    if (was_empty) {
        wake_io_thread();
    }
}

void KernelServer::send_now(Outbound outbound) {
    std::lock_guard lock(server_mutex_);
    // What other threads queued went out first, as it would have from the I/O thread.
    send_queued();
    if (!sockets_->open || stopping_) {
        return;  // as send_queued: a closed or leaving server sends nothing more
    }
    try {
        send_outbound(outbound);
    } catch (const std::exception& error) {
        log_event(LogLevel::error, "kernel_server_error", {{"error", error.what()}});
    }
}

void KernelServer::keep_inbound_announced(int channel_index) {
    if (channel_index == shell) {
        return;  // the interpreter thread, the only one that uses it, reads it before every wait
    }
    const std::size_t polled = channel_index == control ? polled_control : polled_stdin;
    if (on_io_thread()) {
        unread_[polled] = true;  // the loop reads the socket again before it waits
        return;
    }
    // ZMQ_EVENTS takes in pending commands and says whether a message is readable. If none is, a message
    // that arrives later announces itself on the socket's fd again.
    if ((sockets_->routers[channel_index].get(zmq::sockopt::events) & ZMQ_POLLIN) != 0 && !unread_[polled]) {
        unread_[polled] = true;
        wake_io_thread();
    }
}

void KernelServer::send_shell_impl(xeus::xmessage message) {
    Outbound outbound;
    outbound.kind = Outbound::Kind::shell;
    outbound.message = std::move(message);
    if (on_io_thread()) {
        send_outbound(outbound);
    } else {
        send_now(std::move(outbound));
    }
}

void KernelServer::send_control_impl(xeus::xmessage message) {
    Outbound outbound;
    outbound.kind = Outbound::Kind::control;
    outbound.message = std::move(message);
    if (on_io_thread()) {
        send_outbound(outbound);
    } else {
        send_now(std::move(outbound));
    }
}

void KernelServer::publish_impl(xeus::xpub_message message, xeus::channel) {
    Outbound outbound;
    outbound.kind = Outbound::Kind::iopub;
    outbound.publish = std::move(message);
    if (on_io_thread()) {
        send_outbound(outbound);
    } else {
        send_now(std::move(outbound));
    }
}

void KernelServer::publish_kernel_message(std::string msg_type, nlohmann::json content) {
    Outbound outbound;
    outbound.kind = Outbound::Kind::kernel_iopub;
    outbound.msg_type = std::move(msg_type);
    outbound.content = std::move(content);
    enqueue(std::move(outbound));
}

// Interpreter thread (xeus::blocking_input_request): blocks until the prompt is answered.
void KernelServer::send_stdin_impl(xeus::xmessage message) {
    std::uint64_t generation = 0;
    {
        std::lock_guard lock(input_mutex_);
        generation = ++input_generations_;
        input_ = PendingInput{generation, false, std::nullopt};
    }
    Outbound outbound;
    outbound.kind = Outbound::Kind::stdin_channel;
    outbound.message = std::move(message);
    send_now(std::move(outbound));
    std::optional<xeus::xmessage> answer;
    {
        std::unique_lock lock(input_mutex_);
        input_answered_.wait(lock, [&] { return input_.answer.has_value() || stopping_.load(); });
        answer = std::move(input_.answer);
        input_ = PendingInput{};
    }
    if (answer) {
        notify_stdin_listener(std::move(*answer));
    }
}

void KernelServer::interrupt_pending_input() {
    {
        std::lock_guard lock(input_mutex_);
        if (input_.generation == 0 || input_.answer) {
            return;
        }
        input_.answer = xeus::xmessage({}, nlohmann::json::object(), nlohmann::json::object(),
                                       nlohmann::json::object(), {{"value", ""}}, {});
    }
    log_event(LogLevel::debug, "input_request_released", {});
    input_answered_.notify_all();
}

void KernelServer::abort_queue_impl(const listener& abort, long) {
    // Called by xeus from inside the failing execute (after its reply, before its idle); the requests queued
    // now are aborted once that execute is done (run_interpreter), so each gets busy, aborted reply, idle
    // after it. Requests that arrive later were sent after the reply and run.
    pending_abort_ = abort;
    // What the client sent before this reply is queued in the socket, if not read yet.
    {
        std::lock_guard lock(server_mutex_);
        while (sockets_->open && !receive_all(shell)) {
        }
    }
    abort_queued_ = shell_queue_.size();
}

void KernelServer::stop_impl() {
    stopping_ = true;
    wake_io_thread();
}

void KernelServer::update_config_impl(xeus::xconfiguration& config) const {
    BoundPorts ports = bound_ports();
    if (connection_.transport != "tcp") {
        ports = {connection_.shell_port, connection_.control_port, connection_.stdin_port,
                 connection_.iopub_port, connection_.hb_port};
    }
    config.m_transport = connection_.transport;
    config.m_ip = connection_.ip;
    config.m_shell_port = std::to_string(ports.shell);
    config.m_control_port = std::to_string(ports.control);
    config.m_stdin_port = std::to_string(ports.stdin_channel);
    config.m_iopub_port = std::to_string(ports.iopub);
    config.m_hb_port = std::to_string(ports.heartbeat);
    config.m_signature_scheme = connection_.signature_scheme;
    config.m_key = connection_.key;
}

xeus::xcontrol_messenger& KernelServer::get_control_messenger_impl() {
    return messenger_;
}

nlohmann::json KernelServer::ControlMessenger::send_to_shell_impl(const nlohmann::json& message) {
    return server_.notify_internal_listener(message);
}

std::unique_ptr<xeus::xserver> ServerHandoff::take(xeus::xcontext& context, const xeus::xconfiguration&,
                                                   nlohmann::json::error_handler_t) {
    auto& handoff = dynamic_cast<ServerHandoff&>(context);
    if (!handoff.server_) {
        throw std::logic_error("ServerHandoff: the kernel server was already taken");
    }
    return std::move(handoff.server_);
}

// ---- interpreter thread -----------------------------------------------------------------------------------

// The shell socket's ZMQ_FD only signals new commands, so the socket is read until it has nothing left before
// each wait (a send on it, a reply, may have taken in the command that announced a message).
void KernelServer::run_interpreter() {
    bool heap_release_due = false;  // a request ran since the last release (heap_policy.hpp)
    const int shell_fd = sockets_->routers[shell].get(zmq::sockopt::fd);
    bool shell_open = true;
    while (!shell_closed_) {
        if (shell_queue_.empty() && shell_open) {
            std::lock_guard lock(server_mutex_);
            shell_open = sockets_->open;
            if (shell_open) {
                receive_all(shell);  // what it left unread is read once the queue is empty again
            }
        }
        if (!shell_queue_.empty()) {
            xeus::xmessage next = std::move(shell_queue_.front());
            shell_queue_.pop_front();
            heap_release_due = true;
            try {
                notify_shell_listener(std::move(next));
            } catch (const std::exception& error) {
                log_event(LogLevel::error, "shell_dispatch_failed", {{"error", error.what()}});
            }
            if (pending_abort_) {
                abort_queued();
            }
            continue;
        }
        // Closed sockets are not polled: their fds may already belong to something else.
        std::array<pollfd, 2> fds = {
            {{shell_open ? shell_fd : -1, POLLIN, 0}, {interpreter_wake_.get(), POLLIN, 0}}};
        const int timeout_ms = heap_release_due ? static_cast<int>(quiet_before_heap_release.count()) : -1;
        const int ready = ::poll(fds.data(), fds.size(), timeout_ms);
        if (ready == 0 && heap_release_due) {
            release_free_heap();
            heap_release_due = false;
        } else if (ready < 0 && errno != EINTR) {
            log_event(LogLevel::error, "kernel_server_poll_failed", {{"error", std::strerror(errno)}});
        }
        if (fds[1].revents & POLLIN) {
            drain_eventfd(interpreter_wake_.get());
        }
    }
}

bool KernelServer::shell_message_waiting() {
    std::lock_guard lock(server_mutex_);
    // ZMQ_EVENTS takes in pending commands; a readable message stays for the next receive_all.
    return sockets_->open && (sockets_->routers[shell].get(zmq::sockopt::events) & ZMQ_POLLIN) != 0;
}

void KernelServer::abort_queued() {
    const listener abort = std::exchange(pending_abort_, nullptr);
    const auto count = static_cast<std::ptrdiff_t>(std::min(abort_queued_, shell_queue_.size()));
    std::deque<xeus::xmessage> queued;
    std::move(shell_queue_.begin(), shell_queue_.begin() + count, std::back_inserter(queued));
    shell_queue_.erase(shell_queue_.begin(), shell_queue_.begin() + count);
    abort_queued_ = 0;
    for (auto& message : queued) {
        try {
            abort(std::move(message));
        } catch (const std::exception& error) {
            log_event(LogLevel::error, "shell_abort_failed", {{"error", error.what()}});
        }
    }
}

}  // namespace cellblock::kernel
