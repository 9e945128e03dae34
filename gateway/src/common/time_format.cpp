#include "cellblock/gateway/common/time_format.hpp"

#include <cstdio>
#include <ctime>

namespace cellblock::gateway {

std::string format_iso8601_utc(std::chrono::system_clock::time_point when) {
    using namespace std::chrono;
    const auto since_epoch = duration_cast<microseconds>(when.time_since_epoch());
    auto seconds_part = duration_cast<seconds>(since_epoch);
    auto micros = since_epoch - seconds_part;
    if (micros.count() < 0) {  // floor for instants before 1970
        seconds_part -= seconds(1);
        micros += seconds(1);
    }
    const std::time_t as_time_t = static_cast<std::time_t>(seconds_part.count());
    std::tm utc{};
    gmtime_r(&as_time_t, &utc);
    char text[96];
    std::snprintf(text, sizeof text, "%04d-%02d-%02dT%02d:%02d:%02d.%06lldZ", utc.tm_year + 1900,
                  utc.tm_mon + 1, utc.tm_mday, utc.tm_hour, utc.tm_min, utc.tm_sec,
                  static_cast<long long>(micros.count()));
    return text;
}

std::optional<std::chrono::system_clock::time_point> parse_iso8601_utc(const std::string& text) {
    std::tm utc{};
    int consumed = 0;
    // The widths bound every field (no overflow) and the count says all six were read.
    // NOLINTNEXTLINE(cert-err34-c)
    if (std::sscanf(text.c_str(), "%4d-%2d-%2dT%2d:%2d:%2d%n", &utc.tm_year, &utc.tm_mon, &utc.tm_mday,
                    &utc.tm_hour, &utc.tm_min, &utc.tm_sec, &consumed) != 6)
        return std::nullopt;
    long long micros = 0;
    std::size_t at = static_cast<std::size_t>(consumed);
    if (at < text.size() && text[at] == '.') {
        long long scale = 100000;
        for (++at; at < text.size() && text[at] >= '0' && text[at] <= '9'; ++at, scale /= 10)
            if (scale > 0)
                micros += (text[at] - '0') * scale;
    }
    if (at + 1 != text.size() || text[at] != 'Z')
        return std::nullopt;
    utc.tm_year -= 1900;
    utc.tm_mon -= 1;
    const std::time_t seconds = timegm(&utc);
    return std::chrono::system_clock::from_time_t(seconds) + std::chrono::microseconds(micros);
}

}  // namespace cellblock::gateway
