#include "cellblock/gateway/agent/kernel_binding.hpp"

#include <utility>

// The states and their transitions are described once, in kernel_binding.hpp.

namespace cellblock::gateway::agent {

std::shared_ptr<Kernel> KernelBinding::kernel() const {
    const auto* bound = std::get_if<Bound>(&hold_);
    return bound != nullptr ? bound->kernel : nullptr;
}

std::shared_ptr<KernelClientLink> KernelBinding::link() const {
    const auto* bound = std::get_if<Bound>(&hold_);
    return bound != nullptr ? bound->link : nullptr;
}

bool KernelBinding::bind(std::shared_ptr<Kernel> kernel) {
    hold_ = Bound{std::move(kernel), nullptr};
    return std::exchange(served_before_, true);
}

void KernelBinding::set_link(std::shared_ptr<KernelClientLink> link) {
    if (auto* bound = std::get_if<Bound>(&hold_))
        bound->link = std::move(link);
}

void KernelBinding::let_go(bool keep_id) {
    const auto* bound = std::get_if<Bound>(&hold_);
    if (bound == nullptr)
        return;
    if (keep_id)
        hold_ = LetGo{bound->kernel->id()};
    else
        hold_ = Unbound{};
}

std::shared_ptr<Kernel> KernelBinding::unbind() {
    auto* bound = std::get_if<Bound>(&hold_);
    if (bound == nullptr)
        return nullptr;
    auto kernel = std::move(bound->kernel);
    hold_ = Unbound{};
    return kernel;
}

std::string KernelBinding::take_let_go() {
    auto* let_go = std::get_if<LetGo>(&hold_);
    if (let_go == nullptr)
        return {};
    std::string kernel_id = std::move(let_go->kernel_id);
    hold_ = Unbound{};
    return kernel_id;
}

bool KernelBinding::wait(Done done) {
    waiters_.push_back(std::move(done));
    return request_ == Request::none;
}

void KernelBinding::settle(const std::optional<std::string>& error) {
    for (auto& waiter : take_waiters())
        waiter(error);
}

std::vector<KernelBinding::Done> KernelBinding::take_waiters() {
    request_ = Request::none;
    return std::exchange(waiters_, {});
}

bool KernelBinding::take_kernel_info(const JupyterMessage& message) {
    if (message.channel != Channel::shell || message.msg_type != "kernel_info_reply" ||
        kernel_info_msg_id_.empty() || message.parent_header.find(kernel_info_msg_id_) == std::string::npos)
        return false;
    kernel_info_ = nlohmann::json::parse(message.content, nullptr, false);
    return true;
}

}  // namespace cellblock::gateway::agent
