#pragma once
#include <chrono>
#include <string>

namespace cellblock::gateway {
// "%Y-%m-%dT%H:%M:%S.%fZ" with exactly six fractional digits: Jupyter Server's GatewayKernelManager parses
// last_activity with strptime and that exact format, so the fraction must never be dropped.
std::string format_iso8601_utc(std::chrono::system_clock::time_point when);
}  // namespace cellblock::gateway
