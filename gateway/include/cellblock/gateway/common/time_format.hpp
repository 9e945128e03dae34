#pragma once
#include <chrono>
#include <optional>
#include <string>

namespace cellblock::gateway {
// "%Y-%m-%dT%H:%M:%S.%fZ" with exactly six fractional digits: Jupyter Server's GatewayKernelManager parses
// last_activity with strptime and that exact format, so the fraction must never be dropped.
std::string format_iso8601_utc(std::chrono::system_clock::time_point when);
// The inverse of format_iso8601_utc (the fraction is optional); nullopt for anything else.
std::optional<std::chrono::system_clock::time_point> parse_iso8601_utc(const std::string& text);
}  // namespace cellblock::gateway
