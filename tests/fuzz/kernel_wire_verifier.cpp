// The kernel's inbound check of every Jupyter message a client sends (kernel/src/server/inbound_verifier.cpp,
// InboundVerifier::check): delimiter search, exact-length constant-time HMAC, replay memory, header JSON.
//
// Input: one mode byte, then the multipart frames separated by 0x1e. Mode bit 0 re-signs the four signed
// parts with the key before checking (so the fuzzer reaches the header parsing behind the HMAC, which it
// cannot forge); bit 1 uses an empty key (signing disabled, as the protocol allows). Invariants: a message is
// never accepted with a signature the key did not make; a correctly signed message is never refused for its
// signature, and the same message again is a replay.
#include <string>
#include <string_view>
#include <vector>

#include "fuzz_support.hpp"
#include "server/inbound_verifier.hpp"

using cellblock::fuzz::require;
using cellblock::kernel::InboundVerdict;
using cellblock::kernel::InboundVerifier;
using cellblock::kernel::MessageSigner;
using cellblock::kernel::SignedParts;

namespace {
constexpr std::string_view key = "0b8d3c4e-6f1a-4c2b-9e7d-5a3f2c1b0d9e";
constexpr std::string_view delimiter = "<IDS|MSG>";
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    if (size < 1) {
        return 0;
    }
    const bool resign = data[0] & 1;
    const bool keyless = data[0] & 2;
    std::vector<std::string> frames =
        cellblock::fuzz::split_frames(cellblock::fuzz::as_text(data + 1, size - 1));
    const MessageSigner signer("hmac-sha256", keyless ? std::string() : std::string(key));

    std::size_t d = 0;
    while (d < frames.size() && frames[d] != delimiter) {
        ++d;
    }
    const bool well_formed = d < frames.size() && frames.size() >= d + 6;
    if (resign && well_formed) {
        frames[d + 1] = signer.sign(SignedParts{frames[d + 2], frames[d + 3], frames[d + 4], frames[d + 5]});
    }
    const std::vector<std::string_view> views(frames.begin(), frames.end());

    InboundVerifier verifier(signer, 16);
    const InboundVerdict verdict = verifier.check(views);
    if (!well_formed) {
        require(verdict.kind == InboundVerdict::Kind::malformed,
                "a message without delimiter + 5 frames passed");
        return 0;
    }
    const bool signature_valid =
        keyless ||
        signer.verify(frames[d + 1], SignedParts{frames[d + 2], frames[d + 3], frames[d + 4], frames[d + 5]});
    if (!signature_valid) {
        require(verdict.kind == InboundVerdict::Kind::bad_signature,
                "a message with a bad signature was not refused");
        return 0;
    }
    require(verdict.kind != InboundVerdict::Kind::bad_signature, "a correctly signed message was refused");
    if (verdict.kind == InboundVerdict::Kind::accepted) {
        require(verdict.delimiter == d, "the verdict names another delimiter");
    }
    const InboundVerdict again = verifier.check(views);
    if (!keyless) {
        require(again.kind == InboundVerdict::Kind::replayed,
                "the same signed message twice was not a replay");
    } else {
        require(again.kind == verdict.kind, "without a key the same message got another verdict");
    }
    return 0;
}
