#include "worker/worker_channel.hpp"

#include <sys/ioctl.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>

#include "common/json_text.hpp"

namespace cellblock::kernel {

std::string encode_frame(const nlohmann::json& message) {
    const std::string body = dump_json(message);
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

void FrameDecoder::drop_consumed() {
    // The room a large frame needed is not kept by an idle session's kernel: freed, it goes back to the heap,
    // which the kernel trims once idle (heap_policy). Up to this much stays for the next frames.
    constexpr std::size_t kept_buffer_bytes = std::size_t{256} * 1024;
    if (buffer_.capacity() > kept_buffer_bytes) {
        std::string().swap(buffer_);
    } else {
        buffer_.clear();
    }
    consumed_ = 0;
}

ssize_t FrameDecoder::read_from(int fd) {
    constexpr std::size_t least_read_bytes = 65536;
    constexpr std::size_t most_read_bytes = std::size_t{max_frame_bytes} + 4;
    int queued = 0;
    if (::ioctl(fd, FIONREAD, &queued) < 0 || queued < 0) {
        queued = 0;
    }
    if (consumed_ > 0 && consumed_ == buffer_.size()) {
        drop_consumed();
    }
    const std::size_t want =
        std::clamp<std::size_t>(static_cast<std::size_t>(queued), least_read_bytes, most_read_bytes);
    const std::size_t from = buffer_.size();
    buffer_.resize(from + want);
    const ssize_t got = ::recv(fd, buffer_.data() + from, want, MSG_DONTWAIT);
    buffer_.resize(from + static_cast<std::size_t>(std::max<ssize_t>(got, 0)));
    return got;
}

std::optional<WorkerFrame> FrameDecoder::next() {
    // Compact once the consumed part dominates, so long sessions do not grow the buffer (here, not after a
    // frame: a stream frame's text is a view into the buffer until this is called again).
    if (consumed_ == buffer_.size()) {
        drop_consumed();
    } else if (consumed_ > (1u << 20) && consumed_ * 2 > buffer_.size()) {
        buffer_.erase(0, consumed_);
        consumed_ = 0;
    }
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
    const unsigned char channel = body.empty() ? 0 : static_cast<unsigned char>(body.front());
    if (channel == 0x01 || channel == 0x02) {
        if (body.size() < 2) {
            throw ProtocolError("worker sent a stream frame without text");
        }
        consumed_ += 4 + std::size_t{size};
        WorkerFrame frame;
        frame.kind = channel == 0x01 ? WorkerFrame::Kind::stdout_text : WorkerFrame::Kind::stderr_text;
        frame.text = body.substr(1);
        return frame;
    }
    if (channel != '{') {
        throw ProtocolError("worker sent a frame that is neither a JSON object nor a stream frame");
    }
    auto message = nlohmann::json::parse(body, nullptr, false);
    consumed_ += 4 + std::size_t{size};
    if (message.is_discarded() || !message.is_object() || !message.contains("type") ||
        !message["type"].is_string()) {
        throw ProtocolError("worker sent a frame that is not a JSON object with a type");
    }
    WorkerFrame frame;
    frame.message = std::move(message);
    return frame;
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
