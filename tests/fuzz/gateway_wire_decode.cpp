// The gateway's decoding of every multipart message a kernel sends (gateway/src/jupyter/jupyter_message.cpp,
// decode_wire): delimiter search, HMAC check, header JSON, buffers.
//
// Input: one mode byte, then the frames separated by 0x1e. Mode bit 0 re-signs the four signed parts with the
// key (so the fuzzer gets past the HMAC); bit 1 uses an empty key. Bits 2-3 pick the channel.
// Invariants: decode_wire throws nothing but MessageError (its callers in kernel.cpp catch only that); a
// message is never accepted with a signature the key did not make; what decodes re-encodes (encode_wire) to a
// message that decodes to the same parts.
#include <array>
#include <string>
#include <string_view>
#include <vector>

#include "cellblock/gateway/common/crypto.hpp"
#include "cellblock/gateway/jupyter/jupyter_message.hpp"
#include "fuzz_support.hpp"

using namespace cellblock::gateway;
using cellblock::fuzz::require;

namespace {
constexpr std::string_view key = "7c2e9a41-3b5d-4f60-8e1a-2d9c7b3f5e80";
constexpr std::string_view delimiter = "<IDS|MSG>";
constexpr std::array channels = {Channel::shell, Channel::control, Channel::stdin_, Channel::iopub};
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    if (size < 1) {
        return 0;
    }
    const bool resign = data[0] & 1;
    const HmacSigner signer((data[0] & 2) ? std::string() : std::string(key));
    const Channel channel = channels[(data[0] >> 2) & 3];
    std::vector<std::string> frames =
        cellblock::fuzz::split_frames(cellblock::fuzz::as_text(data + 1, size - 1));

    std::size_t d = 0;
    while (d < frames.size() && frames[d] != delimiter) {
        ++d;
    }
    const bool well_formed = d < frames.size() && frames.size() >= d + 6;
    if (resign && well_formed) {
        const std::array<std::string_view, 4> parts = {frames[d + 2], frames[d + 3], frames[d + 4],
                                                       frames[d + 5]};
        frames[d + 1] = signer.sign(parts);
    }
    bool signature_valid = false;
    std::size_t buffer_count = 0;
    if (well_formed) {
        const std::array<std::string_view, 4> parts = {frames[d + 2], frames[d + 3], frames[d + 4],
                                                       frames[d + 5]};
        signature_valid = signer.verify(parts, frames[d + 1]);
        buffer_count = frames.size() - d - 6;
    }

    JupyterMessage message;
    try {
        message = decode_wire(channel, std::move(frames), signer);
    } catch (const MessageError&) {
        return 0;
    }
    require(well_formed && signature_valid, "decode_wire accepted a malformed or badly signed message");
    require(message.channel == channel, "decode_wire changed the channel");
    require(message.buffers.size() == buffer_count, "decode_wire lost or invented buffers");

    // Relaying re-encodes the raw parts: the copy must decode to the same message.
    JupyterMessage again;
    try {
        again = decode_wire(channel, encode_wire(message, signer), signer);
    } catch (const MessageError&) {
        cellblock::fuzz::invariant_failed("a decoded message did not survive encode_wire + decode_wire");
    }
    // encode_wire sends an empty part as "{}".
    const std::string expected_content = message.content.empty() ? "{}" : message.content;
    require(again.header == message.header && again.content == expected_content &&
                again.msg_id == message.msg_id && again.msg_type == message.msg_type &&
                again.buffers == message.buffers,
            "encode_wire + decode_wire changed the message");
    return 0;
}
