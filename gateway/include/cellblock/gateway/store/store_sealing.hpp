#pragma once
// Key material at rest: whoever reads the store's bytes (the SQLite file, a PostgreSQL dump) must not be able
// to drive the kernels. Every kernel's HMAC key is sealed with AES-256-GCM (OpenSSL EVP) under a store secret
// that lives outside the store: `store-key` in the state directory (0600, made on first start), or
// --store-key-file for a store that several gateways share (one secret for all of them). The kernel's id is
// the associated data, so a sealed key cannot be moved to another record.
//
// Sealing is a decorator over any SessionStore (seal_kernel_keys), so neither store implementation knows of
// it. A key written before sealing existed is read as it is and sealed when the record is next written.
#include <array>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>

#include "cellblock/gateway/store/store.hpp"

namespace cellblock::gateway {

class StoreSecret {
  public:
    static constexpr std::size_t size = 32;
    // Reads the secret from `file` (64 hex digits); with `create`, makes a fresh one (mode 0600) when the
    // file does not exist. Throws StoreError naming the file otherwise.
    static StoreSecret load(const std::filesystem::path& file, bool create);
    explicit StoreSecret(const std::array<unsigned char, size>& bytes) : bytes_(bytes) {}

    // "sealed:v1:" + base64(nonce | ciphertext | tag).
    std::string seal(std::string_view plain, std::string_view associated) const;
    // Opens what seal() made; text without the prefix is returned as it is (written before sealing). Throws
    // StoreError when the text was sealed under another secret or altered.
    std::string open(std::string_view sealed, std::string_view associated) const;
    static bool is_sealed(std::string_view text);
    // HMAC-SHA256 of a tenant's token under a key derived from this secret (hex): what the store keeps of a
    // token, so that reading the store gives neither a token nor a hash to try tokens against offline.
    std::string token_digest(std::string_view token) const;

  private:
    std::array<unsigned char, size> bytes_;
};

// `store` with every KernelRecord::key sealed on the way in and opened on the way out.
std::unique_ptr<SessionStore> seal_kernel_keys(std::unique_ptr<SessionStore> store, StoreSecret secret);

}  // namespace cellblock::gateway
