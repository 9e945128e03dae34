#include "cellblock/gateway/common/crypto.hpp"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/rand.h>
#include <uuid/uuid.h>

#include <array>
#include <memory>
#include <stdexcept>
#include <vector>

namespace cellblock::gateway {

namespace {

contract::SignedParts four_parts(std::span<const std::string_view> parts) {
    if (parts.size() != 4)
        throw std::invalid_argument("a Jupyter message signs four parts, not " +
                                    std::to_string(parts.size()));
    return {parts[0], parts[1], parts[2], parts[3]};
}

}  // namespace

HmacSigner::HmacSigner(std::string key)
    : key_(std::move(key)), signer_(std::make_shared<const contract::MessageSigner>("hmac-sha256", key_)) {}

std::string HmacSigner::sign(std::span<const std::string_view> parts) const {
    return signer_->sign(four_parts(parts));
}

bool HmacSigner::verify(std::span<const std::string_view> parts, std::string_view signature) const {
    return signer_->verify(signature, four_parts(parts));
}

std::string random_hex(std::size_t byte_count) {
    std::vector<unsigned char> bytes(byte_count);
    if (RAND_bytes(bytes.data(), static_cast<int>(bytes.size())) != 1)
        throw std::runtime_error("RAND_bytes failed");
    return contract::to_hex(bytes);
}

std::string new_uuid() {
    uuid_t raw;
    uuid_generate_random(raw);
    std::array<char, 37> text{};
    uuid_unparse_lower(raw, text.data());
    return std::string(text.data());
}

bool constant_time_equals(std::string_view a, std::string_view b) {
    if (a.size() != b.size())
        return false;
    return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

std::string base64_encode(std::string_view bytes) {
    std::string out(4 * ((bytes.size() + 2) / 3) + 1, '\0');
    int written =
        EVP_EncodeBlock(reinterpret_cast<unsigned char*>(out.data()),
                        reinterpret_cast<const unsigned char*>(bytes.data()), static_cast<int>(bytes.size()));
    out.resize(static_cast<std::size_t>(written));
    return out;
}

std::optional<std::string> base64_decode(std::string_view text) {
    std::string compact;
    for (char c : text)
        if (c != ' ' && c != '\n' && c != '\r' && c != '\t')
            compact.push_back(c);
    if (compact.size() % 4 != 0)
        return std::nullopt;
    std::string out(compact.size() / 4 * 3, '\0');
    const int length = EVP_DecodeBlock(reinterpret_cast<unsigned char*>(out.data()),
                                       reinterpret_cast<const unsigned char*>(compact.data()),
                                       static_cast<int>(compact.size()));
    if (length < 0)
        return std::nullopt;
    // EVP_DecodeBlock counts the padding as zero bytes.
    std::size_t padding = 0;
    if (!compact.empty() && compact.back() == '=')
        ++padding;
    if (compact.size() > 1 && compact[compact.size() - 2] == '=')
        ++padding;
    out.resize(static_cast<std::size_t>(length) - padding);
    return out;
}

}  // namespace cellblock::gateway
