#include "zygote_client.hpp"

#include <poll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "cellblock/sandbox/sandbox.hpp"
#include "fds.hpp"
#include "plan_codec.hpp"
#include "system.hpp"

namespace cellblock::sandbox::detail {
namespace {

using namespace std::chrono;

constexpr char request_magic[] = {'C', 'B', 'Z', '1'};
constexpr std::size_t max_answer_bytes = 4096;

// PIDFD_GET_INFO (include/uapi/linux/pidfd.h of Linux 6.15); the headers here predate it.
struct PidfdInfo {
    std::uint64_t mask;
    std::uint64_t cgroupid;
    std::uint32_t pid, tgid, ppid, ruid, rgid, euid, egid, suid, sgid, fsuid, fsgid;
    std::int32_t exit_code;
};
static_assert(sizeof(PidfdInfo) == 64, "PIDFD_INFO_SIZE_VER0");
constexpr std::uint64_t pidfd_info_exit = 1ULL << 3;
constexpr unsigned long pidfd_get_info = _IOWR(0xFF, 11, PidfdInfo);

[[noreturn]] void unavailable(const std::filesystem::path& socket, const std::string& why, int error = 0) {
    std::string text = "zygote template " + socket.string() + ": " + why;
    if (error != 0) {
        text += ": ";
        text += std::strerror(error);
    }
    throw ZygoteUnavailable(text);
}

// Waits until `fd` is ready for `events` or `deadline` passes; false on time out.
bool wait_until(int fd, short events, steady_clock::time_point deadline) {
    for (;;) {
        const auto left = duration_cast<milliseconds>(deadline - steady_clock::now()).count();
        if (left <= 0) {
            return false;
        }
        pollfd ready{fd, events, 0};
        const int result = ::poll(&ready, 1, static_cast<int>(std::min<long long>(left, 60000)));
        if (result > 0) {
            return true;
        }
        if (result < 0 && errno != EINTR) {
            throw_errno("poll the zygote connection");
        }
    }
}

// The pid a pidfd refers to, from /proc/self/fdinfo (-1 if it does not say).
pid_t pid_of(int pidfd) {
    std::ifstream info("/proc/self/fdinfo/" + std::to_string(pidfd));
    std::string line;
    while (std::getline(info, line)) {
        if (line.rfind("Pid:", 0) == 0) {
            try {
                return static_cast<pid_t>(std::stol(line.substr(4)));
            } catch (const std::exception&) {
                return -1;
            }
        }
    }
    return -1;
}

}  // namespace

ZygoteChild request_zygote_spawn(const std::filesystem::path& socket, const ChildPlan& plan,
                                 milliseconds timeout) {
    const auto deadline = steady_clock::now() + timeout;
    EncodedPlan encoded;
    try {
        encoded = encode_plan(plan);
    } catch (const SandboxError& error) {
        unavailable(socket, error.what());
    }

    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    const std::string path = socket.string();
    if (path.empty() || path.size() >= sizeof address.sun_path) {
        unavailable(socket, "the socket path is empty or too long");
    }
    std::memcpy(address.sun_path, path.c_str(), path.size() + 1);
    ZygoteChild child;
    child.connection.reset(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
    if (!child.connection) {
        unavailable(socket, "socket", errno);
    }
    const int connection = child.connection.get();
    // A full backlog makes a unix connect wait, up to the send timeout.
    const timeval send_timeout{static_cast<time_t>(timeout.count() / 1000),
                               static_cast<suseconds_t>((timeout.count() % 1000) * 1000)};
    if (::setsockopt(connection, SOL_SOCKET, SO_SNDTIMEO, &send_timeout, sizeof send_timeout) != 0) {
        unavailable(socket, "setsockopt SO_SNDTIMEO", errno);
    }
    if (::connect(connection, reinterpret_cast<const sockaddr*>(&address), sizeof address) != 0) {
        unavailable(socket, "connect", errno);
    }

    std::vector<unsigned char> message(std::begin(request_magic), std::end(request_magic));
    message.insert(message.end(), encoded.bytes.begin(), encoded.bytes.end());
    const ssize_t sent = send_with_fds(connection, message, encoded.fds);
    if (sent < 0) {
        unavailable(socket, "send the plan", errno);
    }
    if (static_cast<std::size_t>(sent) != message.size()) {
        unavailable(socket, "the plan was sent short");
    }

    if (!wait_until(connection, POLLIN, deadline)) {
        unavailable(socket, "no answer within " + std::to_string(timeout.count()) + " ms");
    }
    std::array<char, max_answer_bytes> answer{};
    iovec answer_data{answer.data(), answer.size()};
    alignas(cmsghdr) char answer_control[CMSG_SPACE(sizeof(int) * max_plan_fds)];
    msghdr reply{};
    reply.msg_iov = &answer_data;
    reply.msg_iovlen = 1;
    reply.msg_control = answer_control;
    reply.msg_controllen = sizeof answer_control;
    ssize_t got = 0;
    do {
        got = ::recvmsg(connection, &reply, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    } while (got < 0 && errno == EINTR);
    if (got < 0) {
        unavailable(socket, "receive the answer", errno);
    }
    // Every fd that came with the answer is ours to close, whatever the answer says.
    std::vector<UniqueFd> received;
    for (cmsghdr* header = CMSG_FIRSTHDR(&reply); header != nullptr; header = CMSG_NXTHDR(&reply, header)) {
        if (header->cmsg_level == SOL_SOCKET && header->cmsg_type == SCM_RIGHTS) {
            const std::size_t count = (header->cmsg_len - CMSG_LEN(0)) / sizeof(int);
            for (std::size_t i = 0; i < count; ++i) {
                int fd = -1;
                std::memcpy(&fd, CMSG_DATA(header) + i * sizeof(int), sizeof fd);
                received.emplace_back(fd);
            }
        }
    }
    if (got == 0) {
        unavailable(socket, "the template closed the connection without an answer");
    }
    if ((reply.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) != 0) {
        unavailable(socket, "the answer was truncated");
    }
    nlohmann::json parsed;
    try {
        parsed = nlohmann::json::parse(answer.data(), answer.data() + got);
    } catch (const nlohmann::json::exception&) {
        unavailable(socket, "the answer is not JSON");
    }
    if (parsed.is_object() && parsed.contains("error")) {
        unavailable(socket, "refused: " + (parsed["error"].is_string() ? parsed["error"].get<std::string>()
                                                                       : parsed["error"].dump()));
    }
    if (!parsed.is_object() || !parsed.contains("pid") || !parsed["pid"].is_number_integer() ||
        parsed["pid"].get<long long>() <= 0) {
        unavailable(socket, "the answer has no pid: " + parsed.dump());
    }
    if (received.size() != 1) {
        unavailable(socket,
                    "the answer came with " + std::to_string(received.size()) + " fds instead of the pidfd");
    }
    child.pid = static_cast<pid_t>(parsed["pid"].get<long long>());
    if (pid_of(received.front().get()) != child.pid) {
        unavailable(socket, "the fd that came with pid " + std::to_string(child.pid) + " is not its pidfd");
    }
    child.pidfd = std::move(received.front());
    return child;
}

std::optional<ExitReport> read_exit_report(int connection, milliseconds timeout) {
    const auto deadline = steady_clock::now() + timeout;
    std::array<char, max_answer_bytes> buffer{};
    for (;;) {
        if (!wait_until(connection, POLLIN, deadline)) {
            return std::nullopt;
        }
        const ssize_t got = ::recv(connection, buffer.data(), buffer.size(), MSG_DONTWAIT | MSG_TRUNC);
        if (got < 0 && (errno == EINTR || errno == EAGAIN)) {
            continue;
        }
        if (got <= 0 || static_cast<std::size_t>(got) > buffer.size()) {
            return std::nullopt;  // closed, failed or an oversized message: nothing trustworthy comes
        }
        try {
            const auto message = nlohmann::json::parse(buffer.data(), buffer.data() + got);
            const auto& exit = message.at("exit");
            ExitReport report;
            report.wait_status = exit.at("status").get<int>();
            const auto utime = exit.value("utime_us", std::int64_t{0});
            const auto stime = exit.value("stime_us", std::int64_t{0});
            report.cpu_seconds = static_cast<double>(utime + stime) / 1e6;
            return report;
        } catch (const nlohmann::json::exception&) {
            continue;  // not the exit message: the protocol has no other, but a stray one is no answer
        }
    }
}

std::optional<int> pidfd_exit_status(int pidfd) {
    PidfdInfo info{};
    info.mask = pidfd_info_exit;
    if (::ioctl(pidfd, pidfd_get_info, &info) != 0) {
        return std::nullopt;
    }
    if ((info.mask & pidfd_info_exit) == 0) {
        return std::nullopt;
    }
    return info.exit_code;
}

}  // namespace cellblock::sandbox::detail
