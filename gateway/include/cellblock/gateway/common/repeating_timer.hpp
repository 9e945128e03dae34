#pragma once
#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>
#include <chrono>
#include <functional>
#include <memory>

namespace cellblock::gateway {

// Runs an action on the io_context's thread every `interval` until stopped or destroyed: the one owner of the
// re-arm-after-run pattern of the gateway's sweeps (idle culling, store housekeeping, session expiry,
// purges). The next wait starts after the action returns, so runs never overlap and a slow run delays the
// next one instead of queueing several. A wait that had already completed when stop() came does not run the
// action: cancelling an asio timer does not withdraw a handler that is already queued.
class RepeatingTimer {
  public:
    explicit RepeatingTimer(boost::asio::io_context& io);
    ~RepeatingTimer();
    RepeatingTimer(const RepeatingTimer&) = delete;
    RepeatingTimer& operator=(const RepeatingTimer&) = delete;

    // Replaces any earlier schedule. The interval must be positive and finite (std::invalid_argument
    // otherwise); past 1e9 seconds it is cut to 1e9.
    void start(std::chrono::duration<double> interval, std::function<void()> action);
    void stop();
    bool running() const { return static_cast<bool>(schedule_); }

  private:
    struct Schedule {
        std::chrono::steady_clock::duration interval;
        std::function<void()> action;
    };
    void arm();

    boost::asio::steady_timer timer_;
    // Shared with the pending wait, which runs the action only while this is still the schedule.
    std::shared_ptr<Schedule> schedule_;
};

}  // namespace cellblock::gateway
