#include "cellblock/gateway/jupyter/zmq_channel.hpp"

#include <gtest/gtest.h>

#include <boost/asio/io_context.hpp>
#include <chrono>
#include <stdexcept>
#include <string>
#include <vector>
#include <zmq.hpp>

using namespace cellblock::gateway;
using namespace std::chrono_literals;

namespace {
// As run_serving does: a handler's exception is reported and the io_context runs on.
int run_catching(boost::asio::io_context& io, std::chrono::milliseconds duration) {
    int failures = 0;
    const auto until = std::chrono::steady_clock::now() + duration;
    while (std::chrono::steady_clock::now() < until) {
        try {
            io.run_until(until);
        } catch (const std::runtime_error&) {
            ++failures;
        }
        if (io.stopped())
            io.restart();
    }
    return failures;
}
}  // namespace

// A frame handler that throws (the agent API's collector once did, on a member of the wrong type) used to
// unwind the channel before it waited on its socket again: nothing the kernel sent afterwards was ever read.
TEST(ZmqChannel, AHandlerThatThrowsDoesNotStopTheChannel) {
    zmq::context_t context;
    boost::asio::io_context io;
    std::vector<std::string> received;
    auto channel = ZmqChannel::bind(io, context, zmq::socket_type::pair, "inproc://zmq-channel-test",
                                    [&](std::vector<std::string>&& frames) {
                                        if (frames.at(0) == "boom")
                                            throw std::runtime_error("handler failed");
                                        received.push_back(frames.at(0));
                                    });
    zmq::socket_t kernel(context, zmq::socket_type::pair);
    kernel.connect("inproc://zmq-channel-test");
    for (const char* text : {"a", "boom", "b"})
        kernel.send(zmq::buffer(std::string(text)), zmq::send_flags::none);
    EXPECT_EQ(run_catching(io, 300ms), 1);
    EXPECT_EQ(received, (std::vector<std::string>{"a", "b"})) << "what was queued behind the failure";
    kernel.send(zmq::buffer(std::string("c")), zmq::send_flags::none);
    EXPECT_EQ(run_catching(io, 300ms), 0);
    EXPECT_EQ(received, (std::vector<std::string>{"a", "b", "c"})) << "what came after it";
    channel->close();
}
