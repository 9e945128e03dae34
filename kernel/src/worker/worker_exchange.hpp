// The kernel's side of one request to the confined Python worker, without xeus: it sends the request and
// then pumps the worker's channel, its stdout/stderr pipes, its pidfd and the interrupt wake-up on the
// calling thread until the worker's reply or its end. It enforces the time and output limits, escalates an
// interrupt the code ignores (running → interrupted → killed after the grace period), answers input()
// through its sink, and decides what the execute_reply says happened (`cellblock.outcome`).
//
// Everything it publishes goes to an ExchangeSink, in the order the worker produced it (PROTOCOL.md,
// "Ordering rule"): Python-level stream text comes in band, as stream frames, so the channel orders it with
// displays and results; fd-level text (subprocesses, C code) read from the pipes before a frame is published
// before that frame's output; all of a cell's output is published before the reply is returned.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "launch/kernel_config.hpp"
#include "worker/request_controls.hpp"
#include "worker/worker_supervisor.hpp"

namespace cellblock::kernel {

// Where an exchange's outputs go (the xeus adapter publishes them on IOPub and stdin). Called only on the
// thread that runs the exchange, except release_input.
class ExchangeSink {
  public:
    virtual ~ExchangeSink() = default;
    // name is "stdout" or "stderr"; text is valid UTF-8 and not empty.
    virtual void stream(const std::string& name, std::string text) = 0;
    virtual void display_data(nlohmann::json data, nlohmann::json metadata, nlohmann::json transient) = 0;
    virtual void update_display_data(nlohmann::json data, nlohmann::json metadata,
                                     nlohmann::json transient) = 0;
    virtual void clear_output(bool wait) = 0;
    virtual void execute_result(int execution_count, nlohmann::json data, nlohmann::json metadata) = 0;
    virtual void error(const std::string& ename, const std::string& evalue,
                       const std::vector<std::string>& traceback) = 0;
    // Asks the client for a line (input()/getpass()) and blocks until it answers.
    virtual std::string input(const std::string& prompt, bool password) = 0;
    // Whether release_input can end a pending input(); without it the time limit waits for the client.
    virtual bool can_release_input() const = 0;
    // From another thread, while input() blocks: make it return (with "") now.
    virtual void release_input() = 0;
};

struct ExchangeSettings {
    ExecutionLimits limits;  // timeout_s, interrupt_grace_s, output_bytes (memory_mb is the supervisor's)
    std::chrono::milliseconds worker_start_timeout{60000};
    std::chrono::milliseconds assist_timeout{20000};  // complete / inspect / is_complete
};

struct ExecuteRequest {
    std::string msg_id;  // of the client's request: interrupts and per-execute options are addressed by it
    std::string code;
    bool silent = false;
    bool store_history = true;
    nlohmann::json user_expressions = nlohmann::json::object();
    bool allow_stdin = false;
    int execution_count = 0;
};

struct ExecuteResult {
    // execute_reply content, with the outcome under "cellblock" ({outcome, state_lost, output_truncated})
    // for the kernel server to move into the reply's metadata.
    nlohmann::json reply;
    std::optional<std::string> result_text;  // text/plain of the execute_result, for history
};

class WorkerExchange {
  public:
    WorkerExchange(WorkerSupervisor& supervisor, RequestControls& controls, ExchangeSettings settings);
    ~WorkerExchange();
    WorkerExchange(const WorkerExchange&) = delete;
    WorkerExchange& operator=(const WorkerExchange&) = delete;

    // Runs one execute_request (its per-execute options are taken from `controls` by msg_id). Never throws:
    // a failure of the kernel itself is answered as a KernelError reply.
    ExecuteResult execute(const ExecuteRequest& request, ExchangeSink& sink);
    // complete / inspect / is_complete ({"type": ..., fields}, without "id"): the worker's reply content,
    // or nothing if no worker answered within the assist timeout. Publishes nothing.
    std::optional<nlohmann::json> assist(nlohmann::json request, const std::string& msg_id);

    const ExchangeSettings& settings() const noexcept { return settings_; }

  private:
    // Run and Ending are defined in worker/worker_exchange_internal.hpp, Conversation in conversation.cpp.
    struct Run;           // one request to the worker and everything it produced
    struct Ending;        // how a run ended
    struct Conversation;  // the worker, the reply awaited and the channel's state, while a run goes on

    // The conversation with the worker (conversation.cpp).
    Ending converse(nlohmann::json request, Run& run, ExchangeSink& sink);
    // The steps of converse.
    std::shared_ptr<LiveWorker> acquire_worker(std::string& error);
    void size_pipes(const std::shared_ptr<LiveWorker>& worker);
    // Tells the user (on stderr, if the run publishes) that an earlier worker died; true if one did.
    bool announce_lost_state(Run& run, ExchangeSink& sink);
    void send_request(Conversation& talk, nlohmann::json request, Run& run);
    void enforce_time_limits(LiveWorker& worker, Run& run, std::chrono::steady_clock::time_point now);
    static int wait_until_next_event(const Conversation& talk, const Run& run,
                                     std::chrono::steady_clock::time_point now);
    // Reads and handles the frames the channel has; returns how the run ended if it did.
    std::optional<Ending> read_channel(Conversation& talk, Run& run, ExchangeSink& sink, bool worker_ended);
    std::optional<Ending> take_reply(Conversation& talk, const nlohmann::json& message, Run& run,
                                     ExchangeSink& sink);
    Ending worker_died(Conversation& talk, Run& run, ExchangeSink& sink);
    void interrupt_worker(LiveWorker& worker, Run& run);
    void start_escalation(Run& run, int cause);

    // What the worker's outputs become (worker_exchange.cpp).
    void read_stream(LiveWorker& worker, int index, Run& run, ExchangeSink& sink);
    void append_frame_text(LiveWorker& worker, int index, std::string_view bytes, Run& run,
                           ExchangeSink& sink);
    void batch_text(int index, Run& run, ExchangeSink& sink);
    void schedule_flush(Run& run, ExchangeSink& sink);
    void drain_streams(LiveWorker& worker, Run& run, ExchangeSink& sink);
    void flush_text(Run& run, ExchangeSink& sink);
    void publish_text(int index, std::string text, Run& run, ExchangeSink& sink);
    void publish_tails(Run& run, ExchangeSink& sink);
    bool admit_rich_output(const nlohmann::json& data, Run& run);
    // Returns true if `message` is a reply (which ends the run if its id is the request's).
    bool handle_worker_message(LiveWorker& worker, nlohmann::json& message, Run& run, ExchangeSink& sink);
    void answer_input_request(LiveWorker& worker, const nlohmann::json& message, Run& run,
                              ExchangeSink& sink);

    WorkerSupervisor& supervisor_;
    RequestControls& controls_;
    ExchangeSettings settings_;
    std::uint64_t next_request_id_ = 0;
    std::weak_ptr<LiveWorker> sized_worker_;  // the worker whose pipes were enlarged last
};

}  // namespace cellblock::kernel
