// What the confined worker writes to the kernel: length-prefixed JSON frames and stream frames (0x01/0x02 and
// raw text) on the worker socket (kernel/src/worker/worker_channel.cpp, FrameDecoder) and raw stdout/stderr
// bytes (of the pipes and of stream frames) turned into UTF-8 text (kernel/src/common/utf8_decoder.cpp,
// Utf8StreamDecoder and utf8_prefix). The worker runs untrusted code, so every byte here is hostile.
//
// Input: two bytes that pick the read-chunk sizes, then the byte stream.
// Invariants: the frame decoder throws nothing but ProtocolError, yields only JSON objects with a string
// "type" or stream frames with text, and yields the same messages, the same stream text and the same error
// whether the bytes arrive at once or in chunks; the
// UTF-8 decoder's output is valid UTF-8, independent of the chunking, equal to the input when the input is
// valid UTF-8; utf8_prefix cuts valid UTF-8 on a code point boundary within its limit.
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/utf8_decoder.hpp"
#include "fuzz_support.hpp"
#include "worker/worker_channel.hpp"

using cellblock::fuzz::require;
using cellblock::kernel::FrameDecoder;
using cellblock::kernel::ProtocolError;
using cellblock::kernel::Utf8StreamDecoder;
using nlohmann::json;

namespace {
struct Decoded {
    std::vector<json> messages;
    std::string stream_text;  // of all stream frames, each tagged with its channel byte
    std::optional<std::string> error;
};

// Feeds `stream` in chunks of 1 + (size_byte % 64) bytes, alternating between the two size bytes.
template <typename Consume>
void in_chunks(std::string_view stream, const std::uint8_t sizes[2], Consume consume) {
    for (std::size_t at = 0, turn = 0; at < stream.size(); ++turn) {
        const std::size_t length = 1 + sizes[turn % 2] % 64;
        consume(stream.substr(at, length));
        at += length;
    }
}

Decoded decode_frames(std::string_view stream, const std::uint8_t* sizes) {
    Decoded decoded;
    FrameDecoder decoder;
    const auto consume = [&](std::string_view chunk) {
        if (decoded.error) {
            return;
        }
        decoder.append(chunk);
        try {
            while (auto frame = decoder.next()) {
                if (frame->kind != cellblock::kernel::WorkerFrame::Kind::message) {
                    require(!frame->text.empty(), "the frame decoder yielded a stream frame without text");
                    decoded.stream_text +=
                        frame->kind == cellblock::kernel::WorkerFrame::Kind::stdout_text ? '\1' : '\2';
                    decoded.stream_text += frame->text;
                    continue;
                }
                const json& message = frame->message;
                require(message.is_object() && message.contains("type") && message["type"].is_string(),
                        "the frame decoder yielded a message without a string type");
                decoded.messages.push_back(message);
            }
        } catch (const ProtocolError& error) {
            decoded.error = error.what();
        }
    };
    if (sizes == nullptr) {
        consume(stream);
    } else {
        in_chunks(stream, sizes, consume);
    }
    return decoded;
}

bool valid_utf8(const std::string& text) {
    try {
        (void)json(text).dump();  // nlohmann's own validator: throws type_error 316 on invalid UTF-8
        return true;
    } catch (const json::type_error&) {
        return false;
    }
}

std::string decode_text(std::string_view stream, const std::uint8_t* sizes) {
    Utf8StreamDecoder decoder;
    std::string text;
    if (sizes == nullptr) {
        text = decoder.feed(stream);
    } else {
        in_chunks(stream, sizes, [&](std::string_view chunk) {
            const std::string piece = decoder.feed(chunk);
            require(valid_utf8(piece), "a chunk decoded to invalid UTF-8");
            text += piece;
        });
    }
    text += decoder.finish();
    require(!decoder.has_pending(), "finish() left bytes pending");
    return text;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    if (size < 2) {
        return 0;
    }
    const std::uint8_t* sizes = data;
    const std::string_view stream = cellblock::fuzz::as_text(data + 2, size - 2);

    const Decoded at_once = decode_frames(stream, nullptr);
    const Decoded chunked = decode_frames(stream, sizes);
    require(at_once.messages == chunked.messages, "chunking changed the decoded worker messages");
    require(at_once.stream_text == chunked.stream_text, "chunking changed the decoded stream frames");
    require(at_once.error.has_value() == chunked.error.has_value(),
            "chunking changed whether the stream is refused");

    const std::string text = decode_text(stream, nullptr);
    require(valid_utf8(text), "the UTF-8 decoder produced invalid UTF-8");
    require(decode_text(stream, sizes) == text, "chunking changed the decoded text");
    if (valid_utf8(std::string(stream))) {
        require(text == stream, "valid UTF-8 was altered");
    }
    for (const std::size_t limit : {std::size_t{0}, std::size_t{1}, std::size_t{sizes[0]}, text.size() / 2}) {
        const std::string_view prefix = cellblock::kernel::utf8_prefix(text, limit);
        require(prefix.size() <= limit && text.starts_with(prefix) && valid_utf8(std::string(prefix)),
                "utf8_prefix is not a valid prefix within its limit");
        require(limit - prefix.size() < 4 || prefix.size() == text.size(),
                "utf8_prefix cut more than a code point");
    }
    return 0;
}
