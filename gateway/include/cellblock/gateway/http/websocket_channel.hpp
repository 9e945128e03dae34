#pragma once
// One /api/kernels/{id}/channels WebSocket: translates between the client's format (legacy JSON or
// v1.kernel.websocket.jupyter.org) and the kernel session's ZMQ sockets.
#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>
#include <chrono>
#include <memory>
#include <optional>
#include <string>

#include "cellblock/gateway/http/websocket_transport.hpp"
#include "cellblock/gateway/kernels/kernel.hpp"

namespace cellblock::gateway {

class KernelChannelsConnection : public KernelClient,
                                 public std::enable_shared_from_this<KernelChannelsConnection> {
  public:
    KernelChannelsConnection(std::shared_ptr<Kernel> kernel, std::shared_ptr<WebSocketTransport> transport,
                             const Logger& logger, std::size_t max_pending_send_bytes);
    // A watcher is a principal that may read but not run (a viewer link of the kernel's agent session, an
    // approver; principal.hpp): it receives what the kernel publishes and may ask kernel_info; anything else
    // it sends is refused, it never takes another client's session_id, and a viewer's connection closes
    // when its link expires.
    struct Watcher {
        boost::asio::io_context& io;
        std::optional<std::chrono::system_clock::time_point> expires;
    };
    // Attaches to the kernel under `session_id` (empty = an anonymous, non-resumable session; a watcher's is
    // always anonymous) and starts reading.
    void open(const std::string& session_id, const std::optional<Watcher>& watcher = std::nullopt);

    void deliver(const JupyterMessage& message) override;
    void disconnect(const std::string& reason) override;

  private:
    void on_client_message(std::string&& payload, bool binary);
    void on_closed(const std::string& reason);
    void reject(const std::string& reason, const std::string& parent_msg_id);

    std::shared_ptr<Kernel> kernel_;
    std::shared_ptr<KernelClientLink> session_;
    std::shared_ptr<WebSocketTransport> transport_;
    const Logger& logger_;
    std::size_t max_pending_send_bytes_;
    bool v1_ = false;
    bool closed_ = false;
    bool read_only_ = false;
    std::unique_ptr<boost::asio::steady_timer> expiry_;
};

}  // namespace cellblock::gateway
