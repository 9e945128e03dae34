// The Jupyter side of the egress proxy (kernel/README.md "Network policy"): what the proxy reports becomes
// IOPub messages
// (`cellblock_egress` events for machines; for an approval also a display a person sees in a notebook,
// updated when it is decided), and decisions that arrive on the control channel
// (`cellblock_approval_decision_request`) go to the held request. The proxy owns the approval time-out and
// every decision's effect; this class only carries them.
//
// Threads: the proxy calls the broker and observer methods on its own thread; the kernel server calls
// decide() on its I/O thread. Messages are handed to a Publisher (KernelServer::publish_kernel_message),
// which queues them for the thread that owns the IOPub socket, so nothing here touches xeus or a socket.
#pragma once

#include <functional>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>

#include "egress/egress_proxy.hpp"

namespace cellblock::kernel {

class NetworkApprovals final : public egress::ApprovalBroker, public egress::EgressObserver {
  public:
    // Publishes one IOPub message of the kernel's own; thread-safe, never blocks for long.
    using Publisher = std::function<void(std::string msg_type, nlohmann::json content)>;

    NetworkApprovals() = default;
    NetworkApprovals(const NetworkApprovals&) = delete;
    NetworkApprovals& operator=(const NetworkApprovals&) = delete;

    // While a Connection lives, messages go to its publisher; before and after, they are dropped (and
    // logged). Its destructor waits for a publish in progress, so the publisher's target may go next.
    class [[nodiscard]] Connection {
      public:
        explicit Connection(NetworkApprovals& owner) : owner_(&owner) {}
        Connection(Connection&& other) noexcept : owner_(std::exchange(other.owner_, nullptr)) {}
        Connection& operator=(Connection&&) = delete;
        Connection(const Connection&) = delete;
        Connection& operator=(const Connection&) = delete;
        ~Connection();

      private:
        NetworkApprovals* owner_;
    };
    Connection connect(Publisher publisher);

    // egress::ApprovalBroker (proxy thread).
    void request(const egress::ApprovalRequest& request,
                 std::function<void(egress::Decision, std::string decided_by)> answer) override;
    // egress::EgressObserver (proxy thread).
    void on_connection(const egress::ConnectionRecord& record) override;
    void on_approval_requested(const egress::ApprovalRequest& request, double timeout_s) override;
    void on_approval_decided(const egress::ApprovalRequest& request, egress::Decision decision,
                             const std::string& decided_by) override;

    // The egress helper died and is being restarted (any thread).
    void on_helper_crashed(const std::string& text);

    // The content of a cellblock_approval_decision_request -> the content of its reply:
    // {"status": "ok"} once the decision is passed on, or {"status": "error", "ename": "UnknownApproval"
    // | "ValueError", "evalue": ...} for an approval that is not pending (unknown, decided, timed out) or a
    // malformed request.
    nlohmann::json decide(const nlohmann::json& content);

    // The IOPub messages, for tests and documentation: {msg_type, content}.
    static nlohmann::json approval_display(const egress::ApprovalRequest& request, double timeout_s);
    static nlohmann::json decision_display(const egress::ApprovalRequest& request, egress::Decision decision,
                                           const std::string& decided_by, double timeout_s);

  private:
    static nlohmann::json approval_frame(const egress::ApprovalRequest& request, const std::string& status,
                                         double timeout_s, const nlohmann::json& decision_fields);
    void publish(const char* msg_type, nlohmann::json content);  // with mutex_ held

    struct Pending {
        egress::ApprovalRequest request;
        double timeout_s = 0;
        std::function<void(egress::Decision, std::string)> answer;  // from request(); empty once used
        bool decided = false;                                       // a decision came in on control
        // A decision that came in before request() handed over `answer` (the event is out first).
        std::optional<std::pair<egress::Decision, std::string>> early;
    };

    std::mutex mutex_;
    Publisher publisher_;
    std::map<std::string, Pending> pending_;  // by approval id, from on_approval_requested to the decision
};

}  // namespace cellblock::kernel
