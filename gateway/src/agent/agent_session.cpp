#include "cellblock/gateway/agent/agent_session.hpp"

#include <boost/asio/post.hpp>

#include "cellblock/gateway/agent/output_shield.hpp"
#include "cellblock/gateway/common/crypto.hpp"
#include "cellblock/gateway/common/time_format.hpp"
#include "cellblock/sandbox/sandbox.hpp"

namespace cellblock::gateway::agent {

using nlohmann::json;
namespace fs = std::filesystem;

namespace {
// Where the full text of shielded outputs goes, relative to the workspace (the code's cwd).
constexpr std::string_view saved_output_dir = ".cellblock/outputs";
constexpr std::size_t audit_preview_bytes = 512;
// The kernel enforces an execute's time limit (it gets the limit in the request's metadata) and answers
// within its own grace period; the gateway's timer is only a safety net for a kernel that does not, this much
// later.
constexpr double safety_net_margin_s = 30;

std::chrono::milliseconds seconds_to_ms(double seconds) {
    return std::chrono::milliseconds(static_cast<long long>(seconds * 1000.0));
}

std::string joined_traceback(const json& traceback) {
    std::string text;
    if (!traceback.is_array())
        return text;
    for (const json& line : traceback) {
        if (!line.is_string())
            continue;
        if (!text.empty())
            text.push_back('\n');
        text += line.get<std::string>();
    }
    return strip_ansi(text);
}

// Releases a lease of this gateway on the store's reader thread. Queued behind this gateway's earlier lease
// calls (one reader thread, in order): never overtakes the try_lease that took it. Leases are counted per
// connection (PostgreSQL advisory locks), so every lease taken is released exactly once.
void release_lease_later(StoreWriter& writer, const std::string& lease) {
    writer.read<bool>(
        [lease](SessionStore& store) {
            store.release_lease(lease);
            return true;
        },
        StoreWriter::default_read_limit, [](const StoreAnswer<bool>&) {});
}

json digest_of(const std::string& text) {
    if (text.empty())
        return nullptr;
    return {{"bytes", text.size()},
            {"sha256", sha256_hex(text)},
            {"head", std::string(utf8_head(text, audit_preview_bytes))}};
}
}  // namespace

AgentSession::AgentSession(AgentSessionServices& services, Record record, std::vector<json> cells)
    : services_(services),
      record_(std::move(record)),
      cells_(std::move(cells)),
      // On a shared store several gateways may hold the session at once, each with its own sockets to the
      // kernel: a ROUTER ignores a second peer with the same identity, so each gateway's identity differs.
      link_session_id_(std::string(KernelClientLink::agent_prefix) + record_.id +
                       (services.writer.store().shared()
                            ? "." + sha256_hex(services.kernels.owner()).substr(0, 8)
                            : std::string())),
      deadline_timer_(services.io),
      lease_timer_(services.io),
      live_(services.config.inline_output_bytes) {
    had_kernel_ = !cells_.empty();
    live_.seed(cells_);
}

AgentSession::~AgentSession() = default;

std::chrono::steady_clock::time_point AgentSession::last_used() const {
    auto used = last_used_;
    if (kernel_) {
        // A person working in a notebook attached to the kernel keeps the session alive too.
        const auto kernel_idle = std::chrono::system_clock::now() - kernel_->last_activity();
        used =
            std::max(used, std::chrono::steady_clock::now() -
                               std::chrono::duration_cast<std::chrono::steady_clock::duration>(kernel_idle));
    }
    return used;
}

std::map<std::string, std::string> AgentSession::kernel_limit_environment() const {
    // Defaults are what warm-pool kernels already have: no variables, so the pool can serve the session.
    if (record_.limits == services_.config.default_limits)
        return {};
    return {{"CELLBLOCK_TIMEOUT_S", json(record_.limits.timeout_s).dump()},
            {"CELLBLOCK_MEMORY_MB", std::to_string(record_.limits.memory_mb)},
            {"CELLBLOCK_OUTPUT_BYTES", std::to_string(record_.limits.output_bytes)}};
}

AgentSession::State AgentSession::state() const {
    if (running_ || !queue_.empty())
        return State::busy;
    if (kernel_wait_ != KernelWait::none)
        return State::starting;
    if (!kernel_ || kernel_->state() == KernelState::dead)
        return State::without_kernel;
    return State::idle;
}

std::string_view AgentSession::state_name(State state) {
    switch (state) {
        case State::starting:
            return "starting";
        case State::busy:
            return "busy";
        case State::idle:
            return "idle";
        case State::without_kernel:
            return "without_kernel";
    }
    return "unknown";
}

std::optional<fs::path> AgentSession::workspace() const {
    if (!kernel_)
        return std::nullopt;
    return kernel_->workspace_dir();
}

void AgentSession::ensure_kernel(Done done) {
    if (closed_)
        return done(std::string("session was deleted"));
    kernel_waiters_.push_back(std::move(done));
    if (kernel_wait_ != KernelWait::none)
        return;  // the start or readiness wait in flight answers every waiter
    // A kernel whose new process another gateway may have started.
    std::string reattach;
    if (kernel_ &&
        (kernel_->state() == KernelState::dead || services_.kernels.find(kernel_->id()) != kernel_)) {
        // Deleted through /api/kernels, culled, or dead past its restart limit. A dead kernel still
        // registered would hold a max_kernels slot and its workspace forever: it goes. On a shared store it
        // may have been restarted through another gateway: then its new process is attached instead.
        auto gone = std::exchange(kernel_, nullptr);
        link_ = nullptr;
        if (services_.writer.shared())
            reattach = gone->id();
        else if (services_.kernels.find(gone->id()) == gone)
            services_.kernels.shutdown_kernel(gone->id(), "dead past its restart limit");
    } else if (!kernel_ && !let_go_kernel_id_.empty() && services_.writer.shared()) {
        // Let go here because another gateway restarted it: the session stays on it.
        reattach = let_go_kernel_id_;
    }
    let_go_kernel_id_.clear();
    if (reattach.empty())
        return bind_kernel();
    // The store is asked off the io thread; the waiters wait as they would for a starting kernel.
    kernel_wait_ = KernelWait::attaching;
    std::weak_ptr<AgentSession> weak = weak_from_this();
    services_.kernels.find_or_attach(reattach, [weak](const std::shared_ptr<Kernel>& again) {
        auto self = weak.lock();
        if (!self || self->kernel_wait_ != KernelWait::attaching)
            return;  // closed meanwhile: its waiters were answered
        self->kernel_wait_ = KernelWait::none;
        if (again && again->state() != KernelState::dead)
            self->attach_kernel(again);  // the state may be gone: the next answer says so
        self->bind_kernel();
    });
}

void AgentSession::bind_kernel() {
    std::weak_ptr<AgentSession> weak = weak_from_this();
    if (kernel_) {
        kernel_wait_ = KernelWait::readying;
        kernel_->when_ready([weak](const std::optional<std::string>& error) {
            if (auto self = weak.lock(); self && self->kernel_wait_ == KernelWait::readying)
                self->settle_kernel_waiters(error);
        });
        return;
    }
    kernel_wait_ = KernelWait::starting;
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
                return self->settle_kernel_waiters(failure->message);
            self->attach_kernel(std::get<std::shared_ptr<Kernel>>(result));
            self->settle_kernel_waiters(std::nullopt);
        });
}

void AgentSession::resume(const std::shared_ptr<Kernel>& kernel, const std::string& lost_cause,
                          std::vector<InflightExecute> inflight) {
    if (!kernel) {
        // The next execute starts a fresh kernel and says what was lost, and why.
        had_kernel_ = true;
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
    kernel_wait_ = KernelWait::readying;
    if (!inflight.empty())
        running_ = std::make_unique<Running>();  // busy: queued executes run after the resumed one
    std::weak_ptr<AgentSession> weak = weak_from_this();
    kernel->when_ready([weak, kernel, inflight = std::move(inflight)](std::optional<std::string> error) {
        auto self = weak.lock();
        if (!self || self->closed_)
            return;
        if (error) {
            self->running_.reset();
            self->resume(nullptr, "the kernel could not be re-adopted after the gateway restarted: " + *error,
                         inflight);
            // Nothing is attached: whoever waits gets a fresh kernel instead.
            self->kernel_wait_ = KernelWait::none;
            auto waiters = std::exchange(self->kernel_waiters_, {});
            for (auto& waiter : waiters)
                self->ensure_kernel(std::move(waiter));
            self->run_next();
            return;
        }
        self->had_kernel_ = false;  // the same kernel: nothing was lost
        self->attach_kernel(kernel);
        self->audit({{"event", "kernel_readopted"}, {"kernel_id", kernel->id()}});
        self->settle_kernel_waiters(std::nullopt);
        if (!inflight.empty())
            self->resume_execute(inflight.front());
        else
            self->run_next();
    });
}

void AgentSession::resume_execute(const InflightExecute& inflight) {
    if (!running_)
        running_ = std::make_unique<Running>();
    auto& running = *running_;
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
    for (const JupyterMessage& message : kernel_->replayed_for(inflight.msg_id)) {
        if (!running_ || !running_->collector)
            return;
        deliver(message);
    }
    if (!running_ || !running_->collector)
        return;  // answered from the record
    // Still running in the kernel, which enforces the limit: the safety net gets what is left of its time.
    const double timeout_s =
        running.pending.request.timeout_s > 0 ? running.pending.request.timeout_s : record_.limits.timeout_s;
    const auto elapsed = std::chrono::steady_clock::now() - running.started;
    const auto left =
        std::max(std::chrono::milliseconds(0),
                 seconds_to_ms(timeout_s + services_.config.interrupt_grace_s + safety_net_margin_s) -
                     std::chrono::duration_cast<std::chrono::milliseconds>(elapsed));
    std::weak_ptr<AgentSession> weak = weak_from_this();
    deadline_timer_.expires_after(left);
    deadline_timer_.async_wait([weak](const boost::system::error_code& error) {
        if (error)
            return;
        if (auto self = weak.lock())
            self->on_deadline();
    });
}

void AgentSession::settle_kernel_waiters(const std::optional<std::string>& error) {
    kernel_wait_ = KernelWait::none;
    auto waiters = std::exchange(kernel_waiters_, {});
    for (auto& waiter : waiters)
        waiter(error);
}

void AgentSession::attach_kernel(std::shared_ptr<Kernel> kernel) {
    kernel_ = std::move(kernel);
    kernel_->set_agent_session(record_.id);
    // A request held by another kernel's proxy ended with that kernel.
    for (Approval& approval : approvals_)
        if (approval.decision.empty() && approval.kernel_id != kernel_->id()) {
            approval.decision = "lost";
            approval.decided_by = "the kernel that held it ended";
            approval.decided = format_iso8601_utc(std::chrono::system_clock::now());
        }
    if (had_kernel_)
        state_lost_notice_ = true;
    had_kernel_ = true;
    link_ = kernel_->attach(link_session_id_, weak_from_this());
    // Runtime versions for the audit trail, answered on our own session's shell socket.
    JupyterMessage request =
        make_message(Channel::shell, "kernel_info_request", json::object(), link_session_id_);
    kernel_info_msg_id_ = request.msg_id;
    link_->send(std::move(request));
    persist_record();
    services_.logger.info("agent_session_kernel", {{"session", id()}, {"kernel_id", kernel_->id()}});
}

json AgentSession::runtime_info() const {
    json runtime = {{"gateway", CELLBLOCK_GATEWAY_VERSION}};
    if (kernel_)
        runtime["kernelspec"] = kernel_->spec_name();
    if (kernel_info_.is_object()) {
        runtime["kernel"] = string_member(kernel_info_, "implementation") + " " +
                            string_member(kernel_info_, "implementation_version");
        if (kernel_info_.contains("language_info") && kernel_info_["language_info"].is_object())
            runtime["python"] = string_member(kernel_info_["language_info"], "version");
        runtime["protocol"] = string_member(kernel_info_, "protocol_version");
    }
    return runtime;
}

json AgentSession::model() const {
    std::string state = "no kernel";
    if (kernel_wait_ == KernelWait::starting)
        state = "starting";
    else if (kernel_)
        state = running_ ? "busy" : std::string(kernel_state_name(kernel_->state()));
    json model = {{"id", record_.id},
                  {"name", record_.name},
                  {"kernel_id", kernel_ ? json(kernel_->id()) : json(nullptr)},
                  {"created", record_.created},
                  {"limits", record_.limits.to_json()},
                  {"network", record_.network.none() ? json(nullptr) : record_.network.to_json()},
                  {"state", state},
                  {"cells", cells_.size()},
                  {"queued", queue_.size()}};
    if (!record_.tenant.empty())
        model["tenant"] = record_.tenant;
    return model;
}

void AgentSession::persist_record() {
    json record = {{"id", record_.id},
                   {"name", record_.name},
                   {"created", record_.created},
                   {"limits", record_.limits.to_json()},
                   {"network", record_.network.none() ? json(nullptr) : record_.network.to_json()},
                   {"kernel_id", kernel_ ? json(kernel_->id()) : json(nullptr)},
                   {"deleted", closed_},
                   {"tenant", record_.tenant}};
    if (closed_)
        record["deleted_at"] = deleted_at_;
    services_.writer.submit([record](SessionStore& store) { store.put_agent_session(record); });
}

void AgentSession::audit(const json& entry) {
    json line = {{"time", format_iso8601_utc(std::chrono::system_clock::now())}, {"session", record_.id}};
    if (!record_.tenant.empty())
        line["tenant"] = record_.tenant;
    line.update(entry);
    services_.writer.submit([line](SessionStore& store) { store.append_audit(line); });
}

// ------------------------------------------------------------------------------------------------ the queue

std::uint64_t AgentSession::execute(ExecuteRequest request, ExecuteHandlers handlers) {
    touch();
    Pending pending;
    pending.ticket = next_ticket_++;
    pending.request = std::move(request);
    pending.handlers = std::move(handlers);
    const std::uint64_t ticket = pending.ticket;
    if (closed_) {
        fail_pending(pending, "SessionClosed", "the session was deleted");
        return ticket;
    }
    queue_.push_back(std::move(pending));
    run_next();
    return ticket;
}

void AgentSession::reset(std::string client_address, std::string token_id, Done done) {
    touch();
    Pending pending;
    pending.ticket = next_ticket_++;
    pending.is_reset = true;
    pending.request.client_address = std::move(client_address);
    pending.request.token_id = std::move(token_id);
    pending.reset_done = std::move(done);
    if (closed_)
        return pending.reset_done(std::string("session was deleted"));
    queue_.push_back(std::move(pending));
    run_next();
}

void AgentSession::abandon(std::uint64_t ticket) {
    for (auto it = queue_.begin(); it != queue_.end(); ++it) {
        if (it->ticket != ticket)
            continue;
        Pending pending = std::move(*it);
        queue_.erase(it);
        pending.handlers.on_event = nullptr;
        fail_pending(pending, "ClientDisconnected", "the client went away before the code started");
        return;
    }
    if (running_ && running_->pending.ticket == ticket && !running_->interrupted_by_client) {
        // The answer still completes (and is audited); only its streaming consumer is gone.
        running_->interrupted_by_client = true;
        running_->pending.handlers.on_event = nullptr;
        services_.logger.info("agent_execute_abandoned", {{"session", id()}});
        if (kernel_)
            kernel_->interrupt();
    }
}

void AgentSession::fail_pending(Pending& pending, const std::string& ename, const std::string& evalue) {
    if (pending.is_reset) {
        if (pending.reset_done)
            pending.reset_done(evalue);
        return;
    }
    json answer = {{"session", record_.id},
                   {"status", "error"},
                   {"execution_count", nullptr},
                   {"stdout", ""},
                   {"stderr", ""},
                   {"result", nullptr},
                   {"displays", json::array()},
                   {"error", {{"ename", ename}, {"evalue", evalue}, {"traceback", ename + ": " + evalue}}},
                   {"duration_ms", 0},
                   {"truncated", false},
                   {"state_lost", false}};
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
    if (running_ || queue_.empty() || closed_)
        return;
    Pending pending = std::move(queue_.front());
    queue_.pop_front();
    running_ = std::make_unique<Running>();
    running_->pending.ticket = pending.ticket;  // marks the session busy while the kernel starts
    std::weak_ptr<AgentSession> weak = weak_from_this();
    auto shared_pending = std::make_shared<Pending>(std::move(pending));
    ensure_kernel([weak, shared_pending](std::optional<std::string> error) {
        auto self = weak.lock();
        if (!self)
            return;
        if (error) {
            self->running_.reset();
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
                    locked->running_.reset();
                    locked->fail_pending(*shared_pending, std::string(store_unavailable_ename), *unavailable);
                    return locked->run_next();
                }
                if (locked->closed_ || !locked->kernel_) {
                    locked->running_.reset();
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

void AgentSession::with_execute_lease(std::chrono::steady_clock::time_point give_up,
                                      std::function<void(std::optional<std::string> unavailable)> then) {
    if (holds_execute_lease_ || !services_.writer.shared())
        return then(std::nullopt);  // an embedded store has this gateway alone: every lease is granted
    const auto now = std::chrono::steady_clock::now();
    if (now >= give_up)
        return then(std::string("the store did not answer within the execute's time limit"));
    const auto limit = std::chrono::duration_cast<std::chrono::milliseconds>(give_up - now);
    std::weak_ptr<AgentSession> weak = weak_from_this();
    const std::string lease = "agent-session:" + record_.id;
    // On the store's reader thread with a deadline; a lease it takes after the deadline is released there.
    services_.writer.read<bool>(
        [lease](SessionStore& store) { return store.try_lease(lease); }, limit,
        [weak, give_up, patience = give_up - now, lease, &writer = services_.writer,
         then = std::move(then)](StoreAnswer<bool> answer) mutable {
            auto self = weak.lock();
            if (!self) {
                if (answer.ok() && *answer.value)
                    release_lease_later(writer, lease);  // the session went while its lease was asked for
                return;
            }
            if (answer.ok() && *answer.value) {
                self->holds_execute_lease_ = true;
                return then(std::nullopt);
            }
            if (!answer.ok())
                self->services_.logger.warn("execute_lease_failed",
                                            {{"session", self->id()}, {"error", answer.error}});
            // Another gateway runs an execute of this session now (retried soon, as long as it takes), or
            // the store failed (retried until the execute's limit, then 503 store_unavailable).
            const auto retry = answer.ok() ? std::chrono::milliseconds(10) : std::chrono::milliseconds(200);
            if (!answer.ok() && std::chrono::steady_clock::now() + retry >= give_up)
                return then("the store is unavailable: " + answer.error);
            self->lease_timer_.expires_after(retry);
            self->lease_timer_.async_wait([weak, answered = answer.ok(), give_up, patience,
                                           then = std::move(then)](
                                              const boost::system::error_code& error) mutable {
                if (error)
                    return;
                // After a refusal the store answered, the next attempt gets the same patience again.
                if (auto again = weak.lock())
                    again->with_execute_lease(
                        answered ? std::chrono::steady_clock::now() + patience : give_up, std::move(then));
            });
        },
        [&writer = services_.writer, lease](bool taken_late) {
            if (taken_late)
                release_lease_later(writer, lease);
        });
}

void AgentSession::release_execute_lease() {
    if (std::exchange(holds_execute_lease_, false) && services_.writer.shared())
        release_lease_later(services_.writer, "agent-session:" + record_.id);
}

std::chrono::steady_clock::time_point AgentSession::store_give_up(const Pending& pending) const {
    const double limit_s =
        pending.request.timeout_s > 0 ? pending.request.timeout_s : record_.limits.timeout_s;
    return std::chrono::steady_clock::now() +
           std::min(seconds_to_ms(limit_s), std::chrono::milliseconds(lease_store_limit));
}

void AgentSession::start_reset(Pending pending) {
    auto shared_pending = std::make_shared<Pending>(std::move(pending));
    std::weak_ptr<AgentSession> weak = weak_from_this();
    services_.kernels.restart_kernel(kernel_, [weak, shared_pending](std::optional<std::string> error) {
        auto self = weak.lock();
        if (!self)
            return;
        self->running_.reset();
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
    auto& running = *running_;
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
    const double timeout_s =
        running.pending.request.timeout_s > 0 ? running.pending.request.timeout_s : record_.limits.timeout_s;
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
    services_.writer.submit(
        [inflight = InflightExecute{id(),
                                    request.msg_id,
                                    {{"code", running.pending.request.code},
                                     {"client", running.pending.request.client_address},
                                     {"via", running.pending.request.client_kind},
                                     {"timeout_s", running.pending.request.timeout_s},
                                     {"started", format_iso8601_utc(running.started_wall)}}}](
            SessionStore& store) { store.put_inflight(inflight); });
    link_->send(std::move(request));
    deadline_timer_.expires_after(
        seconds_to_ms(timeout_s + services_.config.interrupt_grace_s + safety_net_margin_s));
    deadline_timer_.async_wait([weak](const boost::system::error_code& error) {
        if (error)
            return;
        if (auto self = weak.lock())
            self->on_deadline();
    });
}

void AgentSession::on_deadline() {
    if (!running_ || !running_->collector)
        return;
    running_->timed_out = true;
    services_.logger.info("agent_execute_timeout", {{"session", id()}});
    if (kernel_)
        kernel_->interrupt();
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
    if (!running_ || !running_->collector)
        return;
    // The code ignored the interrupt: the circuit breaker restarts the kernel, which kills the worker.
    services_.logger.warn("agent_execute_kernel_restart", {{"session", id()}});
    running_->kernel_restarted = true;
    if (kernel_)
        services_.kernels.restart_kernel(kernel_, [](const std::optional<std::string>&) {});
    finish_execute();
}

void AgentSession::deliver(const JupyterMessage& message) {
    if (message.channel == Channel::shell && message.msg_type == "kernel_info_reply" &&
        !kernel_info_msg_id_.empty() &&
        message.parent_header.find(kernel_info_msg_id_) != std::string::npos) {
        kernel_info_ = json::parse(message.content, nullptr, false);
        return;
    }
    if (message.channel == Channel::iopub && message.msg_type == "cellblock_egress")
        return on_egress(message);
    if (message.channel == Channel::control && message.msg_type == "cellblock_approval_decision_reply") {
        const json parent = json::parse(message.parent_header, nullptr, false);
        const std::string parent_id = string_member(parent, "msg_id");
        if (auto waiter = decision_waiters_.find(parent_id); waiter != decision_waiters_.end()) {
            auto answer = std::move(waiter->second);
            decision_waiters_.erase(waiter);
            answer(json::parse(message.content, nullptr, false));
        }
        return;
    }
    if (!running_ || !running_->collector)
        return;
    if (running_->collector->consume(message)) {
        if (running_->collector->complete())
            finish_execute();
        return;
    }
    // The kernel process died or is being replaced: the reply will never come.
    if (message.channel == Channel::iopub && message.msg_type == "status") {
        const json content = json::parse(message.content, nullptr, false);
        const std::string state = string_member(content, "execution_state");
        if (state == "restarting" || state == "dead") {
            running_->kernel_failure =
                "the kernel process " + std::string(state == "dead" ? "died" : "died and was restarted");
            finish_execute();
        }
    }
}

void AgentSession::disconnect(const std::string& reason) {
    if (kernel_ && !closed_)
        let_go_kernel_id_ = kernel_->id();
    kernel_ = nullptr;
    link_ = nullptr;
    if (running_ && running_->collector) {
        running_->kernel_failure = "the kernel went away (" + reason + ")";
        finish_execute();
    }
}

void AgentSession::close(const std::string& reason, bool record_deletion) {
    if (closed_)
        return;
    closed_ = true;
    deleted_at_ = format_iso8601_utc(std::chrono::system_clock::now());
    deadline_timer_.cancel();
    lease_timer_.cancel();
    fail_every_waiter("the session was deleted");
    release_execute_lease();
    if (auto kernel = std::exchange(kernel_, nullptr)) {
        link_ = nullptr;
        services_.kernels.shutdown_kernel(kernel->id(), reason);
    }
    if (record_deletion)
        persist_record();
}

void AgentSession::fail_every_waiter(const std::string& cause) {
    if (running_ && running_->collector) {
        running_->kernel_failure = cause;
        finish_execute();
    }
    // Includes the execute or reset whose kernel is still starting (run_next's waiter answers it).
    settle_kernel_waiters(cause);
    while (!queue_.empty()) {
        Pending pending = std::move(queue_.front());
        queue_.pop_front();
        fail_pending(pending, "SessionClosed", cause);
    }
}

// ------------------------------------------------------------------------------------------------ answers

std::optional<std::string> AgentSession::save_output(const std::string& file_name, const std::string& text) {
    const auto root = workspace();
    if (!root)
        return std::nullopt;
    const std::string relative = std::string(saved_output_dir) + "/" + file_name;
    try {
        sandbox::Workspace workspace_files(*root);
        workspace_files.write_file(relative, text, text.size() + 1);
        return relative;
    } catch (const std::exception& error) {
        services_.logger.warn("agent_output_save_failed",
                              {{"session", id()}, {"path", relative}, {"error", error.what()}});
        return std::nullopt;
    }
}

json AgentSession::build_answer(Running& running, json& cell_outputs) {
    const ExecutionCollector& collected = *running.collector;
    const std::size_t cap = services_.config.inline_output_bytes;
    const auto duration = std::chrono::steady_clock::now() - running.started;
    const std::optional<int> count = collected.execution_count();
    const std::string stem = count ? std::to_string(*count) : "t" + std::to_string(running.pending.ticket);
    bool truncated = collected.kernel_truncated();
    json saved = json::object();

    auto shield = [&](const std::string& text, const std::string& label) -> std::optional<std::string> {
        if (text.size() <= cap)
            return std::nullopt;
        auto path = save_output(stem + "-" + label + ".txt", text);
        if (path)
            saved[label] = *path;
        truncated = true;
        return shield_text(text, cap, path).text;
    };
    const std::optional<std::string> stdout_shielded = shield(collected.stdout_text(), "stdout");
    const std::optional<std::string> stderr_shielded = shield(collected.stderr_text(), "stderr");

    json result = collected.result();
    if (result.is_object()) {
        if (!result.contains("text/plain"))
            result["text/plain"] = "";
        if (result["text/plain"].is_string()) {
            if (auto shielded = shield(result["text/plain"].get<std::string>(), "result"))
                result["text/plain"] = *shielded;
        }
        // Large rich text (e.g. a DataFrame's HTML) stays out of the answer; text/plain says the same.
        for (auto it = result.begin(); it != result.end();) {
            if (it.key() != "text/plain" && it.key().starts_with("text/") && it->is_string() &&
                it->get_ref<const std::string&>().size() > cap) {
                truncated = true;
                it = result.erase(it);
            } else {
                ++it;
            }
        }
    }
    json displays = json::array();
    for (const json& display : collected.displays())
        displays.push_back(display.value("data", json::object()));

    std::string status = collected.reply_status() == "ok" ? "ok" : "error";
    json error = nullptr;
    if (!collected.error().is_null()) {
        error = {{"ename", collected.error().value("ename", "Error")},
                 {"evalue", strip_ansi(collected.error().value("evalue", ""))},
                 {"traceback", joined_traceback(collected.error().value("traceback", json::array()))}};
    }
    bool state_lost = std::exchange(state_lost_notice_, false);
    std::string notice;
    if (state_lost)
        notice = "a new kernel serves this session (" +
                 (state_lost_cause_.empty() ? std::string("the previous one was shut down")
                                            : std::exchange(state_lost_cause_, std::string())) +
                 "): variables, imports and workspace files from earlier executes are gone";
    const std::string ename = error.is_object() ? error.value("ename", "") : "";
    const double timeout_s =
        running.pending.request.timeout_s > 0 ? running.pending.request.timeout_s : record_.limits.timeout_s;
    // What happened is the kernel's word (execute_reply metadata), never a guess from the error's text: a
    // cell that raises its own TimeoutError (a socket timeout) is an error like any other.
    if (collected.kernel_state_lost())
        state_lost = true;
    if (collected.kernel_outcome() == "time_limit") {
        status = "timeout";
        const std::string text = collected.kernel_state_lost()
                                     ? "the code ran longer than " + json(timeout_s).dump() +
                                           " s and ignored the interrupt; the Python worker was killed and "
                                           "restarted, so all state "
                                           "(variables, imports) was lost"
                                     : "the code ran longer than " + json(timeout_s).dump() +
                                           " s and was interrupted; the session's state is kept";
        error = {{"ename", "TimeoutError"}, {"evalue", text}, {"traceback", "TimeoutError: " + text}};
    }
    if (running.timed_out) {
        status = "timeout";
        if (running.kernel_restarted) {
            state_lost = true;
            const std::string text =
                "the code ran longer than " + json(timeout_s).dump() + " s and ignored the interrupt for " +
                json(services_.config.interrupt_grace_s).dump() +
                " s; the kernel was restarted, so all state (variables, imports) was lost";
            error = {{"ename", "TimeoutError"}, {"evalue", text}, {"traceback", "TimeoutError: " + text}};
        } else if (!error.is_object() || ename == "KeyboardInterrupt") {
            const std::string text = "the code ran longer than " + json(timeout_s).dump() +
                                     " s and was interrupted; the session's state is kept";
            error = {{"ename", "TimeoutError"}, {"evalue", text}, {"traceback", "TimeoutError: " + text}};
        }
    }
    if (!running.kernel_failure.empty() && collected.reply_status().empty()) {
        status = "error";
        state_lost = true;
        const std::string failure_name = closed_ ? "SessionClosed" : "KernelDied";
        error = {{"ename", failure_name},
                 {"evalue", running.kernel_failure},
                 {"traceback", failure_name + ": " + running.kernel_failure}};
    }
    if (running.interrupted_by_client && status != "ok")
        notice = "interrupted because the client disconnected";
    if (state_lost && notice.empty())
        notice = "the kernel was restarted: variables and imports from earlier executes are gone";
    if (collected.kernel_truncated()) {
        const std::string limit = std::to_string(
            std::max<std::uint64_t>(record_.limits.output_bytes, services_.config.saved_output_bytes));
        const std::string saved_note =
            "the output exceeded the " + limit +
            "-byte limit for saved output: only its first and last bytes were kept "
            "(a marker in the text says how much was left out)";
        notice = notice.empty() ? saved_note : notice + "; " + saved_note;
    }

    cell_outputs = collected.notebook_outputs(stdout_shielded, stderr_shielded);
    json answer = {{"session", record_.id},
                   {"status", status},
                   {"execution_count", count ? json(*count) : json(nullptr)},
                   {"stdout", stdout_shielded ? *stdout_shielded : collected.stdout_text()},
                   {"stderr", stderr_shielded ? *stderr_shielded : collected.stderr_text()},
                   {"result", result},
                   {"displays", displays},
                   {"error", error},
                   {"duration_ms", std::chrono::duration<double, std::milli>(duration).count()},
                   {"truncated", truncated},
                   {"state_lost", state_lost}};
    if (!saved.empty())
        answer["saved"] = saved;
    if (!notice.empty())
        answer["notice"] = notice;
    return answer;
}

void AgentSession::finish_execute() {
    if (!running_ || !running_->collector)
        return;
    deadline_timer_.cancel();
    std::unique_ptr<Running> running = std::move(running_);
    json cell_outputs;
    // The cell is recorded (queued to the store before the lease is let go: the store's writes are ordered
    // per gateway, and the next holder reads the history only through its own copy).
    json answer = build_answer(*running, cell_outputs);
    count_execute(answer, running->collector->kernel_outcome(), running->interrupted_by_client, true);
    const ExecutionCollector& collected = *running->collector;

    json cell = {
        {"cell_type", "code"},
        {"id", random_hex(8)},  // nbformat 4.5 cell ids must be unique within the notebook
        {"metadata", {{"cellblock", {{"status", answer["status"]}, {"duration_ms", answer["duration_ms"]}}}}},
        {"source", running->pending.request.code},
        {"execution_count", answer["execution_count"]},
        {"outputs", cell_outputs}};
    services_.writer.submit([session = id(), cell, msg_id = running->msg_id](SessionStore& store) {
        store.append_cell(session, cell);
        if (!msg_id.empty())
            store.remove_inflight(session, msg_id);
    });
    cells_.push_back(std::move(cell));

    json displays_digest = json::array();
    for (const json& display : collected.displays()) {
        const json bundle = display.value("data", json::object());
        const std::string data = bundle.dump(-1, ' ', false, json::error_handler_t::replace);
        json mimes = json::array();
        for (const auto& [mime, value] : bundle.items())
            mimes.push_back(mime);
        displays_digest.push_back(
            {{"mime_types", mimes}, {"bytes", data.size()}, {"sha256", sha256_hex(data)}});
    }
    const std::string result_text =
        collected.result().is_object()
            ? collected.result().dump(-1, ' ', false, json::error_handler_t::replace)
            : "";
    audit({{"event", "execute"},
           {"client", running->pending.request.client_address},
           {"via", running->pending.request.client_kind},
           {"token_id", running->pending.request.token_id},
           {"started", format_iso8601_utc(running->started_wall)},
           {"code", running->pending.request.code},
           {"code_sha256", sha256_hex(running->pending.request.code)},
           {"status", answer["status"]},
           {"execution_count", answer["execution_count"]},
           {"duration_ms", answer["duration_ms"]},
           {"timeout_s", running->pending.request.timeout_s > 0 ? running->pending.request.timeout_s
                                                                : record_.limits.timeout_s},
           {"outputs",
            {{"stdout", digest_of(collected.stdout_text())},
             {"stderr", digest_of(collected.stderr_text())},
             {"result", digest_of(result_text)},
             {"displays", displays_digest},
             {"error", answer["error"].is_object() ? json({{"ename", answer["error"]["ename"]},
                                                           {"evalue", answer["error"]["evalue"]}})
                                                   : json(nullptr)}}},
           {"truncated", answer["truncated"]},
           {"state_lost", answer["state_lost"]},
           {"limits", record_.limits.to_json()},
           {"kernel_id", kernel_ ? json(kernel_->id()) : json(nullptr)},
           {"runtime", runtime_info()}});

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

json AgentSession::notebook(bool only_ok) const {
    json cells = json::array();
    for (const json& cell : cells_) {
        if (only_ok) {
            const json& meta = cell.value("metadata", json::object());
            if (meta.contains("cellblock") && meta["cellblock"].value("status", "ok") != "ok")
                continue;
        }
        cells.push_back(cell);
    }
    // The kernelspec's directory name, not an alias such as "python3": on another Jupyter installation the
    // notebook must re-run on the confined kernel, not on whatever "python3" means there.
    std::string spec = "cellblock-python";
    std::string display_name = "Python 3 (cellblock)";
    if (kernel_) {
        if (auto found = services_.kernels.registry().find(kernel_->spec_name())) {
            spec = found->directory.filename().string();
            display_name = found->spec.value("display_name", display_name);
        }
    }
    json language_info = {{"name", "python"}, {"file_extension", ".py"}, {"mimetype", "text/x-python"}};
    if (kernel_info_.is_object() && kernel_info_.contains("language_info") &&
        kernel_info_["language_info"].is_object())
        language_info = kernel_info_["language_info"];
    return {{"cells", cells},
            {"metadata",
             {{"kernelspec", {{"name", spec}, {"display_name", display_name}, {"language", "python"}}},
              {"language_info", language_info},
              {"cellblock",
               {{"session", record_.id}, {"name", record_.name}, {"limits", record_.limits.to_json()}}}}},
            {"nbformat", 4},
            {"nbformat_minor", 5}};
}

// ------------------------------------------------------------------------------------------------ network

json AgentSession::Approval::to_json() const {
    return {{"id", id},
            {"host", host},
            {"port", port},
            {"method", method},
            {"timeout_s", timeout_s},
            {"requested", requested},
            {"state", decision.empty() ? "pending" : "decided"},
            {"decided", decided.empty() ? json(nullptr) : json(decided)},
            {"decision", decision.empty() ? json(nullptr) : json(decision)},
            {"decided_by", decided_by.empty() ? json(nullptr) : json(decided_by)}};
}

json AgentSession::approvals() const {
    json list = json::array();
    for (const Approval& approval : approvals_)
        list.push_back(approval.to_json());
    return list;
}

AgentSession::Approval* AgentSession::find_approval(const std::string& approval_id) {
    for (Approval& approval : approvals_)
        if (approval.id == approval_id)
            return &approval;
    return nullptr;
}

void AgentSession::stream_event(const json& event) {
    live_.cell_event(event);
    if (running_ && running_->pending.handlers.on_event)
        running_->pending.handlers.on_event(event);
}

void AgentSession::on_egress(const JupyterMessage& message) {
    const json content = json::parse(message.content, nullptr, false);
    if (!content.is_object())
        return;
    const std::string event = string_member(content, "event");
    const std::string now = format_iso8601_utc(std::chrono::system_clock::now());
    auto text = [&content](const char* key) { return string_member(content, key); };
    auto number = [&content](const char* key) {
        return content.contains(key) && content[key].is_number() ? content[key] : json(0);
    };
    const json kernel_id = kernel_ ? json(kernel_->id()) : json(nullptr);
    if (event == "connection") {
        audit({{"event", "network_connection"},
               {"host", text("host")},
               {"port", number("port")},
               {"method", text("method")},
               {"bytes_up", number("bytes_up")},
               {"bytes_down", number("bytes_down")},
               {"duration_ms", number("duration_ms")},
               {"allowed", bool_member(content, "allowed")},
               {"rule", text("rule")},
               {"kernel_id", kernel_id}});
        return;
    }
    if (event == "approval_requested") {
        const std::string approval_id = text("id");
        if (approval_id.empty() || find_approval(approval_id))
            return;  // a replayed record after a gateway restart: already known
        Approval approval;
        approval.id = approval_id;
        approval.host = text("host");
        approval.port = number("port").get<int>();
        approval.method = text("method");
        approval.timeout_s = number("timeout_s").get<double>();
        approval.requested = now;
        approval.kernel_id = kernel_ ? kernel_->id() : std::string();
        audit({{"event", "network_approval"},
               {"state", "requested"},
               {"id", approval.id},
               {"host", approval.host},
               {"port", approval.port},
               {"method", approval.method},
               {"timeout_s", approval.timeout_s},
               {"kernel_id", kernel_id}});
        json streamed = approval.to_json();
        streamed["type"] = "approval";
        streamed["session"] = id();
        approvals_.push_back(std::move(approval));
        while (approvals_.size() > max_approvals)
            approvals_.pop_front();
        services_.logger.info("network_approval_requested", {{"session", id()}, {"approval", streamed}});
        stream_event(streamed);
        return;
    }
    if (event == "approval_decided") {
        const std::string approval_id = text("id");
        Approval* approval = find_approval(approval_id);
        const std::string decision = text("decision");
        const std::string decided_by = text("decided_by");
        if (approval && !approval->decided.empty() && approval->decision == decision)
            return;  // recorded when the kernel answered our decision
        audit({{"event", "network_approval"},
               {"state", "decided"},
               {"id", approval_id},
               {"host", text("host")},
               {"port", number("port")},
               {"method", text("method")},
               {"decision", decision},
               {"decided_by", decided_by},
               {"client", approval ? json(approval->asking_client) : json(nullptr)},
               {"token_id", approval ? json(approval->asking_token_id) : json(nullptr)},
               {"kernel_id", kernel_id}});
        if (!approval)
            return;
        approval->decision = decision;
        approval->decided_by = decided_by;
        approval->decided = now;
        json streamed = approval->to_json();
        streamed["type"] = "approval";
        streamed["session"] = id();
        stream_event(streamed);
    }
}

void AgentSession::decide_approval(const std::string& approval_id, const std::string& decision,
                                   const std::string& decided_by, const std::string& client_address,
                                   const std::string& token_id, std::function<void(DecisionResult)> done) {
    using Status = DecisionResult::Status;
    touch();
    Approval* approval = find_approval(approval_id);
    if (!approval)
        return done({Status::unknown, "no approval " + approval_id + " in this session", nullptr});
    if (!approval->decision.empty())
        return done({Status::already_decided,
                     "approval " + approval_id + " was already decided: " + approval->decision + " by " +
                         approval->decided_by,
                     approval->to_json()});
    if (!kernel_ || !link_ || kernel_->id() != approval->kernel_id)
        return done({Status::no_kernel, "the kernel that held this request is gone", nullptr});
    approval->asking_client = client_address;
    approval->asking_token_id = token_id;
    JupyterMessage request = make_message(
        Channel::control, "cellblock_approval_decision_request",
        {{"id", approval_id}, {"decision", decision}, {"decided_by", decided_by}}, link_session_id_);
    const std::string msg_id = request.msg_id;
    auto timer = std::make_shared<boost::asio::steady_timer>(services_.io);
    auto shared_done = std::make_shared<std::function<void(DecisionResult)>>(std::move(done));
    std::weak_ptr<AgentSession> weak = weak_from_this();
    decision_waiters_[msg_id] = [weak, timer, shared_done, approval_id, decision, decided_by, client_address,
                                 token_id](const json& reply) {
        timer->cancel();
        auto self = weak.lock();
        if (!self)
            return;
        Approval* known = self->find_approval(approval_id);
        if (string_member(reply, "status") != "ok") {
            const std::string why = reply.is_object() ? string_member(reply, "evalue", "refused")
                                                      : std::string("unreadable reply");
            // Decided meanwhile (the time limit, a person in a notebook): the kernel says it is not pending.
            if (known && !known->decision.empty())
                return (*shared_done)({Status::already_decided,
                                       "approval " + approval_id + " was already decided: " +
                                           known->decision + " by " + known->decided_by,
                                       known->to_json()});
            return (*shared_done)(
                {Status::kernel_refused, "the kernel refused the decision: " + why, nullptr});
        }
        if (known && known->decision.empty()) {
            known->decision = decision;
            known->decided_by = decided_by;
            known->decided = format_iso8601_utc(std::chrono::system_clock::now());
            self->audit({{"event", "network_approval"},
                         {"state", "decided"},
                         {"id", approval_id},
                         {"host", known->host},
                         {"port", known->port},
                         {"method", known->method},
                         {"decision", decision},
                         {"decided_by", decided_by},
                         {"client", client_address},
                         {"token_id", token_id},
                         {"kernel_id", known->kernel_id}});
            json streamed = known->to_json();
            streamed["type"] = "approval";
            streamed["session"] = self->id();
            self->stream_event(streamed);
        }
        (*shared_done)({Status::ok, "", known ? known->to_json() : json(nullptr)});
    };
    link_->send(std::move(request));
    timer->expires_after(std::chrono::seconds(10));
    timer->async_wait([weak, msg_id, shared_done](const boost::system::error_code& error) {
        if (error)
            return;
        auto self = weak.lock();
        if (!self || !self->decision_waiters_.erase(msg_id))
            return;
        (*shared_done)({Status::no_answer, "the kernel did not answer the decision within 10 s", nullptr});
    });
}

}  // namespace cellblock::gateway::agent
