#include "cellblock/contract/file_messages.hpp"
#include "cellblock/gateway/agent/agent_session.hpp"

// AgentSession's file requests: the agent file API (agent_operations.cpp) reaches the workspace through the
// kernel that owns it, on its control channel, so a kernel on another host (a Slurm job) serves it as a local
// one does. The rest of AgentSession: agent_session.cpp.

namespace cellblock::gateway::agent {

using nlohmann::json;

void AgentSession::file_request(const json& content, FileAnswer done) {
    touch();
    const auto link = binding_.link();
    if (!binding_.kernel() || !link)
        return done(std::nullopt, "the session has no kernel");
    JupyterMessage request =
        make_message(Channel::control, std::string(contract::file_request_type), content, link_session_id_);
    const std::string msg_id = request.msg_id;
    auto timer = std::make_shared<boost::asio::steady_timer>(services_.io);
    file_waits_.insert_or_assign(msg_id, FileWait{std::move(done), timer});
    link->send(std::move(request));
    timer->expires_after(file_request_timeout);
    std::weak_ptr<AgentSession> weak = weak_from_this();
    timer->async_wait([weak, msg_id](const boost::system::error_code& error) {
        auto self = weak.lock();
        if (error || !self)
            return;
        const auto waiting = self->file_waits_.find(msg_id);
        if (waiting == self->file_waits_.end())
            return;
        FileAnswer answer = std::move(waiting->second.done);
        self->file_waits_.erase(waiting);
        answer(std::nullopt, "the kernel did not answer the file request within " +
                                 std::to_string(file_request_timeout.count()) + " s");
    });
}

void AgentSession::on_file_reply(const JupyterMessage& message) {
    const json parent = json::parse(message.parent_header, nullptr, false);
    const auto waiting = file_waits_.find(string_member(parent, "msg_id"));
    if (waiting == file_waits_.end())
        return;  // answered already (timed out), or another gateway's on a shared kernel
    FileWait wait = std::move(waiting->second);
    file_waits_.erase(waiting);
    wait.timer->cancel();
    wait.done(message.content, "");
}

void AgentSession::fail_file_requests(const std::string& cause) {
    std::map<std::string, FileWait> waits;
    waits.swap(file_waits_);
    for (auto& [msg_id, wait] : waits) {
        wait.timer->cancel();
        wait.done(std::nullopt, cause);
    }
}

}  // namespace cellblock::gateway::agent
