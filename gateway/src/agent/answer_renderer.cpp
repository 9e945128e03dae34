#include "cellblock/gateway/agent/answer_renderer.hpp"

#include "cellblock/gateway/agent/output_shield.hpp"

namespace cellblock::gateway::agent {

using nlohmann::json;

namespace {
constexpr std::size_t audit_preview_bytes = 512;

json digest_of(const std::string& text) {
    if (text.empty())
        return nullptr;
    return {{"bytes", text.size()},
            {"sha256", sha256_hex(text)},
            {"head", std::string(utf8_head(text, audit_preview_bytes))}};
}

json timeout_error(const std::string& text) {
    return {{"ename", "TimeoutError"}, {"evalue", text}, {"traceback", "TimeoutError: " + text}};
}

// The answer's texts: within the inline cap as they are, beyond it head and tail (the whole text saved).
struct ShieldedOutputs {
    std::optional<std::string> stdout_text, stderr_text;
    json result;
    json saved = json::object();
    bool truncated = false;
};

ShieldedOutputs shield_outputs(const ExecutionCollector& collected, const AnswerContext& context,
                               const SaveOutput& save) {
    ShieldedOutputs shielded;
    shielded.truncated = collected.kernel_truncated();
    const std::size_t cap = context.inline_output_bytes;
    const std::optional<int> count = collected.execution_count();
    const std::string stem = count ? std::to_string(*count) : "t" + std::to_string(context.ticket);
    auto shield = [&](const std::string& text, const std::string& label) -> std::optional<std::string> {
        if (text.size() <= cap)
            return std::nullopt;
        auto path = save ? save(stem + "-" + label + ".txt", text) : std::nullopt;
        if (path)
            shielded.saved[label] = *path;
        shielded.truncated = true;
        return shield_text(text, cap, path).text;
    };
    shielded.stdout_text = shield(collected.stdout_text(), "stdout");
    shielded.stderr_text = shield(collected.stderr_text(), "stderr");

    json& result = shielded.result = collected.result();
    if (result.is_object()) {
        if (!result.contains("text/plain"))
            result["text/plain"] = "";
        if (result["text/plain"].is_string()) {
            if (auto text = shield(result["text/plain"].get<std::string>(), "result"))
                result["text/plain"] = *text;
        }
        // Large rich text (e.g. a DataFrame's HTML) stays out of the answer; text/plain says the same.
        for (auto it = result.begin(); it != result.end();) {
            if (it.key() != "text/plain" && it.key().starts_with("text/") && it->is_string() &&
                it->get_ref<const std::string&>().size() > cap) {
                shielded.truncated = true;
                it = result.erase(it);
            } else {
                ++it;
            }
        }
    }
    return shielded;
}

// How the execute ended: the answer's status, error, state_lost and notice.
struct Verdict {
    std::string status;
    json error;
    bool state_lost = false;
    std::string notice;
};

// What happened is the kernel's word (execute_reply metadata), never a guess from the error's text: a cell
// that raises its own TimeoutError (a socket timeout) is an error like any other.
void apply_timeouts(const ExecutionCollector& collected, const AnswerContext& context, Verdict& verdict) {
    const std::string ename = verdict.error.is_object() ? verdict.error.value("ename", "") : "";
    const std::string limit = json(context.timeout_s).dump();
    if (collected.kernel_state_lost())
        verdict.state_lost = true;
    if (collected.kernel_outcome() == "time_limit") {
        verdict.status = "timeout";
        const std::string text =
            collected.kernel_state_lost()
                ? "the code ran longer than " + limit +
                      " s and ignored the interrupt; the Python worker was killed and "
                      "restarted, so all state "
                      "(variables, imports) was lost"
                : "the code ran longer than " + limit + " s and was interrupted; the session's state is kept";
        verdict.error = timeout_error(text);
    }
    if (!context.timed_out)
        return;
    verdict.status = "timeout";
    if (context.kernel_restarted) {
        verdict.state_lost = true;
        verdict.error =
            timeout_error("the code ran longer than " + limit + " s and ignored the interrupt for " +
                          json(context.interrupt_grace_s).dump() +
                          " s; the kernel was restarted, so all state (variables, imports) was lost");
    } else if (!verdict.error.is_object() || ename == "KeyboardInterrupt") {
        verdict.error = timeout_error("the code ran longer than " + limit +
                                      " s and was interrupted; the session's state is kept");
    }
}

Verdict judge(const ExecutionCollector& collected, const AnswerContext& context) {
    Verdict verdict;
    verdict.status = collected.reply_status() == "ok" ? "ok" : "error";
    verdict.error = nullptr;
    if (!collected.error().is_null()) {
        verdict.error = {
            {"ename", collected.error().value("ename", "Error")},
            {"evalue", strip_ansi(collected.error().value("evalue", ""))},
            {"traceback", joined_traceback(collected.error().value("traceback", json::array()))}};
    }
    verdict.state_lost = context.state_lost_notice;
    if (context.state_lost_notice)
        verdict.notice = "a new kernel serves this session (" +
                         (context.state_lost_cause.empty() ? std::string("the previous one was shut down")
                                                           : context.state_lost_cause) +
                         "): variables, imports and workspace files from earlier executes are gone";
    apply_timeouts(collected, context, verdict);
    if (!context.kernel_failure.empty() && collected.reply_status().empty()) {
        verdict.status = "error";
        verdict.state_lost = true;
        const std::string failure_name = context.session_closed ? "SessionClosed" : "KernelDied";
        verdict.error = {{"ename", failure_name},
                         {"evalue", context.kernel_failure},
                         {"traceback", failure_name + ": " + context.kernel_failure}};
    }
    if (context.interrupted_by_client && verdict.status != "ok")
        verdict.notice = "interrupted because the client disconnected";
    if (verdict.state_lost && verdict.notice.empty())
        verdict.notice = "the kernel was restarted: variables and imports from earlier executes are gone";
    if (collected.kernel_truncated()) {
        const std::string saved_note =
            "the output exceeded the " + std::to_string(context.saved_output_bytes) +
            "-byte limit for saved output: only its first and last bytes were kept "
            "(a marker in the text says how much was left out)";
        verdict.notice = verdict.notice.empty() ? saved_note : verdict.notice + "; " + saved_note;
    }
    return verdict;
}
}  // namespace

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

RenderedAnswer render_answer(const ExecutionCollector& collected, const AnswerContext& context,
                             const SaveOutput& save) {
    const ShieldedOutputs shielded = shield_outputs(collected, context, save);
    json displays = json::array();
    for (const json& display : collected.displays())
        displays.push_back(display.value("data", json::object()));
    Verdict verdict = judge(collected, context);
    const std::optional<int> count = collected.execution_count();

    RenderedAnswer rendered;
    rendered.cell_outputs = collected.notebook_outputs(shielded.stdout_text, shielded.stderr_text);
    rendered.answer = {{"session", context.session_id},
                       {"status", verdict.status},
                       {"execution_count", count ? json(*count) : json(nullptr)},
                       {"stdout", shielded.stdout_text ? *shielded.stdout_text : collected.stdout_text()},
                       {"stderr", shielded.stderr_text ? *shielded.stderr_text : collected.stderr_text()},
                       {"result", shielded.result},
                       {"displays", displays},
                       {"error", verdict.error},
                       {"duration_ms", context.duration_ms},
                       {"truncated", shielded.truncated},
                       {"state_lost", verdict.state_lost}};
    if (!shielded.saved.empty())
        rendered.answer["saved"] = shielded.saved;
    if (!verdict.notice.empty())
        rendered.answer["notice"] = verdict.notice;
    return rendered;
}

json error_answer(const std::string& session_id, const std::string& ename, const std::string& evalue) {
    return {{"session", session_id},
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
}

json audit_outputs(const ExecutionCollector& collected, const json& answer) {
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
    const json& error = answer["error"];
    return {{"stdout", digest_of(collected.stdout_text())},
            {"stderr", digest_of(collected.stderr_text())},
            {"result", digest_of(result_text)},
            {"displays", displays_digest},
            {"error", error.is_object() ? json({{"ename", error["ename"]}, {"evalue", error["evalue"]}})
                                        : json(nullptr)}};
}

}  // namespace cellblock::gateway::agent
