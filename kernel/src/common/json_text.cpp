#include "common/json_text.hpp"

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>

namespace cellblock::kernel {
namespace {

using nlohmann::json;

constexpr auto replace_invalid = json::error_handler_t::replace;

// Below this, a string goes to nlohmann whole: the scan would save nothing.
constexpr std::size_t short_string = 64;

constexpr bool written_as_is(unsigned char byte) noexcept {
    return byte >= 0x20 && byte < 0x80 && byte != '"' && byte != '\\';
}

// The first byte in [at, end) that JSON does not write as is, eight bytes at a time: in a word, a byte's high
// bit is set below if it is under 0x20, a quote or a backslash, or is itself >= 0x80. A borrow of the
// subtractions can mark bytes above a true one, never below, so the lowest mark is exact.
const char* find_escaped(const char* at, const char* end) noexcept {
    static_assert(std::endian::native == std::endian::little, "the lowest mark is the first byte");
    constexpr std::uint64_t ones = 0x0101010101010101;
    constexpr std::uint64_t high_bits = 0x8080808080808080;
    const auto zero_bytes = [](std::uint64_t word) { return (word - ones) & ~word; };
    while (end - at >= 8) {
        std::uint64_t word = 0;
        std::memcpy(&word, at, sizeof word);
        const std::uint64_t marks = (((word - ones * 0x20) & ~word) | zero_bytes(word ^ (ones * '"')) |
                                     zero_bytes(word ^ (ones * '\\')) | word) &
                                    high_bits;
        if (marks != 0) {
            return at + std::countr_zero(marks) / 8;
        }
        at += 8;
    }
    return std::find_if(at, end, [](char byte) { return !written_as_is(static_cast<unsigned char>(byte)); });
}

void append_escaped_run(std::string& out, std::string_view run) {
    const std::string escaped = json(run).dump(-1, ' ', false, replace_invalid);
    out.append(escaped, 1, escaped.size() - 2);  // without its quotes
}

// A run of bytes that need escaping always ends at an ASCII byte or at the end of the text, and an ASCII byte
// is never inside a UTF-8 sequence, so nlohmann sees every sequence (valid or broken) whole, as in one dump.
void append_string(std::string& out, std::string_view text) {
    out.push_back('"');
    const auto* const end = text.data() + text.size();
    const auto* at = text.data();
    while (at != end) {
        const auto* const special = find_escaped(at, end);
        out.append(at, special);
        const auto* const plain = std::find_if(
            special, end, [](char byte) { return written_as_is(static_cast<unsigned char>(byte)); });
        if (special != plain) {
            append_escaped_run(out, std::string_view(special, static_cast<std::size_t>(plain - special)));
        }
        at = plain;
    }
    out.push_back('"');
}

bool holds_long_string(const json& value) noexcept {
    switch (value.type()) {
        case json::value_t::string:
            return value.get_ref<const std::string&>().size() >= short_string;
        case json::value_t::object:
            return std::any_of(value.get_ref<const json::object_t&>().begin(),
                               value.get_ref<const json::object_t&>().end(),
                               [](const auto& member) { return holds_long_string(member.second); });
        case json::value_t::array:
            return std::any_of(value.get_ref<const json::array_t&>().begin(),
                               value.get_ref<const json::array_t&>().end(),
                               [](const json& element) { return holds_long_string(element); });
        default:
            return false;
    }
}

// Appends dump_json(value) to `out`.
void append_json(std::string& out, const json& value) {
    if (!holds_long_string(value)) {  // the usual message: one dump, no scan
        out += value.dump(-1, ' ', false, replace_invalid);
        return;
    }
    switch (value.type()) {
        case json::value_t::object: {
            out.push_back('{');
            bool first = true;
            for (const auto& [key, member] : value.items()) {
                if (!first) {
                    out.push_back(',');
                }
                first = false;
                append_string(out, key);
                out.push_back(':');
                append_json(out, member);
            }
            out.push_back('}');
            return;
        }
        case json::value_t::array: {
            out.push_back('[');
            bool first = true;
            for (const auto& element : value) {
                if (!first) {
                    out.push_back(',');
                }
                first = false;
                append_json(out, element);
            }
            out.push_back(']');
            return;
        }
        case json::value_t::string: {
            const auto& text = value.get_ref<const std::string&>();
            out.reserve(out.size() + text.size() + 2);
            append_string(out, text);
            return;
        }
        default:
            out += value.dump(-1, ' ', false, replace_invalid);
            return;
    }
}

}  // namespace

std::string dump_json(const json& value) {
    if (!holds_long_string(value)) {
        return value.dump(-1, ' ', false, replace_invalid);
    }
    std::string out;
    append_json(out, value);
    return out;
}

}  // namespace cellblock::kernel
