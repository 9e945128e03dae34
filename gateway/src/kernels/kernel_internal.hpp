#pragma once
// What kernel.cpp, kernel_clients.cpp and kernel_replay.cpp (the parts of `Kernel`, kernels/kernel.hpp) share
// and nothing else uses.
#include <cstddef>

#include "cellblock/gateway/jupyter/jupyter_message.hpp"

namespace cellblock::gateway::kernel_internal {

// At most this many messages are held while a re-adopted kernel's record is on its way (live IOPub, and the
// replies and input requests addressed to clients), and kept after it for sessions that come back later.
constexpr std::size_t max_live_during_adoption = 10000;

// What a message costs an offline buffer (KernelClientLink) or the re-adoption backlog.
inline std::size_t buffered_size(const JupyterMessage& message) {
    return message.header.size() + message.parent_header.size() + message.metadata.size() +
           message.content.size();
}

}  // namespace cellblock::gateway::kernel_internal
