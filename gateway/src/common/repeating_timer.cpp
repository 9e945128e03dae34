#include "cellblock/gateway/common/repeating_timer.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace cellblock::gateway {

RepeatingTimer::RepeatingTimer(boost::asio::io_context& io) : timer_(io) {}

RepeatingTimer::~RepeatingTimer() {
    stop();
}

void RepeatingTimer::start(std::chrono::duration<double> interval, std::function<void()> action) {
    if (!std::isfinite(interval.count()) || interval.count() <= 0)
        throw std::invalid_argument("RepeatingTimer: the interval must be a positive number of seconds");
    // Past about 31 years a sweep never runs in practice; the cap keeps the conversion to the clock's
    // nanoseconds (which overflow past 292 years) defined for any configured value.
    constexpr double longest_seconds = 1e9;
    const auto ticks = std::chrono::duration_cast<std::chrono::steady_clock::duration>(
        std::chrono::duration<double>(std::min(interval.count(), longest_seconds)));
    stop();
    schedule_ = std::make_shared<Schedule>(Schedule{ticks, std::move(action)});
    arm();
}

void RepeatingTimer::stop() {
    schedule_.reset();
    timer_.cancel();
}

void RepeatingTimer::arm() {
    timer_.expires_after(schedule_->interval);
    timer_.async_wait(
        [this, weak = std::weak_ptr<Schedule>(schedule_)](const boost::system::error_code& error) {
            auto schedule = weak.lock();
            // Stopped, restarted or destroyed since this wait began: `this` may be gone, so nothing is
            // touched.
            if (error || !schedule)
                return;
            schedule->action();
            if (schedule_ == schedule)  // the action may have stopped or restarted the timer
                arm();
        });
}

}  // namespace cellblock::gateway
