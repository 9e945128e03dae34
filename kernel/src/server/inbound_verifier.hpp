// The strict check of every message a client sends the kernel (frames as a ROUTER receives them):
// the delimiter, an exact-length constant-time HMAC (contract/include/cellblock/contract/message_signer.hpp),
// replayed signatures refused (replay_filter.hpp),
// and four JSON parts that parse (the header an object with a string msg_type). Refused messages get no
// reply; the kernel server logs them and keeps serving.
#pragma once

#include <cstddef>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "cellblock/contract/message_signer.hpp"
#include "server/replay_filter.hpp"

namespace cellblock::kernel {

// The kernel signs and verifies with the contract's signer, the same code as the gateway's.
using contract::MessageSigner;
using contract::SignedParts;

// The verdict on one inbound multipart message, with its parsed parts when accepted.
struct InboundVerdict {
    enum class Kind { accepted, malformed, bad_signature, replayed, bad_header, bad_json };
    static constexpr std::size_t kinds = 6;
    Kind kind = Kind::malformed;
    std::size_t delimiter = 0;                                // index of "<IDS|MSG>" when accepted
    std::string msg_type;                                     // when accepted
    nlohmann::json header, parent_header, metadata, content;  // when accepted
};

const char* describe(InboundVerdict::Kind kind) noexcept;

// Signature, replay and structure checks; pure apart from the replay memory.
class InboundVerifier {
  public:
    InboundVerifier(const MessageSigner& signer, std::size_t replay_capacity)
        : signer_(signer), replays_(replay_capacity) {}
    InboundVerdict check(const std::vector<std::string_view>& frames);

  private:
    const MessageSigner& signer_;
    ReplayFilter replays_;
};

}  // namespace cellblock::kernel
