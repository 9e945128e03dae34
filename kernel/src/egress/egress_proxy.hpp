// The egress proxy (kernel/README.md "Network egress proxy"): serves the HTTP proxy endpoint that lives
// inside the worker's network namespace (a listening socket handed over by the sandbox) from trusted code
// outside it. CONNECT for HTTPS (the ClientHello's SNI must be the CONNECT host) and absolute-form plain
// HTTP; hosts checked against the session's policy (with approvals), names resolved here (no DNS in the
// sandbox), loopback/private/link-local/ metadata addresses refused after resolution. One io_context thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "common/unique_fd.hpp"
#include "egress/egress_hosts.hpp"
#include "egress/egress_policy.hpp"

namespace cellblock::kernel::egress {

struct ApprovalRequest {
    std::string id;
    std::string host;
    std::uint16_t port = 0;
    std::string method;  // "CONNECT" or the HTTP method
};

enum class Decision { allow_once, allow_session, deny, timeout };
std::string_view to_string(Decision decision);

// Called on the proxy's thread; must not block. `answer` may be called from any thread, exactly once (later
// calls, and calls after the approval timed out, are ignored).
class ApprovalBroker {
  public:
    virtual ~ApprovalBroker() = default;
    virtual void request(const ApprovalRequest& request,
                         std::function<void(Decision, std::string decided_by)> answer) = 0;
};

struct ConnectionRecord {
    std::string host;
    std::uint16_t port = 0;
    std::string method;
    std::uint64_t bytes_up = 0;    // written to the server (request head of plain HTTP included)
    std::uint64_t bytes_down = 0;  // written to the client from the server (the proxy's own answers excluded)
    double duration_ms = 0;
    bool allowed = false;  // the policy (or an approval) let it through (see `error` for a failed connect)
    std::string rule;      // the allowlist pattern, "approval:allow_once by X", or the refusal reason
    std::string error;  // added by egress-core: how an allowed connection failed or ended early ("" if fine)
};

// Called on the proxy's thread (on_connection also from stop()/the destructor for connections still open).
class EgressObserver {
  public:
    virtual ~EgressObserver() = default;
    virtual void on_connection(const ConnectionRecord& record) = 0;  // when a connection ends or is refused
    virtual void on_approval_requested(const ApprovalRequest& request, double timeout_s) = 0;
    virtual void on_approval_decided(const ApprovalRequest& request, Decision decision,
                                     const std::string& decided_by) = 0;
};

// Added by egress-core (defaults are what the kernel uses; tests shorten them).
struct ProxyLimits {
    // From accept to a complete request head.
    std::chrono::milliseconds request_head{30'000};
    // Resolve + connect to the server.
    std::chrono::milliseconds connect{30'000};
    // From "200 Connection established" to the whole ClientHello.
    std::chrono::milliseconds client_hello{30'000};
    // A relay with no byte either way is closed.
    std::chrono::milliseconds idle{300'000};
    // Sessions open at once (one that relays holds two 64 KiB buffers, allocated only when it starts
    // relaying). Up to 16 more are answered 503 and closed; beyond those the proxy stops accepting until a
    // session ends, so a worker opening thousands of connections costs the kernel a bounded amount.
    std::size_t max_connections = 256;
};

// Added by egress-core: the largest request head (request line + headers) the proxy reads.
inline constexpr std::size_t max_request_head_bytes = std::size_t{16} * 1024;

class EgressProxy {
  public:
    EgressProxy(EgressPolicy policy, PinnedHosts pinned, ApprovalBroker& broker, EgressObserver& observer,
                ProxyLimits limits = {});
    ~EgressProxy();
    EgressProxy(const EgressProxy&) = delete;
    EgressProxy& operator=(const EgressProxy&) = delete;

    // A new worker's listening socket; replaces (closes) the previous one. Connections already accepted keep
    // running. Thread-safe.
    void serve(UniqueFd listener);
    // Stops the thread and closes everything (each open connection is reported). Also in the destructor.
    void stop();

    // For tests, which wait for what they can observe: connections held for an approval now (thread-safe)...
    std::size_t waiting_for_approval() const noexcept;
    // ...and a return once everything posted to the proxy's thread before the call (an answer given to the
    // broker's callback, a listener to serve) has run. Not from the proxy's thread; returns at once after
    // stop().
    void wait_for_posted();

    class Impl;

  private:
    std::shared_ptr<Impl> impl_;
};

}  // namespace cellblock::kernel::egress
