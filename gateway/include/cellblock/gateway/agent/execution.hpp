#pragma once
// Collects everything one execute_request produced: the kernel's IOPub messages and execute_reply for that
// msg_id, in order, as the pieces an agent answer and a notebook cell are made of. Knows nothing of HTTP or
// sessions.
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "cellblock/gateway/jupyter/jupyter_message.hpp"

namespace cellblock::gateway::agent {

// How an agent execute ended, as /metrics counts it (cellblock_agent_executes_total{outcome}): one of the
// GatewayMetrics::outcome_* values. From the answer's `status`, the kernel's own word on what happened
// (execute_reply metadata cellblock.outcome; empty when no reply came), whether its client went away while
// it ran, and, only for answers the gateway made itself (no kernel reply), the gateway's error name.
std::string_view execute_outcome(std::string_view status, std::string_view kernel_outcome,
                                 std::string_view gateway_ename, bool interrupted_by_client);

class ExecutionCollector {
  public:
    // Receives each event as it happens: {"type": "stdout"|"stderr", "text"}, {"type": "result", "data",
    // "execution_count"}, {"type": "display", "data"}, {"type": "error", "ename", "evalue", "traceback"}.
    using EventSink = std::function<void(const nlohmann::json& event)>;

    ExecutionCollector(std::string msg_id, EventSink sink);
    // Returns false when the message belongs to another request (another client of the same kernel).
    bool consume(const JupyterMessage& message);
    // execute_reply arrived and IOPub went idle for this request.
    bool complete() const { return reply_seen_ && idle_seen_; }
    bool started() const { return busy_seen_ || reply_seen_; }
    const std::string& msg_id() const { return msg_id_; }

    const std::string& stdout_text() const { return stdout_; }
    const std::string& stderr_text() const { return stderr_; }
    const nlohmann::json& result() const { return result_; }      // null or a mime bundle
    const nlohmann::json& displays() const { return displays_; }  // [{"data", "metadata"}]
    const nlohmann::json& error() const {
        return error_;
    }  // null or {"ename", "evalue", "traceback": [lines]}
    std::optional<int> execution_count() const { return execution_count_; }
    const std::string& reply_status() const {
        return reply_status_;
    }  // "ok", "error", "aborted" or "" (none yet)
    // From the execute_reply's metadata.cellblock (kernel/README.md, "Outcomes"): what happened ("" when
    // the reply had none), whether the worker's state was lost, whether the kernel's output limit left
    // output out.
    const std::string& kernel_outcome() const { return kernel_outcome_; }
    bool kernel_state_lost() const { return kernel_state_lost_; }
    bool kernel_truncated() const { return kernel_truncated_; }

    // nbformat 4 outputs in order. Consecutive stream pieces of one name are merged; a stream whose text is
    // replaced (context shielding) appears once, with `replacement`, where it first appeared.
    nlohmann::json notebook_outputs(const std::optional<std::string>& stdout_replacement,
                                    const std::optional<std::string>& stderr_replacement) const;

  private:
    struct OutputItem {
        enum class Kind { stream, result, display, error } kind;
        bool is_stderr = false;
        std::size_t begin = 0, end = 0;  // stream: byte range in stdout_/stderr_
        nlohmann::json output;           // other kinds: the nbformat output
    };
    void on_stream(bool is_stderr, const std::string& text);

    std::string msg_id_;
    EventSink sink_;
    std::string stdout_, stderr_;
    nlohmann::json result_, displays_ = nlohmann::json::array(), error_;
    std::optional<int> execution_count_;
    std::string reply_status_;
    std::string kernel_outcome_;
    bool kernel_state_lost_ = false;
    std::vector<OutputItem> items_;
    bool busy_seen_ = false, reply_seen_ = false, idle_seen_ = false, kernel_truncated_ = false;
};

}  // namespace cellblock::gateway::agent
