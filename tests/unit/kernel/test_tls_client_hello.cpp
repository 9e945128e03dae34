// The SNI reader the proxy trusts to tell which server a CONNECT tunnel is for: real ClientHellos captured
// from `openssl s_client` and Python's ssl module (fixtures/tls_client_hello/), split at every byte,
// re-recorded over several TLS records, truncated, lengthened and garbled.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

#include "egress/tls_client_hello.hpp"

namespace cellblock::kernel::egress {
namespace {

std::string fixture(const std::string& name) {
    std::ifstream stream(std::string(CELLBLOCK_KERNEL_FIXTURES) + "/tls_client_hello/" + name,
                         std::ios::binary);
    std::ostringstream bytes;
    bytes << stream.rdbuf();
    if (bytes.str().empty()) {
        ADD_FAILURE() << "fixture " << name << " is missing";
    }
    return bytes.str();
}

// The same handshake message carried in records of at most `fragment` bytes each.
std::string refragment(const std::string& hello, std::size_t fragment) {
    const auto payload = hello.substr(5);
    std::string records;
    for (std::size_t at = 0; at < payload.size(); at += fragment) {
        const auto part = payload.substr(at, fragment);
        records += std::string{'\x16', '\x03', '\x01', static_cast<char>(part.size() >> 8),
                               static_cast<char>(part.size() & 0xff)};
        records += part;
    }
    return records;
}

TEST(TlsClientHello, ReadsTheServerNameOfRealClientHellos) {
    const struct {
        const char* file;
        const char* server_name;
    } hellos[] = {{"tls13_pypi_test.bin", "pypi.test"},
                  {"tls12_files_pythonhosted_org.bin", "files.pythonhosted.org"},
                  {"python_ssl_pypi_test_mixed_case.bin", "Pypi.Test"}};
    for (const auto& hello : hellos) {
        const auto result = parse_client_hello(fixture(hello.file));
        ASSERT_EQ(result.status, ClientHelloStatus::complete) << hello.file << ": " << result.error;
        ASSERT_TRUE(result.server_name.has_value()) << hello.file;
        EXPECT_EQ(*result.server_name, hello.server_name);
    }
}

TEST(TlsClientHello, NoSniIsCompleteWithoutAName) {
    const auto result = parse_client_hello(fixture("no_sni.bin"));
    EXPECT_EQ(result.status, ClientHelloStatus::complete) << result.error;
    EXPECT_FALSE(result.server_name.has_value());
}

TEST(TlsClientHello, EveryPrefixNeedsMoreBytes) {
    const auto hello = fixture("tls13_pypi_test.bin");
    for (std::size_t length = 0; length < hello.size(); ++length) {
        const auto result = parse_client_hello(std::string_view(hello).substr(0, length));
        ASSERT_EQ(result.status, ClientHelloStatus::need_more)
            << "prefix of " << length << ": " << result.error;
    }
}

TEST(TlsClientHello, AClientHelloSplitOverSeveralRecords) {
    const auto hello = fixture("tls13_pypi_test.bin");
    for (const std::size_t fragment : {1u, 3u, 50u, 200u}) {
        const auto records = refragment(hello, fragment);
        const auto result = parse_client_hello(records);
        ASSERT_EQ(result.status, ClientHelloStatus::complete) << fragment << ": " << result.error;
        EXPECT_EQ(result.server_name, "pypi.test");
        EXPECT_EQ(parse_client_hello(std::string_view(records).substr(0, records.size() - 1)).status,
                  ClientHelloStatus::need_more);
    }
}

TEST(TlsClientHello, GarbageAndPlainHttpAreNotClientHellos) {
    EXPECT_EQ(parse_client_hello("GET / HTTP/1.1\r\nHost: pypi.test\r\n\r\n").status,
              ClientHelloStatus::invalid);
    EXPECT_EQ(parse_client_hello("G").status, ClientHelloStatus::invalid);
    EXPECT_EQ(parse_client_hello(std::string("\x17\x03\x03\x00\x05hello", 10)).status,
              ClientHelloStatus::invalid);
    // SSLv2-style record header
    EXPECT_EQ(parse_client_hello(std::string("\x80\x2e\x01\x00\x02", 5)).status, ClientHelloStatus::invalid);
    // a handshake record carrying a ServerHello
    auto server_hello = fixture("tls13_pypi_test.bin");
    server_hello[5] = '\x02';
    EXPECT_EQ(parse_client_hello(server_hello).status, ClientHelloStatus::invalid);
    // zero-length record
    EXPECT_EQ(parse_client_hello(std::string("\x16\x03\x01\x00\x00", 5)).status, ClientHelloStatus::invalid);
}

TEST(TlsClientHello, LengthsThatDoNotAddUpAreRefused) {
    const auto hello = fixture("tls13_pypi_test.bin");
    // One byte more in the record and the handshake message than the body holds.
    auto longer = hello;
    longer[4] = static_cast<char>(longer[4] + 1);
    longer[8] = static_cast<char>(longer[8] + 1);
    longer.push_back('\0');
    EXPECT_EQ(parse_client_hello(longer).status, ClientHelloStatus::invalid);
    // The extensions block claims more than the message holds.
    auto truncated_message = hello;
    truncated_message[4] = static_cast<char>(truncated_message[4] - 1);
    truncated_message[8] = static_cast<char>(truncated_message[8] - 1);
    truncated_message.pop_back();
    EXPECT_EQ(parse_client_hello(truncated_message).status, ClientHelloStatus::invalid);
}

TEST(TlsClientHello, AnOversizedClientHelloIsRefusedNotAwaited) {
    // A handshake header announcing 1 MB: refused at once, before buffering it.
    const std::string header("\x16\x03\x01\x00\x04\x01\x10\x00\x00", 9);
    const auto result = parse_client_hello(header);
    EXPECT_EQ(result.status, ClientHelloStatus::invalid);
    EXPECT_NE(result.error.find("larger than"), std::string::npos);
}

TEST(TlsClientHello, ServerNameWithControlBytesIsRefused) {
    auto hello = fixture("tls13_pypi_test.bin");
    const auto at = hello.find("pypi.test");
    ASSERT_NE(at, std::string::npos);
    hello[at + 4] = '\0';
    EXPECT_EQ(parse_client_hello(hello).status, ClientHelloStatus::invalid);
}

}  // namespace
}  // namespace cellblock::kernel::egress
