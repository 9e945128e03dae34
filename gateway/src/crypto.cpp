#include "cellblock/gateway/crypto.hpp"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <uuid/uuid.h>

#include <array>
#include <memory>
#include <stdexcept>
#include <vector>

namespace cellblock::gateway {

namespace {
std::string to_hex(const unsigned char* data, std::size_t size) {
    static constexpr char digits[] = "0123456789abcdef";
    std::string hex(size * 2, '0');
    for (std::size_t i = 0; i < size; ++i) {
        hex[2 * i] = digits[data[i] >> 4];
        hex[2 * i + 1] = digits[data[i] & 0x0f];
    }
    return hex;
}

struct HmacContextDeleter {
    void operator()(HMAC_CTX* context) const { HMAC_CTX_free(context); }
};
}  // namespace

HmacSigner::HmacSigner(std::string key) : key_(std::move(key)) {}

std::string HmacSigner::sign(std::span<const std::string_view> parts) const {
    if (key_.empty())
        return {};
        // HMAC_CTX is deprecated in OpenSSL 3 but remains the cheapest incremental API; EVP_MAC would
        // allocate more.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
    std::unique_ptr<HMAC_CTX, HmacContextDeleter> context(HMAC_CTX_new());
    if (!context ||
        HMAC_Init_ex(context.get(), key_.data(), static_cast<int>(key_.size()), EVP_sha256(), nullptr) != 1)
        throw std::runtime_error("HMAC_Init_ex failed");
    for (std::string_view part : parts) {
        if (HMAC_Update(context.get(), reinterpret_cast<const unsigned char*>(part.data()), part.size()) != 1)
            throw std::runtime_error("HMAC_Update failed");
    }
    std::array<unsigned char, EVP_MAX_MD_SIZE> digest{};
    unsigned int digest_size = 0;
    if (HMAC_Final(context.get(), digest.data(), &digest_size) != 1)
        throw std::runtime_error("HMAC_Final failed");
#pragma GCC diagnostic pop
    return to_hex(digest.data(), digest_size);
}

bool HmacSigner::verify(std::span<const std::string_view> parts, std::string_view signature) const {
    if (key_.empty())
        return true;
    return constant_time_equals(sign(parts), signature);
}

std::string random_hex(std::size_t byte_count) {
    std::vector<unsigned char> bytes(byte_count);
    if (RAND_bytes(bytes.data(), static_cast<int>(bytes.size())) != 1)
        throw std::runtime_error("RAND_bytes failed");
    return to_hex(bytes.data(), bytes.size());
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
