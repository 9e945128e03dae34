#include <boost/asio/post.hpp>

#include "cellblock/gateway/agent/agent_session.hpp"
#include "cellblock/gateway/common/crypto.hpp"
#include "cellblock/gateway/common/time_format.hpp"

// AgentSession's side of its kernel binding (kernel_binding.hpp holds the state and its waiters): a kernel
// for the session (attached again after another gateway restarted it on a shared store, readied, or started),
// its attachment as one more KernelClient, and the re-adopted kernel after a gateway restart with the execute
// it was running. The rest of AgentSession: agent_session.cpp.

namespace cellblock::gateway::agent {

using nlohmann::json;

std::map<std::string, std::string> AgentSession::kernel_limit_environment() const {
    // Defaults are what warm-pool kernels already have: no variables, so the pool can serve the session.
    if (record_.limits == services_.config.default_limits)
        return {};
    return {{"CELLBLOCK_TIMEOUT_S", json(record_.limits.timeout_s).dump()},
            {"CELLBLOCK_MEMORY_MB", std::to_string(record_.limits.memory_mb)},
            {"CELLBLOCK_OUTPUT_BYTES", std::to_string(record_.limits.output_bytes)}};
}

void AgentSession::ensure_kernel(Done done) {
    if (closed_)
        return done(std::string("session was deleted"));
    if (!binding_.wait(std::move(done)))
        return;  // the start or readiness wait in flight answers every waiter
    // A kernel whose new process another gateway may have started.
    const std::string reattach = kernel_to_reattach();
    if (reattach.empty())
        return bind_kernel();
    // The store is asked off the io thread; the waiters wait as they would for a starting kernel.
    binding_.begin(KernelBinding::Request::attaching);
    std::weak_ptr<AgentSession> weak = weak_from_this();
    services_.kernels.find_or_attach(reattach, [weak](const std::shared_ptr<Kernel>& again) {
        auto self = weak.lock();
        if (!self || !self->binding_.requesting(KernelBinding::Request::attaching))
            return;  // closed meanwhile: its waiters were answered
        self->binding_.begin(KernelBinding::Request::none);
        if (again && again->state() != KernelState::dead)
            self->attach_kernel(again);  // the state may be gone: the next answer says so
        self->bind_kernel();
    });
}

std::string AgentSession::kernel_to_reattach() {
    if (const auto kernel = binding_.kernel();
        kernel && (kernel->state() == KernelState::dead || services_.kernels.find(kernel->id()) != kernel)) {
        // Deleted through /api/kernels, culled, or dead past its restart limit. A dead kernel still
        // registered would hold a max_kernels slot and its workspace forever: it goes. On a shared store it
        // may have been restarted through another gateway: then its new process is attached instead.
        auto gone = binding_.unbind();
        if (services_.writer.shared())
            return gone->id();
        if (services_.kernels.find(gone->id()) == gone)
            services_.kernels.shutdown_kernel(gone->id(), "dead past its restart limit");
        return {};
    }
    // Let go here because another gateway restarted it: the session stays on it. Forgotten either way.
    std::string let_go = binding_.take_let_go();
    return services_.writer.shared() ? let_go : std::string();
}

void AgentSession::bind_kernel() {
    std::weak_ptr<AgentSession> weak = weak_from_this();
    if (const auto kernel = binding_.kernel()) {
        binding_.begin(KernelBinding::Request::readying);
        kernel->when_ready([weak](const std::optional<std::string>& error) {
            if (auto self = weak.lock(); self && self->binding_.requesting(KernelBinding::Request::readying))
                self->binding_.settle(error);
        });
        return;
    }
    binding_.begin(KernelBinding::Request::starting);
    KernelStartRequest request;
    request.trusted_env = kernel_limit_environment();
    // An agent session has its own policy (none by default), never the Kernel Gateway API's default.
    request.network = record_.network;
    request.tenant = record_.tenant;
    services_.kernels.start_kernel(
        request,
        [weak, &kernels = services_.kernels](std::variant<std::shared_ptr<Kernel>, KernelStartError> result) {
            auto self = weak.lock();
            if (!self || self->closed_) {
                // Deleted while its kernel started: close() has answered the waiters already.
                if (auto* kernel = std::get_if<std::shared_ptr<Kernel>>(&result))
                    kernels.shutdown_kernel((*kernel)->id(), "the agent session was deleted");
                return;
            }
            if (auto* failure = std::get_if<KernelStartError>(&result))
                return self->binding_.settle(failure->message);
            self->attach_kernel(std::get<std::shared_ptr<Kernel>>(result));
            self->binding_.settle(std::nullopt);
        });
}

void AgentSession::resume(const std::shared_ptr<Kernel>& kernel, const std::string& lost_cause,
                          std::vector<InflightExecute> inflight) {
    if (!kernel) {
        // The next execute starts a fresh kernel and says what was lost, and why.
        binding_.set_served_before(true);
        state_lost_cause_ = lost_cause;
        audit({{"event", "kernel_lost"}, {"cause", lost_cause}});
        for (const InflightExecute& execute : inflight) {
            json cell = {
                {"cell_type", "code"},
                {"id", random_hex(8)},
                {"metadata", {{"cellblock", {{"status", "error"}, {"lost", true}}}}},
                {"source", execute.request.value("code", std::string())},
                {"execution_count", nullptr},
                {"outputs", json::array({{{"output_type", "error"},
                                          {"ename", "KernelLost"},
                                          {"evalue", lost_cause},
                                          {"traceback", json::array({"KernelLost: " + lost_cause})}}})}};
            services_.writer.submit(
                [session = id(), cell](SessionStore& store) { store.append_cell(session, cell); });
            cells_.push_back(std::move(cell));
            audit({{"event", "execute"},
                   {"code", execute.request.value("code", std::string())},
                   {"started", execute.request.value("started", std::string())},
                   {"status", "error"},
                   {"error", {{"ename", "KernelLost"}, {"evalue", lost_cause}}}});
            services_.writer.submit([session = id(), msg_id = execute.msg_id](SessionStore& store) {
                store.remove_inflight(session, msg_id);
            });
        }
        return;
    }
    // Executes wait for the re-adopted kernel as they would for a starting one.
    binding_.begin(KernelBinding::Request::readying);
    if (!inflight.empty())
        executes_.hold();  // busy: queued executes run after the resumed one
    std::weak_ptr<AgentSession> weak = weak_from_this();
    kernel->when_ready([weak, kernel, inflight = std::move(inflight)](std::optional<std::string> error) {
        auto self = weak.lock();
        if (!self || self->closed_)
            return;
        if (error) {
            self->executes_.finish();
            self->resume(nullptr, "the kernel could not be re-adopted after the gateway restarted: " + *error,
                         inflight);
            // Nothing is attached: whoever waits gets a fresh kernel instead.
            for (auto& waiter : self->binding_.take_waiters())
                self->ensure_kernel(std::move(waiter));
            self->run_next();
            return;
        }
        self->binding_.set_served_before(false);  // the same kernel: nothing was lost
        self->attach_kernel(kernel);
        self->audit({{"event", "kernel_readopted"}, {"kernel_id", kernel->id()}});
        self->binding_.settle(std::nullopt);
        if (!inflight.empty())
            self->resume_execute(inflight.front());
        else
            self->run_next();
    });
}

void AgentSession::resume_execute(const InflightExecute& inflight) {
    executes_.hold();
    auto& running = *executes_.running();
    running.msg_id = inflight.msg_id;
    running.pending.request.code = inflight.request.value("code", std::string());
    running.pending.request.client_address = inflight.request.value("client", std::string());
    running.pending.request.client_kind = inflight.request.value("via", std::string());
    running.pending.request.timeout_s = inflight.request.value("timeout_s", 0.0);
    running.started_wall = parse_iso8601_utc(inflight.request.value("started", std::string()))
                               .value_or(std::chrono::system_clock::now());
    running.started =
        std::chrono::steady_clock::now() - std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                               std::chrono::system_clock::now() - running.started_wall);
    running.collector = std::make_unique<ExecutionCollector>(inflight.msg_id, nullptr);
    services_.logger.info("agent_execute_resumed", {{"session", id()}, {"msg_id", inflight.msg_id}});
    // Each message may finish it (finish_execute ends the running one): asked again after each.
    auto still_running = [this] { return executes_.running() != nullptr && executes_.running()->collector; };
    for (const JupyterMessage& message : binding_.kernel()->replayed_for(inflight.msg_id)) {
        if (!still_running())
            return;
        deliver(message);
    }
    if (!still_running())
        return;  // answered from the record
    // Still running in the kernel, which enforces the limit: the safety net gets what is left of its time.
    const auto elapsed = std::chrono::steady_clock::now() - running.started;
    arm_deadline(std::max(std::chrono::milliseconds(0),
                          safety_net_after(time_limit_of(running.pending.request)) -
                              std::chrono::duration_cast<std::chrono::milliseconds>(elapsed)));
}

void AgentSession::attach_kernel(const std::shared_ptr<Kernel>& kernel) {
    // Held before the link is made: attaching may let the session go at once (Kernel::attach).
    if (binding_.bind(kernel))
        state_lost_notice_ = true;
    kernel->set_agent_session(record_.id);
    // A request held by another kernel's proxy ended with that kernel.
    approvals_.lose_all_but(kernel->id(), format_iso8601_utc(std::chrono::system_clock::now()));
    auto link = kernel->attach(link_session_id_, weak_from_this());
    // Runtime versions for the audit trail, answered on our own session's shell socket.
    JupyterMessage request =
        make_message(Channel::shell, "kernel_info_request", json::object(), link_session_id_);
    binding_.expect_kernel_info(request.msg_id);
    link->send(std::move(request));
    binding_.set_link(std::move(link));
    persist_record();
    services_.logger.info("agent_session_kernel", {{"session", id()}, {"kernel_id", kernel->id()}});
}

}  // namespace cellblock::gateway::agent
