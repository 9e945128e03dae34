#include "cellblock/contract/base64.hpp"

#include <openssl/evp.h>

#include <limits>
#include <stdexcept>

namespace cellblock::contract {

std::string base64_encode(std::string_view bytes) {
    if (bytes.size() > static_cast<std::size_t>(std::numeric_limits<int>::max() / 4 * 3 - 3)) {
        throw std::length_error("base64_encode: buffer too large");
    }
    std::string encoded(4 * ((bytes.size() + 2) / 3) + 1, '\0');
    const int length =
        EVP_EncodeBlock(reinterpret_cast<unsigned char*>(encoded.data()),
                        reinterpret_cast<const unsigned char*>(bytes.data()), static_cast<int>(bytes.size()));
    encoded.resize(static_cast<std::size_t>(length));
    return encoded;
}

std::optional<std::string> base64_decode(std::string_view text) {
    std::string compact;
    compact.reserve(text.size());
    for (const char c : text) {
        if (c != ' ' && c != '\n' && c != '\r' && c != '\t') {
            compact.push_back(c);
        }
    }
    if (compact.size() % 4 != 0 ||
        compact.size() > static_cast<std::size_t>(std::numeric_limits<int>::max())) {
        return std::nullopt;
    }
    std::string decoded(compact.size() / 4 * 3, '\0');
    const int length = EVP_DecodeBlock(reinterpret_cast<unsigned char*>(decoded.data()),
                                       reinterpret_cast<const unsigned char*>(compact.data()),
                                       static_cast<int>(compact.size()));
    if (length < 0) {
        return std::nullopt;
    }
    // EVP_DecodeBlock counts the padding as zero bytes.
    std::size_t padding = 0;
    if (!compact.empty() && compact.back() == '=') {
        ++padding;
    }
    if (compact.size() > 1 && compact[compact.size() - 2] == '=') {
        ++padding;
    }
    decoded.resize(static_cast<std::size_t>(length) - padding);
    return decoded;
}

}  // namespace cellblock::contract
