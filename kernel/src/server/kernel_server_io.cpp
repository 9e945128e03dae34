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

#include "cellblock/contract/file_messages.hpp"
#include "common/json_text.hpp"
#include "common/logging.hpp"
#include "launch/heap_policy.hpp"
#include "server/kernel_server.hpp"
#include "server/kernel_server_sockets.hpp"
#include "server/protocol_fixups.hpp"
#include "server/workspace_files.hpp"

namespace cellblock::kernel {
namespace {

constexpr std::array<WireChannel, 4> wire_channels = {WireChannel::shell, WireChannel::control,
                                                      WireChannel::stdin_channel, WireChannel::iopub};

constexpr std::string_view delimiter_frame = "<IDS|MSG>";
// Replies the interpreter owes (a stale entry only misaddresses one interrupt's bookkeeping).
constexpr std::size_t awaiting_reply_capacity = 1024;
// Messages read from one socket before the loop looks at the others again.
constexpr int receive_batch = 64;

std::string_view view(const zmq::message_t& frame) {
    return {static_cast<const char*>(frame.data()), frame.size()};
}

std::string msg_id_of(const nlohmann::json& header) {
    if (!header.is_object()) {
        return {};
    }
    const auto found = header.find("msg_id");
    return found != header.end() && found->is_string() ? found->get<std::string>() : std::string();
}

// A lease of whole seconds is reported as an integer, as the gateway wrote it.
nlohmann::json lease_seconds(std::chrono::milliseconds duration) {
    if (duration.count() % 1000 == 0) {
        return duration.count() / 1000;
    }
    return std::chrono::duration<double>(duration).count();
}

// ISO 8601 UTC with microseconds, as jupyter_client writes it.
std::string utc_now_iso8601() {
    const auto now = std::chrono::system_clock::now();
    const std::time_t seconds = std::chrono::system_clock::to_time_t(now);
    const auto micros =
        std::chrono::duration_cast<std::chrono::microseconds>(now.time_since_epoch()).count() % 1000000;
    std::tm utc{};
    gmtime_r(&seconds, &utc);
    char text[64];
    const auto length = std::strftime(text, sizeof(text), "%Y-%m-%dT%H:%M:%S", &utc);
    std::snprintf(text + length, sizeof(text) - length, ".%06ldZ", static_cast<long>(micros));
    return text;
}

bool is_request(std::string_view msg_type) {
    return msg_type.ends_with("_request");
}

// Which outgoing shell, control and stdin messages fix_outbound or move_outcome_to_metadata may change (the
// others are serialized without a copy).
bool might_need_fixup(std::string_view msg_type, const nlohmann::json& content) {
    if (msg_type == "input_request" || msg_type == "interrupt_reply") {
        return true;
    }
    if (!msg_type.ends_with("_reply") || !content.is_object()) {
        return false;
    }
    if (msg_type == "execute_reply" && content.contains("cellblock")) {
        return true;  // the outcome moves to the metadata
    }
    const auto status = content.find("status");
    return status != content.end() && *status == "error" && !content.contains("ename");
}

}  // namespace

// The I/O thread: its loop, what it reads and verifies, what it sends, and the control services it answers
// itself (the rest of KernelServer: kernel_server.cpp).

// ---- I/O thread -------------------------------------------------------------------------------------------

void KernelServer::start_impl(xeus::xpub_message message) {
    io_thread_ = std::this_thread::get_id();
    if (lease_duration_) {
        lease_.emplace(*lease_duration_, Lease::Clock::now());
        log_event(LogLevel::info, "lease_started", {{"lease_s", lease_seconds(*lease_duration_)}});
    }
    {
        std::lock_guard lock(server_mutex_);
        Outbound starting;
        starting.kind = Outbound::Kind::iopub;
        starting.publish = std::move(message);
        send_outbound(starting);
    }
    // Only now: `starting` is the first IOPub message, before anything a request makes.
    interpreter_ = std::thread([this] { run_interpreter(); });
    run_io_loop();
    std::lock_guard lock(server_mutex_);
    close_sockets();
}

// Server lock held.
void KernelServer::close_sockets() {
    // Whatever the interpreter queued before the end still goes out (within the linger).
    if (sockets_->open) {
        send_queued();
    }
    sockets_->close_all();
    signal_eventfd(interpreter_wake_.get());  // it stops polling the shell socket's fd
}

// The loop polls the sockets' ZMQ_FDs (and the wake-up eventfd) with one poll(2) instead of zmq_poll, which
// asks every socket for its events before and after each wait (a poll(2) and a getpid each time). A ZMQ_FD
// only signals new commands, so a socket is read until it has nothing left (then a new message signals
// again) and read again after the loop sent on it (a send may take in the command that announced a message).
void KernelServer::run_io_loop() {
    auto& s = *sockets_;
    const std::array<zmq::socket_t*, polled_sockets> sockets = {&s.routers[control],
                                                                &s.routers[stdin_channel], &s.heartbeat};
    std::array<pollfd, polled_sockets + 1> fds{};
    std::unique_lock lock(server_mutex_);
    for (std::size_t i = 0; i < polled_sockets; ++i) {
        fds[i] = {sockets[i]->get(zmq::sockopt::fd), POLLIN, 0};
    }
    fds[polled_sockets] = {wake_.get(), POLLIN, 0};
    unread_.fill(true);
    while (s.open && !stopping_) {
        try {
            const bool unread = std::find(unread_.begin(), unread_.end(), true) != unread_.end();
            const int timeout_ms = unread ? 0 : poll_timeout_ms();
            // The interpreter thread reads shell and sends while this thread waits.
            lock.unlock();
            const int ready = ::poll(fds.data(), fds.size(), timeout_ms);
            const int poll_errno = errno;
            lock.lock();
            if (ready < 0) {
                if (poll_errno != EINTR) {
                    log_event(LogLevel::error, "kernel_server_poll_failed",
                              {{"error", std::strerror(poll_errno)}});
                }
                continue;
            }
            for (std::size_t i = 0; i < polled_sockets; ++i) {
                unread_[i] = unread_[i] || (fds[i].revents & POLLIN) != 0;
            }
            if (unread_[polled_control]) {
                unread_[polled_control] = !receive_all(control);
            }
            if (s.open && unread_[polled_stdin]) {
                unread_[polled_stdin] = !receive_all(stdin_channel);
            }
            if (s.open && unread_[polled_heartbeat]) {
                unread_[polled_heartbeat] = !echo_heartbeat();
            }
            if (s.open && (fds[polled_sockets].revents & POLLIN)) {
                drain_eventfd(wake_.get());
                send_queued();
            }
            if (s.open && lease_ && lease_->expired(Lease::Clock::now())) {
                expire_lease();
                return;
            }
        } catch (const zmq::error_t& error) {
            if (error.num() == ETERM) {
                return;
            }
            log_event(LogLevel::error, "kernel_server_error", {{"error", error.what()}});
        } catch (const std::exception& error) {
            // A single bad message must never stop the server.
            log_event(LogLevel::error, "kernel_server_error", {{"error", error.what()}});
        }
    }
}

int KernelServer::poll_timeout_ms() const {
    if (!lease_) {
        return -1;
    }
    const auto wait = lease_->remaining(Lease::Clock::now());
    constexpr auto longest_wait =
        std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::hours(1));
    return static_cast<int>(
        std::clamp<std::chrono::milliseconds::rep>(wait.count(), 0, longest_wait.count()));
}

bool KernelServer::receive_all(int channel_index) {
    auto& socket = sockets_->routers[channel_index];
    for (int i = 0; i < receive_batch; ++i) {
        if (!sockets_->open) {
            return true;
        }
        std::vector<zmq::message_t> frames;
        if (!zmq::recv_multipart(socket, std::back_inserter(frames), zmq::recv_flags::dontwait)) {
            return true;
        }
        try {
            handle_inbound(channel_index, frames);
        } catch (const std::exception& error) {
            log_event(LogLevel::error, "kernel_server_error",
                      {{"channel", channel_names[channel_index]}, {"error", error.what()}});
        }
    }
    return false;  // more may be waiting: read again before the next wait
}

void KernelServer::note_refusal(const InboundVerdict& verdict, const char* channel) {
    auto& count = refusals_[static_cast<std::size_t>(verdict.kind)];
    ++count;
    // Log the first refusal of each kind as a warning (someone is sending bad messages), later ones at debug.
    log_event(count == 1 ? LogLevel::warning : LogLevel::debug, "message_refused",
              {{"reason", describe(verdict.kind)}, {"channel", channel}, {"count", count}});
}

void KernelServer::handle_inbound(int channel_index, std::vector<zmq::message_t>& frames) {
    std::vector<std::string_view> frame_views;
    frame_views.reserve(frames.size());
    for (const auto& frame : frames) {
        frame_views.push_back(view(frame));
    }
    InboundVerdict verdict = verifier_.check(frame_views);
    if (verdict.kind != InboundVerdict::Kind::accepted) {
        note_refusal(verdict, channel_names[channel_index]);
        return;
    }
    if (log_enabled(LogLevel::debug)) {
        log_event(LogLevel::debug, "message_in",
                  {{"channel", channel_names[channel_index]}, {"msg_type", verdict.msg_type}});
    }
    if (lease_) {
        lease_->renew(Lease::Clock::now());
    }
    const std::size_t d = verdict.delimiter;
    std::vector<std::string> identities;
    identities.reserve(d);
    for (std::size_t i = 0; i < d; ++i) {
        identities.emplace_back(frame_views[i]);
    }
    if (const ControlService* service =
            channel_index == control ? control_service(verdict.msg_type) : nullptr) {
        send_own(control, identities, dump_json(verdict.header), service->reply,
                 (this->*service->answer)(verdict), false);
        return;
    }
    if (verdict.msg_type == "shutdown_request" && channel_index != stdin_channel) {
        answer_shutdown(verdict, identities, channel_index);
        return;
    }
    xeus::buffer_sequence buffers;
    for (std::size_t i = d + 6; i < frames.size(); ++i) {
        const auto* data = static_cast<const char*>(frames[i].data());
        buffers.emplace_back(data, data + frames[i].size());
    }
    const std::string msg_id = msg_id_of(verdict.header);
    if (channel_index == stdin_channel) {
        if (verdict.msg_type != "input_reply") {
            log_event(LogLevel::debug, "stdin_message_dropped", {{"msg_type", verdict.msg_type}});
            ++stdin_dropped_;
            return;
        }
        deliver_input_reply(xeus::xmessage(identities, std::move(verdict.header),
                                           std::move(verdict.parent_header), std::move(verdict.metadata),
                                           std::move(verdict.content), std::move(buffers)));
        return;
    }
    if (verdict.msg_type == "interrupt_request") {
        if (actions_.interrupt) {
            std::vector<std::string> unanswered;
            if (!awaiting_reply_.empty()) {
                unanswered.push_back(awaiting_reply_.front());
            }
            actions_.interrupt(unanswered);
        }
        interrupt_pending_input();
    }
    if (channel_index == shell && verdict.msg_type == "execute_request" && actions_.execute_metadata &&
        verdict.metadata.is_object() && verdict.metadata.contains("cellblock")) {
        actions_.execute_metadata(msg_id, verdict.metadata);
    }
    xeus::xmessage message(identities, std::move(verdict.header), std::move(verdict.parent_header),
                           std::move(verdict.metadata), std::move(verdict.content), std::move(buffers));
    if (channel_index == control) {
        notify_control_listener(std::move(message));
        return;
    }
    if (is_request(verdict.msg_type)) {
        if (awaiting_reply_.size() >= awaiting_reply_capacity) {
            awaited_execute_headers_.erase(awaiting_reply_.front());
            awaiting_reply_.pop_front();
        }
        awaiting_reply_.push_back(msg_id);
        if (verdict.msg_type == "execute_request") {
            awaited_execute_headers_.insert_or_assign(msg_id, std::string(frame_views[d + 2]));
        }
    }
    shell_queue_.push_back(std::move(message));
}

void KernelServer::deliver_input_reply(xeus::xmessage reply) {
    {
        std::lock_guard lock(input_mutex_);
        if (input_.generation == 0 || !input_.sent || input_.answer) {
            log_event(LogLevel::debug, "stdin_message_dropped", {{"msg_type", "input_reply"}});
            ++stdin_dropped_;
            return;
        }
        input_.answer = std::move(reply);
    }
    input_answered_.notify_all();
}

void KernelServer::send_queued() {
    std::vector<Outbound> queued;
    {
        std::lock_guard lock(outbound_mutex_);
        queued.swap(outbound_);
    }
    for (auto& outbound : queued) {
        // A kernel that is leaving (stop(): SIGTERM) says nothing more: the outcome of a cell that its own
        // exit ended (the worker it kills) is the kernel's death, which the client learns from the sockets.
        if (!sockets_->open || stopping_) {
            return;
        }
        try {
            send_outbound(outbound);
        } catch (const std::exception& error) {
            log_event(LogLevel::error, "kernel_server_error", {{"error", error.what()}});
        }
    }
}

void KernelServer::send_outbound(Outbound& outbound) {
    switch (outbound.kind) {
        case Outbound::Kind::shell:
            send_xmessage(shell, outbound.message, &outbound.message.identities(), {});
            return;
        case Outbound::Kind::control:
            send_xmessage(control, outbound.message, &outbound.message.identities(), {});
            return;
        case Outbound::Kind::stdin_channel: {
            // An answer still unread from before this prompt (a late one, to a prompt an interrupt released)
            // would answer it, as ipykernel's flush before input_request prevents: what is waiting is read
            // now, while no prompt is out, and deliver_input_reply drops it. One batch: a client flooding
            // stdin cannot hold this thread here.
            receive_all(stdin_channel);
            {
                std::lock_guard lock(input_mutex_);
                if (input_.generation == 0 || input_.answer) {
                    return;  // answered (interrupted) before it went out: no prompt nobody waits for
                }
                input_.sent = true;
            }
            send_xmessage(stdin_channel, outbound.message, &outbound.message.identities(), {});
            return;
        }
        case Outbound::Kind::iopub:
            send_xmessage(iopub, outbound.publish, nullptr, outbound.publish.topic());
            return;
        case Outbound::Kind::kernel_iopub: {
            // xeus runs shell requests one at a time, in order: the oldest unanswered one is the one running.
            std::string parent_header = "{}";
            if (!awaiting_reply_.empty()) {
                if (const auto found = awaited_execute_headers_.find(awaiting_reply_.front());
                    found != awaited_execute_headers_.end()) {
                    parent_header = found->second;
                }
            }
            send_own(iopub, {}, parent_header, outbound.msg_type, outbound.content, true);
            return;
        }
    }
}

void KernelServer::send_xmessage(int channel_index, const xeus::xmessage_base& message,
                                 const std::vector<std::string>* identities, const std::string& topic) {
    const WireChannel channel = wire_channels[channel_index];
    const nlohmann::json& header = message.header();
    const auto type_field = header.find("msg_type");
    const std::string msg_type = type_field != header.end() && type_field->is_string()
                                     ? type_field->get<std::string>()
                                     : std::string();
    // The fixups work on copies, and only for the messages they may change.
    std::optional<nlohmann::json> content, metadata;
    bool aborted = false;
    if (channel == WireChannel::iopub) {
        nlohmann::json unused;
        if (fix_outbound(channel, msg_type, unused) == Fixup::drop) {
            return;  // xeus-only message
        }
    } else if (might_need_fixup(msg_type, message.content())) {
        content = message.content();
        if (fix_outbound(channel, msg_type, *content) == Fixup::modified) {
            aborted = content->value("status", std::string()) == "aborted";
        }
        if (channel == WireChannel::shell && msg_type == "execute_reply") {
            metadata = message.metadata();
            move_outcome_to_metadata(*content, *metadata);
        }
    }
    std::string msg_id = msg_id_of(header);
    if (channel == WireChannel::shell && !last_published_id_.empty()) {
        if (!metadata) {
            metadata = message.metadata();
        }
        name_last_iopub_message(*metadata, last_published_id_);
    } else if (channel == WireChannel::iopub) {
        last_published_id_ = msg_id;
    }
    const std::string parent_text = dump_json(message.parent_header());
    std::vector<zmq::message_t> frames;
    if (identities) {
        for (const auto& identity : *identities) {
            frames.emplace_back(identity.data(), identity.size());
        }
    } else {
        frames.emplace_back(topic.data(), topic.size());
    }
    if (channel == WireChannel::shell) {
        forget_awaited(msg_id_of(message.parent_header()));
    }
    // xeus answers requests aborted by stop_on_error without busy/idle; clients (and ipykernel) expect the
    // usual busy -> reply -> idle for each request.
    if (aborted) {
        publish_status(parent_text, "busy");
    }
    send_frames(channel_index, frames, std::move(msg_id), dump_json(header), parent_text,
                dump_json(metadata ? *metadata : message.metadata()),
                dump_json(content ? *content : message.content()), message.buffers());
    if (aborted) {
        publish_status(parent_text, "idle");
    }
}

void KernelServer::send_frames(int channel_index, std::vector<zmq::message_t>& frames, std::string msg_id,
                               std::string header, std::string parent_header, std::string metadata,
                               std::string content, const xeus::buffer_sequence& buffers) {
    const std::string signature = signer_.sign({header, parent_header, metadata, content});
    frames.emplace_back(delimiter_frame.data(), delimiter_frame.size());
    frames.emplace_back(signature.data(), signature.size());
    frames.emplace_back(header.data(), header.size());
    frames.emplace_back(parent_header.data(), parent_header.size());
    frames.emplace_back(metadata.data(), metadata.size());
    frames.emplace_back(content.data(), content.size());
    for (const auto& buffer : buffers) {
        frames.emplace_back(buffer.data(), buffer.size());
    }
    auto& s = *sockets_;
    if (channel_index == iopub) {
        zmq::send_multipart(s.publisher, frames);
    } else {
        zmq::send_multipart(s.routers[channel_index], frames);
        keep_inbound_announced(channel_index);
    }
    if (channel_index != control && record_.enabled()) {
        std::vector<std::string> recorded_buffers;
        recorded_buffers.reserve(buffers.size());
        for (const auto& buffer : buffers) {
            recorded_buffers.emplace_back(buffer.data(), buffer.size());
        }
        record_.add(std::move(msg_id),
                    {channel_names[channel_index], std::move(header), std::move(parent_header),
                     std::move(metadata), std::move(content), std::move(recorded_buffers)});
    }
}

void KernelServer::forget_awaited(const std::string& msg_id) {
    const auto awaited = std::find(awaiting_reply_.begin(), awaiting_reply_.end(), msg_id);
    if (awaited != awaiting_reply_.end()) {
        awaiting_reply_.erase(awaited);
    }
    awaited_execute_headers_.erase(msg_id);
}

bool KernelServer::echo_heartbeat() {
    for (int i = 0; i < receive_batch; ++i) {
        std::vector<zmq::message_t> frames;
        if (!zmq::recv_multipart(sockets_->heartbeat, std::back_inserter(frames),
                                 zmq::recv_flags::dontwait)) {
            return true;
        }
        zmq::send_multipart(sockets_->heartbeat, frames, zmq::send_flags::dontwait);
    }
    return false;
}

void KernelServer::send_own(int channel_index, const std::vector<std::string>& identities,
                            const std::string& parent_header, std::string_view msg_type,
                            const nlohmann::json& content, bool record) {
    std::string msg_id = xeus::new_xguid().c_str();
    const nlohmann::json header = {
        {"msg_id", msg_id},          {"username", "cellblock"},           {"session", session_id_},
        {"date", utc_now_iso8601()}, {"msg_type", std::string(msg_type)}, {"version", "5.3"}};
    std::vector<zmq::message_t> frames;
    if (channel_index == iopub) {
        last_published_id_ = msg_id;
        frames.emplace_back(msg_type.data(), msg_type.size());  // IOPub topic
    } else {
        for (const auto& identity : identities) {
            frames.emplace_back(identity.data(), identity.size());
        }
    }
    const std::string header_text = dump_json(header);
    const std::string content_text = dump_json(content);
    if (record) {
        send_frames(channel_index, frames, std::move(msg_id), header_text, parent_header, "{}", content_text,
                    {});
        return;
    }
    // Replies to the kernel's own control requests: never recorded, so a replay is never itself replayed.
    const std::string signature = signer_.sign({header_text, parent_header, "{}", content_text});
    frames.emplace_back(delimiter_frame.data(), delimiter_frame.size());
    frames.emplace_back(signature.data(), signature.size());
    frames.emplace_back(header_text.data(), header_text.size());
    frames.emplace_back(parent_header.data(), parent_header.size());
    frames.emplace_back("{}", 2);
    frames.emplace_back(content_text.data(), content_text.size());
    zmq::send_multipart(sockets_->routers[channel_index], frames);
    keep_inbound_announced(channel_index);
}

void KernelServer::publish_status(const std::string& parent_header, const char* state) {
    send_own(iopub, {}, parent_header, "status", {{"execution_state", state}}, true);
}

void KernelServer::answer_shutdown(const InboundVerdict& verdict, const std::vector<std::string>& identities,
                                   int channel_index) {
    const bool restart = verdict.content.is_object() && verdict.content.value("restart", false);
    log_event(LogLevel::info, "shutdown_request", {{"restart", restart}});
    const std::string request_header = dump_json(verdict.header);
    publish_status(request_header, "busy");
    send_own(channel_index, identities, request_header, "shutdown_reply",
             {{"status", "ok"}, {"restart", restart}}, true);
    publish_status(request_header, "idle");
    close_sockets();
    stopping_ = true;
    if (actions_.shutdown) {
        actions_.shutdown();
    }
}

const KernelServer::ControlService* KernelServer::control_service(std::string_view msg_type) {
    static constexpr std::array<ControlService, 4> services = {{
        // What the kernel recorded since a msg_id, for a gateway that re-attaches (outbound_record.hpp).
        {"cellblock_replay_request", "cellblock_replay_reply", &KernelServer::replay_content},
        // The lease a gateway holds on the kernel, renewed by every verified message (lease.hpp).
        {"cellblock_lease_request", "cellblock_lease_reply", &KernelServer::lease_content},
        // A person's or agent's decision on a held network request (egress/network_approvals.hpp).
        {"cellblock_approval_decision_request", "cellblock_approval_decision_reply",
         &KernelServer::approval_decision_content},
        // The agent file API's list, read, write and delete in the worker's workspace (workspace_files.hpp).
        {contract::file_request_type, contract::file_reply_type, &KernelServer::file_content},
    }};
    for (const ControlService& service : services) {
        if (service.request == msg_type) {
            return &service;
        }
    }
    return nullptr;
}

nlohmann::json KernelServer::replay_content(const InboundVerdict& verdict) {
    const nlohmann::json& request = verdict.content;
    const nlohmann::json after =
        request.is_object() && request.contains("after") ? request["after"] : nlohmann::json();
    nlohmann::json content;
    if (after.is_null() || after.is_string()) {
        content = record_.replay(after.is_string() ? std::optional(after.get<std::string>()) : std::nullopt);
    } else {
        content = {{"status", "error"},
                   {"ename", "ValueError"},
                   {"evalue", "cellblock_replay_request: 'after' must be a msg_id or null"},
                   {"traceback", nlohmann::json::array()}};
    }
    log_event(LogLevel::info, "replay_request",
              {{"after", after},
               {"found", content.value("found", false)},
               {"messages", content.contains("messages") ? content["messages"].size() : 0},
               {"dropped", record_.dropped()}});
    return content;
}

nlohmann::json KernelServer::lease_content(const InboundVerdict& /*verdict*/) {
    // Renewed by handle_inbound already, as for every verified message.
    return {{"status", "ok"},
            {"lease_s", lease_duration_ ? lease_seconds(*lease_duration_) : nlohmann::json()}};
}

nlohmann::json KernelServer::approval_decision_content(const InboundVerdict& verdict) {
    if (actions_.approval_decision) {
        return actions_.approval_decision(verdict.content);
    }
    return {{"status", "error"},
            {"ename", "UnknownApproval"},
            {"evalue", "this kernel has no network policy, so no approval is ever pending"},
            {"traceback", nlohmann::json::array()}};
}

nlohmann::json KernelServer::file_content(const InboundVerdict& verdict) {
    // Answered on the I/O thread like the other services: a file is at most contract::max_file_bytes, read or
    // written in one call that nothing else (a planted FIFO, a symlink) can hold up (sandbox::Workspace).
    return answer_file_request(workspace_, verdict.content);
}

void KernelServer::expire_lease() {
    const auto idle = lease_->idle(Lease::Clock::now());
    log_event(LogLevel::warning, "lease_expired",
              {{"idle_s", idle.count()},
               {"lease_s", lease_seconds(lease_->duration())},
               {"recorded_messages", record_.size()},
               {"dropped", record_.dropped()}});
    close_sockets();
    stopping_ = true;
    if (actions_.lease_expired) {
        actions_.lease_expired(idle);
    }
}

}  // namespace cellblock::kernel
