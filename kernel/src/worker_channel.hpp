// Framing of the kernel <-> worker channel (share/cellblock/worker/PROTOCOL.md): a 4-byte big-endian
// length, then that many bytes of UTF-8 JSON.
#pragma once

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

class FrameDecoder {
  public:
    void append(std::string_view bytes) { buffer_.append(bytes); }
    // The next complete message, if one has arrived. Throws ProtocolError.
    std::optional<nlohmann::json> next();
    bool empty() const noexcept { return consumed_ == buffer_.size(); }

  private:
    std::string buffer_;
    std::size_t consumed_ = 0;
};

// Writes the whole buffer to a socket (blocking, no SIGPIPE). Returns false if the peer is gone.
bool send_all(int fd, std::string_view bytes) noexcept;

}  // namespace cellblock::kernel
