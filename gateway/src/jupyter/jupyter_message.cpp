#include "cellblock/gateway/jupyter/jupyter_message.hpp"

#include <array>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <utility>

#include "cellblock/gateway/common/time_format.hpp"

namespace cellblock::gateway {

using nlohmann::json;

namespace {
constexpr std::string_view delimiter = "<IDS|MSG>";

std::uint32_t read_u32_be(std::string_view data, std::size_t at) {
    if (at + 4 > data.size())
        throw MessageError("binary frame truncated");
    const auto* bytes = reinterpret_cast<const unsigned char*>(data.data() + at);
    return (std::uint32_t{bytes[0]} << 24) | (std::uint32_t{bytes[1]} << 16) |
           (std::uint32_t{bytes[2]} << 8) | std::uint32_t{bytes[3]};
}
void append_u32_be(std::string& out, std::uint32_t value) {
    const char bytes[4] = {static_cast<char>(value >> 24), static_cast<char>(value >> 16),
                           static_cast<char>(value >> 8), static_cast<char>(value)};
    out.append(bytes, 4);
}
std::uint64_t read_u64_le(std::string_view data, std::size_t at) {
    if (at + 8 > data.size())
        throw MessageError("v1 frame truncated");
    std::uint64_t value = 0;
    for (int i = 7; i >= 0; --i)
        value = (value << 8) | static_cast<unsigned char>(data[at + static_cast<std::size_t>(i)]);
    return value;
}
void append_u64_le(std::string& out, std::uint64_t value) {
    for (int i = 0; i < 8; ++i)
        out.push_back(static_cast<char>((value >> (8 * i)) & 0xff));
}

json parse_object(std::string_view text, std::string_view what) {
    json value = json::parse(text, nullptr, false);
    if (value.is_discarded())
        throw MessageError(std::string(what) + " is not valid JSON (or not UTF-8)");
    if (value.is_null())
        value = json::object();
    if (!value.is_object())
        throw MessageError(std::string(what) + " must be a JSON object");
    return value;
}

std::string now_iso() {
    return format_iso8601_utc(std::chrono::system_clock::now());
}

// Fills in what clients commonly omit so the kernel sees a spec-conforming header, and records
// msg_id/msg_type.
void normalize_header(json& header, JupyterMessage& message) {
    auto msg_type = header.find("msg_type");
    if (msg_type == header.end() || !msg_type->is_string() || msg_type->get_ref<const std::string&>().empty())
        throw MessageError("header.msg_type is missing");
    auto msg_id = header.find("msg_id");
    if (msg_id == header.end() || !msg_id->is_string() || msg_id->get_ref<const std::string&>().empty())
        header["msg_id"] = new_uuid();
    if (!header.contains("session") || !header["session"].is_string())
        header["session"] = "";
    if (!header.contains("username") || !header["username"].is_string())
        header["username"] = "";
    if (!header.contains("version") || !header["version"].is_string())
        header["version"] = "5.3";
    auto date = header.find("date");
    if (date == header.end() || !date->is_string()) {
        // Missing (OpenHands) or an epoch float (GatewayKernelClient): the kernel wants an ISO string.
        // A number past what system_clock can hold would overflow its integer conversion (undefined
        // behaviour; tests/fuzz/websocket_message): outside 1970..2100 it counts as missing.
        constexpr double latest_epoch_seconds = 4102444800.0;  // 2100-01-01T00:00:00Z
        const double epoch_seconds = date != header.end() && date->is_number() ? date->get<double>() : -1.0;
        if (epoch_seconds >= 0.0 && epoch_seconds <= latest_epoch_seconds) {
            header["date"] = format_iso8601_utc(std::chrono::system_clock::time_point(
                std::chrono::duration_cast<std::chrono::system_clock::duration>(
                    std::chrono::duration<double>(epoch_seconds))));
        } else {
            header["date"] = now_iso();
        }
    }
    message.msg_id = header["msg_id"].get<std::string>();
    message.msg_type = header["msg_type"].get<std::string>();
}

// Shared by both legacy decoders: `envelope` is the parsed JSON object of the message.
JupyterMessage message_from_envelope(json& envelope) {
    if (!envelope.is_object())
        throw MessageError("message must be a JSON object");
    JupyterMessage message;
    json header = envelope.contains("header") ? envelope["header"] : json::object();
    if (!header.is_object())
        throw MessageError("header must be a JSON object");
    normalize_header(header, message);
    auto part = [&envelope](const char* key) -> json {
        auto found = envelope.find(key);
        if (found == envelope.end() || found->is_null())
            return json::object();
        if (!found->is_object())
            throw MessageError(std::string(key) + " must be a JSON object");
        return *found;
    };
    message.header = header.dump();
    message.parent_header = part("parent_header").dump();
    message.metadata = part("metadata").dump();
    message.content = part("content").dump();
    auto channel = envelope.find("channel");
    if (channel != envelope.end() && channel->is_string() &&
        !channel->get_ref<const std::string&>().empty()) {
        auto parsed = parse_channel(channel->get_ref<const std::string&>());
        if (!parsed || *parsed == Channel::iopub)
            throw MessageError("unknown channel '" + channel->get<std::string>() +
                               "' (shell, control, stdin)");
        message.channel = *parsed;
    } else {
        message.channel = infer_channel(message.msg_type);
    }
    return message;
}

std::string_view json_or_empty_object(const std::string& text) {
    return text.empty() ? "{}" : std::string_view(text);
}
}  // namespace

std::string_view channel_name(Channel channel) {
    switch (channel) {
        case Channel::shell:
            return "shell";
        case Channel::control:
            return "control";
        case Channel::stdin_:
            return "stdin";
        case Channel::iopub:
            return "iopub";
    }
    return "shell";
}

std::optional<Channel> parse_channel(std::string_view name) {
    if (name == "shell")
        return Channel::shell;
    if (name == "control")
        return Channel::control;
    if (name == "stdin")
        return Channel::stdin_;
    if (name == "iopub")
        return Channel::iopub;
    return std::nullopt;
}

Channel infer_channel(std::string_view msg_type) {
    if (msg_type == "input_reply")
        return Channel::stdin_;
    if (msg_type == "shutdown_request" || msg_type == "interrupt_request" || msg_type == "debug_request")
        return Channel::control;
    return Channel::shell;
}

std::string string_member(const json& object, std::string_view key, std::string fallback) {
    const auto found = object.find(key);
    return found != object.end() && found->is_string() ? found->get<std::string>() : std::move(fallback);
}

json object_member(const json& object, std::string_view key) {
    const auto found = object.find(key);
    return found != object.end() && found->is_object() ? *found : json::object();
}

std::optional<int> int_member(const json& object, std::string_view key) {
    const auto found = object.find(key);
    if (found == object.end() || !found->is_number_integer())
        return std::nullopt;
    const bool fits = found->is_number_unsigned() ? std::in_range<int>(found->get<std::uint64_t>())
                                                  : std::in_range<int>(found->get<std::int64_t>());
    return fits ? std::optional<int>(found->get<int>()) : std::nullopt;
}

bool bool_member(const json& object, std::string_view key, bool fallback) {
    const auto found = object.find(key);
    return found != object.end() && found->is_boolean() ? found->get<bool>() : fallback;
}

JupyterMessage make_message(Channel channel, std::string_view msg_type, const json& content,
                            std::string_view session, const json& parent_header) {
    JupyterMessage message;
    message.channel = channel;
    message.msg_id = new_uuid();
    message.msg_type = std::string(msg_type);
    message.header = json{{"msg_id", message.msg_id}, {"msg_type", message.msg_type},
                          {"session", session},       {"username", "cellblock-gateway"},
                          {"date", now_iso()},        {"version", "5.3"}}
                         .dump();
    message.parent_header = parent_header.dump();
    message.metadata = "{}";
    message.content = content.dump();
    return message;
}

std::vector<std::string> encode_wire(const JupyterMessage& message, const HmacSigner& signer) {
    const std::array<std::string_view, 4> parts = {
        message.header, json_or_empty_object(message.parent_header), json_or_empty_object(message.metadata),
        json_or_empty_object(message.content)};
    std::vector<std::string> frames;
    frames.reserve(6 + message.buffers.size());
    frames.emplace_back(delimiter);
    frames.push_back(signer.sign(parts));
    for (std::string_view part : parts)
        frames.emplace_back(part);
    for (const std::string& buffer : message.buffers)
        frames.push_back(buffer);
    return frames;
}

JupyterMessage decode_wire(Channel channel, std::vector<std::string>&& frames, const HmacSigner& signer) {
    std::size_t at = 0;
    while (at < frames.size() && frames[at] != delimiter)
        ++at;
    if (at == frames.size() || frames.size() - at < 6)
        throw MessageError("kernel message without delimiter or parts");
    const std::array<std::string_view, 4> parts = {frames[at + 2], frames[at + 3], frames[at + 4],
                                                   frames[at + 5]};
    if (!signer.verify(parts, frames[at + 1]))
        throw MessageError("kernel message signature does not verify");
    JupyterMessage message;
    message.channel = channel;
    message.header = std::move(frames[at + 2]);
    message.parent_header = std::move(frames[at + 3]);
    message.metadata = std::move(frames[at + 4]);
    message.content = std::move(frames[at + 5]);
    for (std::size_t i = at + 6; i < frames.size(); ++i)
        message.buffers.push_back(std::move(frames[i]));
    json header = json::parse(message.header, nullptr, false);
    if (!header.is_object())
        throw MessageError("kernel message header is not a JSON object");
    // json::value() would throw type_error for a non-string field, which the callers (kernel.cpp) do not
    // catch: a kernel's bad header must cost that message only (tests/fuzz/gateway_wire_decode).
    const auto text_field = [&header](const char* name) -> std::string {
        const auto found = header.find(name);
        if (found == header.end())
            return {};
        if (!found->is_string())
            throw MessageError(std::string("kernel message header.") + name + " is not a string");
        return found->get<std::string>();
    };
    message.msg_id = text_field("msg_id");
    message.msg_type = text_field("msg_type");
    return message;
}

JupyterMessage decode_legacy_text(std::string_view text) {
    json envelope = json::parse(text, nullptr, false);
    if (envelope.is_discarded())
        throw MessageError("message is not valid JSON (or not UTF-8)");
    return message_from_envelope(envelope);
}

JupyterMessage decode_legacy_binary(std::string_view frame) {
    const std::uint32_t count = read_u32_be(frame, 0);
    if (count < 1 || count > 4096)
        throw MessageError("binary frame: bad offset count");
    std::vector<std::size_t> offsets;
    for (std::uint32_t i = 0; i < count; ++i)
        offsets.push_back(read_u32_be(frame, std::size_t{4} * (i + 1)));
    offsets.push_back(frame.size());
    for (std::size_t i = 0; i + 1 < offsets.size(); ++i)
        if (offsets[i] > offsets[i + 1] || offsets[i + 1] > frame.size())
            throw MessageError("binary frame: bad offsets");
    json envelope = json::parse(frame.substr(offsets[0], offsets[1] - offsets[0]), nullptr, false);
    if (envelope.is_discarded())
        throw MessageError("binary frame: message is not valid JSON");
    JupyterMessage message = message_from_envelope(envelope);
    for (std::size_t i = 1; i + 1 < offsets.size(); ++i)
        message.buffers.emplace_back(frame.substr(offsets[i], offsets[i + 1] - offsets[i]));
    return message;
}

JupyterMessage decode_v1(std::string_view frame) {
    const std::uint64_t count = read_u64_le(frame, 0);
    if (count < 6 || count > 4096)
        throw MessageError("v1 frame: bad offset count");
    std::vector<std::size_t> offsets;
    for (std::uint64_t i = 0; i < count; ++i)
        offsets.push_back(read_u64_le(frame, 8 * (i + 1)));
    for (std::size_t i = 0; i + 1 < offsets.size(); ++i)
        if (offsets[i] > offsets[i + 1] || offsets[i + 1] > frame.size())
            throw MessageError("v1 frame: bad offsets");
    auto slice = [&](std::size_t i) { return frame.substr(offsets[i], offsets[i + 1] - offsets[i]); };
    json envelope = json::object();
    const std::string channel(slice(0));
    if (!channel.empty())
        envelope["channel"] = channel;
    envelope["header"] = parse_object(slice(1), "header");
    envelope["parent_header"] = parse_object(slice(2), "parent_header");
    envelope["metadata"] = parse_object(slice(3), "metadata");
    envelope["content"] = parse_object(slice(4), "content");
    JupyterMessage message = message_from_envelope(envelope);
    for (std::size_t i = 5; i + 1 < offsets.size(); ++i)
        message.buffers.emplace_back(slice(i));
    return message;
}

WebSocketFrame encode_legacy(const JupyterMessage& message) {
    // Assembled from the raw parts: the kernel's JSON is already valid, so it is spliced in, not re-parsed.
    std::string text;
    text.reserve(message.header.size() + message.parent_header.size() + message.metadata.size() +
                 message.content.size() + message.msg_id.size() + message.msg_type.size() + 160);
    text += "{\"header\":";
    text += message.header;
    text += ",\"parent_header\":";
    text += json_or_empty_object(message.parent_header);
    text += ",\"metadata\":";
    text += json_or_empty_object(message.metadata);
    text += ",\"content\":";
    text += json_or_empty_object(message.content);
    text += ",\"msg_id\":";
    text += json(message.msg_id).dump();
    text += ",\"msg_type\":";
    text += json(message.msg_type).dump();
    text += ",\"channel\":\"";
    text += channel_name(message.channel);
    text += '"';
    if (message.buffers.empty()) {
        text += ",\"buffers\":[]}";
        return {std::move(text), false};
    }
    text += '}';
    // Binary envelope: nbufs = 1 + buffers, big-endian offsets from the frame start, JSON (without buffers),
    // buffers.
    const auto offset_count = static_cast<std::uint32_t>(1 + message.buffers.size());
    std::string frame;
    append_u32_be(frame, offset_count);
    std::size_t position = std::size_t{4} * (offset_count + 1);
    append_u32_be(frame, static_cast<std::uint32_t>(position));
    position += text.size();
    for (const std::string& buffer : message.buffers) {
        append_u32_be(frame, static_cast<std::uint32_t>(position));
        position += buffer.size();
    }
    frame += text;
    for (const std::string& buffer : message.buffers)
        frame += buffer;
    return {std::move(frame), true};
}

WebSocketFrame encode_v1(const JupyterMessage& message) {
    const std::string_view channel = channel_name(message.channel);
    std::vector<std::string_view> parts = {
        channel, message.header, json_or_empty_object(message.parent_header),
        json_or_empty_object(message.metadata), json_or_empty_object(message.content)};
    for (const std::string& buffer : message.buffers)
        parts.emplace_back(buffer);
    const std::uint64_t offset_count = parts.size() + 1;
    std::string frame;
    std::size_t total = 8 * (offset_count + 1);
    for (std::string_view part : parts)
        total += part.size();
    frame.reserve(total);
    append_u64_le(frame, offset_count);
    std::uint64_t position = 8 * (offset_count + 1);
    append_u64_le(frame, position);
    for (std::string_view part : parts) {
        position += part.size();
        append_u64_le(frame, position);
    }
    for (std::string_view part : parts)
        frame.append(part);
    return {std::move(frame), true};
}

}  // namespace cellblock::gateway
