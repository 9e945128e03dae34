// What kernel_server.cpp and kernel_server_io.cpp (the I/O thread) share inside KernelServer: its sockets,
// the channel numbering and the eventfd wake-ups. Private to those two files.
#pragma once

#include <array>
#include <zmq.hpp>

#include "server/kernel_server.hpp"

namespace cellblock::kernel {

enum ChannelIndex { shell = 0, control = 1, stdin_channel = 2, iopub = 3 };
constexpr std::array<const char*, 4> channel_names = {"shell", "control", "stdin", "iopub"};

void signal_eventfd(int fd);
void drain_eventfd(int fd);

struct KernelServer::Sockets {
    zmq::context_t context{1};
    std::array<zmq::socket_t, 3> routers{zmq::socket_t(context, zmq::socket_type::router),
                                         zmq::socket_t(context, zmq::socket_type::router),
                                         zmq::socket_t(context, zmq::socket_type::router)};
    zmq::socket_t publisher{context, zmq::socket_type::pub};
    zmq::socket_t heartbeat{context, zmq::socket_type::router};
    bool open = true;

    void close_all() {
        if (!open) {
            return;
        }
        for (auto& socket : routers) {
            socket.close();
        }
        publisher.close();
        heartbeat.close();
        // Waits (up to the linger) until queued replies are on the wire.
        context.close();
        open = false;
    }
};

}  // namespace cellblock::kernel
