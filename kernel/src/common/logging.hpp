// Structured, quiet-by-default logging: one JSON object per line on stderr.
// Warnings and errors are always written; info and debug only with CELLBLOCK_LOG=debug (or =info).
#pragma once

#include <nlohmann/json.hpp>
#include <string_view>

namespace cellblock::kernel {

enum class LogLevel { debug = 0, info = 1, warning = 2, error = 3 };

// True if messages of this level are written (decided once from CELLBLOCK_LOG).
bool log_enabled(LogLevel level) noexcept;

// Writes {"ts":..., "level":..., "component":"kernel", "event": event, ...fields} as one line.
void log_event(LogLevel level, std::string_view event,
               const nlohmann::json& fields = nlohmann::json::object());

}  // namespace cellblock::kernel
