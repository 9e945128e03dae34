#pragma once
// Context shielding: keeps what an agent reads small. Text beyond a cap comes back as its head and tail
// around a marker that says how much was left out and where the whole text was saved; terminal colour codes
// are removed.
#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

namespace cellblock::gateway::agent {

// Removes ANSI escape sequences (CSI "ESC [ ... final", OSC "ESC ] ... BEL|ESC \", and two-byte ESC x).
std::string strip_ansi(std::string_view text);

// The longest prefix of `text` of at most `max_bytes` that does not end inside a UTF-8 sequence.
std::string_view utf8_head(std::string_view text, std::size_t max_bytes);
// The longest suffix of at most `max_bytes` that does not start inside a UTF-8 sequence.
std::string_view utf8_tail(std::string_view text, std::size_t max_bytes);

struct ShieldedText {
    std::string text;  // the text itself, or head + marker + tail
    bool shortened = false;
    std::size_t original_bytes = 0;
};

// `saved_path` is named in the marker when given (the workspace-relative path of the full text).
ShieldedText shield_text(std::string_view text, std::size_t cap,
                         const std::optional<std::string>& saved_path);

// Well-formed UTF-8 (no overlong forms, surrogates or code points above U+10FFFF).
bool is_valid_utf8(std::string_view text);

// Lowercase hex SHA-256 (OpenSSL).
std::string sha256_hex(std::string_view bytes);

}  // namespace cellblock::gateway::agent
