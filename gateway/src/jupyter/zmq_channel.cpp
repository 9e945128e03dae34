#include "cellblock/gateway/jupyter/zmq_channel.hpp"

#include <boost/asio/post.hpp>

namespace cellblock::gateway {

std::shared_ptr<ZmqChannel> ZmqChannel::connect(boost::asio::io_context& io, zmq::context_t& context,
                                                zmq::socket_type type, const std::string& endpoint,
                                                const std::string& identity, FrameHandler on_frames,
                                                const SocketSetup& setup) {
    zmq::socket_t socket(context, type);
    if (setup)
        setup(socket);
    socket.set(zmq::sockopt::linger, 0);
    // Kernels bind late (the ipc file appears when they are up): retry every 2 ms instead of libzmq's 100 ms
    // so readiness is not quantized to the reconnect grid.
    socket.set(zmq::sockopt::reconnect_ivl, 2);
    socket.set(zmq::sockopt::reconnect_ivl_max, 50);
    if (!identity.empty())
        socket.set(zmq::sockopt::routing_id, zmq::buffer(identity));
    if (type == zmq::socket_type::sub)
        socket.set(zmq::sockopt::subscribe, "");
    socket.connect(endpoint);
    auto channel = std::make_shared<ZmqChannel>(io, std::move(socket), std::move(on_frames));
    channel->arm();
    return channel;
}

std::shared_ptr<ZmqChannel> ZmqChannel::bind(boost::asio::io_context& io, zmq::context_t& context,
                                             zmq::socket_type type, const std::string& endpoint,
                                             FrameHandler on_frames, const SocketSetup& setup) {
    zmq::socket_t socket(context, type);
    socket.set(zmq::sockopt::linger, 0);
    if (setup)
        setup(socket);
    socket.bind(endpoint);
    auto channel = std::make_shared<ZmqChannel>(io, std::move(socket), std::move(on_frames));
    channel->arm();
    return channel;
}

ZmqChannel::ZmqChannel(boost::asio::io_context& io, zmq::socket_t socket, FrameHandler on_frames)
    : io_(io), socket_(std::move(socket)), readiness_(io), on_frames_(std::move(on_frames)) {
    readiness_.assign(socket_.get(zmq::sockopt::fd));
}

ZmqChannel::~ZmqChannel() {
    close();
}

void ZmqChannel::close() {
    if (closed_)
        return;
    closed_ = true;
    on_frames_ = nullptr;
    boost::system::error_code ignored;
    readiness_.cancel(ignored);
    readiness_.release();  // the descriptor belongs to libzmq; asio must not close it
    socket_.close();
}

void ZmqChannel::arm() {
    if (closed_)
        return;
    try {
        drain();
    } catch (...) {
        // A frame handler threw: the exception goes on to the io_context's runner (run_serving logs it), and
        // the channel keeps reading. Unwound before its wait, it would never have read this socket again.
        wait_readable();
        throw;
    }
    wait_readable();
}

void ZmqChannel::wait_readable() {
    if (closed_)
        return;
    readiness_.async_wait(boost::asio::posix::stream_descriptor::wait_read,
                          [weak = weak_from_this()](const boost::system::error_code& error) {
                              if (error)
                                  return;
                              if (auto self = weak.lock())
                                  self->arm();
                          });
}

void ZmqChannel::drain() {
    // Bounded so that one flooding kernel cannot starve the other connections on the io_context.
    for (int handled = 0; !closed_ && handled < 256; ++handled) {
        if (!(socket_.get(zmq::sockopt::events) & ZMQ_POLLIN))
            return;
        std::vector<std::string> frames;
        while (true) {
            zmq::message_t part;
            if (!socket_.recv(part, zmq::recv_flags::dontwait))
                break;
            frames.emplace_back(part.to_string());
            if (!part.more())
                break;
        }
        if (frames.empty())
            return;
        if (on_frames_) {
            auto keep_alive = shared_from_this();  // a handler may close this channel
            try {
                on_frames_(std::move(frames));
            } catch (...) {
                schedule_drain();  // what is queued behind the failed message is still delivered
                throw;
            }
        }
    }
    schedule_drain();  // more is waiting: continue after other handlers had their turn
}

void ZmqChannel::schedule_drain() {
    if (drain_scheduled_ || closed_)
        return;
    drain_scheduled_ = true;
    boost::asio::post(io_, [weak = weak_from_this()] {
        if (auto self = weak.lock()) {
            self->drain_scheduled_ = false;
            self->drain();
        }
    });
}

bool ZmqChannel::send(const std::vector<std::string>& frames) {
    if (closed_ || frames.empty())
        return false;
    try {
        for (std::size_t i = 0; i < frames.size(); ++i) {
            const bool last = i + 1 == frames.size();
            auto sent = socket_.send(
                zmq::buffer(frames[i]),
                last ? zmq::send_flags::dontwait : (zmq::send_flags::sndmore | zmq::send_flags::dontwait));
            if (!sent)
                return false;
        }
    } catch (const zmq::error_t&) {
        return false;
    }
    schedule_drain();  // the send may have consumed the ZMQ_FD edge of an incoming message
    return true;
}

}  // namespace cellblock::gateway
