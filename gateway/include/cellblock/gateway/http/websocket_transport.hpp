#pragma once
// A server-side WebSocket after the upgrade, independent of plain TCP vs TLS, so endpoint logic (kernel
// channels, agent streams) is written once. Writes are queued in order; close() flushes the queue first.
#include <functional>
#include <string>

namespace cellblock::gateway {

class WebSocketTransport {
  public:
    struct Handlers {
        std::function<void(std::string&& payload, bool binary)> on_message;
        std::function<void(const std::string& reason)>
            on_closed;  // called once, whatever ended the connection
    };
    virtual ~WebSocketTransport() = default;
    virtual void start(Handlers handlers) = 0;
    virtual void send(std::string payload, bool binary) = 0;
    // Normal closure (1000) after pending writes; `policy_violation` uses 1008 (e.g. a client too slow to
    // read).
    virtual void close(const std::string& reason, bool policy_violation = false) = 0;
    virtual std::size_t queued_bytes() const = 0;
    virtual const std::string& subprotocol() const = 0;
};

}  // namespace cellblock::gateway
