#include "cellblock/gateway/http/websocket_channel.hpp"

#include "cellblock/gateway/common/crypto.hpp"

namespace cellblock::gateway {

using nlohmann::json;

namespace {
constexpr std::string_view v1_protocol = "v1.kernel.websocket.jupyter.org";

bool usable_session_id(const std::string& id) {
    // A ZMQ routing id is at most 255 bytes and must not start with a zero byte.
    return !id.empty() && id.size() <= 200 && id.front() != '\0' &&
           !id.starts_with(KernelClientLink::anonymous_prefix) &&
           !id.starts_with(KernelClientLink::agent_prefix);
}
}  // namespace

KernelChannelsConnection::KernelChannelsConnection(std::shared_ptr<Kernel> kernel,
                                                   std::shared_ptr<WebSocketTransport> transport,
                                                   const Logger& logger, std::size_t max_pending_send_bytes)
    : kernel_(std::move(kernel)),
      transport_(std::move(transport)),
      logger_(logger),
      max_pending_send_bytes_(max_pending_send_bytes),
      v1_(transport_->subprotocol() == v1_protocol) {}

void KernelChannelsConnection::open(const std::string& requested_session_id,
                                    const std::optional<Watcher>& watcher) {
    read_only_ = watcher.has_value();
    const std::string session_id = usable_session_id(requested_session_id) && !read_only_
                                       ? requested_session_id
                                       : std::string(KernelClientLink::anonymous_prefix) + random_hex(12);
    if (watcher && watcher->expires) {
        expiry_ = std::make_unique<boost::asio::steady_timer>(watcher->io);
        expiry_->expires_after(*watcher->expires - std::chrono::system_clock::now());
        expiry_->async_wait([weak = weak_from_this()](const boost::system::error_code& error) {
            if (auto self = weak.lock(); self && !error)
                self->disconnect("the viewer link expired");
        });
    }
    std::weak_ptr<KernelChannelsConnection> weak = weak_from_this();
    transport_->start({[weak](std::string&& payload, bool binary) {
                           if (auto self = weak.lock())
                               self->on_client_message(std::move(payload), binary);
                       },
                       [self = shared_from_this()](const std::string& reason) { self->on_closed(reason); }});
    session_ = kernel_->attach(session_id, weak_from_this());
    logger_.info(
        "websocket_open",
        {{"kernel_id", kernel_->id()}, {"session_id", session_id}, {"v1", v1_}, {"read_only", read_only_}});
}

void KernelChannelsConnection::deliver(const JupyterMessage& message) {
    if (closed_)
        return;
    if (transport_->queued_bytes() > max_pending_send_bytes_) {
        logger_.warn("websocket_client_too_slow", {{"kernel_id", kernel_->id()}});
        disconnect("client is not reading its messages fast enough");
        return;
    }
    if (logger_.enabled(LogLevel::debug))
        logger_.debug("kernel_message", {{"kernel_id", kernel_->id()},
                                         {"msg_type", message.msg_type},
                                         {"channel", channel_name(message.channel)},
                                         {"queued", transport_->queued_bytes()}});
    WebSocketFrame frame = v1_ ? encode_v1(message) : encode_legacy(message);
    transport_->send(std::move(frame.payload), frame.binary);
}

void KernelChannelsConnection::disconnect(const std::string& reason) {
    if (closed_)
        return;
    transport_->close(reason);
}

void KernelChannelsConnection::reject(const std::string& reason, const std::string& parent_msg_id) {
    logger_.info("websocket_message_rejected", {{"kernel_id", kernel_->id()}, {"error", reason}});
    json parent = json::object();
    if (!parent_msg_id.empty())
        parent["msg_id"] = parent_msg_id;
    deliver(
        make_message(Channel::iopub, "stream",
                     {{"name", "stderr"}, {"text", "[cellblock-gateway] message rejected: " + reason + "\n"}},
                     session_ ? session_->session_id() : "", parent));
}

void KernelChannelsConnection::on_client_message(std::string&& payload, bool binary) {
    if (closed_ || !session_)
        return;
    try {
        JupyterMessage message = v1_      ? decode_v1(payload)
                                 : binary ? decode_legacy_binary(payload)
                                          : decode_legacy_text(payload);
        if (logger_.enabled(LogLevel::debug))
            logger_.debug("client_message", {{"kernel_id", kernel_->id()},
                                             {"msg_type", message.msg_type},
                                             {"channel", channel_name(message.channel)}});
        // A watcher asks kernel_info on shell and nothing else: a kernel may take any message on stdin as the
        // answer to a prompt.
        if (read_only_ && (message.msg_type != "kernel_info_request" || message.channel != Channel::shell)) {
            const json header = json::parse(message.header, nullptr, false);
            return reject(
                "this token watches the kernel and sends it nothing ('" + message.msg_type + "' refused)",
                header.is_object() ? header.value("msg_id", std::string()) : std::string());
        }
        if (message.msg_type.starts_with("cellblock_")) {
            // The kernel's own requests (replay, lease, approval decisions) are the gateway's: an approval is
            // decided through the agent API or `cellblock approve`, which audit who decided it.
            const json header = json::parse(message.header, nullptr, false);
            return reject("'" + message.msg_type +
                              "' is reserved for the gateway (approvals: POST "
                              "/agent/v1/sessions/{id}/approvals/{approval_id} or `cellblock approve`)",
                          header.is_object() ? header.value("msg_id", std::string()) : std::string());
        }
        session_->send(std::move(message));
    } catch (const MessageError& error) {
        reject(error.what(), "");
    } catch (const std::exception& error) {
        reject(std::string("internal error: ") + error.what(), "");
    }
}

void KernelChannelsConnection::on_closed(const std::string& reason) {
    if (closed_)
        return;
    closed_ = true;
    if (expiry_)
        expiry_->cancel();
    logger_.info("websocket_closed", {{"kernel_id", kernel_->id()}, {"reason", reason}});
    kernel_->detach(session_, this);
    session_.reset();
}

}  // namespace cellblock::gateway
