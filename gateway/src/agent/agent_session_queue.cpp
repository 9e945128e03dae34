#include <boost/asio/post.hpp>

#include "cellblock/gateway/agent/agent_session.hpp"
#include "cellblock/gateway/agent/answer_renderer.hpp"
#include "cellblock/gateway/agent/output_shield.hpp"
#include "cellblock/gateway/common/crypto.hpp"
#include "cellblock/gateway/common/time_format.hpp"

// AgentSession's side of its execute queue (execute_queue.hpp, which keeps the order): each execute or reset
// starts once the session has its kernel and this gateway its execute lease (agent_session_lease.cpp); the
// safety net's timers; an ended execute's answer, cell, audit entry and metrics. The rest of AgentSession:
// agent_session.cpp.

namespace cellblock::gateway::agent {

using nlohmann::json;

namespace {
// The kernel enforces an execute's time limit (it gets the limit in the request's metadata) and answers
// within its own grace period; the gateway's timer is only a safety net for a kernel that does not, this much
// later.
constexpr double safety_net_margin_s = 30;
}  // namespace

std::uint64_t AgentSession::execute(ExecuteRequest request, ExecuteHandlers handlers) {
    touch();
    Pending pending = executes_.make_execute(std::move(request), std::move(handlers));
    const std::uint64_t ticket = pending.ticket;
    if (closed_) {
        fail_pending(pending, "SessionClosed", "the session was deleted");
        return ticket;
    }
    executes_.push(std::move(pending));
    run_next();
    return ticket;
}

void AgentSession::reset(std::string client_address, std::string token_id, Done done) {
    touch();
    ExecuteRequest request;
    request.client_address = std::move(client_address);
    request.token_id = std::move(token_id);
    Pending pending = executes_.make_reset(std::move(request), std::move(done));
    if (closed_)
        return pending.reset_done(std::string("session was deleted"));
    executes_.push(std::move(pending));
    run_next();
}

void AgentSession::abandon(std::uint64_t ticket) {
    ExecuteQueue::Abandoned abandoned = executes_.abandon(ticket);
    if (abandoned.queued)
        return fail_pending(*abandoned.queued, "ClientDisconnected",
                            "the client went away before the code started");
    if (abandoned.running) {
        services_.logger.info("agent_execute_abandoned", {{"session", id()}});
        if (const auto kernel = binding_.kernel())
            kernel->interrupt();
    }
}

void AgentSession::fail_pending(Pending& pending, const std::string& ename, const std::string& evalue) {
    if (pending.is_reset) {
        if (pending.reset_done)
            pending.reset_done(evalue);
        return;
    }
    json answer = error_answer(record_.id, ename, evalue);
    count_execute(answer, "", false, false);
    if (pending.handlers.on_done)
        pending.handlers.on_done(std::move(answer));
}

void AgentSession::count_execute(const json& answer, std::string_view kernel_outcome,
                                 bool interrupted_by_client, bool reached_kernel) {
    const json& error = answer.contains("error") ? answer["error"] : json();
    const std::string ename = error.is_object() ? error.value("ename", std::string()) : std::string();
    const std::string_view outcome =
        execute_outcome(answer.value("status", std::string()), kernel_outcome, ename, interrupted_by_client);
    services_.metrics.agent_executes.with(std::string(outcome)).increment();
    if (!record_.tenant.empty())
        services_.metrics.tenant_executes.with(record_.tenant).increment();
    if (outcome == GatewayMetrics::outcome_sandbox_unavailable)
        services_.metrics.count_launch_failure(GatewayMetrics::cause_sandbox_unavailable);
    if (reached_kernel && answer.contains("duration_ms") && answer["duration_ms"].is_number())
        services_.metrics.agent_execute_duration.observe(answer["duration_ms"].get<double>() / 1000.0);
}

void AgentSession::run_next() {
    if (closed_)
        return;
    std::optional<Pending> next = executes_.start_next();
    if (!next)
        return;
    std::weak_ptr<AgentSession> weak = weak_from_this();
    auto shared_pending = std::make_shared<Pending>(std::move(*next));
    ensure_kernel([weak, shared_pending](std::optional<std::string> error) {
        auto self = weak.lock();
        if (!self)
            return;
        if (error) {
            self->executes_.finish();
            if (self->closed_)
                self->fail_pending(*shared_pending, "SessionClosed", "the session was deleted");
            else
                self->fail_pending(*shared_pending, "KernelUnavailable",
                                   "no kernel for this session: " + *error);
            boost::asio::post(self->services_.io, [weak] {
                if (auto again = weak.lock())
                    again->run_next();
            });
            return;
        }
        self->with_execute_lease(
            self->store_give_up(*shared_pending),
            [weak, shared_pending](std::optional<std::string> unavailable) {
                auto locked = weak.lock();
                if (!locked)
                    return;
                if (unavailable) {
                    locked->executes_.finish();
                    locked->fail_pending(*shared_pending, std::string(store_unavailable_ename), *unavailable);
                    return locked->run_next();
                }
                if (locked->closed_ || !locked->binding_.kernel()) {
                    locked->executes_.finish();
                    locked->release_execute_lease();
                    locked->fail_pending(
                        *shared_pending, locked->closed_ ? "SessionClosed" : "KernelUnavailable",
                        locked->closed_ ? "the session was deleted" : "the kernel went away");
                    return locked->run_next();
                }
                if (shared_pending->is_reset)
                    locked->start_reset(std::move(*shared_pending));
                else
                    locked->start_execute(std::move(*shared_pending));
            });
    });
}

void AgentSession::start_reset(Pending pending) {
    auto shared_pending = std::make_shared<Pending>(std::move(pending));
    std::weak_ptr<AgentSession> weak = weak_from_this();
    services_.kernels.restart_kernel(kernel(), [weak, shared_pending](std::optional<std::string> error) {
        auto self = weak.lock();
        if (!self)
            return;
        self->executes_.finish();
        self->release_execute_lease();
        if (!error) {
            self->cells_.clear();
            self->live_.reset();
            self->services_.writer.submit(
                [session = self->id()](SessionStore& store) { store.clear_cells(session); });
        }
        self->audit({{"event", "reset"},
                     {"client", shared_pending->request.client_address},
                     {"token_id", shared_pending->request.token_id},
                     {"status", error ? "error" : "ok"},
                     {"error", error ? json(*error) : json(nullptr)}});
        if (shared_pending->reset_done)
            shared_pending->reset_done(error);
        self->run_next();
    });
}

void AgentSession::start_execute(Pending pending) {
    auto& running = *executes_.running();
    running.pending = std::move(pending);
    running.started = std::chrono::steady_clock::now();
    running.started_wall = std::chrono::system_clock::now();
    live_.cell_started(running.pending.request.code);
    JupyterMessage request = make_message(Channel::shell, "execute_request",
                                          {{"code", running.pending.request.code},
                                           {"silent", false},
                                           {"store_history", true},
                                           {"user_expressions", json::object()},
                                           {"allow_stdin", false},
                                           {"stop_on_error", true}},
                                          link_session_id_);
    const double timeout_s = time_limit_of(running.pending.request);
    // The kernel owns the limits (kernel/README.md, "Outcomes, limits and interrupts"): this call's time
    // limit, and enough output for the saved file.
    request.metadata =
        json{{"cellblock",
              {{"timeout_s", timeout_s},
               {"output_bytes",
                std::max<std::uint64_t>(record_.limits.output_bytes, services_.config.saved_output_bytes)}}}}
            .dump();
    std::weak_ptr<AgentSession> weak = weak_from_this();
    running.collector = std::make_unique<ExecutionCollector>(request.msg_id, [weak](const json& event) {
        auto self = weak.lock();
        if (self)
            self->stream_event(event);
    });
    running.msg_id = request.msg_id;
    // Recorded before it is sent: if the gateway dies now, the next one completes this cell from the kernel.
    // Fenced: not recorded once another gateway has taken the session's execute lease.
    submit_under_execute_lease(
        [inflight = InflightExecute{id(),
                                    request.msg_id,
                                    {{"code", running.pending.request.code},
                                     {"client", running.pending.request.client_address},
                                     {"via", running.pending.request.client_kind},
                                     {"timeout_s", running.pending.request.timeout_s},
                                     {"started", format_iso8601_utc(running.started_wall)}}}](
            SessionStore& store, const std::optional<LeaseFence>& fence) {
            if (fence)
                return store.put_inflight_fenced(inflight, *fence);
            store.put_inflight(inflight);
            return true;
        });
    binding_.link()->send(std::move(request));
    arm_deadline(safety_net_after(timeout_s));
}

double AgentSession::time_limit_of(const ExecuteRequest& request) const {
    return request.timeout_s > 0 ? request.timeout_s : record_.limits.timeout_s;
}

std::chrono::milliseconds AgentSession::seconds_to_ms(double seconds) {
    return std::chrono::milliseconds(static_cast<long long>(seconds * 1000.0));
}

std::chrono::milliseconds AgentSession::safety_net_after(double timeout_s) const {
    return seconds_to_ms(timeout_s + services_.config.interrupt_grace_s + safety_net_margin_s);
}

void AgentSession::arm_deadline(std::chrono::milliseconds after) {
    std::weak_ptr<AgentSession> weak = weak_from_this();
    deadline_timer_.expires_after(after);
    deadline_timer_.async_wait([weak](const boost::system::error_code& error) {
        if (error)
            return;
        if (auto self = weak.lock())
            self->on_deadline();
    });
}

void AgentSession::on_deadline() {
    Running* running = executes_.running();
    if (!running || !running->collector)
        return;
    running->timed_out = true;
    services_.logger.info("agent_execute_timeout", {{"session", id()}});
    if (const auto kernel = binding_.kernel())
        kernel->interrupt();
    std::weak_ptr<AgentSession> weak = weak_from_this();
    deadline_timer_.expires_after(seconds_to_ms(services_.config.interrupt_grace_s));
    deadline_timer_.async_wait([weak](const boost::system::error_code& error) {
        if (error)
            return;
        if (auto self = weak.lock())
            self->on_grace_expired();
    });
}

void AgentSession::on_grace_expired() {
    Running* running = executes_.running();
    if (!running || !running->collector)
        return;
    // The code ignored the interrupt: the circuit breaker restarts the kernel, which kills the worker.
    services_.logger.warn("agent_execute_kernel_restart", {{"session", id()}});
    running->kernel_restarted = true;
    if (const auto kernel = binding_.kernel())
        services_.kernels.restart_kernel(kernel, [](const std::optional<std::string>&) {});
    finish_execute();
}

void AgentSession::finish_execute() {
    if (!executes_.running() || !executes_.running()->collector)
        return;
    deadline_timer_.cancel();
    std::unique_ptr<Running> running = executes_.finish();
    json cell_outputs;
    // The cell is recorded (queued to the store before the lease is let go: the store's writes are ordered
    // per gateway, and the next holder reads the history only through its own copy).
    json answer = build_answer(*running, cell_outputs);
    count_execute(answer, running->collector->kernel_outcome(), running->interrupted_by_client, true);

    json cell = {
        {"cell_type", "code"},
        {"id", random_hex(8)},  // nbformat 4.5 cell ids must be unique within the notebook
        {"metadata", {{"cellblock", {{"status", answer["status"]}, {"duration_ms", answer["duration_ms"]}}}}},
        {"source", running->pending.request.code},
        {"execution_count", answer["execution_count"]},
        {"outputs", cell_outputs}};
    // Fenced: a gateway that lost the lease unawares does not write its cell after the next holder's. Its
    // in-flight record goes either way (only this execute's), so no restart completes the refused cell.
    submit_under_execute_lease([session = id(), cell, msg_id = running->msg_id](
                                   SessionStore& store, const std::optional<LeaseFence>& fence) {
        bool applied = true;
        if (fence)
            applied = store.append_cell_fenced(session, cell, *fence);
        else
            store.append_cell(session, cell);
        if (!msg_id.empty())
            store.remove_inflight(session, msg_id);
        return applied;
    });
    cells_.push_back(std::move(cell));

    audit(execute_audit_entry(*running, answer));

    touch();
    release_execute_lease();
    live_.cell_finished(answer);
    if (running->pending.handlers.on_done)
        running->pending.handlers.on_done(std::move(answer));
    std::weak_ptr<AgentSession> weak = weak_from_this();
    boost::asio::post(services_.io, [weak] {
        if (auto self = weak.lock())
            self->run_next();
    });
}

json AgentSession::execute_audit_entry(const Running& running, const json& answer) const {
    const ExecuteRequest& request = running.pending.request;
    return {{"event", "execute"},
            {"client", request.client_address},
            {"via", request.client_kind},
            {"token_id", request.token_id},
            {"started", format_iso8601_utc(running.started_wall)},
            {"code", request.code},
            {"code_sha256", sha256_hex(request.code)},
            {"status", answer["status"]},
            {"execution_count", answer["execution_count"]},
            {"duration_ms", answer["duration_ms"]},
            {"timeout_s", time_limit_of(request)},
            {"outputs", audit_outputs(*running.collector, answer)},
            {"truncated", answer["truncated"]},
            {"state_lost", answer["state_lost"]},
            {"limits", record_.limits.to_json()},
            {"kernel_id", binding_.kernel() ? json(binding_.kernel()->id()) : json(nullptr)},
            {"runtime", runtime_info()}};
}

}  // namespace cellblock::gateway::agent
