#include "cellblock/contract/message_signer.hpp"

#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/params.h>

#include <stdexcept>
#include <vector>

namespace cellblock::contract {

// A keyed HMAC context that every signature starts from (EVP_MAC_CTX_dup is cheaper than re-keying).
struct MessageSigner::Mac {
    EVP_MAC* mac = nullptr;
    EVP_MAC_CTX* keyed = nullptr;
    ~Mac() {
        EVP_MAC_CTX_free(keyed);
        EVP_MAC_free(mac);
    }
};

namespace {

struct MacCtxDeleter {
    void operator()(EVP_MAC_CTX* ctx) const noexcept { EVP_MAC_CTX_free(ctx); }
};

}  // namespace

std::string to_hex(std::span<const unsigned char> bytes) {
    static constexpr char digits[] = "0123456789abcdef";
    std::string hex(bytes.size() * 2, '0');
    for (std::size_t i = 0; i < bytes.size(); ++i) {
        hex[2 * i] = digits[bytes[i] >> 4];
        hex[2 * i + 1] = digits[bytes[i] & 0x0f];
    }
    return hex;
}

MessageSigner::MessageSigner(std::string_view scheme, std::string key)
    : key_(std::move(key)), mac_(std::make_unique<Mac>()) {
    if (key_.empty()) {
        return;
    }
    constexpr std::string_view prefix = "hmac-";
    if (scheme.substr(0, prefix.size()) != prefix) {
        throw std::invalid_argument("unsupported signature scheme '" + std::string(scheme) + "'");
    }
    std::string digest(scheme.substr(prefix.size()));
    EVP_MD* md = EVP_MD_fetch(nullptr, digest.c_str(), nullptr);
    if (md == nullptr) {
        throw std::invalid_argument("unknown digest in signature scheme '" + std::string(scheme) + "'");
    }
    EVP_MD_free(md);

    mac_->mac = EVP_MAC_fetch(nullptr, "HMAC", nullptr);
    if (mac_->mac == nullptr) {
        throw std::runtime_error("OpenSSL has no HMAC implementation");
    }
    mac_->keyed = EVP_MAC_CTX_new(mac_->mac);
    if (mac_->keyed == nullptr) {
        throw std::runtime_error("EVP_MAC_CTX_new failed");
    }
    OSSL_PARAM params[] = {OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, digest.data(), 0),
                           OSSL_PARAM_construct_end()};
    if (EVP_MAC_init(mac_->keyed, reinterpret_cast<const unsigned char*>(key_.data()), key_.size(), params) !=
        1) {
        throw std::runtime_error("EVP_MAC_init failed for scheme '" + std::string(scheme) + "'");
    }
}

MessageSigner::~MessageSigner() = default;

std::string MessageSigner::sign(const SignedParts& parts) const {
    if (!enabled()) {
        return {};
    }
    std::unique_ptr<EVP_MAC_CTX, MacCtxDeleter> ctx(EVP_MAC_CTX_dup(mac_->keyed));
    if (!ctx) {
        throw std::runtime_error("EVP_MAC_CTX_dup failed");
    }
    for (const auto part : parts) {
        if (EVP_MAC_update(ctx.get(), reinterpret_cast<const unsigned char*>(part.data()), part.size()) !=
            1) {
            throw std::runtime_error("EVP_MAC_update failed");
        }
    }
    unsigned char digest[EVP_MAX_MD_SIZE];
    std::size_t length = 0;
    if (EVP_MAC_final(ctx.get(), digest, &length, sizeof(digest)) != 1) {
        throw std::runtime_error("EVP_MAC_final failed");
    }
    return to_hex({digest, length});
}

bool MessageSigner::verify(std::string_view signature, const SignedParts& parts) const {
    if (!enabled()) {
        return true;
    }
    const std::string expected = sign(parts);
    // Exact length first (rejects a valid signature with junk appended), then a constant-time compare.
    return signature.size() == expected.size() &&
           CRYPTO_memcmp(signature.data(), expected.data(), expected.size()) == 0;
}
}  // namespace cellblock::contract
