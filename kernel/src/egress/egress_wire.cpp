#include "egress/egress_wire.hpp"

#include <sys/socket.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <vector>

namespace cellblock::kernel::egress::wire {

bool send(int socket, const nlohmann::json& body, int fd) {
    const std::string text = body.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    if (text.size() > max_message_bytes) {
        return false;
    }
    iovec iov{const_cast<char*>(text.data()), text.size()};
    msghdr message{};
    message.msg_iov = &iov;
    message.msg_iovlen = 1;
    alignas(cmsghdr) std::array<char, CMSG_SPACE(sizeof(int))> control{};
    if (fd >= 0) {
        message.msg_control = control.data();
        message.msg_controllen = control.size();
        cmsghdr* header = CMSG_FIRSTHDR(&message);
        header->cmsg_level = SOL_SOCKET;
        header->cmsg_type = SCM_RIGHTS;
        header->cmsg_len = CMSG_LEN(sizeof(int));
        std::memcpy(CMSG_DATA(header), &fd, sizeof(int));
    }
    for (;;) {
        const ssize_t sent = ::sendmsg(socket, &message, MSG_NOSIGNAL);
        if (sent >= 0) {
            return static_cast<std::size_t>(sent) == text.size();
        }
        if (errno != EINTR) {
            return false;
        }
    }
}

std::optional<Message> receive(int socket) {
    std::vector<char> buffer(max_message_bytes + 1);
    iovec iov{buffer.data(), buffer.size()};
    msghdr message{};
    message.msg_iov = &iov;
    message.msg_iovlen = 1;
    alignas(cmsghdr) std::array<char, CMSG_SPACE(sizeof(int))> control{};
    message.msg_control = control.data();
    message.msg_controllen = control.size();
    ssize_t received = -1;
    do {
        received = ::recvmsg(socket, &message, MSG_CMSG_CLOEXEC);
    } while (received < 0 && errno == EINTR);
    if (received <= 0) {
        return std::nullopt;
    }
    Message result;
    for (cmsghdr* header = CMSG_FIRSTHDR(&message); header != nullptr;
         header = CMSG_NXTHDR(&message, header)) {
        if (header->cmsg_level == SOL_SOCKET && header->cmsg_type == SCM_RIGHTS &&
            header->cmsg_len == CMSG_LEN(sizeof(int))) {
            int fd = -1;
            std::memcpy(&fd, CMSG_DATA(header), sizeof(int));
            result.fd = UniqueFd(fd);
        }
    }
    // A truncated message (MSG_TRUNC) or descriptors beyond one (MSG_CTRUNC) is a broken peer.
    if ((message.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) != 0) {
        return std::nullopt;
    }
    result.body = nlohmann::json::parse(buffer.data(), buffer.data() + received, nullptr, false);
    if (!result.body.is_object() || !result.body.contains("type") || !result.body["type"].is_string()) {
        return std::nullopt;
    }
    return result;
}

nlohmann::json to_json(const ApprovalRequest& request) {
    return {{"id", request.id}, {"host", request.host}, {"port", request.port}, {"method", request.method}};
}

ApprovalRequest request_from_json(const nlohmann::json& json) {
    ApprovalRequest request;
    request.id = json.at("id").get<std::string>();
    request.host = json.at("host").get<std::string>();
    request.port = json.at("port").get<std::uint16_t>();
    request.method = json.at("method").get<std::string>();
    return request;
}

nlohmann::json to_json(const ConnectionRecord& record) {
    return {{"host", record.host},
            {"port", record.port},
            {"method", record.method},
            {"bytes_up", record.bytes_up},
            {"bytes_down", record.bytes_down},
            {"duration_ms", record.duration_ms},
            {"allowed", record.allowed},
            {"rule", record.rule},
            {"error", record.error}};
}

ConnectionRecord record_from_json(const nlohmann::json& json) {
    ConnectionRecord record;
    record.host = json.at("host").get<std::string>();
    record.port = json.at("port").get<std::uint16_t>();
    record.method = json.at("method").get<std::string>();
    record.bytes_up = json.at("bytes_up").get<std::uint64_t>();
    record.bytes_down = json.at("bytes_down").get<std::uint64_t>();
    record.duration_ms = json.at("duration_ms").get<double>();
    record.allowed = json.at("allowed").get<bool>();
    record.rule = json.at("rule").get<std::string>();
    record.error = json.at("error").get<std::string>();
    return record;
}

std::optional<Decision> decision_from_string(std::string_view text) {
    for (Decision decision :
         {Decision::allow_once, Decision::allow_session, Decision::deny, Decision::timeout}) {
        if (to_string(decision) == text) {
            return decision;
        }
    }
    return std::nullopt;
}

}  // namespace cellblock::kernel::egress::wire
