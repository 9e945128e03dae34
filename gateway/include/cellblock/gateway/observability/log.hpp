#pragma once
// Structured logging: one JSON object per line on stderr, quiet (warnings and errors) unless asked otherwise.
#include <nlohmann/json.hpp>
#include <string_view>

namespace cellblock::gateway {

enum class LogLevel { debug = 0, info = 1, warning = 2, error = 3 };

class Logger {
  public:
    explicit Logger(LogLevel threshold = LogLevel::warning) : threshold_(threshold) {}
    static LogLevel parse_level(std::string_view name);  // throws std::invalid_argument

    bool enabled(LogLevel level) const { return level >= threshold_; }
    void log(LogLevel level, std::string_view event,
             const nlohmann::json& fields = nlohmann::json::object()) const;
    void debug(std::string_view event, const nlohmann::json& fields = nlohmann::json::object()) const {
        log(LogLevel::debug, event, fields);
    }
    void info(std::string_view event, const nlohmann::json& fields = nlohmann::json::object()) const {
        log(LogLevel::info, event, fields);
    }
    void warn(std::string_view event, const nlohmann::json& fields = nlohmann::json::object()) const {
        log(LogLevel::warning, event, fields);
    }
    void error(std::string_view event, const nlohmann::json& fields = nlohmann::json::object()) const {
        log(LogLevel::error, event, fields);
    }

  private:
    LogLevel threshold_;
};

}  // namespace cellblock::gateway
