// Turns a byte stream read in arbitrary chunks (a pipe) into valid UTF-8 text: a multi-byte sequence cut
// by a read boundary is kept for the next chunk, and invalid bytes become U+FFFD, so nothing the worker
// writes can make a message unserializable.
#pragma once

#include <string>
#include <string_view>

namespace cellblock::kernel {

class Utf8StreamDecoder {
  public:
    // Returns the valid text decodable so far; an incomplete trailing sequence is held back.
    std::string feed(std::string_view bytes);
    // The same for bytes read straight into a text buffer: `text[from..]` are raw bytes just appended, and
    // become valid text in place (bytes held back from the previous chunk go in front of them). Valid input,
    // the usual case, costs one scan and no copy.
    void decode_appended(std::string& text, std::size_t from);
    // End of stream: a held-back incomplete sequence becomes U+FFFD.
    std::string finish();
    bool has_pending() const noexcept { return !pending_.empty(); }

  private:
    std::string pending_;
};

// Longest prefix of `text` (valid UTF-8) that is at most `max_bytes` long and ends on a code point boundary.
std::string_view utf8_prefix(std::string_view text, std::size_t max_bytes) noexcept;

}  // namespace cellblock::kernel
