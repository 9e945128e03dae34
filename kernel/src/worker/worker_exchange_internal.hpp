#pragma once
// What worker_exchange.cpp (execute, assist and what the worker's outputs become) and conversation.cpp (one
// request's conversation with the worker) share and nothing else uses: the parts of `WorkerExchange`
// (worker/worker_exchange.hpp) that are not in its header.
#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "worker/output_budget.hpp"
#include "worker/worker_exchange.hpp"

namespace cellblock::kernel {
namespace exchange_internal {

using Clock = std::chrono::steady_clock;

constexpr int stdout_index = 0;
constexpr int stderr_index = 1;
inline const std::array<std::string, 2> stream_names = {"stdout", "stderr"};

enum KillCause { no_kill = 0, kill_for_time_limit = 1, kill_for_interrupt = 2 };

inline std::string seconds_text(double seconds) {
    char text[32];
    std::snprintf(text, sizeof(text), "%g", seconds);
    return text;
}

inline Clock::duration to_duration(double seconds) {
    return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

// The object field `name` of a worker frame ({} if absent or null); throws ProtocolError if it is not an
// object (PROTOCOL.md: user code can write to the channel fd, so a frame may be anything).
const nlohmann::json& object_field(const nlohmann::json& message, const char* name);

}  // namespace exchange_internal

// Everything one request to the worker needs and produces.
struct WorkerExchange::Run {
    explicit Run(std::uint64_t output_limit = 0) : output(output_limit) {}
    std::string msg_id;    // of the client's request (interrupts are addressed by it)
    bool publish = false;  // execute and not silent: outputs go to the sink
    bool allow_stdin = false;
    int execution_count = 0;
    double timeout_s = 0;  // 0 = no limit
    OutputBudget output;
    bool error_published = false;
    bool timed_out = false;    // SIGINT sent because the time limit passed
    bool interrupted = false;  // SIGINT sent because a client asked
    // Why the worker is to be killed if it is still busy at kill_at (the first of the two causes).
    exchange_internal::KillCause kill_cause = exchange_internal::no_kill;
    bool killed = false;
    // The time limit.
    exchange_internal::Clock::time_point deadline = exchange_internal::Clock::time_point::max();
    // An interrupt's grace period ends.
    exchange_internal::Clock::time_point kill_at = exchange_internal::Clock::time_point::max();
    std::optional<std::string> result_text;          // text/plain of execute_result, for history
    std::array<bool, 2> stream_open = {true, true};  // until a pipe reports end of file
    // The stream batch: text of one stream read but not published yet.
    int pending_stream = exchange_internal::stdout_index;
    std::string pending_text;
    exchange_internal::Clock::time_point flush_at = exchange_internal::Clock::time_point::max();
};

struct WorkerExchange::Ending {
    enum class Kind { reply, worker_died, unavailable } kind = Kind::unavailable;
    nlohmann::json content;           // the worker's reply content
    std::string reason;               // why the worker died / was unavailable
    bool memory_limit = false;        // the worker was killed by its memory limit
    bool earlier_state_lost = false;  // the worker that ran earlier cells is gone (died while idle)
};

}  // namespace cellblock::kernel
