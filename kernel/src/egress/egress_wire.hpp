// The socketpair between the kernel and its egress helper (cellblock-egress): SOCK_SEQPACKET, one JSON
// object per message, a worker's listening socket riding along as SCM_RIGHTS on a "serve" message.
//
// kernel -> helper: {"type":"start","policy":{...},"hosts":"<hosts(5) text>","hosts_origin":"<file>"} once,
//                   {"type":"serve"} + fd, {"type":"answer","id":..,"decision":..,"decided_by":..}
// helper -> kernel: {"type":"ready"}, {"type":"connection",...},
// {"type":"approval_requested",...,"timeout_s"},
//                   {"type":"approval_decided",...,"decision","decided_by"}, {"type":"approval",...}
#pragma once

#include <cstddef>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "common/unique_fd.hpp"
#include "egress/egress_proxy.hpp"

namespace cellblock::kernel::egress::wire {

inline constexpr std::size_t max_message_bytes = std::size_t{256} * 1024;

struct Message {
    nlohmann::json body;
    UniqueFd fd;  // a "serve" message's listener; empty otherwise
};

// Blocking; false if the peer is gone (EPIPE, ECONNRESET). Thread-safe per call (one sendmsg).
bool send(int socket, const nlohmann::json& body, int fd = -1);
// Blocking; std::nullopt at end of stream or on a malformed message (the caller treats both as the peer
// being gone: a helper that writes garbage is as good as dead).
std::optional<Message> receive(int socket);

nlohmann::json to_json(const ApprovalRequest& request);
ApprovalRequest request_from_json(const nlohmann::json& json);
nlohmann::json to_json(const ConnectionRecord& record);
ConnectionRecord record_from_json(const nlohmann::json& json);
std::optional<Decision> decision_from_string(std::string_view text);

}  // namespace cellblock::kernel::egress::wire
