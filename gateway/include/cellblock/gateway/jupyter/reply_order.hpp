#pragma once
// Keeps each shell reply behind the IOPub output the kernel published before it.
//
// The kernel sends a request's outputs and then its reply, but on two sockets: a large output can reach the
// gateway after the small reply, and a client that stops at execute_reply (OpenHands) would lose it. Every
// reply of a cellblock kernel names the IOPub message published last before it
// (metadata.cellblock.last_iopub_msg_id). A reply is handed out once that message has arrived (IOPub keeps
// its order, so everything before it has too) or, if it never comes (dropped at the high-water mark, or a
// kernel that names none), after `patience`. Replies leave in the order they came, whichever client they
// are for. No I/O: the Kernel feeds it arrivals and the clock, and delivers what it returns.
#include <chrono>
#include <cstddef>
#include <deque>
#include <optional>
#include <string>
#include <vector>

#include "cellblock/gateway/jupyter/jupyter_message.hpp"

namespace cellblock::gateway {

class ReplyOrder {
  public:
    using Clock = std::chrono::steady_clock;

    struct Reply {
        std::string session_id;  // whose DEALER socket it came on
        JupyterMessage message;
    };

    explicit ReplyOrder(std::chrono::milliseconds patience) : patience_(patience) {}

    // The IOPub message the kernel names in `reply` (empty: none, deliver at once).
    static std::string awaited_iopub(const JupyterMessage& reply);

    // A reply arrived that waits for the IOPub message `awaited` (awaited_iopub(reply.message), which the
    // caller has worked out already to decide what to flush; empty: none): the replies to deliver now, in
    // order.
    std::vector<Reply> reply_arrived(Reply reply, std::string awaited, Clock::time_point now);
    // An IOPub message was delivered: the replies it releases, in order.
    std::vector<Reply> iopub_arrived(const std::string& msg_id, Clock::time_point now);
    // The replies whose wait has run out by `now` (and those queued behind them that may go too).
    std::vector<Reply> expire(Clock::time_point now);
    // When expire() next has something to release; none while nothing is held.
    std::optional<Clock::time_point> next_deadline() const;
    std::size_t held() const { return held_.size(); }
    // Replies released because their IOPub message never came, since construction (the kernel logs them).
    std::size_t released_without_iopub() const { return released_without_iopub_; }

  private:
    struct Held {
        Reply reply;
        std::string awaited;
        Clock::time_point deadline;
    };
    bool seen(const std::string& msg_id) const;
    std::vector<Reply> release(Clock::time_point now);

    std::chrono::milliseconds patience_;
    std::deque<Held> held_;
    // The last IOPub ids delivered, newest last: a reply usually names the newest one or one still in
    // transit.
    std::deque<std::string> recent_iopub_;
    std::size_t released_without_iopub_ = 0;
};

}  // namespace cellblock::gateway
