#pragma once
// One /api/kernels/{id}/channels WebSocket: translates between the client's format (legacy JSON or
// v1.kernel.websocket.jupyter.org) and the kernel session's ZMQ sockets.
#include <memory>
#include <string>

#include "cellblock/gateway/kernel.hpp"
#include "cellblock/gateway/websocket_transport.hpp"

namespace cellblock::gateway {

class KernelChannelsConnection : public KernelClient,
                                 public std::enable_shared_from_this<KernelChannelsConnection> {
  public:
    KernelChannelsConnection(std::shared_ptr<Kernel> kernel, std::shared_ptr<WebSocketTransport> transport,
                             const Logger& logger, std::size_t max_pending_send_bytes);
    // Attaches to the kernel under `session_id` (empty = an anonymous, non-resumable session) and starts
    // reading.
    void open(const std::string& session_id);

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
};

}  // namespace cellblock::gateway
