// Reads the server name (SNI host_name) out of the first bytes a TLS client sends: the record layer and the
// ClientHello handshake message, nothing else of TLS. Every length is checked against the bytes present;
// the ClientHello may arrive split over several reads and several records.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

namespace cellblock::kernel::egress {

// A ClientHello larger than this is refused (real ones are a few hundred bytes to ~2 KB, post-quantum key
// shares included); also the most the proxy buffers before deciding.
inline constexpr std::size_t max_client_hello_bytes = std::size_t{32} * 1024;

enum class ClientHelloStatus {
    need_more,  // a valid prefix of a ClientHello: read more bytes and call again with all of them
    complete,   // a whole ClientHello was parsed; server_name set if it carried a host_name
    invalid     // not a TLS ClientHello (or a malformed one); error says why
};

struct ClientHelloResult {
    ClientHelloStatus status;
    std::optional<std::string> server_name;  // as sent (not normalized)
    std::string error;
};

// `bytes`: everything the client sent so far, from its first byte.
ClientHelloResult parse_client_hello(std::string_view bytes);

}  // namespace cellblock::kernel::egress
