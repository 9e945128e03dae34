#pragma once
// Cryptographic helpers, all delegated to OpenSSL / libuuid: message signing for the Jupyter wire protocol,
// random identifiers and constant-time comparison of secrets.
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "cellblock/contract/base64.hpp"
#include "cellblock/contract/message_signer.hpp"

namespace cellblock::gateway {

// Signs Jupyter messages with HMAC-SHA256 over header, parent_header, metadata and content (in that order),
// as the Jupyter messaging spec requires, with the kernel's own signer (contract/include/cellblock/contract/
// message_signer.hpp). An empty key disables signing (the signature is then ""). Copies share one keyed
// context.
class HmacSigner {
  public:
    explicit HmacSigner(std::string key);
    // `parts` must be the four signed frames; throws std::invalid_argument otherwise.
    std::string sign(std::span<const std::string_view> parts) const;
    bool verify(std::span<const std::string_view> parts, std::string_view signature) const;
    const std::string& key() const { return key_; }

  private:
    std::string key_;
    std::shared_ptr<const contract::MessageSigner> signer_;
};

// Random bytes from OpenSSL's CSPRNG, hex-encoded (2 characters per byte).
std::string random_hex(std::size_t byte_count);
// RFC 4122 version 4 UUID in canonical lowercase form (libuuid).
std::string new_uuid();
// Compares secrets without leaking the position of the first difference (CRYPTO_memcmp).
bool constant_time_equals(std::string_view a, std::string_view b);
// Standard base64, the contract's (contract/include/cellblock/contract/base64.hpp).
using contract::base64_decode;
using contract::base64_encode;

}  // namespace cellblock::gateway
