// The xeus interpreter: forwards each request to the confined Python worker and, on the shell thread
// that xeus calls it on, pumps the worker's channel and stdout/stderr pipes, publishing outputs as they
// arrive until the worker's reply. Publishing only from this thread is deliberate: xeus's publisher and
// parent header are not thread-safe.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <xeus/xinterpreter.hpp>

#include "history_manager.hpp"
#include "kernel_config.hpp"
#include "reply_builders.hpp"
#include "request_controls.hpp"
#include "worker_supervisor.hpp"

namespace cellblock::kernel {

struct InterpreterSettings {
    ExecutionLimits limits;
    KernelIdentity identity;  // python_version here is the fallback until a worker reports its own
    std::chrono::milliseconds worker_start_timeout{60000};
    std::chrono::milliseconds assist_timeout{20000};  // complete / inspect / is_complete
};

class PythonInterpreter final : public xeus::xinterpreter {
  public:
    PythonInterpreter(WorkerSupervisor& supervisor, HistoryManager& history, RequestControls& controls,
                      InterpreterSettings settings);

    // How to answer a pending input_request with "" (the wire guard's); used when the time limit passes
    // while the shell thread waits for input. Set before the kernel starts.
    void set_input_releaser(std::function<void()> releaser) { input_releaser_ = std::move(releaser); }

  private:
    struct Exchange;  // one request to the worker and everything it produced
    struct Ending;    // how an exchange ended

    void configure_impl() override {}
    nl::json execute_request_impl(int execution_counter, const std::string& code, bool silent,
                                  bool store_history, nl::json user_expressions, bool allow_stdin) override;
    nl::json complete_request_impl(const std::string& code, int cursor_pos) override;
    nl::json inspect_request_impl(const std::string& code, int cursor_pos, int detail_level) override;
    nl::json is_complete_request_impl(const std::string& code) override;
    nl::json kernel_info_request_impl() override;
    void shutdown_request_impl() override;

    Ending run(nl::json request, Exchange& exchange);
    void read_stream(LiveWorker& worker, bool is_stderr, Exchange& exchange);
    void drain_streams(LiveWorker& worker, Exchange& exchange);
    void queue_text(const std::string& name, const std::string& text, Exchange& exchange);
    void flush_text(Exchange& exchange);
    void publish_text(const std::string& name, const std::string& text, Exchange& exchange);
    bool admit_rich_output(const nl::json& data, Exchange& exchange);
    void publish_tails(Exchange& exchange);
    void interrupt_worker(LiveWorker& worker, Exchange& exchange);
    // Returns true if `message` is the reply that ends the exchange.
    bool handle_worker_message(LiveWorker& worker, nl::json& message, Exchange& exchange);
    void answer_input_request(LiveWorker& worker, const nl::json& message, Exchange& exchange);

    WorkerSupervisor& supervisor_;
    HistoryManager& history_;
    RequestControls& controls_;
    InterpreterSettings settings_;
    std::uint64_t next_request_id_ = 0;
    std::function<void()> input_releaser_;
};

}  // namespace cellblock::kernel
