// Helpers shared by the fuzz targets: splitting one fuzz input into the frames of a multipart message, and
// a failure that libFuzzer reports as a crash (with the input saved) when an invariant does not hold.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace cellblock::fuzz {

// Frames are separated by the ASCII record separator, so seed files stay readable JSON lines.
inline constexpr char frame_separator = '\x1e';

inline std::vector<std::string> split_frames(std::string_view input) {
    std::vector<std::string> frames;
    std::size_t at = 0;
    while (true) {
        const std::size_t next = input.find(frame_separator, at);
        if (next == std::string_view::npos) {
            frames.emplace_back(input.substr(at));
            return frames;
        }
        frames.emplace_back(input.substr(at, next - at));
        at = next + 1;
    }
}

// NAME=VALUE lines, as an environment the code under test reads through a lookup; lines without '=' are
// skipped.
inline std::map<std::string, std::string> environment_lines(std::string_view text) {
    std::map<std::string, std::string> variables;
    std::size_t at = 0;
    while (at < text.size()) {
        const std::size_t end = std::min(text.find('\n', at), text.size());
        const std::string_view line = text.substr(at, end - at);
        if (const auto equals = line.find('='); equals != std::string_view::npos)
            variables[std::string(line.substr(0, equals))] = std::string(line.substr(equals + 1));
        at = end + 1;
    }
    return variables;
}

inline std::string_view as_text(const std::uint8_t* data, std::size_t size) {
    return {reinterpret_cast<const char*>(data), size};
}

// An invariant of the code under test does not hold: abort, so libFuzzer keeps the input as a crash.
[[noreturn]] inline void invariant_failed(const char* what) {
    std::fprintf(stderr, "fuzz invariant failed: %s\n", what);
    std::abort();
}

inline void require(bool holds, const char* what) {
    if (!holds) {
        invariant_failed(what);
    }
}

}  // namespace cellblock::fuzz
