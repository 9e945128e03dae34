#pragma once
// A ZMQ socket driven by the io_context: libzmq's ZMQ_FD is watched for readability and the socket is drained
// (ZMQ_EVENTS) on every wakeup and after every send, because ZMQ_FD is edge-triggered and a send can consume
// the edge that announced an incoming message. Everything runs on the io_context thread; no extra thread, no
// polling.
#include <boost/asio/io_context.hpp>
#include <boost/asio/posix/stream_descriptor.hpp>
#include <functional>
#include <memory>
#include <string>
#include <vector>
#include <zmq.hpp>

#include "cellblock/gateway/jupyter/jupyter_message.hpp"

namespace cellblock::gateway {

class ZmqChannel : public std::enable_shared_from_this<ZmqChannel> {
  public:
    using FrameHandler = std::function<void(std::vector<std::string>&& frames)>;
    // Socket options set before connect/bind (CurveZMQ keys).
    using SocketSetup = std::function<void(zmq::socket_t& socket)>;

    // `identity` (may be empty) becomes ZMQ_ROUTING_ID, i.e. how the kernel's ROUTER addresses replies.
    static std::shared_ptr<ZmqChannel> connect(boost::asio::io_context& io, zmq::context_t& context,
                                               zmq::socket_type type, const std::string& endpoint,
                                               const std::string& identity, FrameHandler on_frames,
                                               const SocketSetup& setup = {});
    // A listening socket (the launch registry); `last_endpoint()` says where it ended up.
    static std::shared_ptr<ZmqChannel> bind(boost::asio::io_context& io, zmq::context_t& context,
                                            zmq::socket_type type, const std::string& endpoint,
                                            FrameHandler on_frames, const SocketSetup& setup = {});
    std::string last_endpoint() const { return socket_.get(zmq::sockopt::last_endpoint); }
    ~ZmqChannel();
    ZmqChannel(const ZmqChannel&) = delete;
    ZmqChannel& operator=(const ZmqChannel&) = delete;

    // Non-blocking; returns false when the message could not be queued (high-water mark) or the channel is
    // closed.
    bool send(const std::vector<std::string>& frames);
    void close();
    // Delivers whatever libzmq has already received, now (used to keep IOPub ahead of the reply it precedes).
    void flush_received() { drain(); }

    ZmqChannel(boost::asio::io_context& io, zmq::socket_t socket, FrameHandler on_frames);

  private:
    // Delivers what is queued, then waits for the socket to become readable again; a handler's exception
    // propagates to the caller without stopping the channel.
    void arm();
    void wait_readable();
    void drain();
    void schedule_drain();

    boost::asio::io_context& io_;
    zmq::socket_t socket_;
    boost::asio::posix::stream_descriptor readiness_;
    FrameHandler on_frames_;
    bool drain_scheduled_ = false;
    bool closed_ = false;
};

}  // namespace cellblock::gateway
