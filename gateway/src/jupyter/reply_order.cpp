#include "cellblock/gateway/jupyter/reply_order.hpp"

#include <algorithm>
#include <nlohmann/json.hpp>
#include <utility>

namespace cellblock::gateway {
namespace {

// Enough for the outputs of other clients' requests that arrive between a reply's IOPub message and the
// reply itself; a reply whose message scrolled out waits until its deadline, it is never lost.
constexpr std::size_t remembered_iopub_ids = 64;

}  // namespace

std::string ReplyOrder::awaited_iopub(const JupyterMessage& reply) {
    if (reply.channel != Channel::shell || reply.metadata.find("last_iopub_msg_id") == std::string::npos)
        return {};
    const nlohmann::json metadata = nlohmann::json::parse(reply.metadata, nullptr, false);
    if (!metadata.is_object())
        return {};
    const auto ours = metadata.find("cellblock");
    if (ours == metadata.end() || !ours->is_object())
        return {};
    const auto named = ours->find("last_iopub_msg_id");
    return named != ours->end() && named->is_string() ? named->get<std::string>() : std::string();
}

std::vector<ReplyOrder::Reply> ReplyOrder::reply_arrived(Reply reply, std::string awaited,
                                                         Clock::time_point now) {
    if (held_.empty() && (awaited.empty() || seen(awaited))) {
        std::vector<Reply> ready;
        ready.push_back(std::move(reply));
        return ready;
    }
    held_.push_back({std::move(reply), std::move(awaited), now + patience_});
    return release(now);
}

std::vector<ReplyOrder::Reply> ReplyOrder::iopub_arrived(const std::string& msg_id, Clock::time_point now) {
    recent_iopub_.push_back(msg_id);
    if (recent_iopub_.size() > remembered_iopub_ids)
        recent_iopub_.pop_front();
    return held_.empty() ? std::vector<Reply>{} : release(now);
}

std::vector<ReplyOrder::Reply> ReplyOrder::expire(Clock::time_point now) {
    return release(now);
}

std::optional<ReplyOrder::Clock::time_point> ReplyOrder::next_deadline() const {
    if (held_.empty())
        return std::nullopt;
    return held_.front().deadline;
}

bool ReplyOrder::seen(const std::string& msg_id) const {
    return std::find(recent_iopub_.rbegin(), recent_iopub_.rend(), msg_id) != recent_iopub_.rend();
}

std::vector<ReplyOrder::Reply> ReplyOrder::release(Clock::time_point now) {
    std::vector<Reply> ready;
    while (!held_.empty()) {
        Held& front = held_.front();
        const bool arrived = front.awaited.empty() || seen(front.awaited);
        if (!arrived && front.deadline > now)
            break;
        if (!arrived)
            ++released_without_iopub_;
        ready.push_back(std::move(front.reply));
        held_.pop_front();
    }
    return ready;
}

}  // namespace cellblock::gateway
