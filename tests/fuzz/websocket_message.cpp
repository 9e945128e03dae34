// What a WebSocket client sends on /api/kernels/{id}/channels (gateway/src/http/websocket_channel.cpp hands
// the payload to these decoders in gateway/src/jupyter/jupyter_message.cpp): legacy JSON text, the legacy
// binary envelope (big-endian offsets) and v1.kernel.websocket.jupyter.org (little-endian offsets).
//
// Input: one byte picks the decoder (0 text, 1 legacy binary, 2 v1), the rest is the WebSocket payload.
// Invariants: only MessageError escapes (anything else becomes "internal error" for the client); a decoded
// message has a msg_type and msg_id, is never on IOPub, and survives the gateway's own encoders: encode_v1
// and encode_legacy output decodes back to the same message.
#include <string>
#include <string_view>

#include "cellblock/gateway/jupyter/jupyter_message.hpp"
#include "fuzz_support.hpp"

using namespace cellblock::gateway;
using cellblock::fuzz::require;

namespace {
JupyterMessage decode(int format, std::string_view payload) {
    switch (format) {
        case 0:
            return decode_legacy_text(payload);
        case 1:
            return decode_legacy_binary(payload);
        default:
            return decode_v1(payload);
    }
}

void require_same(const JupyterMessage& a, const JupyterMessage& b, const char* what) {
    require(a.channel == b.channel && a.msg_id == b.msg_id && a.msg_type == b.msg_type &&
                a.header == b.header && a.parent_header == b.parent_header && a.metadata == b.metadata &&
                a.content == b.content && a.buffers == b.buffers,
            what);
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    if (size < 1) {
        return 0;
    }
    const int format = data[0] % 3;
    const std::string_view payload = cellblock::fuzz::as_text(data + 1, size - 1);
    JupyterMessage message;
    try {
        message = decode(format, payload);
    } catch (const MessageError&) {
        return 0;
    }
    require(!message.msg_type.empty() && !message.msg_id.empty(),
            "a decoded message has no msg_type or msg_id");
    require(message.channel != Channel::iopub, "a client message was accepted on IOPub");

    try {
        require_same(decode_v1(encode_v1(message).payload), message,
                     "encode_v1 + decode_v1 changed the message");
        const WebSocketFrame legacy = encode_legacy(message);
        require(legacy.binary == !message.buffers.empty(), "encode_legacy picked the wrong frame type");
        require_same(
            legacy.binary ? decode_legacy_binary(legacy.payload) : decode_legacy_text(legacy.payload),
            message, "encode_legacy + decode changed the message");
    } catch (const MessageError& error) {
        cellblock::fuzz::invariant_failed(error.what());
    }
    return 0;
}
