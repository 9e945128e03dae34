#include "cellblock/gateway/agent/execution.hpp"

#include <cstdint>
#include <utility>

#include "cellblock/gateway/observability/metrics.hpp"

namespace cellblock::gateway::agent {

using nlohmann::json;

namespace {
// A kernel's messages are read by the types nbformat gives their members (string_member and its kin): a
// member of another type counts as absent, never a json::type_error out of consume().
json parse_object(const std::string& text) {
    json parsed = json::parse(text, nullptr, false);
    return parsed.is_object() ? parsed : json::object();
}

// A traceback is a list of lines: other entries are kept as their JSON text, anything else is no traceback.
json traceback_member(const json& object) {
    json lines = json::array();
    const auto found = object.find("traceback");
    if (found == object.end() || !found->is_array())
        return lines;
    for (const json& line : *found)
        lines.push_back(line.is_string() ? line
                                         : json(line.dump(-1, ' ', false, json::error_handler_t::replace)));
    return lines;
}

json error_of(const json& content) {
    return {{"ename", string_member(content, "ename", "Error")},
            {"evalue", string_member(content, "evalue", "")},
            {"traceback", traceback_member(content)}};
}
}  // namespace

std::string_view execute_outcome(std::string_view status, std::string_view kernel_outcome,
                                 std::string_view gateway_ename, bool interrupted_by_client) {
    using M = GatewayMetrics;
    if (status == "ok")
        return M::outcome_ok;
    if (status == "timeout")
        return M::outcome_timeout;  // the kernel's time limit, or the gateway's safety net
    if (interrupted_by_client)
        return M::outcome_interrupted;
    if (!kernel_outcome.empty()) {
        // The kernel said what happened; the error's name is the code's business (a class of the user's
        // may well be called WorkerDied).
        if (kernel_outcome == "worker_died" || kernel_outcome == "memory_limit")
            return M::outcome_worker_died;
        if (kernel_outcome == "worker_unavailable")
            return M::outcome_sandbox_unavailable;
        if (kernel_outcome == "interrupted")
            return M::outcome_interrupted;
        return M::outcome_error;
    }
    // Answers the gateway made itself, without a kernel reply (agent_session.cpp).
    if (gateway_ename == "KernelDied")
        return M::outcome_kernel_died;
    if (gateway_ename == "KernelUnavailable")
        return M::outcome_kernel_unavailable;
    if (gateway_ename == "SessionClosed")
        return M::outcome_session_closed;
    if (gateway_ename == "ClientDisconnected")
        return M::outcome_abandoned;
    return M::outcome_error;
}

ExecutionCollector::ExecutionCollector(std::string msg_id, EventSink sink)
    : msg_id_(std::move(msg_id)), sink_(std::move(sink)) {}

void ExecutionCollector::on_stream(bool is_stderr, const std::string& text) {
    std::string& target = is_stderr ? stderr_ : stdout_;
    const std::size_t begin = target.size();
    target += text;
    if (!items_.empty() && items_.back().kind == OutputItem::Kind::stream &&
        items_.back().is_stderr == is_stderr) {
        items_.back().end = target.size();
    } else {
        items_.push_back({OutputItem::Kind::stream, is_stderr, begin, target.size(), nullptr});
    }
    if (sink_)
        sink_({{"type", is_stderr ? "stderr" : "stdout"}, {"text", text}});
}

bool ExecutionCollector::consume(const JupyterMessage& message) {
    // Cheap filter first: every message of this request carries our msg_id in its parent header.
    if (message.parent_header.find(msg_id_) == std::string::npos)
        return false;
    const json parent = parse_object(message.parent_header);
    if (string_member(parent, "msg_id", "") != msg_id_)
        return false;
    const std::string& type = message.msg_type;

    if (message.channel == Channel::shell) {
        if (type != "execute_reply")
            return true;
        const json content = parse_object(message.content);
        reply_seen_ = true;
        reply_status_ = string_member(content, "status", "error");
        const json cellblock = object_member(parse_object(message.metadata), "cellblock");
        kernel_outcome_ = string_member(cellblock, "outcome", kernel_outcome_);
        kernel_state_lost_ = bool_member(cellblock, "state_lost");
        kernel_truncated_ = bool_member(cellblock, "output_truncated");
        if (const auto count = int_member(content, "execution_count"))
            execution_count_ = count;
        // An error reply without an IOPub error message (rare) still reports the error.
        if (reply_status_ == "error" && error_.is_null())
            error_ = error_of(content);
        return true;
    }
    if (message.channel != Channel::iopub)
        return true;

    if (type == "status") {
        const std::string state = string_member(parse_object(message.content), "execution_state", "");
        if (state == "busy")
            busy_seen_ = true;
        if (state == "idle")
            idle_seen_ = true;
        return true;
    }
    const json content = parse_object(message.content);
    if (type == "stream") {
        const std::string name = string_member(content, "name", "stdout");
        const json& text = content.contains("text") ? content["text"] : json();
        if (text.is_string())
            on_stream(name == "stderr", text.get<std::string>());
    } else if (type == "execute_input") {
        if (const auto count = int_member(content, "execution_count"))
            execution_count_ = count;
    } else if (type == "execute_result") {
        result_ = object_member(content, "data");
        if (const auto count = int_member(content, "execution_count"))
            execution_count_ = count;
        items_.push_back({OutputItem::Kind::result,
                          false,
                          0,
                          0,
                          {{"output_type", "execute_result"},
                           {"execution_count", execution_count_ ? json(*execution_count_) : json(nullptr)},
                           {"data", result_},
                           {"metadata", object_member(content, "metadata")}}});
        if (sink_)
            sink_({{"type", "result"},
                   {"data", result_},
                   {"execution_count", items_.back().output["execution_count"]}});
    } else if (type == "display_data") {
        json display = {{"data", object_member(content, "data")},
                        {"metadata", object_member(content, "metadata")}};
        displays_.push_back(display);
        items_.push_back({OutputItem::Kind::display,
                          false,
                          0,
                          0,
                          {{"output_type", "display_data"},
                           {"data", display["data"]},
                           {"metadata", display["metadata"]}}});
        if (sink_)
            sink_({{"type", "display"}, {"data", display["data"]}});
    } else if (type == "error") {
        error_ = error_of(content);
        items_.push_back({OutputItem::Kind::error,
                          false,
                          0,
                          0,
                          {{"output_type", "error"},
                           {"ename", error_["ename"]},
                           {"evalue", error_["evalue"]},
                           {"traceback", error_["traceback"]}}});
        if (sink_)
            sink_({{"type", "error"}, {"ename", error_["ename"]}, {"evalue", error_["evalue"]}});
    }
    return true;
}

json ExecutionCollector::notebook_outputs(const std::optional<std::string>& stdout_replacement,
                                          const std::optional<std::string>& stderr_replacement) const {
    json outputs = json::array();
    bool stdout_placed = false, stderr_placed = false;
    for (const OutputItem& item : items_) {
        if (item.kind != OutputItem::Kind::stream) {
            outputs.push_back(item.output);
            continue;
        }
        const auto& replacement = item.is_stderr ? stderr_replacement : stdout_replacement;
        bool& placed = item.is_stderr ? stderr_placed : stdout_placed;
        std::string text;
        if (replacement) {
            if (placed)
                continue;
            placed = true;
            text = *replacement;
        } else {
            const std::string& source = item.is_stderr ? stderr_ : stdout_;
            text = source.substr(item.begin, item.end - item.begin);
        }
        const char* name = item.is_stderr ? "stderr" : "stdout";
        if (!outputs.empty() && outputs.back().value("output_type", "") == "stream" &&
            outputs.back().value("name", "") == name) {
            outputs.back()["text"] = outputs.back()["text"].get<std::string>() + text;
        } else {
            outputs.push_back({{"output_type", "stream"}, {"name", name}, {"text", text}});
        }
    }
    return outputs;
}

}  // namespace cellblock::gateway::agent
