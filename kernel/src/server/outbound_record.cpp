#include "server/outbound_record.hpp"

#include <algorithm>
#include <charconv>
#include <stdexcept>

namespace cellblock::kernel {
namespace {

std::size_t parse_limit(const char* name, const char* value, std::size_t fallback) {
    if (value == nullptr) {
        return fallback;
    }
    const std::string_view text(value);
    std::size_t parsed = 0;
    const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), parsed);
    if (text.empty() || error != std::errc() || end != text.data() + text.size()) {
        throw std::invalid_argument(std::string(name) + " must be a non-negative integer, got '" +
                                    std::string(text) + "'");
    }
    return parsed;
}

// A part that is not valid JSON (xeus never sends one) is carried as a string rather than lost.
nlohmann::json parse_part(const std::string& text) {
    auto parsed = nlohmann::json::parse(text, nullptr, false);
    return parsed.is_discarded() ? nlohmann::json(text) : parsed;
}

nlohmann::json to_json(const RecordedMessage& message) {
    nlohmann::json buffers = nlohmann::json::array();
    for (const auto& buffer : message.buffers) {
        buffers.push_back(base64_encode(buffer));
    }
    return {{"channel", message.channel},
            {"header", parse_part(message.header)},
            {"parent_header", parse_part(message.parent_header)},
            {"metadata", parse_part(message.metadata)},
            {"content", parse_part(message.content)},
            {"buffers", std::move(buffers)}};
}

}  // namespace

RecordLimits RecordLimits::from_environment(const char* bytes, const char* messages) {
    const RecordLimits defaults;
    return {parse_limit("CELLBLOCK_RECORD_BYTES", bytes, defaults.max_bytes),
            parse_limit("CELLBLOCK_RECORD_MESSAGES", messages, defaults.max_messages)};
}

std::size_t RecordedMessage::bytes() const noexcept {
    std::size_t total =
        channel.size() + header.size() + parent_header.size() + metadata.size() + content.size();
    for (const auto& buffer : buffers) {
        total += buffer.size();
    }
    return total;
}

void OutboundRecord::add(std::string msg_id, RecordedMessage message) {
    if (!limits_.enabled()) {
        return;
    }
    bytes_ += message.bytes();
    entries_.push_back({std::move(msg_id), std::move(message)});
    while (!entries_.empty() && (bytes_ > limits_.max_bytes || entries_.size() > limits_.max_messages)) {
        bytes_ -= entries_.front().message.bytes();
        entries_.pop_front();
        ++dropped_;
    }
}

nlohmann::json OutboundRecord::replay(const std::optional<std::string>& after) const {
    auto first = entries_.begin();
    bool found = true;
    if (after) {
        // Newest first: a reconnecting gateway usually asks about something recent.
        const auto match = std::find_if(entries_.rbegin(), entries_.rend(),
                                        [&](const Entry& entry) { return entry.msg_id == *after; });
        found = match != entries_.rend() && !after->empty();
        first = found ? match.base() : entries_.begin();
    }
    nlohmann::json messages = nlohmann::json::array();
    for (auto entry = first; entry != entries_.end(); ++entry) {
        messages.push_back(to_json(entry->message));
    }
    return {{"status", "ok"}, {"found", found}, {"dropped", dropped_}, {"messages", std::move(messages)}};
}

}  // namespace cellblock::kernel
