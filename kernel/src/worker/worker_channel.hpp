// Framing of the kernel <-> worker channel (share/cellblock/worker/PROTOCOL.md): a 4-byte big-endian
// length, then that many bytes: UTF-8 JSON (a body starting with '{'), or from the worker a stream frame
// (a body starting with the channel byte 0x01 stdout or 0x02 stderr, then the text's bytes, not encoded).
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>

namespace cellblock::kernel {

inline constexpr std::uint32_t max_frame_bytes = 64u << 20;

// The worker broke the protocol (oversized frame, invalid JSON): the kernel kills it.
class ProtocolError : public std::runtime_error {
  public:
    using std::runtime_error::runtime_error;
};

std::string encode_frame(const nlohmann::json& message);

// One frame from the worker: a JSON message, or Python-level stream text (raw bytes, checked as UTF-8 by the
// reader, as pipe bytes are).
struct WorkerFrame {
    enum class Kind { message, stdout_text, stderr_text };
    Kind kind = Kind::message;
    nlohmann::json message;  // for Kind::message: an object with a string "type"
    std::string_view text;   // stream frames: valid until the decoder's next call
};

class FrameDecoder {
  public:
    void append(std::string_view bytes) { buffer_.append(bytes); }
    // Reads what the socket holds (FIONREAD, so a large frame is one read, copied once) without blocking.
    // Returns recv's result: > 0 bytes read, 0 end of file, < 0 an error (errno set; EAGAIN: nothing yet).
    ssize_t read_from(int fd);
    // The next complete frame, if one has arrived. Throws ProtocolError: a body that is neither a JSON
    // object with a string "type" nor a stream frame with text.
    std::optional<WorkerFrame> next();
    // No partial frame is waiting.
    bool empty() const noexcept { return consumed_ == buffer_.size(); }

  private:
    void drop_consumed();

    std::string buffer_;
    std::size_t consumed_ = 0;
};

// Writes the whole buffer to a socket (blocking, no SIGPIPE). Returns false if the peer is gone.
bool send_all(int fd, std::string_view bytes) noexcept;

}  // namespace cellblock::kernel
