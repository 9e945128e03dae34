#pragma once
// Standard base64 (RFC 4648, padded; OpenSSL's EVP_EncodeBlock / EVP_DecodeBlock): how Jupyter carries binary
// buffers in JSON, how the file requests carry a file's bytes (file_messages.hpp), and the gateway's sealed
// store values. One implementation for the gateway and the kernel.

#include <optional>
#include <string>
#include <string_view>

namespace cellblock::contract {

// Throws std::length_error for more bytes than OpenSSL's int-sized call takes (about 1.5 GiB).
std::string base64_encode(std::string_view bytes);
// Whitespace is ignored; nullopt for text that is not valid base64.
std::optional<std::string> base64_decode(std::string_view text);

}  // namespace cellblock::contract
