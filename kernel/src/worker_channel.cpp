#include "worker_channel.hpp"

#include <sys/socket.h>

#include <cerrno>

namespace cellblock::kernel {

std::string encode_frame(const nlohmann::json& message) {
    const std::string body = message.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    if (body.size() > max_frame_bytes) {
        throw ProtocolError("message to the worker exceeds the frame limit");
    }
    const auto size = static_cast<std::uint32_t>(body.size());
    std::string frame;
    frame.reserve(4 + body.size());
    frame.push_back(static_cast<char>((size >> 24) & 0xff));
    frame.push_back(static_cast<char>((size >> 16) & 0xff));
    frame.push_back(static_cast<char>((size >> 8) & 0xff));
    frame.push_back(static_cast<char>(size & 0xff));
    frame.append(body);
    return frame;
}

std::optional<nlohmann::json> FrameDecoder::next() {
    const std::size_t available = buffer_.size() - consumed_;
    if (available < 4) {
        return std::nullopt;
    }
    const auto* bytes = reinterpret_cast<const unsigned char*>(buffer_.data() + consumed_);
    const std::uint32_t size = (std::uint32_t{bytes[0]} << 24) | (std::uint32_t{bytes[1]} << 16) |
                               (std::uint32_t{bytes[2]} << 8) | std::uint32_t{bytes[3]};
    if (size > max_frame_bytes) {
        throw ProtocolError("worker frame of " + std::to_string(size) + " bytes exceeds the limit");
    }
    if (available < 4 + std::size_t{size}) {
        return std::nullopt;
    }
    const std::string_view body(buffer_.data() + consumed_ + 4, size);
    auto message = nlohmann::json::parse(body, nullptr, false);
    consumed_ += 4 + std::size_t{size};
    // Compact once the consumed part dominates, so long sessions do not grow the buffer.
    if (consumed_ == buffer_.size()) {
        buffer_.clear();
        consumed_ = 0;
    } else if (consumed_ > (1u << 20) && consumed_ * 2 > buffer_.size()) {
        buffer_.erase(0, consumed_);
        consumed_ = 0;
    }
    if (message.is_discarded() || !message.is_object() || !message.contains("type") ||
        !message["type"].is_string()) {
        throw ProtocolError("worker sent a frame that is not a JSON object with a type");
    }
    return message;
}

bool send_all(int fd, std::string_view bytes) noexcept {
    while (!bytes.empty()) {
        const ssize_t sent = ::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
        if (sent < 0) {
            if (errno == EINTR) {
                continue;
            }
            return false;
        }
        bytes.remove_prefix(static_cast<std::size_t>(sent));
    }
    return true;
}

}  // namespace cellblock::kernel
