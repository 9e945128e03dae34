// The orphan lease: a kernel started by the gateway with CELLBLOCK_LEASE_S stops itself when no verified
// message has reached it for that long, so a kernel whose gateway died and never came back does not run
// (and hold its workspace) forever. Any verified inbound message renews it; cellblock_lease_request exists
// only to renew it. Kernels started without the variable (direct jupyter_client use) have no lease.
//
// Pure time arithmetic on a steady clock, so the decision is testable without sockets or sleeping.
#pragma once

#include <algorithm>
#include <chrono>
#include <optional>

namespace cellblock::kernel {

class Lease {
  public:
    using Clock = std::chrono::steady_clock;

    Lease(std::chrono::milliseconds duration, Clock::time_point now) : duration_(duration), renewed_(now) {}

    void renew(Clock::time_point now) noexcept { renewed_ = std::max(renewed_, now); }
    bool expired(Clock::time_point now) const noexcept { return now - renewed_ >= duration_; }
    // Time left until expiry (zero once expired): how long the server may sleep in poll.
    std::chrono::milliseconds remaining(Clock::time_point now) const noexcept;
    std::chrono::duration<double> idle(Clock::time_point now) const noexcept { return now - renewed_; }
    std::chrono::milliseconds duration() const noexcept { return duration_; }

    // From CELLBLOCK_LEASE_S (seconds, fractions allowed): null, empty or not positive = no lease.
    // Throws std::invalid_argument for anything that is not a number.
    static std::optional<std::chrono::milliseconds> duration_from_environment(const char* value);

  private:
    std::chrono::milliseconds duration_;
    Clock::time_point renewed_;
};

}  // namespace cellblock::kernel
