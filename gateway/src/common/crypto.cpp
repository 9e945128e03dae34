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

}  // namespace cellblock::gateway
