#include "cellblock/gateway/observability/log.hpp"

#include <cstdio>
#include <stdexcept>
#include <string>

#include "cellblock/gateway/common/time_format.hpp"

namespace cellblock::gateway {

LogLevel Logger::parse_level(std::string_view name) {
    if (name == "debug")
        return LogLevel::debug;
    if (name == "info")
        return LogLevel::info;
    if (name == "warning" || name == "warn")
        return LogLevel::warning;
    if (name == "error")
        return LogLevel::error;
    throw std::invalid_argument("unknown log level '" + std::string(name) +
                                "' (debug, info, warning, error)");
}

void Logger::log(LogLevel level, std::string_view event, const nlohmann::json& fields) const {
    if (!enabled(level))
        return;
    static constexpr const char* names[] = {"debug", "info", "warning", "error"};
    nlohmann::json line = {{"time", format_iso8601_utc(std::chrono::system_clock::now())},
                           {"level", names[static_cast<int>(level)]},
                           {"event", event}};
    if (fields.is_object())
        line.update(fields);
    const std::string text = line.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
    std::fwrite(text.data(), 1, text.size(), stderr);
}

}  // namespace cellblock::gateway
