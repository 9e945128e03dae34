// What clients ask of one request beyond the Jupyter fields, handed from the kernel server's I/O thread
// (which sees every verified message) to the interpreter thread (which runs the request): per-execute limits
// from the request's metadata, and interrupts addressed to requests that have not been answered yet.
//
// xeus 2.4.1 gives the interpreter neither the request's metadata nor interrupt_request, so the kernel
// server posts both here, keyed by the request's msg_id, and the interpreter takes them by the msg_id of
// its parent header. An interrupt is remembered for the requests the server had handed over and not seen
// answered, so one that arrives before the worker starts running the code is not lost.
#pragma once

#include <cstdint>
#include <deque>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "common/unique_fd.hpp"

namespace cellblock::kernel {

// From execute_request metadata {"cellblock": {"timeout_s": N, "output_bytes": N}}.
struct ExecuteOptions {
    std::optional<double> timeout_s;  // > 0 and ≤ longest_seconds; the kernel's own limit stays the ceiling
    // Replaces the kernel's output limit for this execute, up to max(the kernel's, 256 MiB); 0 asks for that
    // ceiling. A kernel without a limit stays without one.
    std::optional<std::uint64_t> output_bytes;
};

// Reads the "cellblock" member of a request's metadata; a field of the wrong type or range is ignored.
ExecuteOptions parse_execute_options(const nlohmann::json& metadata);

class RequestControls {
  public:
    RequestControls();
    RequestControls(const RequestControls&) = delete;
    RequestControls& operator=(const RequestControls&) = delete;

    // The kernel server's I/O thread.
    void post_options(const std::string& msg_id, ExecuteOptions options);
    // An interrupt_request: applies to the request running now and to `unanswered` (msg_ids forwarded to
    // xeus without a reply yet), whichever of them runs next.
    void interrupt(const std::vector<std::string>& unanswered);

    // Shell thread.
    ExecuteOptions take_options(const std::string& msg_id);
    // True once per interrupt addressed to `msg_id` (or to whatever was running).
    bool take_interrupt(const std::string& msg_id);
    // Readable after interrupt(); the shell thread polls it while a request runs and calls drain_wakeup().
    int wakeup_fd() const noexcept { return wakeup_.get(); }
    void drain_wakeup() noexcept;
    // The request with this msg_id runs from begin() to end(); a signal-mode interrupt (no msg_ids)
    // applies to it only.
    void begin(const std::string& msg_id);
    void end();

  private:
    static constexpr std::size_t remembered_requests = 64;
    std::mutex mutex_;
    std::deque<std::pair<std::string, ExecuteOptions>> options_;
    std::deque<std::string> interrupted_;
    std::string running_;  // msg_id of the request the shell thread runs now
    bool interrupt_running_ = false;
    UniqueFd wakeup_;
};

}  // namespace cellblock::kernel
