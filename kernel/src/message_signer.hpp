// HMAC signatures of Jupyter messages (hex of HMAC(header | parent_header | metadata | content)),
// checked strictly: the received signature must have exactly the expected length and is compared in
// constant time. xeus 2.4.1 compares only a prefix (accepts "validsig+junk") and keeps no replay history,
// which is why the kernel verifies messages itself before xeus sees them.
#pragma once

#include <array>
#include <cstddef>
#include <deque>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_set>

namespace cellblock::kernel {

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

// Remembers the last `capacity` signatures; a message whose signature was already seen is a replay.
class ReplayFilter {
  public:
    explicit ReplayFilter(std::size_t capacity) : capacity_(capacity) {}
    // True the first time a signature is offered, false for a replay.
    bool first_time(std::string_view signature);

  private:
    std::size_t capacity_;
    std::deque<std::string> order_;
    std::unordered_set<std::string> seen_;
};

}  // namespace cellblock::kernel
