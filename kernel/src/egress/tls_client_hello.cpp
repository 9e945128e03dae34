#include "egress/tls_client_hello.hpp"

#include <cstdint>
#include <set>

namespace cellblock::kernel::egress {
namespace {

constexpr std::uint8_t record_handshake = 22;
constexpr std::uint8_t handshake_client_hello = 1;
constexpr std::size_t record_header_bytes = 5;
constexpr std::size_t max_record_payload = (1 << 14) + 2048;  // TLSCiphertext's limit
constexpr std::uint16_t extension_server_name = 0;
constexpr std::uint8_t name_type_host_name = 0;

ClientHelloResult invalid(std::string why) {
    return {ClientHelloStatus::invalid, std::nullopt, std::move(why)};
}

// A bounds-checked reader over the handshake body: every read fails (returns false) past the end.
class Reader {
  public:
    explicit Reader(std::string_view bytes) : bytes_(bytes) {}

    bool u8(std::uint8_t& value) {
        if (bytes_.size() < 1) {
            return false;
        }
        value = static_cast<std::uint8_t>(bytes_[0]);
        bytes_.remove_prefix(1);
        return true;
    }
    bool u16(std::uint16_t& value) {
        if (bytes_.size() < 2) {
            return false;
        }
        value = static_cast<std::uint16_t>((static_cast<std::uint8_t>(bytes_[0]) << 8) |
                                           static_cast<std::uint8_t>(bytes_[1]));
        bytes_.remove_prefix(2);
        return true;
    }
    bool take(std::size_t count, std::string_view& out) {
        if (bytes_.size() < count) {
            return false;
        }
        out = bytes_.substr(0, count);
        bytes_.remove_prefix(count);
        return true;
    }
    bool skip(std::size_t count) {
        std::string_view ignored;
        return take(count, ignored);
    }
    template <typename Length>
    bool vector(std::string_view& out) {
        Length length{};
        if constexpr (sizeof(Length) == 1) {
            if (!u8(length)) {
                return false;
            }
        } else {
            if (!u16(length)) {
                return false;
            }
        }
        return take(length, out);
    }
    bool empty() const { return bytes_.empty(); }

  private:
    std::string_view bytes_;
};

bool valid_host_name_bytes(std::string_view name) {
    for (const char c : name) {
        const auto byte = static_cast<unsigned char>(c);
        if (byte <= 0x20 || byte >= 0x7f) {
            return false;
        }
    }
    return !name.empty();
}

// RFC 6066 §3: a server_name list with exactly one host_name.
ClientHelloResult parse_server_name(std::string_view data) {
    Reader reader(data);
    std::string_view list;
    if (!reader.vector<std::uint16_t>(list) || !reader.empty()) {
        return invalid("server_name extension length mismatch");
    }
    Reader entries(list);
    std::optional<std::string> host_name;
    while (!entries.empty()) {
        std::uint8_t type = 0;
        std::string_view name;
        if (!entries.u8(type) || !entries.vector<std::uint16_t>(name)) {
            return invalid("truncated server_name entry");
        }
        if (type != name_type_host_name) {
            continue;
        }
        if (host_name) {
            return invalid("more than one host_name in server_name");
        }
        if (!valid_host_name_bytes(name)) {
            return invalid("server_name host_name is empty or not printable ASCII");
        }
        host_name = std::string(name);
    }
    if (!host_name) {
        return invalid("server_name extension without a host_name");
    }
    return {ClientHelloStatus::complete, std::move(host_name), {}};
}

ClientHelloResult parse_body(std::string_view body) {
    Reader reader(body);
    std::string_view ignored;
    std::uint16_t version = 0;
    if (!reader.u16(version) || !reader.skip(32)) {
        return invalid("truncated ClientHello");
    }
    if ((version >> 8) != 3) {
        return invalid("ClientHello legacy_version is not TLS");
    }
    std::string_view session_id;
    if (!reader.vector<std::uint8_t>(session_id) || session_id.size() > 32) {
        return invalid("bad ClientHello session_id");
    }
    std::string_view cipher_suites;
    if (!reader.vector<std::uint16_t>(cipher_suites) || cipher_suites.size() < 2 ||
        cipher_suites.size() % 2) {
        return invalid("bad ClientHello cipher_suites");
    }
    std::string_view compression;
    if (!reader.vector<std::uint8_t>(compression) || compression.empty()) {
        return invalid("bad ClientHello compression_methods");
    }
    if (reader.empty()) {
        return {ClientHelloStatus::complete, std::nullopt, {}};  // no extensions at all (old TLS 1.2 clients)
    }
    std::string_view extensions;
    if (!reader.vector<std::uint16_t>(extensions) || !reader.empty()) {
        return invalid("ClientHello extensions length mismatch");
    }
    Reader list(extensions);
    std::set<std::uint16_t> seen;
    ClientHelloResult result{ClientHelloStatus::complete, std::nullopt, {}};
    while (!list.empty()) {
        std::uint16_t type = 0;
        std::string_view data;
        if (!list.u16(type) || !list.vector<std::uint16_t>(data)) {
            return invalid("truncated ClientHello extension");
        }
        if (!seen.insert(type).second) {
            return invalid("ClientHello repeats extension " + std::to_string(type));
        }
        if (type == extension_server_name) {
            result = parse_server_name(data);
            if (result.status != ClientHelloStatus::complete) {
                return result;
            }
        }
    }
    return result;
}

}  // namespace

ClientHelloResult parse_client_hello(std::string_view bytes) {
    // Reassemble the handshake layer from consecutive handshake records.
    std::string handshake;
    std::size_t at = 0;
    std::optional<std::size_t> message_length;
    while (true) {
        if (message_length && handshake.size() >= 4 + *message_length) {
            break;
        }
        if (bytes.size() - at < record_header_bytes) {
            if (at < bytes.size() && static_cast<std::uint8_t>(bytes[at]) != record_handshake) {
                return invalid("not a TLS handshake record");
            }
            return {ClientHelloStatus::need_more, std::nullopt, {}};
        }
        const auto type = static_cast<std::uint8_t>(bytes[at]);
        const auto major = static_cast<std::uint8_t>(bytes[at + 1]);
        const std::size_t length =
            (static_cast<std::uint8_t>(bytes[at + 3]) << 8) | static_cast<std::uint8_t>(bytes[at + 4]);
        if (type != record_handshake) {
            return invalid("not a TLS handshake record");
        }
        if (major != 3) {
            return invalid("record version is not TLS");
        }
        if (length == 0 || length > max_record_payload) {
            return invalid("bad TLS record length");
        }
        if (bytes.size() - at - record_header_bytes < length) {
            if (at + record_header_bytes + length > max_client_hello_bytes) {
                return invalid("ClientHello larger than " + std::to_string(max_client_hello_bytes) +
                               " bytes");
            }
            return {ClientHelloStatus::need_more, std::nullopt, {}};
        }
        handshake.append(bytes.substr(at + record_header_bytes, length));
        at += record_header_bytes + length;
        if (!message_length && handshake.size() >= 4) {
            if (static_cast<std::uint8_t>(handshake[0]) != handshake_client_hello) {
                return invalid("first handshake message is not a ClientHello");
            }
            message_length = (static_cast<std::size_t>(static_cast<std::uint8_t>(handshake[1])) << 16) |
                             (static_cast<std::size_t>(static_cast<std::uint8_t>(handshake[2])) << 8) |
                             static_cast<std::uint8_t>(handshake[3]);
            if (*message_length + 4 > max_client_hello_bytes) {
                return invalid("ClientHello larger than " + std::to_string(max_client_hello_bytes) +
                               " bytes");
            }
        }
        if (at > max_client_hello_bytes) {
            return invalid("ClientHello larger than " + std::to_string(max_client_hello_bytes) + " bytes");
        }
    }
    return parse_body(std::string_view(handshake).substr(4, *message_length));
}

}  // namespace cellblock::kernel::egress
