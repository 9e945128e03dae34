#include "common/logging.hpp"

#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <string>

namespace cellblock::kernel {
namespace {

LogLevel threshold_from_environment() noexcept {
    const char* value = std::getenv("CELLBLOCK_LOG");
    if (value == nullptr) {
        return LogLevel::warning;
    }
    const std::string_view level(value);
    if (level == "debug") {
        return LogLevel::debug;
    }
    if (level == "info") {
        return LogLevel::info;
    }
    if (level == "error") {
        return LogLevel::error;
    }
    return LogLevel::warning;
}

const char* level_name(LogLevel level) noexcept {
    switch (level) {
        case LogLevel::debug:
            return "debug";
        case LogLevel::info:
            return "info";
        case LogLevel::warning:
            return "warning";
        case LogLevel::error:
            return "error";
    }
    return "?";
}

}  // namespace

bool log_enabled(LogLevel level) noexcept {
    // Read once: the environment does not change while the kernel runs.
    static const LogLevel threshold = threshold_from_environment();
    return level >= threshold;
}

void log_event(LogLevel level, std::string_view event, const nlohmann::json& fields) {
    if (!log_enabled(level)) {
        return;
    }
    nlohmann::json line = {
        {"ts", std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count()},
        {"level", level_name(level)},
        {"component", "kernel"},
        {"pid", ::getpid()},
        {"event", std::string(event)}};
    if (fields.is_object()) {
        for (const auto& [key, value] : fields.items()) {
            line[key] = value;
        }
    }
    std::string text = line.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    text.push_back('\n');
    // One write() per line so concurrent threads do not interleave within a line.
    [[maybe_unused]] const auto written = ::write(STDERR_FILENO, text.data(), text.size());
}

}  // namespace cellblock::kernel
