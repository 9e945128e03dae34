// The xeus interpreter: a thin adapter between xeus's request handlers and the WorkerExchange, which runs
// each request against the confined Python worker on the interpreter thread that xeus calls this on. Outputs
// are published from that thread only, because xeus's publisher and parent header are not thread-safe.
#pragma once

#include <chrono>
#include <functional>
#include <future>
#include <string>
#include <xeus/xinterpreter.hpp>

#include "launch/kernel_config.hpp"
#include "server/history_manager.hpp"
#include "worker/reply_builders.hpp"
#include "worker/request_controls.hpp"
#include "worker/worker_exchange.hpp"
#include "worker/worker_supervisor.hpp"

namespace cellblock::kernel {

struct InterpreterSettings {
    ExecutionLimits limits;
    KernelIdentity identity;
    // The Python version kernel_info names until a worker reports its own: `python --version`, run while the
    // kernel starts, so neither kernel_info waits for the worker nor the kernel's start for the probe.
    std::shared_future<std::string> probed_python_version;
    std::chrono::milliseconds worker_start_timeout{60000};
    std::chrono::milliseconds assist_timeout{20000};  // complete / inspect / is_complete
};

class PythonInterpreter final : public xeus::xinterpreter {
  public:
    PythonInterpreter(WorkerSupervisor& supervisor, HistoryManager& history, RequestControls& controls,
                      InterpreterSettings settings);

    // How to answer a pending input_request with "" (the kernel server's); used when the time limit passes
    // while the interpreter thread waits for input. Set before the kernel starts.
    void set_input_releaser(std::function<void()> releaser) { input_releaser_ = std::move(releaser); }

  private:
    class Publisher;  // the ExchangeSink that publishes through xeus

    void configure_impl() override {}
    nl::json execute_request_impl(int execution_counter, const std::string& code, bool silent,
                                  bool store_history, nl::json user_expressions, bool allow_stdin) override;
    nl::json complete_request_impl(const std::string& code, int cursor_pos) override;
    nl::json inspect_request_impl(const std::string& code, int cursor_pos, int detail_level) override;
    nl::json is_complete_request_impl(const std::string& code) override;
    nl::json kernel_info_request_impl() override;
    void shutdown_request_impl() override;

    std::string parent_msg_id() const;

    WorkerSupervisor& supervisor_;
    HistoryManager& history_;
    KernelIdentity identity_;
    std::shared_future<std::string> probed_python_version_;
    WorkerExchange exchange_;
    std::function<void()> input_releaser_;
};

}  // namespace cellblock::kernel
