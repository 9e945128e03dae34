// HMAC signatures of Jupyter messages (hex of HMAC(header | parent_header | metadata | content)), the one
// signer of both sides (EVP_MAC, a keyed context duplicated per message): the kernel signs and verifies its
// wire with it, the gateway its side of every kernel connection. Checked strictly: the received signature
// must have exactly the expected length and is compared in constant time (xeus 2.4.1 compares only a prefix
// and accepts "validsig+junk", which is why the kernel verifies messages itself before xeus sees them).
#pragma once

#include <array>
#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <string_view>

namespace cellblock::contract {

// The four signed frames of a message, in wire order.
using SignedParts = std::array<std::string_view, 4>;

class MessageSigner {
  public:
    // scheme: "hmac-sha256" (or any hmac-<digest> OpenSSL knows). An empty key disables signing: sign()
    // returns "" and verify() accepts everything, as the protocol specifies. Throws std::invalid_argument
    // for an unknown scheme.
    MessageSigner(std::string_view scheme, std::string key);
    ~MessageSigner();
    MessageSigner(const MessageSigner&) = delete;
    MessageSigner& operator=(const MessageSigner&) = delete;

    bool enabled() const noexcept { return !key_.empty(); }
    std::string sign(const SignedParts& parts) const;
    bool verify(std::string_view signature, const SignedParts& parts) const;

  private:
    struct Mac;
    std::string key_;
    std::unique_ptr<Mac> mac_;
};

// Lowercase hex, two characters a byte: how a signature is written (the gateway writes its random ids and
// tokens with it too).
std::string to_hex(std::span<const unsigned char> bytes);

}  // namespace cellblock::contract
