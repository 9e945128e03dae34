#include "wire_guard.hpp"

#include <algorithm>
#include <array>
#include <chrono>
#include <ctime>
#include <iterator>
#include <xeus/xguid.hpp>
#include <zmq_addon.hpp>

#include "logging.hpp"
#include "protocol_fixups.hpp"

namespace cellblock::kernel {
namespace {

constexpr std::string_view delimiter_frame = "<IDS|MSG>";
constexpr std::size_t replay_capacity = 16384;
constexpr int linger_ms = 1000;
// Replies xeus owes (a stale entry only costs one idle its wait; see WireGuard::awaiting_reply_).
constexpr std::size_t awaiting_reply_capacity = 1024;

enum ChannelIndex { shell = 0, control = 1, stdin_channel = 2, iopub = 3 };
constexpr std::array<const char*, 4> channel_names = {"shell", "control", "stdin", "iopub"};
constexpr std::array<WireChannel, 4> wire_channels = {WireChannel::shell, WireChannel::control,
                                                      WireChannel::stdin_channel, WireChannel::iopub};

std::string_view view(const zmq::message_t& frame) {
    return {static_cast<const char*>(frame.data()), frame.size()};
}

std::optional<std::size_t> find_delimiter(const std::vector<std::string_view>& frames) {
    for (std::size_t i = 0; i < frames.size(); ++i) {
        if (frames[i] == delimiter_frame) {
            return i;
        }
    }
    return std::nullopt;
}

std::string parent_msg_id(std::string_view parent_header) {
    const auto parent = nlohmann::json::parse(parent_header, nullptr, false);
    return parent.is_object() ? parent.value("msg_id", std::string()) : std::string();
}

std::vector<zmq::message_t> identities_of(const std::vector<zmq::message_t>& frames, std::size_t delimiter) {
    std::vector<zmq::message_t> identities;
    for (std::size_t i = 0; i < delimiter; ++i) {
        identities.emplace_back(frames[i].data(), frames[i].size());
    }
    return identities;
}

// A lease of whole seconds is reported as an integer, as the gateway wrote it.
nlohmann::json lease_seconds(std::chrono::milliseconds duration) {
    if (duration.count() % 1000 == 0) {
        return duration.count() / 1000;
    }
    return std::chrono::duration<double>(duration).count();
}

std::vector<std::string_view> views(const std::vector<zmq::message_t>& frames) {
    std::vector<std::string_view> result;
    result.reserve(frames.size());
    for (const auto& frame : frames) {
        result.push_back(view(frame));
    }
    return result;
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

bool might_need_fixup(WireChannel channel, std::string_view msg_type, std::string_view content) {
    if (channel == WireChannel::iopub) {
        return false;  // only msg_type matters there
    }
    if (channel == WireChannel::stdin_channel) {
        return msg_type == "input_request";
    }
    if (msg_type == "interrupt_reply") {
        return true;
    }
    if (msg_type == "execute_reply" && content.find("\"cellblock\"") != std::string_view::npos) {
        return true;  // the outcome moves to the metadata
    }
    // Cheap pre-filter so large replies are not parsed: only error replies without ename are rewritten.
    return content.find("\"error\"") != std::string_view::npos &&
           content.find("\"ename\"") == std::string_view::npos;
}

}  // namespace

const char* describe(InboundVerdict::Kind kind) noexcept {
    switch (kind) {
        case InboundVerdict::Kind::accepted:
            return "accepted";
        case InboundVerdict::Kind::malformed:
            return "malformed";
        case InboundVerdict::Kind::bad_signature:
            return "bad_signature";
        case InboundVerdict::Kind::replayed:
            return "replayed";
        case InboundVerdict::Kind::bad_header:
            return "bad_header";
    }
    return "?";
}

InboundVerdict InboundVerifier::check(const std::vector<std::string_view>& frames) {
    InboundVerdict verdict;
    const auto delimiter = find_delimiter(frames);
    // delimiter, signature, header, parent_header, metadata, content (+ optional buffers)
    if (!delimiter || frames.size() < *delimiter + 6) {
        verdict.kind = InboundVerdict::Kind::malformed;
        return verdict;
    }
    const std::size_t d = *delimiter;
    const std::string_view signature = frames[d + 1];
    const SignedParts parts = {frames[d + 2], frames[d + 3], frames[d + 4], frames[d + 5]};
    if (!signer_.verify(signature, parts)) {
        verdict.kind = InboundVerdict::Kind::bad_signature;
        return verdict;
    }
    // Without a key there is no signature to remember; replay protection needs signing.
    if (signer_.enabled() && !replays_.first_time(signature)) {
        verdict.kind = InboundVerdict::Kind::replayed;
        return verdict;
    }
    const auto header = nlohmann::json::parse(frames[d + 2], nullptr, false);
    if (header.is_discarded() || !header.is_object() || !header.contains("msg_type") ||
        !header["msg_type"].is_string()) {
        verdict.kind = InboundVerdict::Kind::bad_header;
        return verdict;
    }
    verdict.kind = InboundVerdict::Kind::accepted;
    verdict.delimiter = d;
    verdict.msg_type = header["msg_type"].get<std::string>();
    return verdict;
}

struct WireGuard::Sockets {
    zmq::context_t context{1};
    // Public side (clients).
    std::array<zmq::socket_t, 3> routers{zmq::socket_t(context, zmq::socket_type::router),
                                         zmq::socket_t(context, zmq::socket_type::router),
                                         zmq::socket_t(context, zmq::socket_type::router)};
    zmq::socket_t publisher{context, zmq::socket_type::pub};
    zmq::socket_t heartbeat{context, zmq::socket_type::router};
    // Private side (xeus). The three dealers share one routing id: xeus answers an input_request's
    // reply routing by the shell request's identities, so its stdin ROUTER must know us by the same id.
    std::array<zmq::socket_t, 3> dealers{zmq::socket_t(context, zmq::socket_type::dealer),
                                         zmq::socket_t(context, zmq::socket_type::dealer),
                                         zmq::socket_t(context, zmq::socket_type::dealer)};
    zmq::socket_t subscriber{context, zmq::socket_type::sub};
    // Wakes the loop up for destruction.
    zmq::socket_t stop_receiver{context, zmq::socket_type::pair};
    zmq::socket_t stop_sender{context, zmq::socket_type::pair};
    // Signal-mode interrupts from the signal thread (sender guarded by wake_mutex_).
    zmq::socket_t wake_receiver{context, zmq::socket_type::pair};
    zmq::socket_t wake_sender{context, zmq::socket_type::pair};
    bool open = true;

    void close_all() {
        if (!open) {
            return;
        }
        for (auto& socket : routers) {
            socket.close();
        }
        for (auto& socket : dealers) {
            socket.close();
        }
        publisher.close();
        heartbeat.close();
        subscriber.close();
        stop_receiver.close();
        stop_sender.close();
        wake_receiver.close();
        wake_sender.close();
        // Waits (up to the linger) until queued replies are on the wire.
        context.close();
        open = false;
    }
};

WireGuard::WireGuard(const ConnectionInfo& connection, const PrivateEndpoints& xeus, GuardActions actions,
                     GuardOptions options)
    : signer_(connection.signature_scheme, connection.key),
      verifier_(signer_, replay_capacity),
      actions_(std::move(actions)),
      session_id_(xeus::new_xguid().c_str()),
      sockets_(std::make_unique<Sockets>()),
      refusals_(5, 0),
      record_(options.record),
      lease_duration_(options.lease),
      reply_hold_limit_(options.reply_hold_limit) {
    auto& s = *sockets_;
    const std::array<int, 3> ports = {connection.shell_port, connection.control_port, connection.stdin_port};
    const std::array<const std::string*, 3> private_ends = {&xeus.shell, &xeus.control, &xeus.stdin_channel};
    const std::string routing_id = "cellblock-wire-guard";
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
        s.dealers[i].set(zmq::sockopt::linger, linger_ms);
        s.dealers[i].set(zmq::sockopt::routing_id, routing_id);
        s.dealers[i].connect(*private_ends[i]);
    }
    curve_server(s.publisher);
    curve_server(s.heartbeat);
    s.publisher.set(zmq::sockopt::linger, linger_ms);
    s.publisher.bind(connection.endpoint(connection.iopub_port));
    s.heartbeat.set(zmq::sockopt::linger, 0);
    s.heartbeat.bind(connection.endpoint(connection.hb_port));
    s.subscriber.set(zmq::sockopt::subscribe, "");
    s.subscriber.connect(xeus.iopub);
    s.stop_receiver.bind("inproc://wire-guard-stop");
    s.stop_sender.connect("inproc://wire-guard-stop");
    s.wake_receiver.bind("inproc://wire-guard-wake");
    s.wake_sender.connect("inproc://wire-guard-wake");
}

BoundPorts WireGuard::bound_ports() const {
    const auto port_of = [](const zmq::socket_t& socket) {
        const std::string endpoint = socket.get(zmq::sockopt::last_endpoint);
        const auto colon = endpoint.rfind(':');
        return colon == std::string::npos ? 0 : std::stoi(endpoint.substr(colon + 1));
    };
    const auto& s = *sockets_;
    return {port_of(s.routers[0]), port_of(s.routers[1]), port_of(s.routers[2]), port_of(s.publisher),
            port_of(s.heartbeat)};
}

WireGuard::~WireGuard() {
    if (thread_.joinable()) {
        if (sockets_->open) {
            sockets_->stop_sender.send(zmq::str_buffer("stop"), zmq::send_flags::dontwait);
        }
        thread_.join();
    }
    std::lock_guard lock(wake_mutex_);
    sockets_->close_all();
}

void WireGuard::start() {
    if (lease_duration_) {
        lease_.emplace(*lease_duration_, Lease::Clock::now());
        log_event(LogLevel::info, "lease_started", {{"lease_s", lease_seconds(*lease_duration_)}});
    }
    thread_ = std::thread([this] { run(); });
}

void WireGuard::close_sockets() {
    std::lock_guard lock(wake_mutex_);  // the signal thread may be using wake_sender
    sockets_->close_all();
}

void WireGuard::interrupt_pending_input() {
    std::lock_guard lock(wake_mutex_);
    if (sockets_->open) {
        sockets_->wake_sender.send(zmq::str_buffer("interrupt"), zmq::send_flags::dontwait);
    }
}

void WireGuard::publish(std::string msg_type, nlohmann::json content) {
    {
        std::lock_guard lock(queued_mutex_);
        queued_.push_back({std::move(msg_type), std::move(content)});
    }
    std::lock_guard lock(wake_mutex_);
    if (sockets_->open) {
        sockets_->wake_sender.send(zmq::str_buffer("publish"), zmq::send_flags::dontwait);
    }
}

void WireGuard::publish_queued() {
    std::vector<Queued> queued;
    {
        std::lock_guard lock(queued_mutex_);
        queued.swap(queued_);
    }
    if (queued.empty()) {
        return;
    }
    // xeus runs shell requests one at a time, in order: the oldest unanswered one is the one running.
    std::string parent_header = "{}";
    if (!awaiting_reply_.empty()) {
        if (const auto found = awaited_execute_headers_.find(awaiting_reply_.front());
            found != awaited_execute_headers_.end()) {
            parent_header = found->second;
        }
    }
    const std::string parent_id = parent_msg_id(parent_header);
    for (auto& message : queued) {
        route_iopub({parent_id, false, build_message({}, parent_header, message.msg_type, message.content)});
    }
}

void WireGuard::release_pending_input() {
    if (!pending_input_) {
        return;
    }
    const nlohmann::json header = {{"msg_id", std::string(xeus::new_xguid().c_str())},
                                   {"username", "cellblock"},
                                   {"session", session_id_},
                                   {"date", utc_now_iso8601()},
                                   {"msg_type", "input_reply"},
                                   {"version", "5.3"}};
    std::vector<zmq::message_t> message;
    for (const auto& identity : pending_input_->identities) {
        message.emplace_back(identity.data(), identity.size());
    }
    const std::string header_text = header.dump();
    const std::string content = R"({"value":""})";
    message.emplace_back(delimiter_frame.data(), delimiter_frame.size());
    message.emplace_back();  // xeus listens unsigned
    message.emplace_back(header_text.data(), header_text.size());
    message.emplace_back(pending_input_->header.data(), pending_input_->header.size());
    message.emplace_back("{}", 2);
    message.emplace_back(content.data(), content.size());
    pending_input_.reset();
    log_event(LogLevel::debug, "input_request_released", {});
    zmq::send_multipart(sockets_->dealers[stdin_channel], message);
}

void WireGuard::run() noexcept {
    auto& s = *sockets_;
    std::array<zmq::pollitem_t, 10> items = {{
        {s.routers[shell].handle(), 0, ZMQ_POLLIN, 0},
        {s.routers[control].handle(), 0, ZMQ_POLLIN, 0},
        {s.routers[stdin_channel].handle(), 0, ZMQ_POLLIN, 0},
        {s.dealers[shell].handle(), 0, ZMQ_POLLIN, 0},
        {s.dealers[control].handle(), 0, ZMQ_POLLIN, 0},
        {s.dealers[stdin_channel].handle(), 0, ZMQ_POLLIN, 0},
        {s.subscriber.handle(), 0, ZMQ_POLLIN, 0},
        {s.heartbeat.handle(), 0, ZMQ_POLLIN, 0},
        {s.stop_receiver.handle(), 0, ZMQ_POLLIN, 0},
        {s.wake_receiver.handle(), 0, ZMQ_POLLIN, 0},
    }};
    while (s.open) {
        try {
            zmq::poll(items.data(), items.size(), std::chrono::milliseconds(poll_timeout_ms()));
            release_expired_replies();
            if (items[8].revents & ZMQ_POLLIN) {
                return;
            }
            // Control first: an interrupt or shutdown must not queue behind shell traffic.
            if (items[1].revents & ZMQ_POLLIN) {
                relay_inbound(control);
            }
            if (!s.open) {
                return;
            }
            if (items[4].revents & ZMQ_POLLIN) {
                relay_outbound(control);
            }
            if (items[0].revents & ZMQ_POLLIN) {
                relay_inbound(shell);
            }
            if (!s.open) {
                return;
            }
            if (items[2].revents & ZMQ_POLLIN) {
                relay_inbound(stdin_channel);
            }
            if (items[3].revents & ZMQ_POLLIN) {
                relay_outbound(shell);
            }
            if (items[5].revents & ZMQ_POLLIN) {
                relay_outbound(stdin_channel);
            }
            if (items[6].revents & ZMQ_POLLIN) {
                relay_outbound(iopub);
            }
            if (items[7].revents & ZMQ_POLLIN) {
                echo_heartbeat();
            }
            if (items[9].revents & ZMQ_POLLIN) {
                zmq::message_t wake;
                bool interrupted = false;
                while (s.wake_receiver.recv(wake, zmq::recv_flags::dontwait)) {
                    interrupted = interrupted || view(wake) == "interrupt";
                }
                if (interrupted) {
                    release_pending_input();
                }
                publish_queued();
            }
            if (lease_ && lease_->expired(Lease::Clock::now())) {
                expire_lease();
                return;
            }
        } catch (const zmq::error_t& error) {
            if (error.num() == EINTR) {
                continue;
            }
            if (error.num() == ETERM) {
                return;
            }
            log_event(LogLevel::error, "wire_guard_error", {{"error", error.what()}});
        } catch (const std::exception& error) {
            // A single bad message must never stop the proxy.
            log_event(LogLevel::error, "wire_guard_error", {{"error", error.what()}});
        }
    }
}

void WireGuard::note_refusal(const InboundVerdict& verdict, const char* channel) {
    auto& count = refusals_[static_cast<std::size_t>(verdict.kind)];
    ++count;
    // Log the first refusal of each kind as a warning (someone is sending bad messages), later ones at debug.
    log_event(count == 1 ? LogLevel::warning : LogLevel::debug, "message_refused",
              {{"reason", describe(verdict.kind)}, {"channel", channel}, {"count", count}});
}

void WireGuard::relay_inbound(int channel_index) {
    auto& s = *sockets_;
    std::vector<zmq::message_t> frames;
    if (!zmq::recv_multipart(s.routers[channel_index], std::back_inserter(frames),
                             zmq::recv_flags::dontwait)) {
        return;
    }
    const auto verdict = verifier_.check(views(frames));
    if (verdict.kind != InboundVerdict::Kind::accepted) {
        note_refusal(verdict, channel_names[channel_index]);
        return;
    }
    log_event(LogLevel::debug, "message_in",
              {{"channel", channel_names[channel_index]}, {"msg_type", verdict.msg_type}});
    if (lease_) {
        lease_->renew(Lease::Clock::now());
    }
    if (channel_index == control && verdict.msg_type == "cellblock_replay_request") {
        answer_replay(frames, verdict.delimiter);
        return;
    }
    if (channel_index == control && verdict.msg_type == "cellblock_lease_request") {
        answer_lease(frames, verdict.delimiter);
        return;
    }
    if (channel_index == control && verdict.msg_type == "cellblock_approval_decision_request") {
        answer_approval_decision(frames, verdict.delimiter);
        return;
    }
    if (verdict.msg_type == "shutdown_request" && channel_index != stdin_channel) {
        answer_shutdown(frames, verdict.delimiter, channel_index);
        return;
    }
    if (channel_index == stdin_channel) {
        if (verdict.msg_type != "input_reply" || !pending_input_) {
            log_event(LogLevel::debug, "stdin_message_dropped", {{"msg_type", verdict.msg_type}});
            return;
        }
        pending_input_.reset();
    }
    if (verdict.msg_type == "interrupt_request") {
        if (actions_.interrupt) {
            std::vector<std::string> unanswered;
            if (!awaiting_reply_.empty()) {
                unanswered.push_back(awaiting_reply_.front());
            }
            actions_.interrupt(unanswered);
        }
        release_pending_input();
    }
    if (channel_index == shell && verdict.msg_type == "execute_request" && actions_.execute_metadata) {
        const std::string_view metadata_text = view(frames[verdict.delimiter + 4]);
        if (metadata_text.find("\"cellblock\"") != std::string_view::npos) {
            const auto metadata = nlohmann::json::parse(metadata_text, nullptr, false);
            if (metadata.is_object()) {
                actions_.execute_metadata(parent_msg_id(view(frames[verdict.delimiter + 2])), metadata);
            }
        }
    }
    if (channel_index == shell && verdict.msg_type.ends_with("_request")) {
        if (awaiting_reply_.size() >= awaiting_reply_capacity) {
            awaited_execute_headers_.erase(awaiting_reply_.front());
            awaiting_reply_.pop_front();
        }
        const std::string_view header = view(frames[verdict.delimiter + 2]);
        awaiting_reply_.push_back(parent_msg_id(header));
        if (verdict.msg_type == "execute_request") {
            awaited_execute_headers_.insert_or_assign(awaiting_reply_.back(), std::string(header));
        }
    }
    zmq::send_multipart(s.dealers[channel_index], frames);
}

void WireGuard::relay_outbound(int channel_index) {
    auto& s = *sockets_;
    std::vector<zmq::message_t> frames;
    zmq::socket_t& from = channel_index == iopub ? s.subscriber : s.dealers[channel_index];
    if (!zmq::recv_multipart(from, std::back_inserter(frames), zmq::recv_flags::dontwait)) {
        return;
    }
    // Everything read through views of the frames is read in this block: a fixup below replaces a frame,
    // and a view into the replaced frame would dangle. After it only owned copies and `frames` are used.
    std::size_t d = 0;
    std::string msg_type;
    bool reports_idle = false;
    std::optional<nlohmann::json> fixable_content;
    const WireChannel channel = wire_channels[channel_index];
    {
        const auto frame_views = views(frames);
        const auto delimiter = find_delimiter(frame_views);
        if (!delimiter || frames.size() < *delimiter + 6) {
            log_event(LogLevel::error, "xeus_message_malformed", {{"channel", channel_names[channel_index]}});
            return;
        }
        d = *delimiter;
        const auto header = nlohmann::json::parse(frame_views[d + 2], nullptr, false);
        msg_type = header.is_object() ? header.value("msg_type", std::string()) : std::string();
        reports_idle = channel == WireChannel::iopub && msg_type == "status" &&
                       frame_views[d + 5].find("\"idle\"") != std::string_view::npos;
        if (might_need_fixup(channel, msg_type, frame_views[d + 5])) {
            fixable_content = nlohmann::json::parse(frame_views[d + 5], nullptr, false);
        }
    }
    if (msg_type == "interrupt" && channel == WireChannel::iopub) {
        return;  // xeus-only message
    }
    bool aborted = false;
    if (fixable_content && !fixable_content->is_discarded()) {
        bool content_changed = false;
        if (fix_outbound(channel, msg_type, *fixable_content) == Fixup::modified) {
            aborted = fixable_content->value("status", std::string()) == "aborted";
            content_changed = true;
        }
        if (channel == WireChannel::shell && msg_type == "execute_reply") {
            auto metadata = nlohmann::json::parse(view(frames[d + 4]), nullptr, false);
            if (move_outcome_to_metadata(*fixable_content, metadata)) {
                content_changed = true;
                const std::string text =
                    metadata.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
                frames[d + 4] = zmq::message_t(text.data(), text.size());
            }
        }
        if (content_changed) {
            const std::string text =
                fixable_content->dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
            frames[d + 5] = zmq::message_t(text.data(), text.size());
        }
    }
    const SignedParts parts = {view(frames[d + 2]), view(frames[d + 3]), view(frames[d + 4]),
                               view(frames[d + 5])};
    const std::string signature = signer_.sign(parts);
    frames[d + 1] = zmq::message_t(signature.data(), signature.size());
    // xeus answers requests aborted by stop_on_error without busy/idle; clients (and ipykernel) expect the
    // usual busy -> reply -> idle for each request.
    const std::string parent_header(view(frames[d + 3]));
    if (channel == WireChannel::stdin_channel && msg_type == "input_request") {
        PendingInput pending;
        for (std::size_t i = 0; i < d; ++i) {
            pending.identities.emplace_back(view(frames[i]));
        }
        pending.header = std::string(view(frames[d + 2]));
        pending_input_ = std::move(pending);
    }
    if (channel == WireChannel::shell) {
        forget_awaited(parent_msg_id(parent_header));
    }
    if (channel == WireChannel::shell && !aborted) {
        // A client that stops reading at execute_reply (OpenHands does) must already have every output:
        // the reply goes out just before its request's idle (see HeldReply in the header).
        std::string replied_to = parent_msg_id(parent_header);
        if (!held_iopub_.empty() && held_iopub_.front().parent_msg_id == replied_to) {
            send_to_clients(shell, frames);
            release_held_iopub();
            return;
        }
        held_replies_.push_back(
            {std::move(replied_to), std::move(frames), std::chrono::steady_clock::now() + reply_hold_limit_});
        return;
    }
    if (channel == WireChannel::iopub) {
        route_iopub({parent_msg_id(parent_header), reports_idle, std::move(frames)});
        return;
    }
    if (aborted) {
        publish_status(parent_header, "busy");
    }
    send_to_clients(channel_index, frames);
    if (aborted) {
        publish_status(parent_header, "idle");
    }
}

void WireGuard::send_to_clients(int channel_index, std::vector<zmq::message_t>& frames) {
    if (channel_index != control) {
        const auto frame_views = views(frames);
        const auto delimiter = find_delimiter(frame_views);
        if (delimiter && frames.size() >= *delimiter + 6) {
            const std::size_t d = *delimiter;
            RecordedMessage recorded{
                channel_names[channel_index],
                std::string(frame_views[d + 2]),
                std::string(frame_views[d + 3]),
                std::string(frame_views[d + 4]),
                std::string(frame_views[d + 5]),
                std::vector<std::string>(frame_views.begin() + d + 6, frame_views.end())};
            record_.add(std::move(recorded));
        }
    }
    auto& s = *sockets_;
    zmq::send_multipart(channel_index == iopub ? s.publisher : s.routers[channel_index], frames);
}

void WireGuard::release_held_replies(std::string_view parent_msg_id) {
    std::erase_if(held_replies_, [&](HeldReply& held) {
        if (held.parent_msg_id != parent_msg_id) {
            return false;
        }
        send_to_clients(shell, held.frames);
        return true;
    });
}

void WireGuard::route_iopub(HeldIopub message) {
    if (!held_iopub_.empty()) {
        held_iopub_.push_back(std::move(message));
        return;
    }
    if (message.reports_idle && awaiting_reply(message.parent_msg_id)) {
        held_iopub_deadline_ = std::chrono::steady_clock::now() + reply_hold_limit_;
        held_iopub_.push_back(std::move(message));
        return;
    }
    if (message.reports_idle && !held_replies_.empty()) {
        release_held_replies(message.parent_msg_id);
    }
    send_to_clients(iopub, message.frames);
}

void WireGuard::release_held_iopub() {
    while (!held_iopub_.empty()) {
        HeldIopub& next = held_iopub_.front();
        if (next.reports_idle && awaiting_reply(next.parent_msg_id)) {
            held_iopub_deadline_ = std::chrono::steady_clock::now() + reply_hold_limit_;
            return;
        }
        if (next.reports_idle && !held_replies_.empty()) {
            release_held_replies(next.parent_msg_id);
        }
        send_to_clients(iopub, next.frames);
        held_iopub_.pop_front();
    }
}

bool WireGuard::awaiting_reply(std::string_view msg_id) const {
    return std::find(awaiting_reply_.begin(), awaiting_reply_.end(), msg_id) != awaiting_reply_.end();
}

void WireGuard::forget_awaited(std::string_view msg_id) {
    const auto awaited = std::find(awaiting_reply_.begin(), awaiting_reply_.end(), msg_id);
    if (awaited != awaiting_reply_.end()) {
        awaiting_reply_.erase(awaited);
    }
    if (const auto header = awaited_execute_headers_.find(msg_id); header != awaited_execute_headers_.end()) {
        awaited_execute_headers_.erase(header);
    }
}

void WireGuard::release_expired_replies() {
    const auto now = std::chrono::steady_clock::now();
    if (!held_iopub_.empty() && held_iopub_deadline_ <= now) {
        // The reply never came (it should not happen): the idle and what queued behind it go out without it.
        log_event(LogLevel::debug, "idle_released_without_reply", {});
        forget_awaited(held_iopub_.front().parent_msg_id);
        release_held_iopub();
    }
    if (held_replies_.empty()) {
        return;
    }
    std::erase_if(held_replies_, [&](HeldReply& held) {
        if (held.deadline > now) {
            return false;
        }
        // The idle never came (it should not happen): a late reply beats none.
        log_event(LogLevel::debug, "reply_released_without_idle", {});
        send_to_clients(shell, held.frames);
        return true;
    });
}

int WireGuard::poll_timeout_ms() const {
    const auto now = std::chrono::steady_clock::now();
    std::optional<std::chrono::milliseconds> wait;
    if (lease_) {
        wait = lease_->remaining(now);
    }
    for (const auto& held : held_replies_) {
        const auto until = std::chrono::ceil<std::chrono::milliseconds>(held.deadline - now);
        wait = std::min(wait.value_or(until), until);
    }
    if (!held_iopub_.empty()) {
        const auto until = std::chrono::ceil<std::chrono::milliseconds>(held_iopub_deadline_ - now);
        wait = std::min(wait.value_or(until), until);
    }
    if (!wait) {
        return -1;
    }
    return static_cast<int>(std::clamp<std::chrono::milliseconds::rep>(wait->count(), 0, 60 * 60 * 1000));
}

void WireGuard::echo_heartbeat() {
    std::vector<zmq::message_t> frames;
    if (!zmq::recv_multipart(sockets_->heartbeat, std::back_inserter(frames), zmq::recv_flags::dontwait)) {
        return;
    }
    zmq::send_multipart(sockets_->heartbeat, frames, zmq::send_flags::dontwait);
}

std::vector<zmq::message_t> WireGuard::build_message(const std::vector<zmq::message_t>& identities,
                                                     std::string_view parent_header,
                                                     std::string_view msg_type,
                                                     const nlohmann::json& content) const {
    const nlohmann::json header = {{"msg_id", std::string(xeus::new_xguid().c_str())},
                                   {"username", "cellblock"},
                                   {"session", session_id_},
                                   {"date", utc_now_iso8601()},
                                   {"msg_type", std::string(msg_type)},
                                   {"version", "5.3"}};
    const std::string header_text = header.dump();
    const std::string metadata = "{}";
    const std::string content_text = content.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    const std::string signature = signer_.sign({header_text, parent_header, metadata, content_text});
    std::vector<zmq::message_t> message;
    if (identities.empty()) {
        message.emplace_back(msg_type.data(), msg_type.size());  // IOPub topic
    } else {
        for (const auto& identity : identities) {
            message.emplace_back(identity.data(), identity.size());
        }
    }
    message.emplace_back(delimiter_frame.data(), delimiter_frame.size());
    message.emplace_back(signature.data(), signature.size());
    message.emplace_back(header_text.data(), header_text.size());
    message.emplace_back(parent_header.data(), parent_header.size());
    message.emplace_back(metadata.data(), metadata.size());
    message.emplace_back(content_text.data(), content_text.size());
    return message;
}

void WireGuard::publish_status(std::string_view parent_header, const char* state) {
    auto status = build_message({}, parent_header, "status", {{"execution_state", state}});
    send_to_clients(iopub, status);
}

void WireGuard::answer_shutdown(const std::vector<zmq::message_t>& frames, std::size_t delimiter,
                                int channel_index) {
    const auto request = nlohmann::json::parse(view(frames[delimiter + 5]), nullptr, false);
    const bool restart = request.is_object() && request.value("restart", false);
    log_event(LogLevel::info, "shutdown_request", {{"restart", restart}});
    const std::string_view request_header = view(frames[delimiter + 2]);
    publish_status(request_header, "busy");
    auto reply = build_message(identities_of(frames, delimiter), request_header, "shutdown_reply",
                               {{"status", "ok"}, {"restart", restart}});
    send_to_clients(channel_index, reply);
    publish_status(request_header, "idle");
    close_sockets();
    if (actions_.shutdown) {
        actions_.shutdown();
    }
}

void WireGuard::answer_replay(const std::vector<zmq::message_t>& frames, std::size_t delimiter) {
    const auto request = nlohmann::json::parse(view(frames[delimiter + 5]), nullptr, false);
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
    // Straight to the router, not through send_to_clients: a replay is never itself replayed.
    zmq::send_multipart(sockets_->routers[control],
                        build_message(identities_of(frames, delimiter), view(frames[delimiter + 2]),
                                      "cellblock_replay_reply", content));
}

void WireGuard::answer_lease(const std::vector<zmq::message_t>& frames, std::size_t delimiter) {
    // Renewed by relay_inbound already, as for every verified message.
    zmq::send_multipart(
        sockets_->routers[control],
        build_message(identities_of(frames, delimiter), view(frames[delimiter + 2]), "cellblock_lease_reply",
                      {{"status", "ok"},
                       {"lease_s", lease_duration_ ? lease_seconds(*lease_duration_) : nlohmann::json()}}));
}

void WireGuard::answer_approval_decision(const std::vector<zmq::message_t>& frames, std::size_t delimiter) {
    const auto request = nlohmann::json::parse(view(frames[delimiter + 5]), nullptr, false);
    nlohmann::json content;
    if (actions_.approval_decision) {
        content = actions_.approval_decision(request);
    } else {
        content = {{"status", "error"},
                   {"ename", "UnknownApproval"},
                   {"evalue", "this kernel has no network policy, so no approval is ever pending"},
                   {"traceback", nlohmann::json::array()}};
    }
    // Straight to the router like the lease and replay replies: a decision reply is not replayed.
    zmq::send_multipart(sockets_->routers[control],
                        build_message(identities_of(frames, delimiter), view(frames[delimiter + 2]),
                                      "cellblock_approval_decision_reply", content));
}

void WireGuard::expire_lease() {
    const auto idle = lease_->idle(Lease::Clock::now());
    log_event(LogLevel::warning, "lease_expired",
              {{"idle_s", idle.count()},
               {"lease_s", lease_seconds(lease_->duration())},
               {"recorded_messages", record_.size()},
               {"dropped", record_.dropped()}});
    close_sockets();
    if (actions_.lease_expired) {
        actions_.lease_expired(idle);
    }
}

}  // namespace cellblock::kernel
