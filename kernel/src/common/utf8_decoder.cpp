#include "common/utf8_decoder.hpp"

#include <cstdint>
#include <cstring>

namespace cellblock::kernel {
namespace {

constexpr std::string_view replacement = "\xEF\xBF\xBD";

bool is_continuation(unsigned char byte) noexcept {
    return (byte & 0xC0) == 0x80;
}

// Expected length of a sequence starting with `lead`, 0 if `lead` cannot start one.
std::size_t sequence_length(unsigned char lead) noexcept {
    if (lead < 0x80) {
        return 1;
    }
    if (lead >= 0xC2 && lead <= 0xDF) {
        return 2;
    }
    if (lead >= 0xE0 && lead <= 0xEF) {
        return 3;
    }
    if (lead >= 0xF0 && lead <= 0xF4) {
        return 4;
    }
    return 0;  // continuation byte, overlong lead (C0, C1) or beyond U+10FFFF (F5..FF)
}

// The allowed range of the second byte (rules out overlongs, surrogates and > U+10FFFF).
bool second_byte_ok(unsigned char lead, unsigned char second) noexcept {
    switch (lead) {
        case 0xE0:
            return second >= 0xA0 && second <= 0xBF;
        case 0xED:
            return second >= 0x80 && second <= 0x9F;
        case 0xF0:
            return second >= 0x90 && second <= 0xBF;
        case 0xF4:
            return second >= 0x80 && second <= 0x8F;
        default:
            return is_continuation(second);
    }
}

// End of the longest prefix of data[from..] made of complete, valid sequences.
std::size_t complete_valid_end(std::string_view data, std::size_t from) noexcept {
    constexpr std::uint64_t high_bits = 0x8080808080808080ULL;
    std::size_t i = from;
    const std::size_t size = data.size();
    while (i < size) {
        // Eight ASCII bytes at a time: output is mostly ASCII.
        std::uint64_t word = 0;
        while (i + sizeof(word) <= size) {
            std::memcpy(&word, data.data() + i, sizeof(word));
            if (word & high_bits) {
                break;
            }
            i += sizeof(word);
        }
        if (i == size) {
            break;
        }
        const auto lead = static_cast<unsigned char>(data[i]);
        if (lead < 0x80) {
            ++i;
            continue;
        }
        const std::size_t length = sequence_length(lead);
        if (length == 0 || i + length > size ||
            !second_byte_ok(lead, static_cast<unsigned char>(data[i + 1]))) {
            return i;
        }
        for (std::size_t k = 2; k < length; ++k) {
            if (!is_continuation(static_cast<unsigned char>(data[i + k]))) {
                return i;
            }
        }
        i += length;
    }
    return size;
}

}  // namespace

void Utf8StreamDecoder::decode_appended(std::string& text, std::size_t from) {
    if (!pending_.empty()) {
        text.insert(from, pending_);
        pending_.clear();
    }
    const std::size_t valid_end = complete_valid_end(text, from);
    if (valid_end == text.size()) {
        return;
    }
    // An incomplete tail or invalid bytes: the rest goes the careful way.
    const std::string rest = text.substr(valid_end);
    text.resize(valid_end);
    text += feed(rest);
}

std::string Utf8StreamDecoder::feed(std::string_view bytes) {
    std::string input;
    std::string_view data = bytes;
    if (!pending_.empty()) {
        input = std::move(pending_);
        input.append(bytes);
        pending_.clear();
        data = input;
    }
    std::string output;
    output.reserve(data.size());
    std::size_t i = 0;
    while (i < data.size()) {
        const auto lead = static_cast<unsigned char>(data[i]);
        if (lead < 0x80) {
            // Fast path for ASCII runs.
            std::size_t end = i + 1;
            while (end < data.size() && static_cast<unsigned char>(data[end]) < 0x80) {
                ++end;
            }
            output.append(data.substr(i, end - i));
            i = end;
            continue;
        }
        const std::size_t length = sequence_length(lead);
        if (length == 0) {
            output.append(replacement);
            ++i;
            continue;
        }
        // Check as many bytes as are available; a valid but incomplete tail waits for the next chunk.
        std::size_t valid = 1;
        while (valid < length && i + valid < data.size()) {
            const auto byte = static_cast<unsigned char>(data[i + valid]);
            const bool ok = valid == 1 ? second_byte_ok(lead, byte) : is_continuation(byte);
            if (!ok) {
                break;
            }
            ++valid;
        }
        if (valid == length) {
            output.append(data.substr(i, length));
            i += length;
        } else if (i + valid == data.size()) {
            pending_.assign(data.substr(i));
            break;
        } else {
            // Maximal invalid subpart becomes one U+FFFD (the Unicode "substitution of maximal subparts").
            output.append(replacement);
            i += valid;
        }
    }
    return output;
}

std::string Utf8StreamDecoder::finish() {
    if (pending_.empty()) {
        return {};
    }
    pending_.clear();
    return std::string(replacement);
}

std::string_view utf8_prefix(std::string_view text, std::size_t max_bytes) noexcept {
    if (text.size() <= max_bytes) {
        return text;
    }
    std::size_t end = max_bytes;
    while (end > 0 && is_continuation(static_cast<unsigned char>(text[end]))) {
        --end;
    }
    return text.substr(0, end);
}

}  // namespace cellblock::kernel
