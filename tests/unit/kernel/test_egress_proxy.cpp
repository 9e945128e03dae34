// The egress proxy on loopback, end to end at the socket level: a real listening socket handed to serve(),
// real TCP clients speaking CONNECT and absolute-form HTTP, real upstream servers on 127.0.0.1 (reached
// through names pinned like `--egress-hosts` does, which is what exempts 127.0.0.1), a fake approval broker
// and an observer that checks what the audit would record. Names the host's resolver would answer with both a
// public and a private address come from a getaddrinfo of this binary's own (below), which asio's resolver
// calls.
#include <arpa/inet.h>
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <fstream>
#include <functional>
#include <future>
#include <mutex>
#include <sstream>
#include <thread>

#include "egress/egress_proxy.hpp"

// The host's resolver as a hostile or split-horizon zone would make it answer: private-first.test resolves to
// 127.0.0.1 (where the test's upstream servers listen) and then a public address, public-first.test the other
// way round. Every other name goes to glibc's getaddrinfo. Defined in the executable, this one is what asio
// calls.
std::atomic<int> mixed_name_lookups{0};

extern "C" int getaddrinfo(const char* node, const char* service, const addrinfo* hints, addrinfo** result) {
    using Real = int (*)(const char*, const char*, const addrinfo*, addrinfo**);
    static const auto real = reinterpret_cast<Real>(::dlsym(RTLD_NEXT, "getaddrinfo"));
    const std::string name = node ? node : "";
    if (name != "private-first.test" && name != "public-first.test")
        return real(node, service, hints, result);
    ++mixed_name_lookups;
    // 100.128.0.1: public (EgressAddress's cases), and no server of this test listens there.
    const char* first = name == "private-first.test" ? "127.0.0.1" : "100.128.0.1";
    const char* second = name == "private-first.test" ? "100.128.0.1" : "127.0.0.1";
    addrinfo numeric{};
    numeric.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV;
    numeric.ai_family = AF_INET;
    numeric.ai_socktype = SOCK_STREAM;
    addrinfo* head = nullptr;
    addrinfo* tail = nullptr;
    if (const int error = real(first, service, &numeric, &head); error != 0)
        return error;
    if (const int error = real(second, service, &numeric, &tail); error != 0) {
        ::freeaddrinfo(head);
        return error;
    }
    head->ai_next = tail;  // glibc's freeaddrinfo frees node by node
    *result = head;
    return 0;
}

namespace cellblock::kernel::egress {
namespace {

using nlohmann::json;
using namespace std::chrono_literals;

// Polls `condition` until it holds (true) or 10 s passed (false): the tests wait for what they can observe,
// never for a guessed while.
template <typename Condition>
bool within_10s(Condition condition) {
    const auto deadline = std::chrono::steady_clock::now() + 10s;
    while (!condition()) {
        if (std::chrono::steady_clock::now() >= deadline) {
            return false;
        }
        std::this_thread::sleep_for(1ms);
    }
    return true;
}

std::string fixture(const std::string& name) {
    std::ifstream stream(std::string(CELLBLOCK_KERNEL_FIXTURES) + "/tls_client_hello/" + name,
                         std::ios::binary);
    std::ostringstream bytes;
    bytes << stream.rdbuf();
    return bytes.str();
}

UniqueFd listening_socket(std::uint16_t& port) {
    UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!fd) {
        throw std::runtime_error("socket failed");
    }
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t length = sizeof(address);
    if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&address), length) != 0 || ::listen(fd.get(), 16) != 0 ||
        ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&address), &length) != 0) {
        throw std::runtime_error("bind/listen failed");
    }
    port = ntohs(address.sin_port);
    return fd;
}

UniqueFd connect_to(std::uint16_t port) {
    UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    address.sin_port = htons(port);
    if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
        return UniqueFd();
    }
    timeval timeout{10, 0};  // generous: a hung proxy fails the test instead of hanging it
    ::setsockopt(fd.get(), SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
    return fd;
}

void send_all(int fd, std::string_view bytes) {
    while (!bytes.empty()) {
        const auto sent = ::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
        if (sent <= 0) {
            throw std::runtime_error("send failed");
        }
        bytes.remove_prefix(static_cast<std::size_t>(sent));
    }
}

// Reads until EOF (or error/timeout), or until `limit` bytes.
std::string receive(int fd, std::size_t limit = SIZE_MAX) {
    std::string received;
    char buffer[8192];
    while (received.size() < limit) {
        const auto got = ::recv(fd, buffer, std::min(sizeof(buffer), limit - received.size()), 0);
        if (got <= 0) {
            break;
        }
        received.append(buffer, static_cast<std::size_t>(got));
    }
    return received;
}

// Reads up to and including the blank line that ends a response or request head.
std::string receive_head(int fd) {
    std::string head;
    char byte;
    while (!head.ends_with("\r\n\r\n") && ::recv(fd, &byte, 1, 0) == 1) {
        head += byte;
    }
    return head;
}

// A TCP server on 127.0.0.1 serving each connection with `handle` on its own thread; remembers what it got.
class UpstreamServer {
  public:
    explicit UpstreamServer(std::function<void(int fd, UpstreamServer&)> handle)
        : listener_(listening_socket(port_)), handle_(std::move(handle)) {
        thread_ = std::thread([this] {
            while (true) {
                const int client = ::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC);
                if (client < 0 || stopping_) {
                    if (client >= 0) {
                        ::close(client);
                    }
                    return;
                }
                ++connections_;
                timeval timeout{10, 0};
                ::setsockopt(client, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
                workers_.emplace_back([this, client] {
                    handle_(client, *this);
                    ::close(client);
                });
            }
        });
    }
    ~UpstreamServer() {
        stopping_ = true;
        ::shutdown(listener_.get(), SHUT_RDWR);
        thread_.join();
        for (auto& worker : workers_) {
            worker.join();
        }
    }
    std::uint16_t port() const { return port_; }
    int connections() const { return connections_; }
    void remember(const std::string& bytes) {
        std::lock_guard lock(mutex_);
        received_ += bytes;
    }
    std::string received() {
        std::lock_guard lock(mutex_);
        return received_;
    }

  private:
    std::uint16_t port_ = 0;
    UniqueFd listener_;
    std::function<void(int, UpstreamServer&)> handle_;
    std::atomic<bool> stopping_{false};
    std::atomic<int> connections_{0};
    std::thread thread_;
    std::vector<std::thread> workers_;
    std::mutex mutex_;
    std::string received_;
};

void echo(int fd, UpstreamServer& server) {
    char buffer[8192];
    while (true) {
        const auto got = ::recv(fd, buffer, sizeof(buffer), 0);
        if (got <= 0) {
            return;
        }
        server.remember(std::string(buffer, static_cast<std::size_t>(got)));
        send_all(fd, std::string_view(buffer, static_cast<std::size_t>(got)));
    }
}

const std::string http_body = "<html>simple index</html>\n";

const std::string& large_body() {
    static const std::string body(20 << 20, 'z');
    return body;
}

void http_origin(int fd, UpstreamServer& server) {
    auto head = receive_head(fd);
    std::string body;
    if (const auto at = head.find("Content-Length: "); at != std::string::npos) {
        body = receive(fd, std::stoul(head.substr(at + 16)));
    }
    server.remember(head + body);
    // Larger than any default body limit of an HTTP parser (Beast: 8 MB for responses).
    const std::string answer = head.starts_with("GET /large ") ? large_body() : http_body;
    send_all(
        fd, "HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: " + std::to_string(answer.size()) +
                "\r\nConnection: keep-alive\r\nKeep-Alive: timeout=5\r\n\r\n" + answer);
}

class Recorder : public EgressObserver {
  public:
    void on_connection(const ConnectionRecord& record) override {
        std::lock_guard lock(mutex_);
        connections.push_back(record);
        changed_.notify_all();
    }
    void on_approval_requested(const ApprovalRequest& request, double timeout_s) override {
        std::lock_guard lock(mutex_);
        requested.push_back(request);
        requested_timeout_s = timeout_s;
        changed_.notify_all();
    }
    void on_approval_decided(const ApprovalRequest& request, Decision decision,
                             const std::string& by) override {
        std::lock_guard lock(mutex_);
        decided.push_back({request, decision, by});
        changed_.notify_all();
    }
    // Waits (generously) until `count` connections were reported; returns a copy of them all.
    std::vector<ConnectionRecord> wait_connections(std::size_t count) {
        std::unique_lock lock(mutex_);
        changed_.wait_for(lock, 10s, [&] { return connections.size() >= count; });
        return connections;
    }

    struct Decided {
        ApprovalRequest request;
        Decision decision;
        std::string by;
    };
    std::mutex mutex_;
    std::condition_variable changed_;
    std::vector<ConnectionRecord> connections;
    std::vector<ApprovalRequest> requested;
    double requested_timeout_s = 0;
    std::vector<Decided> decided;
};

class FakeBroker : public ApprovalBroker {
  public:
    void request(const ApprovalRequest& request, std::function<void(Decision, std::string)> answer) override {
        std::lock_guard lock(mutex_);
        requests.push_back(request);
        answers.push_back(std::move(answer));
        changed_.notify_all();
    }
    // Waits for the n-th request (1-based) and answers it from this (the test's) thread.
    bool answer(std::size_t n, Decision decision, const std::string& by) {
        std::function<void(Decision, std::string)> callback;
        {
            std::unique_lock lock(mutex_);
            if (!changed_.wait_for(lock, 10s, [&] { return requests.size() >= n; })) {
                return false;
            }
            callback = answers[n - 1];
        }
        callback(decision, by);
        return true;
    }
    std::size_t count() {
        std::lock_guard lock(mutex_);
        return requests.size();
    }
    std::mutex mutex_;
    std::condition_variable changed_;
    std::vector<ApprovalRequest> requests;
    std::vector<std::function<void(Decision, std::string)>> answers;
};

class EgressProxyTest : public ::testing::Test {
  protected:
    UpstreamServer echo_server{echo};
    UpstreamServer http_server{http_origin};
    Recorder recorder;
    FakeBroker broker;
    std::unique_ptr<EgressProxy> proxy;
    std::uint16_t proxy_port = 0;

    // Starts the proxy with `policy` (the upstream ports added to "ports" unless given) and pypi.test,
    // files.test, ask.test pinned to 127.0.0.1.
    void start(json policy, ProxyLimits limits = {}) {
        if (!policy.contains("ports")) {
            policy["ports"] = {echo_server.port(), http_server.port()};
        }
        proxy = std::make_unique<EgressProxy>(
            EgressPolicy::parse(policy),
            PinnedHosts::parse("127.0.0.1 pypi.test files.test ask.test other.test\n", "test-hosts"), broker,
            recorder, limits);
        proxy->serve(listening_socket(proxy_port));
    }

    std::string connect_line(const std::string& host, std::uint16_t port) {
        return "CONNECT " + host + ":" + std::to_string(port) + " HTTP/1.1\r\nHost: " + host + ":" +
               std::to_string(port) + "\r\n\r\n";
    }

    std::string get_request(const std::string& host, std::uint16_t port,
                            const std::string& path = "/simple/") {
        const auto authority = host + ":" + std::to_string(port);
        return "GET http://" + authority + path + " HTTP/1.1\r\nHost: " + authority +
               "\r\nProxy-Connection: keep-alive\r\nUser-Agent: test\r\n\r\n";
    }

    // Sends `request` and returns everything the proxy answers until it closes.
    std::string exchange(const std::string& request) {
        auto client = connect_to(proxy_port);
        EXPECT_TRUE(client);
        send_all(client.get(), request);
        return receive(client.get());
    }
};

TEST_F(EgressProxyTest, ConnectWithMatchingSniRelaysBothWays) {
    start({{"allow", {"pypi.test"}}});
    const auto hello = fixture("tls13_pypi_test.bin");
    auto client = connect_to(proxy_port);
    send_all(client.get(), connect_line("PyPI.test", echo_server.port()));
    EXPECT_EQ(receive_head(client.get()), "HTTP/1.1 200 Connection established\r\n\r\n");
    send_all(client.get(), hello);
    EXPECT_EQ(receive(client.get(), hello.size()), hello);  // the server got it and echoed it back
    send_all(client.get(), "more bytes after the hello");
    EXPECT_EQ(receive(client.get(), 26), "more bytes after the hello");
    ::shutdown(client.get(), SHUT_WR);
    EXPECT_EQ(receive(client.get()), "");  // the server saw the end and the tunnel closed

    const auto records = recorder.wait_connections(1);
    ASSERT_EQ(records.size(), 1u);
    EXPECT_EQ(records[0].host, "pypi.test");
    EXPECT_EQ(records[0].port, echo_server.port());
    EXPECT_EQ(records[0].method, "CONNECT");
    EXPECT_TRUE(records[0].allowed);
    EXPECT_EQ(records[0].rule, "pypi.test");
    EXPECT_EQ(records[0].bytes_up, hello.size() + 26);
    EXPECT_EQ(records[0].bytes_down, hello.size() + 26);
    EXPECT_EQ(records[0].error, "");
    EXPECT_GT(records[0].duration_ms, 0);
    EXPECT_EQ(echo_server.received(), hello + "more bytes after the hello");
}

TEST_F(EgressProxyTest, ClientHelloArrivingInPiecesAndWithTheConnectIsAccepted) {
    start({{"allow", {"pypi.test"}}});
    const auto hello = fixture("python_ssl_pypi_test_mixed_case.bin");
    auto client = connect_to(proxy_port);
    // The first bytes of the hello in the same segment as the CONNECT, the rest in pieces.
    send_all(client.get(), connect_line("pypi.test", echo_server.port()) + hello.substr(0, 3));
    EXPECT_EQ(receive_head(client.get()), "HTTP/1.1 200 Connection established\r\n\r\n");
    for (std::size_t at = 3; at < hello.size(); at += 100) {
        send_all(client.get(), hello.substr(at, 100));
        std::this_thread::sleep_for(5ms);
    }
    EXPECT_EQ(receive(client.get(), hello.size()), hello);
}

TEST_F(EgressProxyTest, SniOtherThanTheConnectHostClosesTheTunnel) {
    start({{"allow", {"pypi.test", "files.pythonhosted.org"}}});
    auto client = connect_to(proxy_port);
    send_all(client.get(), connect_line("pypi.test", echo_server.port()));
    EXPECT_EQ(receive_head(client.get()), "HTTP/1.1 200 Connection established\r\n\r\n");
    send_all(client.get(), fixture("tls12_files_pythonhosted_org.bin"));  // domain fronting
    EXPECT_EQ(receive(client.get()), "");
    const auto records = recorder.wait_connections(1);
    ASSERT_EQ(records.size(), 1u);
    EXPECT_FALSE(records[0].allowed);
    EXPECT_NE(records[0].rule.find("names files.pythonhosted.org, not the CONNECT host pypi.test"),
              std::string::npos)
        << records[0].rule;
    EXPECT_EQ(records[0].bytes_up, 0u);
    EXPECT_EQ(echo_server.received(), "");  // nothing reached the server
}

TEST_F(EgressProxyTest, TunnelWithoutSniOrWithoutTlsIsClosed) {
    start({{"allow", {"pypi.test"}}});
    for (const std::string& first_bytes :
         {fixture("no_sni.bin"), std::string("GET / HTTP/1.1\r\nHost: x\r\n\r\n")}) {
        auto client = connect_to(proxy_port);
        send_all(client.get(), connect_line("pypi.test", echo_server.port()));
        EXPECT_EQ(receive_head(client.get()), "HTTP/1.1 200 Connection established\r\n\r\n");
        send_all(client.get(), first_bytes);
        EXPECT_EQ(receive(client.get()), "");
    }
    const auto records = recorder.wait_connections(2);
    ASSERT_EQ(records.size(), 2u);
    EXPECT_NE(records[0].rule.find("no SNI"), std::string::npos) << records[0].rule;
    EXPECT_NE(records[1].rule.find("not a TLS ClientHello"), std::string::npos) << records[1].rule;
    EXPECT_EQ(echo_server.received(), "");
}

TEST_F(EgressProxyTest, PlainGetIsForwardedInOriginFormWithConnectionClose) {
    start({{"allow", {"pypi.test"}}});
    const auto response = exchange(get_request("pypi.test", http_server.port(), "/simple/pkg/?x=1#frag"));
    EXPECT_TRUE(response.starts_with("HTTP/1.1 200 OK\r\n")) << response;
    EXPECT_TRUE(response.ends_with("\r\n\r\n" + http_body)) << response;
    // One request per connection, and the client is told so although the server offered keep-alive.
    EXPECT_NE(response.find("Connection: close\r\n"), std::string::npos) << response;
    EXPECT_EQ(response.find("keep-alive"), std::string::npos) << response;
    EXPECT_EQ(response.find("Keep-Alive"), std::string::npos) << response;

    const auto seen = http_server.received();
    EXPECT_TRUE(seen.starts_with("GET /simple/pkg/?x=1 HTTP/1.1\r\n")) << seen;
    EXPECT_NE(seen.find("Connection: close\r\n"), std::string::npos) << seen;
    EXPECT_NE(seen.find("User-Agent: test\r\n"), std::string::npos) << seen;
    EXPECT_EQ(seen.find("Proxy-Connection"), std::string::npos) << seen;

    const auto records = recorder.wait_connections(1);
    ASSERT_EQ(records.size(), 1u);
    EXPECT_EQ(records[0].method, "GET");
    EXPECT_TRUE(records[0].allowed);
    EXPECT_EQ(records[0].bytes_up, seen.size());
    EXPECT_EQ(records[0].bytes_down, response.size());
}

TEST_F(EgressProxyTest, ALargePlainResponseIsRelayedWhole) {
    start({{"allow", {"pypi.test"}}});
    const auto response = exchange(get_request("pypi.test", http_server.port(), "/large"));
    EXPECT_TRUE(response.starts_with("HTTP/1.1 200 OK\r\n")) << response.substr(0, 200);
    EXPECT_TRUE(response.ends_with("\r\n\r\n" + large_body())) << response.size();
}

TEST_F(EgressProxyTest, AServerThatDoesNotAnswerHttpGets502) {
    start({{"allow", {"pypi.test"}}});
    // The echo server answers a request with the request itself: not an HTTP response.
    const auto response = exchange(get_request("pypi.test", echo_server.port()));
    EXPECT_TRUE(response.starts_with("HTTP/1.1 502 Bad Gateway: cellblock egress: ")) << response;
    EXPECT_NE(response.find("the response of pypi.test is not valid HTTP"), std::string::npos) << response;
}

TEST_F(EgressProxyTest, PlainPostBodyIsForwardedExactly) {
    start({{"allow", {"pypi.test"}}});
    const auto authority = "pypi.test:" + std::to_string(http_server.port());
    // Larger than Beast's default request body limit (1 MB): only the head is parsed, the body is relayed.
    const std::string body = "name=value&x=" + std::string(3 << 20, 'y');
    const auto response = exchange("POST http://" + authority + "/upload HTTP/1.1\r\nHost: " + authority +
                                   "\r\nContent-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body);
    EXPECT_TRUE(response.starts_with("HTTP/1.1 200 OK\r\n")) << response;
    EXPECT_TRUE(http_server.received().ends_with("\r\n\r\n" + body));
}

TEST_F(EgressProxyTest, HostHeaderMustMatchTheUrl) {
    start({{"allow", {"pypi.test", "files.test"}}});
    const auto port = std::to_string(http_server.port());
    const auto response =
        exchange("GET http://pypi.test:" + port + "/ HTTP/1.1\r\nHost: files.test:" + port + "\r\n\r\n");
    EXPECT_TRUE(response.starts_with("HTTP/1.1 400 Bad Request: cellblock egress: ")) << response;
    EXPECT_NE(response.find("does not match the URL's host"), std::string::npos) << response;
    EXPECT_EQ(http_server.connections(), 0);
}

TEST_F(EgressProxyTest, HostNotOnTheAllowlistGetsA403NamingHostAndPolicy) {
    start({{"allow", {"pypi.test", "*.pythonhosted.org"}}, {"ceiling", {"*"}}});
    for (const auto& request :
         {connect_line("evil.test", echo_server.port()), get_request("evil.test", http_server.port())}) {
        const auto response = exchange(request);
        EXPECT_TRUE(response.starts_with("HTTP/1.1 403 Forbidden: cellblock egress: ")) << response;
        EXPECT_TRUE(
            response.ends_with("\r\n\r\ncellblock egress: evil.test is not on this session's network "
                               "allowlist (allowed: pypi.test, *.pythonhosted.org)\n"))
            << response;
    }
    const auto records = recorder.wait_connections(2);
    ASSERT_EQ(records.size(), 2u);
    EXPECT_FALSE(records[0].allowed);
    EXPECT_EQ(records[0].host, "evil.test");
    EXPECT_NE(records[0].rule.find("not on this session's network allowlist"), std::string::npos);
    EXPECT_EQ(broker.count(), 0u);
}

TEST_F(EgressProxyTest, LoopbackAndMetadataAddressesAreRefusedUnlessPinned) {
    start({{"allow", {"localhost", "169.254.169.254", "127.0.0.1"}}});
    const auto port = echo_server.port();
    const auto localhost = exchange(connect_line("localhost", port));  // the host resolver: 127.0.0.1 or ::1
    EXPECT_TRUE(localhost.starts_with("HTTP/1.1 403 Forbidden: cellblock egress: ")) << localhost;
    EXPECT_NE(localhost.find("localhost resolves to"), std::string::npos) << localhost;
    EXPECT_NE(localhost.find("a loopback address"), std::string::npos) << localhost;

    const auto metadata = exchange(get_request("169.254.169.254", http_server.port()));
    EXPECT_TRUE(metadata.starts_with("HTTP/1.1 403 Forbidden: cellblock egress: ")) << metadata;
    EXPECT_NE(metadata.find("the cloud metadata address"), std::string::npos) << metadata;

    const auto literal = exchange(get_request("127.0.0.1", http_server.port()));
    EXPECT_NE(literal.find("127.0.0.1 resolves to 127.0.0.1, a loopback address"), std::string::npos)
        << literal;
    EXPECT_EQ(echo_server.connections() + http_server.connections(), 0);
}

// DNS rebinding within one answer: a name the host's resolver answers with a public and a private address.
// The private one is never dialled, whether it comes first or is what async_connect would fall back to once
// the public one fails; the public one is (the answer is no 403). The control: a pinned name to the same
// 127.0.0.1 server is dialled through this proxy and counted there.
TEST_F(EgressProxyTest, ANameResolvingToAPublicAndAPrivateAddressNeverDialsThePrivateOne) {
    ProxyLimits limits;
    limits.connect = 1s;  // the public address answers nothing here
    start({{"allow", {"private-first.test", "public-first.test", "pypi.test"}}}, limits);
    for (const std::string host : {"private-first.test", "public-first.test"}) {
        for (const auto& request :
             {connect_line(host, echo_server.port()), get_request(host, echo_server.port())}) {
            const auto response = exchange(request);
            EXPECT_FALSE(response.starts_with("HTTP/1.1 403 ")) << host << ": " << response;
            EXPECT_EQ(response.find("127.0.0.1"), std::string::npos) << response;
        }
    }
    EXPECT_EQ(mixed_name_lookups.load(), 4);

    // The server echoes the control's hello only after it accepted the control's connection, and it accepts
    // in order: a dial to 127.0.0.1 by any request above would be counted by then.
    const auto hello = fixture("tls13_pypi_test.bin");
    auto control = connect_to(proxy_port);
    send_all(control.get(), connect_line("pypi.test", echo_server.port()) + hello);
    EXPECT_EQ(receive_head(control.get()), "HTTP/1.1 200 Connection established\r\n\r\n");
    EXPECT_EQ(receive(control.get(), hello.size()), hello);
    EXPECT_EQ(echo_server.connections(), 1);
}

// The operator's deny list wins over a pinned name: the hosts file exempts from the private ranges only.
TEST_F(EgressProxyTest, TheOperatorsDenyListRefusesEvenAPinnedHost) {
    start({{"allow", {"pypi.test"}}, {"deny", {"127.0.0.0/8"}}});
    const auto response = exchange(get_request("pypi.test", http_server.port()));
    EXPECT_TRUE(response.starts_with("HTTP/1.1 403 ")) << response;
    EXPECT_NE(response.find("127.0.0.0/8 is in the operator's deny list"), std::string::npos) << response;
    EXPECT_EQ(http_server.connections(), 0);
}

TEST_F(EgressProxyTest, PortNotAllowedGetsA403) {
    start({{"allow", {"pypi.test"}}, {"ports", {443}}});
    const auto response = exchange(connect_line("pypi.test", echo_server.port()));
    EXPECT_TRUE(response.starts_with("HTTP/1.1 403 Forbidden: cellblock egress: ")) << response;
    EXPECT_NE(response.find("cellblock egress: port " + std::to_string(echo_server.port()) +
                            " is not allowed for pypi.test (allowed ports: 443)"),
              std::string::npos)
        << response;
    EXPECT_EQ(echo_server.connections(), 0);
}

TEST_F(EgressProxyTest, MalformedRequestsGet400) {
    start({{"allow", {"pypi.test"}}});
    const auto origin_form = exchange("GET /simple/ HTTP/1.1\r\nHost: pypi.test\r\n\r\n");
    EXPECT_TRUE(origin_form.starts_with("HTTP/1.1 400 Bad Request: cellblock egress: ")) << origin_form;
    EXPECT_NE(origin_form.find("send an absolute http:// URL or CONNECT"), std::string::npos);
    const auto no_port = exchange("CONNECT pypi.test HTTP/1.1\r\n\r\n");
    EXPECT_TRUE(no_port.starts_with("HTTP/1.1 400 Bad Request: cellblock egress: ")) << no_port;
    const auto userinfo = exchange("GET http://user@pypi.test/ HTTP/1.1\r\nHost: pypi.test\r\n\r\n");
    EXPECT_TRUE(userinfo.starts_with("HTTP/1.1 400 Bad Request: cellblock egress: ")) << userinfo;
    const auto garbage = exchange("\x16\x03\x01 nonsense\r\n\r\n");
    EXPECT_TRUE(garbage.starts_with("HTTP/1.1 400 Bad Request: cellblock egress: ")) << garbage;
}

TEST_F(EgressProxyTest, OversizedRequestHeadIsRefused) {
    start({{"allow", {"pypi.test"}}});
    const auto response = exchange("GET http://pypi.test/ HTTP/1.1\r\nHost: pypi.test\r\nX-Big: " +
                                   std::string(max_request_head_bytes, 'a') + "\r\n\r\n");
    EXPECT_TRUE(response.starts_with("HTTP/1.1 431 ")) << response.substr(0, 100);
    EXPECT_EQ(http_server.connections(), 0);
}

TEST_F(EgressProxyTest, SilentClientIsClosedAfterTheHeadTimeout) {
    ProxyLimits limits;
    limits.request_head = 300ms;
    start({{"allow", {"pypi.test"}}}, limits);
    auto client = connect_to(proxy_port);
    send_all(client.get(), "GET http://pypi.test/ HTTP/1.1\r\n");  // never finished
    const auto started = std::chrono::steady_clock::now();
    EXPECT_EQ(receive(client.get()), "");
    EXPECT_LT(std::chrono::steady_clock::now() - started, 8s);
    const auto records = recorder.wait_connections(1);
    ASSERT_EQ(records.size(), 1u);
    EXPECT_NE(records[0].rule.find("no complete request head"), std::string::npos) << records[0].rule;
}

TEST_F(EgressProxyTest, IdleTunnelIsClosed) {
    ProxyLimits limits;
    limits.idle = 300ms;
    start({{"allow", {"pypi.test"}}}, limits);
    const auto hello = fixture("tls13_pypi_test.bin");
    auto client = connect_to(proxy_port);
    send_all(client.get(), connect_line("pypi.test", echo_server.port()) + hello);
    EXPECT_EQ(receive_head(client.get()), "HTTP/1.1 200 Connection established\r\n\r\n");
    EXPECT_EQ(receive(client.get(), hello.size()), hello);
    EXPECT_EQ(receive(client.get()), "");  // nothing more either way: closed
    const auto records = recorder.wait_connections(1);
    ASSERT_EQ(records.size(), 1u);
    EXPECT_NE(records[0].error.find("no data either way"), std::string::npos) << records[0].error;
}

TEST_F(EgressProxyTest, ConnectionsBeyondTheLimitGet503) {
    ProxyLimits limits;
    limits.max_connections = 2;
    start({{"allow", {"pypi.test"}}}, limits);
    auto first = connect_to(proxy_port);
    auto second = connect_to(proxy_port);
    const auto third = exchange(get_request("pypi.test", http_server.port()));
    EXPECT_TRUE(third.starts_with("HTTP/1.1 503 Service Unavailable: cellblock egress: ")) << third;
    EXPECT_NE(third.find("too many connections open through the proxy (limit 2)"), std::string::npos)
        << third;
    first.reset();
    second.reset();
    recorder.wait_connections(3);
    EXPECT_TRUE(exchange(get_request("pypi.test", http_server.port())).starts_with("HTTP/1.1 200 OK\r\n"));
}

TEST_F(EgressProxyTest, OutsideTheCeilingIsRefusedNeverAsked) {
    start({{"allow", {"pypi.test"}}, {"ask", true}, {"ceiling", {"pypi.test", "*.test"}}});
    const auto response = exchange(get_request("evil.example", http_server.port()));
    EXPECT_TRUE(response.starts_with("HTTP/1.1 403 Forbidden: cellblock egress: ")) << response;
    EXPECT_NE(
        response.find("evil.example is outside this gateway's network ceiling (ceiling: pypi.test, *.test)"),
        std::string::npos)
        << response;
    EXPECT_EQ(broker.count(), 0u);
}

class EgressApprovalTest : public EgressProxyTest {
  protected:
    void SetUp() override {
        start({{"allow", {"pypi.test"}}, {"ask", true}, {"ceiling", {"*.test"}}, {"approval_timeout_s", 30}});
    }
    // A GET to ask.test in the background; its full answer lands in the future.
    std::future<std::string> get_in_background(const std::string& host = "ask.test") {
        return std::async(std::launch::async,
                          [this, host] { return exchange(get_request(host, http_server.port())); });
    }
};

TEST_F(EgressApprovalTest, AllowOnceLetsThisConnectionThroughAndAsksAgainNextTime) {
    auto first = get_in_background();
    ASSERT_TRUE(broker.answer(1, Decision::allow_once, "alice"));
    const auto response = first.get();
    EXPECT_TRUE(response.starts_with("HTTP/1.1 200 OK\r\n")) << response;
    EXPECT_EQ(broker.requests[0].host, "ask.test");
    EXPECT_EQ(broker.requests[0].method, "GET");
    EXPECT_EQ(broker.requests[0].port, http_server.port());
    EXPECT_FALSE(broker.requests[0].id.empty());

    auto second = get_in_background();
    ASSERT_TRUE(broker.answer(2, Decision::deny, "alice"));
    EXPECT_TRUE(second.get().starts_with("HTTP/1.1 403 Forbidden: cellblock egress: "));

    const auto records = recorder.wait_connections(2);
    ASSERT_EQ(records.size(), 2u);
    EXPECT_TRUE(records[0].allowed);
    EXPECT_EQ(records[0].rule, "approval:allow_once by alice");
    std::lock_guard lock(recorder.mutex_);
    ASSERT_EQ(recorder.requested.size(), 2u);
    EXPECT_EQ(recorder.requested_timeout_s, 30);
    ASSERT_EQ(recorder.decided.size(), 2u);
    EXPECT_EQ(recorder.decided[0].decision, Decision::allow_once);
    EXPECT_EQ(recorder.decided[0].by, "alice");
    EXPECT_EQ(recorder.decided[0].request.id, broker.requests[0].id);
}

TEST_F(EgressApprovalTest, AllowSessionAddsTheHostForTheRestOfTheSession) {
    auto first = get_in_background();
    ASSERT_TRUE(broker.answer(1, Decision::allow_session, "agent api"));
    EXPECT_TRUE(first.get().starts_with("HTTP/1.1 200 OK\r\n"));
    const auto second = exchange(get_request("ask.test", http_server.port()));
    EXPECT_TRUE(second.starts_with("HTTP/1.1 200 OK\r\n")) << second;
    EXPECT_EQ(broker.count(), 1u);  // not asked again
    const auto records = recorder.wait_connections(2);
    ASSERT_EQ(records.size(), 2u);
    EXPECT_EQ(records[1].rule, "session:ask.test");
    // Only that host: another one is still asked about.
    auto other = get_in_background("other.test");
    ASSERT_TRUE(broker.answer(2, Decision::deny, "agent api"));
    EXPECT_TRUE(other.get().starts_with("HTTP/1.1 403 Forbidden: cellblock egress: "));
}

TEST_F(EgressApprovalTest, DenyAnswers403NamingWhoDenied) {
    auto held = get_in_background();
    ASSERT_TRUE(broker.answer(1, Decision::deny, "bob"));
    const auto response = held.get();
    EXPECT_TRUE(response.starts_with("HTTP/1.1 403 Forbidden: cellblock egress: ")) << response;
    EXPECT_NE(response.find("cellblock egress: the request to ask.test:" +
                            std::to_string(http_server.port()) + " was denied by bob"),
              std::string::npos)
        << response;
    EXPECT_EQ(http_server.connections(), 0);
}

TEST_F(EgressApprovalTest, OnePendingApprovalPerHostAnswersEveryWaiter) {
    // Two clients held at once for the same host: one approval, one answer for both.
    auto a = get_in_background();
    auto b = get_in_background();
    ASSERT_TRUE(within_10s([this] { return proxy->waiting_for_approval() == 2; })) << "both held";
    ASSERT_TRUE(broker.answer(1, Decision::allow_once, "alice"));
    EXPECT_TRUE(a.get().starts_with("HTTP/1.1 200 OK\r\n"));
    EXPECT_TRUE(b.get().starts_with("HTTP/1.1 200 OK\r\n"));
    EXPECT_EQ(broker.count(), 1u);
    std::lock_guard lock(recorder.mutex_);
    EXPECT_EQ(recorder.requested.size(), 1u);
}

TEST_F(EgressApprovalTest, LateAndRepeatedAnswersAreIgnored) {
    auto held = get_in_background();
    ASSERT_TRUE(broker.answer(1, Decision::deny, "bob"));
    ASSERT_TRUE(broker.answer(1, Decision::allow_session, "mallory"));  // a second answer to the same request
    EXPECT_TRUE(held.get().starts_with("HTTP/1.1 403 Forbidden: cellblock egress: "));
    proxy->wait_for_posted();  // mallory's answer has been dealt with
    auto again = get_in_background();
    ASSERT_TRUE(
        broker.answer(2, Decision::deny, "bob"));  // still asked: mallory's late allow_session did nothing
    EXPECT_TRUE(again.get().starts_with("HTTP/1.1 403 Forbidden: cellblock egress: "));
    // Control: an allow_session in time, given and waited for the same way, lets the next request through
    // unasked, so the check above would have seen mallory's had it counted.
    auto third = get_in_background();
    ASSERT_TRUE(broker.answer(3, Decision::allow_session, "alice"));
    EXPECT_TRUE(third.get().starts_with("HTTP/1.1 200 OK\r\n"));
    proxy->wait_for_posted();
    EXPECT_TRUE(exchange(get_request("ask.test", http_server.port())).starts_with("HTTP/1.1 200 OK\r\n"));
    EXPECT_EQ(broker.count(), 3u);
}

TEST_F(EgressApprovalTest, AnAnswerAfterTheProxyIsGoneIsHarmless) {
    auto held = get_in_background();
    {
        std::unique_lock lock(broker.mutex_);
        ASSERT_TRUE(broker.changed_.wait_for(lock, 10s, [&] { return !broker.requests.empty(); }));
    }
    proxy.reset();  // the kernel replaced or stopped the proxy while a human was still deciding
    EXPECT_EQ(held.get(), "");
    EXPECT_TRUE(broker.answer(1, Decision::allow_session, "alice"));  // the broker still holds the callback
    const auto records = recorder.wait_connections(1);
    ASSERT_EQ(records.size(), 1u);
    EXPECT_FALSE(records[0].allowed);
}

TEST_F(EgressProxyTest, NoDecisionWithinTheTimeoutDenies) {
    start({{"allow", json::array()}, {"ask", true}, {"ceiling", {"*.test"}}, {"approval_timeout_s", 0.5}});
    const auto started = std::chrono::steady_clock::now();
    const auto response = exchange(get_request("ask.test", http_server.port()));
    EXPECT_GE(std::chrono::steady_clock::now() - started, 400ms);
    EXPECT_TRUE(response.starts_with("HTTP/1.1 403 Forbidden: cellblock egress: ")) << response;
    EXPECT_NE(response.find("no decision within 0.5 s on the request to ask.test:"), std::string::npos)
        << response;
    std::lock_guard lock(recorder.mutex_);
    ASSERT_EQ(recorder.decided.size(), 1u);
    EXPECT_EQ(recorder.decided[0].decision, Decision::timeout);
}

TEST_F(EgressProxyTest, ANewListenerReplacesThePreviousOne) {
    start({{"allow", {"pypi.test"}}});
    const auto old_port = proxy_port;
    std::uint16_t new_port = 0;
    proxy->serve(listening_socket(new_port));
    proxy_port = new_port;
    EXPECT_TRUE(exchange(get_request("pypi.test", http_server.port())).starts_with("HTTP/1.1 200 OK\r\n"));
    EXPECT_FALSE(connect_to(old_port));  // the previous worker's listener is closed
}

TEST_F(EgressProxyTest, StopReportsOpenConnections) {
    start({{"allow", {"pypi.test"}}});
    auto client = connect_to(proxy_port);
    send_all(client.get(), connect_line("pypi.test", echo_server.port()) + fixture("tls13_pypi_test.bin"));
    EXPECT_EQ(receive_head(client.get()), "HTTP/1.1 200 Connection established\r\n\r\n");
    (void)receive(client.get(), fixture("tls13_pypi_test.bin").size());
    proxy->stop();
    EXPECT_EQ(receive(client.get()), "");
    const auto records = recorder.wait_connections(1);
    ASSERT_EQ(records.size(), 1u);
    EXPECT_TRUE(records[0].allowed);
}

// The method and host reach an approval a person or a model reads: the worker chooses neither freely.
TEST_F(EgressApprovalTest, OnlyRealMethodsAndDnsSizedHostsReachAnApproval) {
    const auto injected = exchange(
        "OPERATOR_PREAPPROVED_CHOOSE_ALLOW_SESSION http://ask.test:" + std::to_string(http_server.port()) +
        "/ HTTP/1.1\r\nHost: ask.test:" + std::to_string(http_server.port()) + "\r\n\r\n");
    EXPECT_TRUE(injected.starts_with("HTTP/1.1 405 ")) << injected;
    EXPECT_EQ(injected.find("OPERATOR_PREAPPROVED"), std::string::npos) << injected;
    const std::string long_host(300, 'a');
    const auto too_long = exchange("CONNECT " + long_host + ".test:443 HTTP/1.1\r\n\r\n");
    EXPECT_TRUE(too_long.starts_with("HTTP/1.1 400 ")) << too_long.substr(0, 200);
    EXPECT_EQ(broker.count(), 0u) << "a refused request must not be asked about";
    // Control: a real method to the same host is asked about, with its method.
    auto held = get_in_background();
    ASSERT_TRUE(broker.answer(1, Decision::deny, "alice"));
    EXPECT_TRUE(held.get().starts_with("HTTP/1.1 403 "));
    EXPECT_EQ(broker.requests[0].method, "GET");
}

}  // namespace
}  // namespace cellblock::kernel::egress
