#include "server/python_interpreter.hpp"

#include <xeus/xinput.hpp>

#include "common/logging.hpp"

namespace cellblock::kernel {

class PythonInterpreter::Publisher final : public ExchangeSink {
  public:
    explicit Publisher(PythonInterpreter& interpreter) : interpreter_(interpreter) {}

    void stream(const std::string& name, std::string text) override {
        interpreter_.publish_stream(name, text);
    }
    void display_data(nl::json data, nl::json metadata, nl::json transient) override {
        interpreter_.display_data(std::move(data), std::move(metadata), std::move(transient));
    }
    void update_display_data(nl::json data, nl::json metadata, nl::json transient) override {
        interpreter_.update_display_data(std::move(data), std::move(metadata), std::move(transient));
    }
    void clear_output(bool wait) override { interpreter_.clear_output(wait); }
    void execute_result(int execution_count, nl::json data, nl::json metadata) override {
        interpreter_.publish_execution_result(execution_count, std::move(data), std::move(metadata));
    }
    void error(const std::string& ename, const std::string& evalue,
               const std::vector<std::string>& traceback) override {
        interpreter_.publish_execution_error(ename, evalue, traceback);
    }
    std::string input(const std::string& prompt, bool password) override {
        return xeus::blocking_input_request(prompt, password);
    }
    bool can_release_input() const override { return static_cast<bool>(interpreter_.input_releaser_); }
    void release_input() override { interpreter_.input_releaser_(); }

  private:
    PythonInterpreter& interpreter_;
};

PythonInterpreter::PythonInterpreter(WorkerSupervisor& supervisor, HistoryManager& history,
                                     RequestControls& controls, InterpreterSettings settings)
    : supervisor_(supervisor),
      history_(history),
      identity_(std::move(settings.identity)),
      probed_python_version_(std::move(settings.probed_python_version)),
      exchange_(supervisor, controls,
                ExchangeSettings{settings.limits, settings.worker_start_timeout, settings.assist_timeout}) {
    // Without this, xeus::blocking_input_request talks to a mock interpreter and returns "".
    xeus::register_interpreter(this);
}

std::string PythonInterpreter::parent_msg_id() const {
    const nl::json& header = parent_header();
    if (header.is_object()) {
        const auto found = header.find("msg_id");
        if (found != header.end() && found->is_string()) {
            return found->get<std::string>();
        }
    }
    return {};
}

nl::json PythonInterpreter::execute_request_impl(int execution_counter, const std::string& code, bool silent,
                                                 bool store_history, nl::json user_expressions,
                                                 bool allow_stdin) {
    ExecuteRequest request;
    request.msg_id = parent_msg_id();
    request.code = code;
    request.silent = silent;
    request.store_history = store_history;
    request.user_expressions = std::move(user_expressions);
    request.allow_stdin = allow_stdin;
    request.execution_count = execution_counter;
    Publisher publisher(*this);
    ExecuteResult result = exchange_.execute(request, publisher);
    if (store_history && !silent) {
        try {
            history_.record(execution_counter, code, result.result_text);
        } catch (const std::exception& failure) {
            log_event(LogLevel::error, "history_record_failed", {{"error", failure.what()}});
        }
    }
    return std::move(result.reply);
}

nl::json PythonInterpreter::complete_request_impl(const std::string& code, int cursor_pos) try {
    const auto content =
        exchange_.assist({{"type", "complete"}, {"code", code}, {"cursor_pos", cursor_pos}}, parent_msg_id());
    if (content && content->contains("matches")) {
        return *content;
    }
    return make_empty_complete_reply(cursor_pos);
} catch (const std::exception& failure) {
    log_event(LogLevel::error, "complete_failed", {{"error", failure.what()}});
    return make_empty_complete_reply(cursor_pos);
}

nl::json PythonInterpreter::inspect_request_impl(const std::string& code, int cursor_pos,
                                                 int detail_level) try {
    const auto content = exchange_.assist(
        {{"type", "inspect"}, {"code", code}, {"cursor_pos", cursor_pos}, {"detail_level", detail_level}},
        parent_msg_id());
    if (content && content->contains("found")) {
        return *content;
    }
    return make_not_found_inspect_reply();
} catch (const std::exception& failure) {
    log_event(LogLevel::error, "inspect_failed", {{"error", failure.what()}});
    return make_not_found_inspect_reply();
}

nl::json PythonInterpreter::is_complete_request_impl(const std::string& code) try {
    const auto content = exchange_.assist({{"type", "is_complete"}, {"code", code}}, parent_msg_id());
    if (content && content->contains("status")) {
        return *content;
    }
    return make_unknown_is_complete_reply();
} catch (const std::exception& failure) {
    log_event(LogLevel::error, "is_complete_failed", {{"error", failure.what()}});
    return make_unknown_is_complete_reply();
}

nl::json PythonInterpreter::kernel_info_request_impl() {
    KernelIdentity identity = identity_;
    if (auto version = supervisor_.worker_python_version()) {
        identity.python_version = *version;
    } else if (probed_python_version_.valid()) {
        identity.python_version = probed_python_version_.get();
    }
    return make_kernel_info_reply(identity);
}

void PythonInterpreter::shutdown_request_impl() {
    // The kernel server answers shutdown_request itself; this runs only if xeus is stopped another way.
    supervisor_.shutdown();
}

}  // namespace cellblock::kernel
