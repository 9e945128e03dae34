#include "server/lease.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

namespace cellblock::kernel {

std::chrono::milliseconds Lease::remaining(Clock::time_point now) const noexcept {
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(renewed_ + duration_ - now);
    return std::max(left, std::chrono::milliseconds(0));
}

std::optional<std::chrono::milliseconds> Lease::duration_from_environment(const char* value) {
    if (value == nullptr || *value == '\0') {
        return std::nullopt;
    }
    const std::string text(value);
    std::size_t used = 0;
    double seconds = 0;
    try {
        seconds = std::stod(text, &used);
    } catch (const std::exception&) {
        used = 0;
    }
    if (used != text.size() || !std::isfinite(seconds)) {
        throw std::invalid_argument("CELLBLOCK_LEASE_S must be a number of seconds, got '" + text + "'");
    }
    if (seconds <= 0) {
        return std::nullopt;
    }
    // At least 1 ms, at most about 100 years: beyond that a lease is no lease.
    const double millis = std::clamp(seconds * 1000.0, 1.0, 3.2e12);
    return std::chrono::milliseconds(static_cast<std::chrono::milliseconds::rep>(std::llround(millis)));
}

}  // namespace cellblock::kernel
