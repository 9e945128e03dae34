#include "cellblock/gateway/agent/execution.hpp"

#include "cellblock/gateway/metrics.hpp"

namespace cellblock::gateway::agent {

using nlohmann::json;

namespace {
json parse_object(const std::string& text) {
    json parsed = json::parse(text, nullptr, false);
    return parsed.is_object() ? parsed : json::object();
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
    if (parent.value("msg_id", std::string()) != msg_id_)
        return false;
    const std::string& type = message.msg_type;

    if (message.channel == Channel::shell) {
        if (type != "execute_reply")
            return true;
        const json content = parse_object(message.content);
        reply_seen_ = true;
        reply_status_ = content.value("status", std::string("error"));
        const json metadata = parse_object(message.metadata);
        if (const auto cellblock = metadata.find("cellblock");
            cellblock != metadata.end() && cellblock->is_object()) {
            const auto outcome = cellblock->find("outcome");
            if (outcome != cellblock->end() && outcome->is_string())
                kernel_outcome_ = outcome->get<std::string>();
            const auto flag = [&](const char* name) {
                const auto found = cellblock->find(name);
                return found != cellblock->end() && found->is_boolean() && found->get<bool>();
            };
            kernel_state_lost_ = flag("state_lost");
            kernel_truncated_ = flag("output_truncated");
        }
        if (content.contains("execution_count") && content["execution_count"].is_number_integer())
            execution_count_ = content["execution_count"].get<int>();
        // An error reply without an IOPub error message (rare) still reports the error.
        if (reply_status_ == "error" && error_.is_null()) {
            error_ = {{"ename", content.value("ename", std::string("Error"))},
                      {"evalue", content.value("evalue", std::string())},
                      {"traceback", content.value("traceback", json::array())}};
        }
        return true;
    }
    if (message.channel != Channel::iopub)
        return true;

    if (type == "status") {
        const std::string state = parse_object(message.content).value("execution_state", std::string());
        if (state == "busy")
            busy_seen_ = true;
        if (state == "idle")
            idle_seen_ = true;
        return true;
    }
    const json content = parse_object(message.content);
    if (type == "stream") {
        const std::string name = content.value("name", std::string("stdout"));
        const json& text = content.contains("text") ? content["text"] : json();
        if (text.is_string())
            on_stream(name == "stderr", text.get<std::string>());
    } else if (type == "execute_input") {
        if (content.contains("execution_count") && content["execution_count"].is_number_integer())
            execution_count_ = content["execution_count"].get<int>();
    } else if (type == "execute_result") {
        result_ = content.value("data", json::object());
        if (content.contains("execution_count") && content["execution_count"].is_number_integer())
            execution_count_ = content["execution_count"].get<int>();
        items_.push_back({OutputItem::Kind::result,
                          false,
                          0,
                          0,
                          {{"output_type", "execute_result"},
                           {"execution_count", execution_count_ ? json(*execution_count_) : json(nullptr)},
                           {"data", result_},
                           {"metadata", content.value("metadata", json::object())}}});
        if (sink_)
            sink_({{"type", "result"},
                   {"data", result_},
                   {"execution_count", items_.back().output["execution_count"]}});
    } else if (type == "display_data") {
        json display = {{"data", content.value("data", json::object())},
                        {"metadata", content.value("metadata", json::object())}};
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
        error_ = {{"ename", content.value("ename", std::string("Error"))},
                  {"evalue", content.value("evalue", std::string())},
                  {"traceback", content.value("traceback", json::array())}};
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
