#include "cellblock/gateway/agent/agent_session.hpp"

#include "cellblock/contract/file_messages.hpp"
#include "cellblock/gateway/agent/answer_renderer.hpp"
#include "cellblock/gateway/agent/output_shield.hpp"
#include "cellblock/gateway/common/crypto.hpp"
#include "cellblock/gateway/common/time_format.hpp"
#include "cellblock/sandbox/sandbox.hpp"

// The session itself: its record, model, notebook, audit trail, the messages of its kernel and its end. The
// rest of AgentSession is by responsibility in agent_session_kernel.cpp (its kernel: start, attach, ready,
// resume after a gateway restart), agent_session_queue.cpp (the execute queue, its timers and answers),
// agent_session_lease.cpp (the execute lease across gateways on a shared store),
// agent_session_network.cpp (network approvals and the proxy's audit entries) and agent_session_files.cpp
// (the file requests to its kernel).

namespace cellblock::gateway::agent {

using nlohmann::json;
namespace fs = std::filesystem;

namespace {
// Where the full text of shielded outputs goes, relative to the workspace (the code's cwd).
constexpr std::string_view saved_output_dir = ".cellblock/outputs";
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
      binding_(!cells_.empty()),
      deadline_timer_(services.io),
      lease_timer_(services.io),
      live_(services.config.inline_output_bytes) {
    live_.seed(cells_);
}

AgentSession::~AgentSession() = default;

std::chrono::steady_clock::time_point AgentSession::last_used() const {
    auto used = last_used_;
    if (const auto kernel = binding_.kernel()) {
        // A person working in a notebook attached to the kernel keeps the session alive too.
        const auto kernel_idle = std::chrono::system_clock::now() - kernel->last_activity();
        used =
            std::max(used, std::chrono::steady_clock::now() -
                               std::chrono::duration_cast<std::chrono::steady_clock::duration>(kernel_idle));
    }
    return used;
}

AgentSession::State AgentSession::state() const {
    if (executes_.busy())
        return State::busy;
    if (!binding_.requesting(KernelBinding::Request::none))
        return State::starting;
    if (const auto kernel = binding_.kernel(); !kernel || kernel->state() == KernelState::dead)
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
    const auto kernel = binding_.kernel();
    if (!kernel)
        return std::nullopt;
    return kernel->workspace_dir();
}

json AgentSession::runtime_info() const {
    json runtime = {{"gateway", CELLBLOCK_GATEWAY_VERSION}};
    if (const auto kernel = binding_.kernel())
        runtime["kernelspec"] = kernel->spec_name();
    if (const json& info = binding_.kernel_info(); info.is_object()) {
        runtime["kernel"] =
            string_member(info, "implementation") + " " + string_member(info, "implementation_version");
        if (info.contains("language_info") && info["language_info"].is_object())
            runtime["python"] = string_member(info["language_info"], "version");
        runtime["protocol"] = string_member(info, "protocol_version");
    }
    return runtime;
}

json AgentSession::model() const {
    const auto kernel = binding_.kernel();
    std::string state = "no kernel";
    if (binding_.requesting(KernelBinding::Request::starting))
        state = "starting";
    else if (kernel)
        state = executes_.running() != nullptr ? "busy" : std::string(kernel_state_name(kernel->state()));
    json model = {{"id", record_.id},
                  {"name", record_.name},
                  {"kernel_id", kernel ? json(kernel->id()) : json(nullptr)},
                  {"created", record_.created},
                  {"limits", record_.limits.to_json()},
                  {"network", record_.network.none() ? json(nullptr) : record_.network.to_json()},
                  {"state", state},
                  {"cells", cells_.size()},
                  {"queued", executes_.queued()}};
    if (!record_.tenant.empty())
        model["tenant"] = record_.tenant;
    return model;
}

void AgentSession::persist_record() {
    const auto kernel = binding_.kernel();
    json record = {{"id", record_.id},
                   {"name", record_.name},
                   {"created", record_.created},
                   {"limits", record_.limits.to_json()},
                   {"network", record_.network.none() ? json(nullptr) : record_.network.to_json()},
                   {"kernel_id", kernel ? json(kernel->id()) : json(nullptr)},
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

void AgentSession::deliver(const JupyterMessage& message) {
    if (binding_.take_kernel_info(message))
        return;
    if (message.channel == Channel::iopub && message.msg_type == "cellblock_egress")
        return on_egress(message);
    if (message.channel == Channel::control && message.msg_type == contract::file_reply_type)
        return on_file_reply(message);
    if (message.channel == Channel::control && message.msg_type == "cellblock_approval_decision_reply") {
        const json parent = json::parse(message.parent_header, nullptr, false);
        approvals_.answer_decision(string_member(parent, "msg_id"),
                                   json::parse(message.content, nullptr, false));
        return;
    }
    Running* running = executes_.running();
    if (!running || !running->collector)
        return;
    if (running->collector->consume(message)) {
        if (running->collector->complete())
            finish_execute();
        return;
    }
    // The kernel process died or is being replaced: the reply will never come.
    if (message.channel == Channel::iopub && message.msg_type == "status") {
        const json content = json::parse(message.content, nullptr, false);
        const std::string state = string_member(content, "execution_state");
        if (state == "restarting" || state == "dead") {
            running->kernel_failure =
                "the kernel process " + std::string(state == "dead" ? "died" : "died and was restarted");
            finish_execute();
        }
    }
}

void AgentSession::disconnect(const std::string& reason) {
    binding_.let_go(!closed_);
    fail_file_requests("the kernel went away (" + reason + ")");
    if (Running* running = executes_.running(); running && running->collector) {
        running->kernel_failure = "the kernel went away (" + reason + ")";
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
    execute_lease_retry_ = nullptr;
    fail_every_waiter("the session was deleted");
    release_execute_lease();
    if (auto kernel = binding_.unbind())
        services_.kernels.shutdown_kernel(kernel->id(), reason);
    if (record_deletion)
        persist_record();
}

void AgentSession::fail_every_waiter(const std::string& cause) {
    if (Running* running = executes_.running(); running && running->collector) {
        running->kernel_failure = cause;
        finish_execute();
    }
    fail_file_requests(cause);
    // Includes the execute or reset whose kernel is still starting (run_next's waiter answers it).
    binding_.settle(cause);
    for (Pending& pending : executes_.take_all())
        fail_pending(pending, "SessionClosed", cause);
}

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
    AnswerContext context;
    context.session_id = record_.id;
    context.ticket = running.pending.ticket;
    context.inline_output_bytes = services_.config.inline_output_bytes;
    context.saved_output_bytes =
        std::max<std::uint64_t>(record_.limits.output_bytes, services_.config.saved_output_bytes);
    context.timeout_s = time_limit_of(running.pending.request);
    context.interrupt_grace_s = services_.config.interrupt_grace_s;
    context.duration_ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - running.started).count();
    context.timed_out = running.timed_out;
    context.kernel_restarted = running.kernel_restarted;
    context.interrupted_by_client = running.interrupted_by_client;
    context.kernel_failure = running.kernel_failure;
    context.session_closed = closed_;
    // Told once: the next answer no longer says it.
    context.state_lost_notice = std::exchange(state_lost_notice_, false);
    if (context.state_lost_notice)
        context.state_lost_cause = std::exchange(state_lost_cause_, std::string());
    RenderedAnswer rendered = render_answer(*running.collector, context,
                                            [this](const std::string& file_name, const std::string& text) {
                                                return save_output(file_name, text);
                                            });
    cell_outputs = std::move(rendered.cell_outputs);
    return std::move(rendered.answer);
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
    if (const auto kernel = binding_.kernel()) {
        if (auto found = services_.kernels.registry().find(kernel->spec_name())) {
            spec = found->directory.filename().string();
            display_name = found->spec.value("display_name", display_name);
        }
    }
    json language_info = {{"name", "python"}, {"file_extension", ".py"}, {"mimetype", "text/x-python"}};
    if (const json& info = binding_.kernel_info();
        info.is_object() && info.contains("language_info") && info["language_info"].is_object())
        language_info = info["language_info"];
    return {{"cells", cells},
            {"metadata",
             {{"kernelspec", {{"name", spec}, {"display_name", display_name}, {"language", "python"}}},
              {"language_info", language_info},
              {"cellblock",
               {{"session", record_.id}, {"name", record_.name}, {"limits", record_.limits.to_json()}}}}},
            {"nbformat", 4},
            {"nbformat_minor", 5}};
}

json AgentSession::approvals() const {
    return approvals_.to_json();
}
}  // namespace cellblock::gateway::agent
