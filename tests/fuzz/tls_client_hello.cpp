// The first bytes a sandboxed client sends into a CONNECT tunnel (kernel/src/egress/tls_client_hello.cpp,
// parse_client_hello): the egress proxy reads the SNI from them to refuse a tunnel whose TLS server name is
// not the CONNECT host. Every byte is hostile.
//
// Input: two bytes that pick a split point, then the bytes of the tunnel.
// Invariants: the verdict does not depend on how the bytes were read: once a prefix is decided (complete or
// invalid), every longer input gets the same verdict and name, and a prefix of an input that needs more bytes
// needs more bytes too; "need more" is never answered past max_client_hello_bytes (the proxy's buffer cap);
// a name is only given for a complete ClientHello and is non-empty printable ASCII; an invalid one says why.
#include "egress/tls_client_hello.hpp"

#include <cstdint>
#include <string_view>

#include "fuzz_support.hpp"

using cellblock::fuzz::require;
using cellblock::kernel::egress::ClientHelloResult;
using cellblock::kernel::egress::ClientHelloStatus;
using cellblock::kernel::egress::max_client_hello_bytes;
using cellblock::kernel::egress::parse_client_hello;

namespace {

void check_shape(const ClientHelloResult& result, std::size_t input_size) {
    switch (result.status) {
        case ClientHelloStatus::need_more:
            require(!result.server_name && result.error.empty(), "need_more carries a name or an error");
            require(input_size < max_client_hello_bytes + 5, "need_more past the ClientHello size cap");
            break;
        case ClientHelloStatus::invalid:
            require(!result.server_name, "an invalid ClientHello carries a name");
            require(!result.error.empty(), "an invalid ClientHello does not say why");
            break;
        case ClientHelloStatus::complete:
            require(result.error.empty(), "a complete ClientHello carries an error");
            if (result.server_name) {
                require(!result.server_name->empty(), "empty server name");
                for (const char c : *result.server_name) {
                    const auto byte = static_cast<unsigned char>(c);
                    require(byte > 0x20 && byte < 0x7f, "server name is not printable ASCII");
                }
            }
            break;
    }
}

bool same(const ClientHelloResult& a, const ClientHelloResult& b) {
    return a.status == b.status && a.server_name == b.server_name;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    if (size < 2) {
        return 0;
    }
    const std::size_t split_seed = (static_cast<std::size_t>(data[0]) << 8) | data[1];
    const auto bytes = cellblock::fuzz::as_text(data + 2, size - 2);
    const auto whole = parse_client_hello(bytes);
    check_shape(whole, bytes.size());

    const std::size_t split = bytes.empty() ? 0 : split_seed % (bytes.size() + 1);
    const auto prefix = parse_client_hello(bytes.substr(0, split));
    check_shape(prefix, split);
    if (prefix.status != ClientHelloStatus::need_more) {
        require(same(prefix, whole), "a decided prefix changed its verdict when more bytes came");
    }
    if (whole.status == ClientHelloStatus::need_more) {
        require(prefix.status == ClientHelloStatus::need_more, "a prefix of an undecided input was decided");
    }
    return 0;
}
