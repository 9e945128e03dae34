#pragma once
// Turns what one execute produced (an ExecutionCollector) and how it ran into the agent API's answer JSON and
// its notebook cell's outputs, and the audit entry's digest of those outputs. Pure functions: no kernel, no
// session, no clock; saving the whole text of an output too large to answer inline is the caller's
// (SaveOutput). agent_session.cpp renders every execute's answer through these.
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "cellblock/gateway/agent/execution.hpp"

namespace cellblock::gateway::agent {

// Everything an answer says beyond the collected output.
struct AnswerContext {
    std::string session_id;
    std::uint64_t ticket = 0;             // names saved files when the execute has no execution count
    std::size_t inline_output_bytes = 0;  // per text field (--agent-inline-output-bytes)
    // The kernel's limit for saved output: max(limits.output_bytes, --agent-saved-output-bytes).
    std::uint64_t saved_output_bytes = 0;
    double timeout_s = 0;          // the execute's time limit
    double interrupt_grace_s = 0;  // --agent-interrupt-grace
    double duration_ms = 0;
    // The gateway's safety net passed and interrupted the code; `kernel_restarted`: the code ignored that
    // too.
    bool timed_out = false;
    bool kernel_restarted = false;
    bool interrupted_by_client = false;
    std::string kernel_failure;   // the kernel died or went away during the execute
    bool session_closed = false;  // the session was deleted during the execute
    // A new kernel replaced the session's old one since the last answer, and why (empty: not known).
    bool state_lost_notice = false;
    std::string state_lost_cause;
};

// Saves the whole text of a shielded output as `file_name`; answers its workspace-relative path, or nullopt
// when it could not be saved.
using SaveOutput =
    std::function<std::optional<std::string>(const std::string& file_name, const std::string& text)>;

struct RenderedAnswer {
    nlohmann::json answer;        // {"session", "status", "stdout", ..., "state_lost"[, "saved", "notice"]}
    nlohmann::json cell_outputs;  // nbformat outputs, shielded texts in place of the whole ones
};

RenderedAnswer render_answer(const ExecutionCollector& collected, const AnswerContext& context,
                             const SaveOutput& save);

// The answer of an execute that never ran (the session closed, no kernel, the store unavailable).
nlohmann::json error_answer(const std::string& session_id, const std::string& ename,
                            const std::string& evalue);

// The audit entry's "outputs" of an execute: the size, SHA-256 and head of each, never the whole text.
nlohmann::json audit_outputs(const ExecutionCollector& collected, const nlohmann::json& answer);

// A traceback's lines joined by newlines, without ANSI colour codes.
std::string joined_traceback(const nlohmann::json& traceback);

}  // namespace cellblock::gateway::agent
