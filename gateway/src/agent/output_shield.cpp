#include "cellblock/gateway/agent/output_shield.hpp"

#include <openssl/evp.h>

#include <array>
#include <cstdint>
#include <stdexcept>

#include "cellblock/contract/message_signer.hpp"

namespace cellblock::gateway::agent {

std::string strip_ansi(std::string_view text) {
    std::string out;
    out.reserve(text.size());
    constexpr char escape = '\x1b';
    for (std::size_t i = 0; i < text.size(); ++i) {
        if (text[i] != escape) {
            out.push_back(text[i]);
            continue;
        }
        if (i + 1 >= text.size())
            break;
        const char kind = text[i + 1];
        if (kind == '[') {  // CSI: parameters and intermediates, then one final byte in @..~
            std::size_t j = i + 2;
            while (j < text.size() && !(text[j] >= '@' && text[j] <= '~'))
                ++j;
            i = j;
        } else if (kind == ']') {  // OSC: ends with BEL or ESC '\'
            std::size_t j = i + 2;
            while (j < text.size() && text[j] != '\a' &&
                   !(text[j] == escape && j + 1 < text.size() && text[j + 1] == '\\'))
                ++j;
            i = (j < text.size() && text[j] == escape) ? j + 1 : j;
        } else {
            // nF escapes (ESC, intermediates 0x20-0x2F, one final byte, e.g. ESC ( B) and two-byte ones (ESC
            // 7).
            std::size_t j = i + 1;
            while (j < text.size() && text[j] >= 0x20 && text[j] <= 0x2F)
                ++j;
            i = j;
        }
    }
    return out;
}

namespace {
bool is_continuation(char byte) {
    return (static_cast<unsigned char>(byte) & 0xC0) == 0x80;
}
}  // namespace

std::string_view utf8_head(std::string_view text, std::size_t max_bytes) {
    if (text.size() <= max_bytes)
        return text;
    std::size_t end = max_bytes;
    while (end > 0 && is_continuation(text[end]))
        --end;
    return text.substr(0, end);
}

std::string_view utf8_tail(std::string_view text, std::size_t max_bytes) {
    if (text.size() <= max_bytes)
        return text;
    std::size_t start = text.size() - max_bytes;
    while (start < text.size() && is_continuation(text[start]))
        ++start;
    return text.substr(start);
}

ShieldedText shield_text(std::string_view text, std::size_t cap,
                         const std::optional<std::string>& saved_path) {
    ShieldedText shielded;
    shielded.original_bytes = text.size();
    if (text.size() <= cap) {
        shielded.text = std::string(text);
        return shielded;
    }
    const std::string_view head = utf8_head(text, cap / 2);
    const std::string_view tail = utf8_tail(text, cap - cap / 2);
    const std::size_t omitted = text.size() - head.size() - tail.size();
    std::string marker = "\n[cellblock: " + std::to_string(omitted) + " of " + std::to_string(text.size()) +
                         " bytes omitted here";
    marker += saved_path ? "; the full text is in the workspace file " + *saved_path + "]\n" : "]\n";
    shielded.text.reserve(head.size() + marker.size() + tail.size());
    shielded.text.append(head).append(marker).append(tail);
    shielded.shortened = true;
    return shielded;
}

bool is_valid_utf8(std::string_view text) {
    std::size_t i = 0;
    while (i < text.size()) {
        const auto lead = static_cast<unsigned char>(text[i]);
        std::size_t length;
        std::uint32_t code;
        if (lead < 0x80) {
            ++i;
            continue;
        }
        if ((lead & 0xE0) == 0xC0) {
            length = 2;
            code = lead & 0x1F;
        } else if ((lead & 0xF0) == 0xE0) {
            length = 3;
            code = lead & 0x0F;
        } else if ((lead & 0xF8) == 0xF0) {
            length = 4;
            code = lead & 0x07;
        } else
            return false;
        if (i + length > text.size())
            return false;
        for (std::size_t k = 1; k < length; ++k) {
            const auto next = static_cast<unsigned char>(text[i + k]);
            if ((next & 0xC0) != 0x80)
                return false;
            code = (code << 6) | (next & 0x3F);
        }
        static constexpr std::uint32_t smallest[] = {0, 0, 0x80, 0x800, 0x10000};
        if (code < smallest[length] || code > 0x10FFFF || (code >= 0xD800 && code <= 0xDFFF))
            return false;
        i += length;
    }
    return true;
}

std::string sha256_hex(std::string_view bytes) {
    std::array<unsigned char, EVP_MAX_MD_SIZE> digest{};
    unsigned int length = 0;
    if (EVP_Digest(bytes.data(), bytes.size(), digest.data(), &length, EVP_sha256(), nullptr) != 1)
        throw std::runtime_error("EVP_Digest(SHA-256) failed");
    return contract::to_hex({digest.data(), length});
}

}  // namespace cellblock::gateway::agent
