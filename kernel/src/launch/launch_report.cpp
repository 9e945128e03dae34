#include "launch/launch_report.hpp"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <openssl/rand.h>
#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <cstring>
#include <stdexcept>
#include <zmq.hpp>

#include "common/unique_fd.hpp"

namespace cellblock::kernel {

CurveKeyPair make_curve_keypair() {
    if (!zmq_has("curve"))
        throw std::runtime_error("libzmq has no CURVE support: a reported launch cannot be encrypted");
    std::array<char, 41> public_key{}, secret_key{};
    if (zmq_curve_keypair(public_key.data(), secret_key.data()) != 0)
        throw std::runtime_error(std::string("zmq_curve_keypair: ") + zmq_strerror(zmq_errno()));
    return {public_key.data(), secret_key.data()};
}

namespace {
// "tcp://host:port" -> {host, port}; IPv6 hosts in brackets.
std::pair<std::string, std::string> host_and_port(const std::string& endpoint) {
    constexpr std::string_view scheme = "tcp://";
    if (!endpoint.starts_with(scheme))
        throw std::runtime_error("report endpoint must be tcp://host:port, got '" + endpoint + "'");
    const std::string rest = endpoint.substr(scheme.size());
    const auto colon = rest.rfind(':');
    if (colon == std::string::npos || colon == 0)
        throw std::runtime_error("report endpoint has no port: '" + endpoint + "'");
    std::string host = rest.substr(0, colon);
    if (host.size() > 2 && host.front() == '[' && host.back() == ']')
        host = host.substr(1, host.size() - 2);
    return {host, rest.substr(colon + 1)};
}
}  // namespace

std::string local_address_towards(const std::string& endpoint) {
    const auto [host, port] = host_and_port(endpoint);
    addrinfo hints{};
    hints.ai_socktype = SOCK_DGRAM;
    addrinfo* found = nullptr;
    if (int rc = ::getaddrinfo(host.c_str(), port.c_str(), &hints, &found); rc != 0)
        throw std::runtime_error("cannot resolve report host '" + host + "': " + gai_strerror(rc));
    std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> addresses(found, &::freeaddrinfo);
    // A connected UDP socket sends nothing; it only asks the routing table which local address is used.
    UniqueFd probe(::socket(found->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0));
    if (probe.get() < 0)
        throw std::runtime_error(std::string("socket: ") + std::strerror(errno));
    if (::connect(probe.get(), found->ai_addr, found->ai_addrlen) != 0)
        throw std::runtime_error("no route to report host '" + host + "': " + std::strerror(errno));
    sockaddr_storage local{};
    socklen_t length = sizeof(local);
    if (::getsockname(probe.get(), reinterpret_cast<sockaddr*>(&local), &length) != 0)
        throw std::runtime_error(std::string("getsockname: ") + std::strerror(errno));
    std::array<char, INET6_ADDRSTRLEN> text{};
    const void* address = local.ss_family == AF_INET6
                              ? static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&local)->sin6_addr)
                              : static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&local)->sin_addr);
    if (!::inet_ntop(local.ss_family, address, text.data(), text.size()))
        throw std::runtime_error(std::string("inet_ntop: ") + std::strerror(errno));
    return text.data();
}

ConnectionInfo ephemeral_connection(const std::string& ip) {
    ConnectionInfo connection;
    connection.transport = "tcp";
    connection.ip = ip;
    std::array<unsigned char, 32> bytes{};
    if (RAND_bytes(bytes.data(), static_cast<int>(bytes.size())) != 1)
        throw std::runtime_error("RAND_bytes failed: no HMAC key");
    static constexpr char hex[] = "0123456789abcdef";
    for (unsigned char byte : bytes) {
        connection.key.push_back(hex[byte >> 4]);
        connection.key.push_back(hex[byte & 0xf]);
    }
    return connection;
}

void send_launch_report(const ReportTarget& target, nlohmann::json report,
                        std::chrono::milliseconds timeout) {
    report["token"] = target.token;
    const CurveKeyPair link = make_curve_keypair();  // this link's own client keys, used once
    zmq::context_t context(1);
    zmq::socket_t socket(context, zmq::socket_type::dealer);
    socket.set(zmq::sockopt::linger, 0);
    socket.set(zmq::sockopt::curve_serverkey, target.server_public_key);
    socket.set(zmq::sockopt::curve_publickey, link.public_key);
    socket.set(zmq::sockopt::curve_secretkey, link.secret_key);
    socket.set(zmq::sockopt::rcvtimeo, static_cast<int>(timeout.count()));
    socket.connect(target.endpoint);
    const std::string text = report.dump();
    if (!socket.send(zmq::buffer(text), zmq::send_flags::none))
        throw std::runtime_error("cannot send the launch report to " + target.endpoint);
    zmq::message_t answer;
    if (!socket.recv(answer, zmq::recv_flags::none))
        throw std::runtime_error("no answer from the launch registry " + target.endpoint + " within " +
                                 std::to_string(timeout.count()) + " ms");
    const nlohmann::json verdict = nlohmann::json::parse(answer.to_string(), nullptr, false);
    if (!verdict.is_object() || verdict.value("status", "") != "ok")
        throw std::runtime_error(
            "the launch registry refused the report: " +
            (verdict.is_object() ? verdict.value("reason", answer.to_string()) : answer.to_string()));
    socket.close();
    context.close();
}

}  // namespace cellblock::kernel
