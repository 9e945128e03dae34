#include "network.hpp"

#include <net/if.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

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

}  // namespace cellblock::sandbox::detail
