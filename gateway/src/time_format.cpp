#include "cellblock/gateway/time_format.hpp"

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

}  // namespace cellblock::gateway
