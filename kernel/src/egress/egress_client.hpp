// The kernel's side of the egress helper (kernel/src/egress/README.md): starts cellblock-egress, hands it
// the policy once and each worker's listener as it comes, and turns what the helper reports into calls on
// the kernel's EgressObserver / ApprovalBroker (NetworkApprovals), so the kernel parses no byte a worker
// wrote. A helper that dies is logged, reported through `note`, and started again with the current
// listener; every approval it held counts as denied (a crash never lets a request through).
#pragma once

#include <sys/types.h>

#include <filesystem>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "common/unique_fd.hpp"
#include "egress/egress_proxy.hpp"

namespace cellblock::kernel::egress {

struct HelperSpec {
    std::filesystem::path program;  // cellblock-egress, installed beside cellblock-kernel
    uid_t uid = 0;                  // the helper's own unprivileged uid/gid (never 0)
    gid_t gid = 0;
    nlohmann::json policy;     // CELLBLOCK_NETWORK_POLICY, already validated by the kernel
    std::string hosts;         // the pinned hosts file's text ("" = none)
    std::string hosts_origin;  // its path, for error messages
};

class EgressClient {
  public:
    // `note` gets a sentence for people when the helper died (called on the client's thread).
    EgressClient(HelperSpec spec, ApprovalBroker& broker, EgressObserver& observer,
                 std::function<void(const std::string&)> note);
    ~EgressClient();
    EgressClient(const EgressClient&) = delete;
    EgressClient& operator=(const EgressClient&) = delete;

    // Starts the helper and waits for it to be ready; throws std::runtime_error if it does not start.
    void start();
    // A new worker's listening socket (replaces the previous one). Thread-safe.
    void serve(UniqueFd listener);
    // Ends the helper (every connection with it). Also in the destructor.
    void stop();
    // The running helper's pid (0 between a crash and its restart); for logs and tests.
    pid_t helper_pid() const;

    class Impl;

  private:
    std::shared_ptr<Impl> impl_;
};

}  // namespace cellblock::kernel::egress
