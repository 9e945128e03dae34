#include "worker/request_controls.hpp"

#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "launch/kernel_config.hpp"

namespace cellblock::kernel {

ExecuteOptions parse_execute_options(const nlohmann::json& metadata) {
    ExecuteOptions options;
    if (!metadata.is_object()) {
        return options;
    }
    const auto cellblock = metadata.find("cellblock");
    if (cellblock == metadata.end() || !cellblock->is_object()) {
        return options;
    }
    const auto timeout = cellblock->find("timeout_s");
    if (timeout != cellblock->end() && timeout->is_number()) {
        const double seconds = timeout->get<double>();
        if (seconds > 0 && seconds <= longest_seconds) {
            options.timeout_s = seconds;
        }
    }
    const auto output = cellblock->find("output_bytes");
    if (output != cellblock->end() && output->is_number_unsigned()) {
        options.output_bytes = output->get<std::uint64_t>();
    }
    return options;
}

RequestControls::RequestControls() : wakeup_(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {
    if (!wakeup_) {
        throw std::runtime_error(std::string("eventfd (request controls): ") + std::strerror(errno));
    }
}

void RequestControls::post_options(const std::string& msg_id, ExecuteOptions options) {
    std::lock_guard lock(mutex_);
    if (options_.size() >= remembered_requests) {
        options_.pop_front();
    }
    options_.emplace_back(msg_id, options);
}

void RequestControls::interrupt(const std::vector<std::string>& unanswered) {
    {
        std::lock_guard lock(mutex_);
        if (unanswered.empty()) {
            interrupt_running_ = !running_.empty();
        }
        for (const auto& msg_id : unanswered) {
            if (std::find(interrupted_.begin(), interrupted_.end(), msg_id) != interrupted_.end()) {
                continue;
            }
            if (interrupted_.size() >= remembered_requests) {
                interrupted_.pop_front();
            }
            interrupted_.push_back(msg_id);
        }
    }
    const std::uint64_t one = 1;
    // Fails only when the counter is saturated, and then the fd is readable anyway.
    [[maybe_unused]] const auto written = ::write(wakeup_.get(), &one, sizeof(one));
}

ExecuteOptions RequestControls::take_options(const std::string& msg_id) {
    std::lock_guard lock(mutex_);
    const auto found = std::find_if(options_.begin(), options_.end(),
                                    [&](const auto& entry) { return entry.first == msg_id; });
    if (found == options_.end()) {
        return {};
    }
    ExecuteOptions options = found->second;
    options_.erase(found);
    return options;
}

bool RequestControls::take_interrupt(const std::string& msg_id) {
    std::lock_guard lock(mutex_);
    if (interrupt_running_ && running_ == msg_id) {
        interrupt_running_ = false;
        std::erase(interrupted_, msg_id);
        return true;
    }
    const auto found = std::find(interrupted_.begin(), interrupted_.end(), msg_id);
    if (found == interrupted_.end()) {
        return false;
    }
    interrupted_.erase(found);
    return true;
}

void RequestControls::drain_wakeup() noexcept {
    std::uint64_t count = 0;
    [[maybe_unused]] const auto got = ::read(wakeup_.get(), &count, sizeof(count));
}

void RequestControls::begin(const std::string& msg_id) {
    std::lock_guard lock(mutex_);
    running_ = msg_id;
    interrupt_running_ = false;
}

void RequestControls::end() {
    std::lock_guard lock(mutex_);
    std::erase(interrupted_, running_);  // an interrupt that came too late must not hit a later request
    running_.clear();
    interrupt_running_ = false;
}

}  // namespace cellblock::kernel
