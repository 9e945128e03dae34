#include "worker/worker_exchange.hpp"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <functional>
#include <mutex>
#include <string_view>
#include <thread>

#include "common/json_text.hpp"
#include "common/logging.hpp"
#include "worker/output_budget.hpp"
#include "worker/reply_builders.hpp"

namespace cellblock::kernel {
namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

// Pipe text up to this size is read onto the stack; more goes straight into the stream batch.
constexpr std::size_t small_read_bytes = 65536;
// Stream text is batched for a few milliseconds so a print() that reaches the pipe as several writes
// becomes one stream message, while prints further apart still arrive apart. A batch is published early
// once it is this large, so a flood of output reaches clients in pieces of a bounded size. Every message
// costs a JSON serialization, a signature and a parse in the client, so fewer and larger is cheaper: a
// 1 MiB print is one message.
constexpr auto stream_batch_window = std::chrono::milliseconds(3);
constexpr std::size_t stream_batch_bytes = 4u << 20;
// The worker's pipes hold this much (Linux's default /proc/sys/fs/pipe-max-size) instead of 64 KiB, so a
// large print is one write in the worker and one read here rather than a ping-pong of 16 wake-ups per MiB.
// Pipe pages are allocated as they are written: an idle worker's pipes cost nothing.
constexpr int pipe_capacity_bytes = 1 << 20;

// A worker that answered a request answers the sync after it at once (it is idle); one that does not within
// this time is stuck in a thread of its own, and the held reply is returned anyway.
constexpr double sync_timeout_s = 5;

constexpr int stdout_index = 0;
constexpr int stderr_index = 1;
const std::array<std::string, 2> stream_names = {"stdout", "stderr"};

enum KillCause { no_kill = 0, kill_for_time_limit = 1, kill_for_interrupt = 2 };

std::string seconds_text(double seconds) {
    char text[32];
    std::snprintf(text, sizeof(text), "%g", seconds);
    return text;
}

Clock::duration to_duration(double seconds) {
    return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

OutputStream output_stream(int index) {
    return index == stderr_index ? OutputStream::stderr_stream : OutputStream::stdout_stream;
}

// Runs `action` once at `when` unless stopped first (on its own thread: the caller is blocked).
class InputWatchdog {
  public:
    InputWatchdog(Clock::time_point when, std::function<void()> action)
        : thread_([this, when, action = std::move(action)] {
              std::unique_lock lock(mutex_);
              if (!changed_.wait_until(lock, when, [this] { return stopped_; })) {
                  fired_ = true;
                  lock.unlock();
                  action();
              }
          }) {}
    ~InputWatchdog() { stop(); }
    InputWatchdog(const InputWatchdog&) = delete;
    InputWatchdog& operator=(const InputWatchdog&) = delete;
    // Cancels the watchdog; returns true if it had already fired.
    bool stop() {
        {
            std::lock_guard lock(mutex_);
            stopped_ = true;
        }
        changed_.notify_all();
        if (thread_.joinable()) {
            thread_.join();
        }
        return fired_;
    }

  private:
    std::mutex mutex_;
    std::condition_variable changed_;
    bool stopped_ = false;
    bool fired_ = false;
    std::thread thread_;
};

// Ends a request's claim on interrupts however run() leaves.
class RunningRequest {
  public:
    RunningRequest(RequestControls& controls, const std::string& msg_id) : controls_(controls) {
        controls_.begin(msg_id);
    }
    ~RunningRequest() { controls_.end(); }
    RunningRequest(const RunningRequest&) = delete;
    RunningRequest& operator=(const RunningRequest&) = delete;

  private:
    RequestControls& controls_;
};

// Where assist requests (complete, inspect, is_complete) publish: nowhere (their runs never publish).
class DiscardingSink final : public ExchangeSink {
  public:
    void stream(const std::string&, std::string) override {}
    void display_data(json, json, json) override {}
    void update_display_data(json, json, json) override {}
    void clear_output(bool) override {}
    void execute_result(int, json, json) override {}
    void error(const std::string&, const std::string&, const std::vector<std::string>&) override {}
    std::string input(const std::string&, bool) override { return {}; }
    bool can_release_input() const override { return false; }
    void release_input() override {}
};

// Fields a worker frame must have with the right type; anything else is a protocol error (PROTOCOL.md:
// user code can write to the channel fd, so a frame may be anything).
const json& object_field(const json& message, const char* name) {
    static const json empty = json::object();
    const auto found = message.find(name);
    if (found == message.end() || found->is_null()) {
        return empty;
    }
    if (!found->is_object()) {
        throw ProtocolError(std::string("worker frame field '") + name + "' is not an object");
    }
    return *found;
}

std::string string_field(const json& message, const char* name, const std::string& fallback) {
    const auto found = message.find(name);
    if (found == message.end() || found->is_null()) {
        return fallback;
    }
    if (!found->is_string()) {
        throw ProtocolError(std::string("worker frame field '") + name + "' is not a string");
    }
    return found->get<std::string>();
}

bool bool_field(const json& message, const char* name) {
    const auto found = message.find(name);
    if (found == message.end() || found->is_null()) {
        return false;
    }
    if (!found->is_boolean()) {
        throw ProtocolError(std::string("worker frame field '") + name + "' is not a boolean");
    }
    return found->get<bool>();
}

// What the execute_reply's metadata says happened (the kernel server moves it there from the content;
// xeus 2.4.1 gives interpreters no say over reply metadata).
json outcome_metadata(std::string_view outcome, bool state_lost, bool output_truncated) {
    return {{"outcome", outcome}, {"state_lost", state_lost}, {"output_truncated", output_truncated}};
}

}  // namespace

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
    KillCause kill_cause = no_kill;
    bool killed = false;
    Clock::time_point deadline = Clock::time_point::max();  // the time limit
    Clock::time_point kill_at = Clock::time_point::max();   // an interrupt's grace period ends
    std::optional<std::string> result_text;                 // text/plain of execute_result, for history
    std::array<bool, 2> stream_open = {true, true};         // until a pipe reports end of file
    // The stream batch: text of one stream read but not published yet.
    int pending_stream = stdout_index;
    std::string pending_text;
    Clock::time_point flush_at = Clock::time_point::max();
};

struct WorkerExchange::Ending {
    enum class Kind { reply, worker_died, unavailable } kind = Kind::unavailable;
    json content;                     // the worker's reply content
    std::string reason;               // why the worker died / was unavailable
    bool memory_limit = false;        // the worker was killed by its memory limit
    bool earlier_state_lost = false;  // the worker that ran earlier cells is gone (died while idle)
};

WorkerExchange::WorkerExchange(WorkerSupervisor& supervisor, RequestControls& controls,
                               ExchangeSettings settings)
    : supervisor_(supervisor), controls_(controls), settings_(settings) {}

WorkerExchange::~WorkerExchange() = default;

void WorkerExchange::publish_text(int index, std::string text, Run& run, ExchangeSink& sink) {
    if (!run.publish || text.empty()) {
        return;
    }
    std::string live = run.output.admit_text(output_stream(index), std::move(text));
    if (!live.empty()) {
        sink.stream(stream_names[index], std::move(live));
    }
}

void WorkerExchange::flush_text(Run& run, ExchangeSink& sink) {
    run.flush_at = Clock::time_point::max();
    if (run.pending_text.empty()) {
        return;
    }
    std::string text = std::move(run.pending_text);
    run.pending_text = std::string();
    publish_text(run.pending_stream, std::move(text), run, sink);
}

void WorkerExchange::publish_tails(Run& run, ExchangeSink& sink) {
    flush_text(run, sink);
    if (!run.publish) {
        return;
    }
    for (const int index : {stdout_index, stderr_index}) {
        std::string tail = run.output.take_tail(output_stream(index));
        if (!tail.empty()) {
            sink.stream(stream_names[index], std::move(tail));
        }
    }
    if (const auto dropped = run.output.dropped_rich(); dropped > 0) {
        sink.stream(stream_names[stderr_index],
                    "\n[cellblock] Output truncated: " + std::to_string(dropped) +
                        " rich output(s) (displays, results) were left out (the output limit is " +
                        std::to_string(run.output.limit_bytes()) + " bytes per execute).\n");
    }
}

bool WorkerExchange::admit_rich_output(const json& data, Run& run) {
    if (!run.publish) {
        return false;
    }
    if (run.output.limit_bytes() == 0) {
        return true;
    }
    return run.output.admit_rich(dump_json(data).size());
}

void WorkerExchange::start_escalation(Run& run, int cause) {
    if (run.kill_cause == no_kill) {
        run.kill_cause = static_cast<KillCause>(cause);
        run.kill_at = Clock::now() + to_duration(settings_.limits.interrupt_grace_s);
    }
}

void WorkerExchange::interrupt_worker(LiveWorker& worker, Run& run) {
    run.interrupted = true;
    worker.signal(SIGINT);
    log_event(LogLevel::info, "execution_interrupted", {{"msg_id", run.msg_id}});
    start_escalation(run, kill_for_interrupt);
}

void WorkerExchange::size_pipes(const std::shared_ptr<LiveWorker>& worker) {
    if (sized_worker_.lock() == worker) {
        return;  // once per worker; a worker serves many requests
    }
    sized_worker_ = worker;
    for (const int fd : {worker->stdout_fd(), worker->stderr_fd()}) {
        if (::fcntl(fd, F_SETPIPE_SZ, pipe_capacity_bytes) < 0) {
            // Not fatal: an unprivileged kernel over its pipe quota keeps 64 KiB pipes.
            log_event(LogLevel::debug, "pipe_resize_failed", {{"fd", fd}, {"errno", errno}});
        }
    }
}

// Reads what the pipe holds at this moment (FIONREAD) and not more. The worker sends a frame only once the
// pipes are empty (bounded, PROTOCOL.md), so bytes that arrive after a read that emptied the pipe may have
// been written after a frame that is now waiting on the channel: they wait for the next poll round, which
// looks at the channel first.
void WorkerExchange::read_stream(LiveWorker& worker, int index, Run& run, ExchangeSink& sink) {
    const int fd = index == stderr_index ? worker.stderr_fd() : worker.stdout_fd();
    auto& decoder = index == stderr_index ? worker.stderr_text : worker.stdout_text;
    int available = 0;
    if (::ioctl(fd, FIONREAD, &available) < 0 || available < 0) {
        available = 0;  // not a pipe: read what one read gives
    }
    batch_text(index, run, sink);
    std::string& text = run.pending_text;
    const std::size_t from = text.size();
    ssize_t got = 0;
    if (static_cast<std::size_t>(available) <= small_read_bytes) {
        // 0 available: the writers are gone (POLLHUP) and this read sees the end of the file.
        std::array<char, small_read_bytes> buffer;
        got = ::read(fd, buffer.data(), available > 0 ? static_cast<std::size_t>(available) : buffer.size());
        if (got > 0) {
            text.append(buffer.data(), static_cast<std::size_t>(got));
        }
    } else {
        // A large burst is read straight into the batch: the bytes are copied once, out of the pipe.
        text.resize(from + static_cast<std::size_t>(available));
        got = ::read(fd, text.data() + from, static_cast<std::size_t>(available));
        text.resize(from + static_cast<std::size_t>(std::max<ssize_t>(got, 0)));
    }
    if (got < 0 && errno != EAGAIN && errno != EINTR) {
        run.stream_open[index] = false;
    }
    decoder.decode_appended(text, from);
    if (got == 0) {
        run.stream_open[index] = false;
        text += decoder.finish();
    }
    schedule_flush(run, sink);
}

// Python-level text from a stream frame joins the same batch, output limit and UTF-8 check as pipe text.
void WorkerExchange::append_frame_text(LiveWorker& worker, int index, std::string_view bytes, Run& run,
                                       ExchangeSink& sink) {
    auto& decoder = index == stderr_index ? worker.stderr_frame_text : worker.stdout_frame_text;
    batch_text(index, run, sink);
    const std::size_t from = run.pending_text.size();
    run.pending_text.append(bytes);
    decoder.decode_appended(run.pending_text, from);
    schedule_flush(run, sink);
}

// The batch holds text of one stream: text of the other one publishes it first.
void WorkerExchange::batch_text(int index, Run& run, ExchangeSink& sink) {
    if (run.pending_stream != index && !run.pending_text.empty()) {
        flush_text(run, sink);
    }
    run.pending_stream = index;
}

void WorkerExchange::schedule_flush(Run& run, ExchangeSink& sink) {
    if (run.pending_text.empty()) {
        return;
    }
    if (run.pending_text.size() >= stream_batch_bytes) {
        flush_text(run, sink);
    } else if (run.flush_at == Clock::time_point::max()) {
        run.flush_at = Clock::now() + stream_batch_window;
    }
}

void WorkerExchange::drain_streams(LiveWorker& worker, Run& run, ExchangeSink& sink) {
    // Bounded so a worker printing without pause cannot keep us here forever.
    for (int round = 0; round < 4096; ++round) {
        std::array<pollfd, 2> fds = {{{run.stream_open[0] ? worker.stdout_fd() : -1, POLLIN, 0},
                                      {run.stream_open[1] ? worker.stderr_fd() : -1, POLLIN, 0}}};
        if (::poll(fds.data(), fds.size(), 0) <= 0) {
            break;
        }
        bool any = false;
        for (const int index : {stdout_index, stderr_index}) {
            if (fds[index].revents & (POLLIN | POLLHUP)) {
                read_stream(worker, index, run, sink);
                any = true;
            }
        }
        if (!any) {
            break;
        }
    }
    flush_text(run, sink);
}

void WorkerExchange::answer_input_request(LiveWorker& worker, const json& message, Run& run,
                                          ExchangeSink& sink) {
    json answer = {{"type", "input_reply"}};
    if (run.allow_stdin && run.publish) {
        const std::string prompt = string_field(message, "prompt", std::string());
        const bool password = bool_field(message, "password");
        // Blocks this thread until the client answers on stdin (xeus 2.4.1 has no cancel), so the time
        // limit is enforced by a watchdog that interrupts the worker and has the sink release the prompt.
        std::optional<InputWatchdog> watchdog;
        if (run.deadline != Clock::time_point::max() && sink.can_release_input()) {
            watchdog.emplace(run.deadline, [&worker, &sink] {
                worker.signal(SIGINT);
                sink.release_input();
            });
        }
        answer["value"] = sink.input(prompt, password);
        if (watchdog && watchdog->stop()) {
            run.timed_out = true;
            start_escalation(run, kill_for_time_limit);
            log_event(LogLevel::info, "execution_timeout",
                      {{"timeout_s", run.timeout_s}, {"while", "input"}});
        }
        // An interrupt_request released the prompt: interrupt the worker before it gets the answer, so
        // KeyboardInterrupt is raised in input() itself.
        if (controls_.take_interrupt(run.msg_id)) {
            interrupt_worker(worker, run);
        }
    } else {
        answer["error"] = "this frontend does not support input requests (allow_stdin is false)";
    }
    if (!send_all(worker.channel_fd(), encode_frame(answer))) {
        log_event(LogLevel::warning, "worker_channel_closed", {{"while", "input_reply"}});
    }
}

bool WorkerExchange::handle_worker_message(LiveWorker& worker, json& message, Run& run, ExchangeSink& sink) {
    const std::string type = message["type"].get<std::string>();
    if (type == "reply") {
        return true;
    }
    if (type == "display_data" || type == "update_display_data") {
        json data = object_field(message, "data");
        json metadata = object_field(message, "metadata");
        json transient = object_field(message, "transient");
        if (!admit_rich_output(data, run)) {
            return false;
        }
        if (type == "display_data") {
            sink.display_data(std::move(data), std::move(metadata), std::move(transient));
        } else {
            sink.update_display_data(std::move(data), std::move(metadata), std::move(transient));
        }
    } else if (type == "clear_output") {
        const bool wait = bool_field(message, "wait");
        if (run.publish) {
            sink.clear_output(wait);
        }
    } else if (type == "execute_result") {
        json data = object_field(message, "data");
        json metadata = object_field(message, "metadata");
        if (data.contains("text/plain") && data["text/plain"].is_string()) {
            run.result_text = data["text/plain"].get<std::string>();
        }
        if (!admit_rich_output(data, run)) {
            return false;
        }
        sink.execute_result(run.execution_count, std::move(data), std::move(metadata));
    } else if (type == "error") {
        std::string ename = string_field(message, "ename", "Error");
        std::string evalue = string_field(message, "evalue", std::string());
        const auto traceback = message.find("traceback");
        if (traceback != message.end() && !traceback->is_array() && !traceback->is_null()) {
            throw ProtocolError("worker frame field 'traceback' is not an array");
        }
        if (!run.publish) {
            return false;
        }
        if (run.timed_out) {
            ename = "TimeoutError";
            evalue = "the cell exceeded the time limit of " + seconds_text(run.timeout_s) +
                     " s and was interrupted";
        }
        sink.error(ename, evalue,
                   traceback_lines(traceback != message.end() && traceback->is_array() ? *traceback
                                                                                       : json::array()));
        run.error_published = true;
    } else if (type == "input_request") {
        flush_text(run, sink);
        answer_input_request(worker, message, run, sink);
    } else {
        log_event(LogLevel::debug, "worker_message_ignored", {{"type", type}});
    }
    return false;
}

// The state of one converse loop besides the run's own.
struct WorkerExchange::Conversation {
    std::shared_ptr<LiveWorker> worker;
    std::uint64_t id = 0;  // of the reply awaited: the request's, then the sync's
    bool channel_open = false;
    bool killed_for_protocol = false;
    bool earlier_state_lost = false;
    // The worker's reply, held while a sync makes sure no SIGINT of this run is still on its way.
    std::optional<Ending> answered;
    Clock::time_point settle_by = Clock::time_point::max();
};

std::shared_ptr<LiveWorker> WorkerExchange::acquire_worker(std::string& error) {
    auto worker = supervisor_.acquire(settings_.worker_start_timeout, error);
    // A worker that died while idle (a background thread hit the memory limit, say) is replaced before
    // this request, which is not to blame.
    for (int attempt = 0; worker && attempt < 2; ++attempt) {
        pollfd ended = {worker->pidfd(), POLLIN, 0};
        if (::poll(&ended, 1, 0) == 0) {
            break;
        }
        log_event(LogLevel::warning, "worker_died_while_idle",
                  {{"reason", supervisor_.retire(worker).describe()}});
        worker = supervisor_.acquire(settings_.worker_start_timeout, error);
    }
    return worker;
}

bool WorkerExchange::announce_lost_state(Run& run, ExchangeSink& sink) {
    if (!run.publish) {
        return false;
    }
    auto note = supervisor_.take_lost_state_note();
    if (!note) {
        return false;
    }
    sink.stream(stream_names[stderr_index],
                "[cellblock] The Python worker was restarted (the previous one was " + *note +
                    "); variables, imports and other state from earlier cells are gone.\n");
    return true;
}

void WorkerExchange::send_request(Conversation& talk, json request, Run& run) {
    talk.id = ++next_request_id_;
    request["id"] = talk.id;
    talk.channel_open = send_all(talk.worker->channel_fd(), encode_frame(request));
    const auto started = Clock::now();
    run.deadline = run.timeout_s > 0 ? started + to_duration(run.timeout_s) : Clock::time_point::max();
    if (!talk.channel_open) {
        talk.worker->kill();  // it is gone or going; the pidfd tells why
    }
    // An interrupt that arrived before the request reached the worker belongs to it.
    if (controls_.take_interrupt(run.msg_id)) {
        interrupt_worker(*talk.worker, run);
    }
}

void WorkerExchange::enforce_time_limits(LiveWorker& worker, Run& run,
                                         std::chrono::steady_clock::time_point now) {
    if (!run.timed_out && now >= run.deadline) {
        run.timed_out = true;
        log_event(LogLevel::info, "execution_timeout", {{"timeout_s", run.timeout_s}});
        worker.signal(SIGINT);
        start_escalation(run, kill_for_time_limit);
    }
    if (run.kill_cause != no_kill && !run.killed && now >= run.kill_at) {
        run.killed = true;
        log_event(LogLevel::warning, "worker_kill_after_interrupt",
                  {{"grace_s", settings_.limits.interrupt_grace_s},
                   {"cause", run.kill_cause == kill_for_time_limit ? "time_limit" : "interrupt"}});
        worker.kill();
    }
}

int WorkerExchange::wait_until_next_event(const Conversation& talk, const Run& run,
                                          std::chrono::steady_clock::time_point now) {
    const auto never = Clock::time_point::max();
    auto next_event = run.timed_out ? never : run.deadline;
    if (run.kill_cause != no_kill && !run.killed) {
        next_event = std::min(next_event, run.kill_at);
    }
    next_event = std::min({next_event, run.flush_at, talk.settle_by});
    if (next_event == never) {
        return -1;
    }
    return static_cast<int>(std::max<long long>(
        0, std::chrono::duration_cast<std::chrono::milliseconds>(next_event - now).count() + 1));
}

WorkerExchange::Ending WorkerExchange::converse(json request, Run& run, ExchangeSink& sink) {
    const RunningRequest running(controls_, run.msg_id);
    Conversation talk;
    std::string error;
    talk.worker = acquire_worker(error);
    if (!talk.worker) {
        return {Ending::Kind::unavailable, nullptr, error};
    }
    LiveWorker& worker = *talk.worker;
    size_pipes(talk.worker);
    talk.earlier_state_lost = announce_lost_state(run, sink);
    send_request(talk, std::move(request), run);
    while (true) {
        const auto now = Clock::now();
        enforce_time_limits(worker, run, now);
        if (talk.answered && now >= talk.settle_by) {
            log_event(LogLevel::warning, "worker_sync_timeout", {{"timeout_s", sync_timeout_s}});
            return *talk.answered;
        }
        const int wait_ms = wait_until_next_event(talk, run, now);
        // While a frame is only partly read, pipe text that became readable was written after it began
        // (the worker waits for the pipes to be read before it sends a frame), so it waits for the frame.
        const bool frame_complete = worker.frames.empty() || !talk.channel_open;
        std::array<pollfd, 5> fds = {
            {{talk.channel_open ? worker.channel_fd() : -1, POLLIN, 0},
             {run.stream_open[0] && frame_complete ? worker.stdout_fd() : -1, POLLIN, 0},
             {run.stream_open[1] && frame_complete ? worker.stderr_fd() : -1, POLLIN, 0},
             {worker.pidfd(), POLLIN, 0},
             {controls_.wakeup_fd(), POLLIN, 0}}};
        const int ready = ::poll(fds.data(), fds.size(), wait_ms);
        if (ready < 0) {
            if (errno == EINTR) {
                continue;
            }
            log_event(LogLevel::error, "poll_failed", {{"errno", errno}});
            worker.kill();
        }
        // The channel before the pipes: the worker sends a frame only after the kernel has read what it
        // wrote to fds 1/2 before it, so pipe text readable together with a frame was written after it.
        if (fds[0].revents & (POLLIN | POLLHUP | POLLERR)) {
            if (auto ending = read_channel(talk, run, sink, fds[3].revents != 0)) {
                return *ending;
            }
        }
        if (worker.frames.empty() || !talk.channel_open) {
            for (const int index : {stdout_index, stderr_index}) {
                if (fds[1 + index].revents & (POLLIN | POLLHUP)) {
                    read_stream(worker, index, run, sink);
                }
            }
        }
        if (Clock::now() >= run.flush_at) {
            flush_text(run, sink);
        }
        if (fds[4].revents & POLLIN) {
            controls_.drain_wakeup();
            if (controls_.take_interrupt(run.msg_id) && !talk.answered) {
                interrupt_worker(worker, run);
            }
        }
        if (fds[3].revents != 0 && talk.answered) {
            return *talk.answered;  // died after answering: the next request finds it gone and replaces it
        }
        if (fds[3].revents != 0) {
            return worker_died(talk, run, sink);
        }
    }
}

std::optional<WorkerExchange::Ending> WorkerExchange::read_channel(Conversation& talk, Run& run,
                                                                   ExchangeSink& sink, bool worker_ended) {
    LiveWorker& worker = *talk.worker;
    const ssize_t got = worker.frames.read_from(worker.channel_fd());
    if (got > 0) {
        try {
            while (auto frame = worker.frames.next()) {
                if (frame->kind != WorkerFrame::Kind::message) {
                    // Python-level text: in band, so already in the worker's order.
                    append_frame_text(
                        worker, frame->kind == WorkerFrame::Kind::stderr_text ? stderr_index : stdout_index,
                        frame->text, run, sink);
                    continue;
                }
                json& message = frame->message;
                // Text read before the frame was written before it: publish it first.
                flush_text(run, sink);
                if (handle_worker_message(worker, message, run, sink)) {
                    if (auto ending = take_reply(talk, message, run, sink)) {
                        return ending;
                    }
                }
            }
        } catch (const std::exception& failure) {
            // ProtocolError, or a field of the wrong type (nlohmann::json::type_error): either way the
            // channel cannot be trusted any more.
            log_event(LogLevel::error, "worker_protocol_error", {{"error", failure.what()}});
            talk.killed_for_protocol = true;
            talk.channel_open = false;
            worker.kill();
        }
    } else if (got == 0 || (errno != EAGAIN && errno != EINTR)) {
        // The worker closed its end: it is exiting. Make sure it does, then report why.
        talk.channel_open = false;
        if (!worker_ended) {
            if (!worker.wait_for(std::chrono::milliseconds(500))) {
                worker.kill();
            }
        }
    }
    return std::nullopt;
}

std::optional<WorkerExchange::Ending> WorkerExchange::take_reply(Conversation& talk, const json& message,
                                                                 Run& run, ExchangeSink& sink) {
    const auto reply_id = message.find("id");
    if (reply_id == message.end() || !reply_id->is_number_unsigned()) {
        throw ProtocolError("worker reply without a numeric id");
    }
    if (reply_id->get<std::uint64_t>() != talk.id) {
        log_event(LogLevel::warning, "stale_worker_reply", {{"id", *reply_id}});
        return std::nullopt;
    }
    if (talk.answered) {
        return talk.answered;  // the sync's reply
    }
    // Output of children or C code that raced with the reply still belongs here.
    drain_streams(*talk.worker, run, sink);
    Ending ending{Ending::Kind::reply, object_field(message, "content"), {}};
    ending.earlier_state_lost = talk.earlier_state_lost;
    if (!run.interrupted && !run.timed_out) {
        return ending;
    }
    // A SIGINT of this run may not have been taken yet; it must not reach the next request (PROTOCOL.md,
    // "Signals").
    talk.id = ++next_request_id_;
    if (!send_all(talk.worker->channel_fd(), encode_frame({{"type", "sync"}, {"id", talk.id}}))) {
        return ending;
    }
    talk.answered = std::move(ending);
    run.kill_cause = no_kill;  // answered: nothing left to escalate
    run.deadline = Clock::time_point::max();
    talk.settle_by = Clock::now() + to_duration(sync_timeout_s);
    return std::nullopt;
}

WorkerExchange::Ending WorkerExchange::worker_died(Conversation& talk, Run& run, ExchangeSink& sink) {
    drain_streams(*talk.worker, run, sink);
    const auto outcome = supervisor_.retire(talk.worker);
    std::string reason = outcome.describe();
    if (run.killed && run.kill_cause == kill_for_time_limit) {
        reason = "killed by the time limit (the cell ran longer than " + seconds_text(run.timeout_s) +
                 " s and did not stop within " + seconds_text(settings_.limits.interrupt_grace_s) +
                 " s of the interrupt)";
    } else if (run.killed) {
        reason = "killed because the code did not stop within " +
                 seconds_text(settings_.limits.interrupt_grace_s) + " s of the interrupt";
    } else if (talk.killed_for_protocol) {
        reason = "killed after a protocol error on the worker channel";
    }
    log_event(LogLevel::warning, "worker_died", {{"reason", reason}});
    Ending ending{Ending::Kind::worker_died, nullptr, reason};
    ending.memory_limit = outcome.reason == sandbox::Outcome::Reason::memory_limit && !run.killed;
    ending.earlier_state_lost = talk.earlier_state_lost;
    return ending;
}

ExecuteResult WorkerExchange::execute(const ExecuteRequest& request, ExchangeSink& sink) try {
    const ExecuteOptions options = controls_.take_options(request.msg_id);
    Run run(effective_output_limit(options.output_bytes, settings_.limits.output_bytes));
    run.msg_id = request.msg_id;
    run.publish = !request.silent;
    run.allow_stdin = request.allow_stdin;
    run.execution_count = request.execution_count;
    run.timeout_s = settings_.limits.timeout_s;
    if (options.timeout_s && (run.timeout_s <= 0 || *options.timeout_s < run.timeout_s)) {
        run.timeout_s = *options.timeout_s;  // a client may ask for less time, never for more
    }

    json message = {{"type", "execute"},
                    {"code", request.code},
                    {"silent", request.silent},
                    {"store_history", request.store_history},
                    {"user_expressions",
                     request.user_expressions.is_object() ? request.user_expressions : json::object()},
                    {"allow_stdin", request.allow_stdin},
                    {"execution_count", request.execution_count}};
    const Ending ending = converse(std::move(message), run, sink);
    publish_tails(run, sink);

    ExecuteResult result;
    result.result_text = run.result_text;
    const bool truncated = run.output.truncated();

    if (ending.kind != Ending::Kind::reply) {
        std::string ename = ending.kind == Ending::Kind::worker_died ? "WorkerDied" : "WorkerUnavailable";
        std::string evalue = ending.kind == Ending::Kind::worker_died
                                 ? ending.reason + "; the next execution starts a fresh Python worker"
                                 : ending.reason;
        std::string_view outcome = "worker_unavailable";
        if (ending.kind == Ending::Kind::worker_died) {
            outcome = "worker_died";
            if (run.killed && run.kill_cause == kill_for_time_limit) {
                outcome = "time_limit";
            } else if (run.killed) {
                outcome = "interrupted";
                ename = "KeyboardInterrupt";
                evalue = "the code did not stop within " + seconds_text(settings_.limits.interrupt_grace_s) +
                         " s of the interrupt, so the Python worker was killed; the next execution starts a "
                         "fresh one (variables and imports are gone)";
            } else if (ending.memory_limit) {
                outcome = "memory_limit";
            }
        }
        const std::vector<std::string> traceback = {ename + ": " + evalue};
        if (!request.silent) {
            sink.error(ename, evalue, traceback);
        }
        result.reply = make_error_reply(ename, evalue, traceback);
        result.reply["cellblock"] = outcome_metadata(
            outcome, ending.kind == Ending::Kind::worker_died || ending.earlier_state_lost, truncated);
        return result;
    }
    const json& content = ending.content;
    if (content.value("status", std::string("error")) == "ok") {
        result.reply = make_execute_ok_reply(content.value("payload", json::array()),
                                             content.value("user_expressions", json::object()));
        result.reply["cellblock"] =
            outcome_metadata(truncated ? "output_limit" : "ok", ending.earlier_state_lost, truncated);
        return result;
    }
    std::string ename = content.value("ename", std::string("Error"));
    std::string evalue = content.value("evalue", std::string());
    json traceback = content.value("traceback", json::array());
    std::string_view outcome = "error";
    if (run.timed_out) {
        outcome = "time_limit";
        ename = "TimeoutError";
        evalue =
            "the cell exceeded the time limit of " + seconds_text(run.timeout_s) + " s and was interrupted";
    } else if (run.interrupted && ename == "KeyboardInterrupt") {
        outcome = "interrupted";
    }
    if (!run.error_published && !request.silent) {
        sink.error(ename, evalue, traceback_lines(traceback));
    }
    result.reply = make_error_reply(ename, evalue, traceback);
    result.reply["cellblock"] = outcome_metadata(outcome, ending.earlier_state_lost, truncated);
    return result;
} catch (const std::exception& failure) {
    // xeus swallows exceptions from handlers and then sends no reply at all; answer with an error instead.
    log_event(LogLevel::error, "execute_failed", {{"error", failure.what()}});
    ExecuteResult result;
    result.reply = make_error_reply("KernelError", failure.what());
    result.reply["cellblock"] = outcome_metadata("error", false, false);
    return result;
}

std::optional<json> WorkerExchange::assist(json request, const std::string& msg_id) {
    DiscardingSink sink;
    Run run;
    run.msg_id = msg_id;
    run.timeout_s = std::chrono::duration<double>(settings_.assist_timeout).count();
    const Ending ending = converse(std::move(request), run, sink);
    if (ending.kind == Ending::Kind::reply && ending.content.is_object()) {
        return ending.content;
    }
    return std::nullopt;
}

}  // namespace cellblock::kernel
