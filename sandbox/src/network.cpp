#include "network.hpp"

#include <arpa/inet.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "fds.hpp"
#include "system.hpp"

namespace cellblock::sandbox::detail {

int bring_loopback_up() noexcept {
    const int sock = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (sock < 0) {
        return errno;
    }
    ifreq request{};
    std::memcpy(request.ifr_name, "lo", 3);
    int result = 0;
    if (::ioctl(sock, SIOCGIFFLAGS, &request) != 0) {
        result = errno;
    } else {
        request.ifr_flags = static_cast<short>(request.ifr_flags | IFF_UP | IFF_RUNNING);
        if (::ioctl(sock, SIOCSIFFLAGS, &request) != 0) {
            result = errno;
        }
    }
    ::close(sock);
    return result;
}

ListenerChannel ListenerChannel::prepare(const LoopbackListener& listener, StepNames& steps,
                                         ChildPlan& plan) {
    if (listener.port == 0) {
        throw SandboxError("launch: the loopback listener needs a port (1 to 65535)");
    }
    if (!plan.loopback_up) {
        throw SandboxError("launch: a loopback listener needs the loopback interface (network_loopback)");
    }
    ListenerChannel channel;
    int ends[2];
    // SEQPACKET: one message per socket, so a short read can never mix two of them.
    if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, ends) != 0) {
        throw_errno("launch: socketpair for the loopback listener");
    }
    channel.parent_end_.reset(ends[0]);
    channel.child_end_.reset(ends[1]);
    plan.listener_parent_fd = channel.parent_end_.get();
    plan.listener_child_fd = channel.child_end_.get();
    const std::string port = std::to_string(listener.port);
    auto add = [&](bool ipv6) {
        const std::string address = ipv6 ? "[::1]:" + port : "127.0.0.1:" + port;
        plan.listeners.push_back({ipv6, listener.port, steps.add("loopback listener " + address + ": socket"),
                                  steps.add("loopback listener " + address + ": bind"),
                                  steps.add("loopback listener " + address + ": listen"),
                                  steps.add("loopback listener " + address + ": send it to the launcher")});
    };
    add(false);
    if (listener.ipv6) {
        add(true);
    }
    channel.expected_ = plan.listeners.size();
    return channel;
}

std::vector<UniqueFd> ListenerChannel::receive() {
    std::vector<UniqueFd> received;
    while (received.size() < expected_) {
        char byte = 0;
        iovec data{&byte, 1};
        alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))];
        msghdr message{};
        message.msg_iov = &data;
        message.msg_iovlen = 1;
        message.msg_control = control;
        message.msg_controllen = sizeof control;
        const ssize_t got = ::recvmsg(parent_end_.get(), &message, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
        if (got < 0 && errno == EINTR) {
            continue;
        }
        if (got < 0) {
            throw_errno("launch: receive the loopback listener");
        }
        const cmsghdr* header = CMSG_FIRSTHDR(&message);
        if (got == 0 || (message.msg_flags & MSG_CTRUNC) != 0 || header == nullptr ||
            header->cmsg_level != SOL_SOCKET || header->cmsg_type != SCM_RIGHTS ||
            header->cmsg_len != CMSG_LEN(sizeof(int))) {
            throw SandboxError("launch: the sandbox did not send its loopback listener");
        }
        int fd = -1;
        std::memcpy(&fd, CMSG_DATA(header), sizeof fd);
        received.emplace_back(fd);
    }
    return received;
}

bool send_loopback_listeners(const ChildPlan& plan, int* failed_step) noexcept {
    for (const auto& op : plan.listeners) {
        const int family = op.ipv6 ? AF_INET6 : AF_INET;
        *failed_step = op.step_socket;
        const int sock = ::socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (sock < 0) {
            return false;
        }
        auto give_up = [sock](int step, int* failed) {
            const int error = errno;
            ::close(sock);
            *failed = step;
            errno = error;
            return false;
        };
        int bound = -1;
        if (op.ipv6) {
            const int only_v6 = 1;
            if (::setsockopt(sock, IPPROTO_IPV6, IPV6_V6ONLY, &only_v6, sizeof only_v6) != 0) {
                return give_up(op.step_socket, failed_step);
            }
            sockaddr_in6 address{};
            address.sin6_family = AF_INET6;
            address.sin6_port = htons(op.port);
            address.sin6_addr = in6addr_loopback;
            bound = ::bind(sock, reinterpret_cast<const sockaddr*>(&address), sizeof address);
        } else {
            sockaddr_in address{};
            address.sin_family = AF_INET;
            address.sin_port = htons(op.port);
            address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
            bound = ::bind(sock, reinterpret_cast<const sockaddr*>(&address), sizeof address);
        }
        if (bound != 0) {
            return give_up(op.step_bind, failed_step);
        }
        if (::listen(sock, SOMAXCONN) != 0) {
            return give_up(op.step_listen, failed_step);
        }
        const unsigned char byte = 0;
        if (send_with_fds(plan.listener_child_fd, {&byte, 1}, {&sock, 1}) != 1) {
            return give_up(op.step_send, failed_step);
        }
        ::close(sock);  // the parent holds it now; nothing of the program's ever sees this descriptor
    }
    return true;
}

}  // namespace cellblock::sandbox::detail
