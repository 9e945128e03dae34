#include "python_interpreter.hpp"

#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <functional>
#include <mutex>
#include <thread>
#include <xeus/xinput.hpp>

#include "logging.hpp"
#include "output_budget.hpp"

namespace cellblock::kernel {
namespace {

using Clock = std::chrono::steady_clock;
constexpr std::size_t read_chunk_bytes = 65536;
constexpr auto stream_batch_window = std::chrono::milliseconds(3);

std::string seconds_text(double seconds) {
    char text[32];
    std::snprintf(text, sizeof(text), "%g", seconds);
    return text;
}

Clock::duration to_duration(double seconds) {
    return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
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

}  // namespace

// Everything one request to the worker needs and produces.
struct PythonInterpreter::Exchange {
    explicit Exchange(std::uint64_t output_limit = 0) : output(output_limit) {}
    std::string msg_id;    // of the client's request (interrupts are addressed by it)
    bool publish = false;  // execute and not silent: outputs go to IOPub
    bool allow_stdin = false;
    int execution_count = 0;
    double timeout_s = 0;  // 0 = no limit
    OutputBudget output;
    bool error_published = false;
    bool timed_out = false;    // SIGINT sent because the time limit passed
    bool interrupted = false;  // SIGINT sent because a client asked
    // Why the worker is to be killed if it is still busy at kill_at (the first of the two causes).
    enum class KillCause { none, time_limit, interrupt } kill_cause = KillCause::none;
    bool killed = false;
    Clock::time_point deadline = Clock::time_point::max();  // the time limit
    Clock::time_point kill_at = Clock::time_point::max();   // an interrupt's grace period ends
    std::optional<std::string> result_text;                 // text/plain of execute_result, for history
    bool stdout_open = true;                                // until the pipe reports end of file
    bool stderr_open = true;
    // Stream text is batched for a few milliseconds so a print() that reaches the pipe as several writes
    // becomes one stream message, while prints further apart still arrive apart.
    std::string pending_name;
    std::string pending_text;
    Clock::time_point flush_at = Clock::time_point::max();
};

struct PythonInterpreter::Ending {
    enum class Kind { reply, worker_died, unavailable } kind = Kind::unavailable;
    nl::json content;                 // the worker's reply content
    std::string reason;               // why the worker died / was unavailable
    bool memory_limit = false;        // the worker was killed by its memory limit
    bool earlier_state_lost = false;  // the worker that ran earlier cells is gone (died while idle)
};

namespace {

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

// Fields a worker frame must have with the right type; anything else is a protocol error (PROTOCOL.md:
// user code can write to the channel fd, so a frame may be anything).
const nl::json& object_field(const nl::json& message, const char* name) {
    static const nl::json empty = nl::json::object();
    const auto found = message.find(name);
    if (found == message.end() || found->is_null()) {
        return empty;
    }
    if (!found->is_object()) {
        throw ProtocolError(std::string("worker frame field '") + name + "' is not an object");
    }
    return *found;
}

std::string string_field(const nl::json& message, const char* name, const std::string& fallback) {
    const auto found = message.find(name);
    if (found == message.end() || found->is_null()) {
        return fallback;
    }
    if (!found->is_string()) {
        throw ProtocolError(std::string("worker frame field '") + name + "' is not a string");
    }
    return found->get<std::string>();
}

bool bool_field(const nl::json& message, const char* name) {
    const auto found = message.find(name);
    if (found == message.end() || found->is_null()) {
        return false;
    }
    if (!found->is_boolean()) {
        throw ProtocolError(std::string("worker frame field '") + name + "' is not a boolean");
    }
    return found->get<bool>();
}

}  // namespace

PythonInterpreter::PythonInterpreter(WorkerSupervisor& supervisor, HistoryManager& history,
                                     RequestControls& controls, InterpreterSettings settings)
    : supervisor_(supervisor), history_(history), controls_(controls), settings_(std::move(settings)) {
    // Without this, xeus::blocking_input_request talks to a mock interpreter and returns "".
    xeus::register_interpreter(this);
}

void PythonInterpreter::publish_text(const std::string& name, const std::string& text, Exchange& exchange) {
    if (!exchange.publish || text.empty()) {
        return;
    }
    const auto stream = name == "stderr" ? OutputStream::stderr_stream : OutputStream::stdout_stream;
    const std::string live = exchange.output.admit_text(stream, text);
    if (!live.empty()) {
        publish_stream(name, live);
    }
}

void PythonInterpreter::publish_tails(Exchange& exchange) {
    flush_text(exchange);
    if (!exchange.publish) {
        return;
    }
    for (const auto stream : {OutputStream::stdout_stream, OutputStream::stderr_stream}) {
        const std::string tail = exchange.output.take_tail(stream);
        if (!tail.empty()) {
            publish_stream(stream == OutputStream::stderr_stream ? "stderr" : "stdout", tail);
        }
    }
    if (const auto dropped = exchange.output.dropped_rich(); dropped > 0) {
        publish_stream("stderr",
                       "\n[cellblock] Output truncated: " + std::to_string(dropped) +
                           " rich output(s) (displays, results) were left out (the output limit is " +
                           std::to_string(exchange.output.limit_bytes()) + " bytes per execute).\n");
    }
}

void PythonInterpreter::queue_text(const std::string& name, const std::string& text, Exchange& exchange) {
    if (text.empty()) {
        return;
    }
    if (!exchange.pending_text.empty() && exchange.pending_name != name) {
        flush_text(exchange);
    }
    exchange.pending_name = name;
    exchange.pending_text += text;
    if (exchange.pending_text.size() >= read_chunk_bytes) {
        flush_text(exchange);
    } else if (exchange.flush_at == Clock::time_point::max()) {
        exchange.flush_at = Clock::now() + stream_batch_window;
    }
}

void PythonInterpreter::flush_text(Exchange& exchange) {
    exchange.flush_at = Clock::time_point::max();
    if (exchange.pending_text.empty()) {
        return;
    }
    const std::string text = std::move(exchange.pending_text);
    exchange.pending_text.clear();
    publish_text(exchange.pending_name, text, exchange);
}

bool PythonInterpreter::admit_rich_output(const nl::json& data, Exchange& exchange) {
    if (!exchange.publish) {
        return false;
    }
    if (exchange.output.limit_bytes() == 0) {
        return true;
    }
    return exchange.output.admit_rich(data.dump(-1, ' ', false, nl::json::error_handler_t::replace).size());
}

void PythonInterpreter::interrupt_worker(LiveWorker& worker, Exchange& exchange) {
    exchange.interrupted = true;
    worker.signal(SIGINT);
    log_event(LogLevel::info, "execution_interrupted", {{"msg_id", exchange.msg_id}});
    if (exchange.kill_cause == Exchange::KillCause::none) {
        exchange.kill_cause = Exchange::KillCause::interrupt;
        exchange.kill_at = Clock::now() + to_duration(settings_.limits.interrupt_grace_s);
    }
}

void PythonInterpreter::read_stream(LiveWorker& worker, bool is_stderr, Exchange& exchange) {
    bool& open = is_stderr ? exchange.stderr_open : exchange.stdout_open;
    std::array<char, read_chunk_bytes> buffer{};
    const int fd = is_stderr ? worker.stderr_fd() : worker.stdout_fd();
    auto& decoder = is_stderr ? worker.stderr_text : worker.stdout_text;
    const ssize_t got = ::read(fd, buffer.data(), buffer.size());
    if (got > 0) {
        queue_text(is_stderr ? "stderr" : "stdout",
                   decoder.feed({buffer.data(), static_cast<std::size_t>(got)}), exchange);
    } else if (got == 0) {
        open = false;
        queue_text(is_stderr ? "stderr" : "stdout", decoder.finish(), exchange);
    } else if (errno != EAGAIN && errno != EINTR) {
        open = false;
    }
}

void PythonInterpreter::drain_streams(LiveWorker& worker, Exchange& exchange) {
    // Bounded so a worker printing without pause cannot keep us here forever.
    for (int round = 0; round < 4096; ++round) {
        std::array<pollfd, 2> fds = {{{exchange.stdout_open ? worker.stdout_fd() : -1, POLLIN, 0},
                                      {exchange.stderr_open ? worker.stderr_fd() : -1, POLLIN, 0}}};
        if (::poll(fds.data(), fds.size(), 0) <= 0) {
            break;
        }
        bool any = false;
        if (fds[0].revents & (POLLIN | POLLHUP)) {
            read_stream(worker, false, exchange);
            any = true;
        }
        if (fds[1].revents & (POLLIN | POLLHUP)) {
            read_stream(worker, true, exchange);
            any = true;
        }
        if (!any) {
            break;
        }
    }
    flush_text(exchange);
}

void PythonInterpreter::answer_input_request(LiveWorker& worker, const nl::json& message,
                                             Exchange& exchange) {
    nl::json answer = {{"type", "input_reply"}};
    if (exchange.allow_stdin && exchange.publish) {
        const std::string prompt = string_field(message, "prompt", std::string());
        const bool password = bool_field(message, "password");
        // Blocks the shell thread until the client answers on stdin (xeus 2.4.1 has no cancel), so the
        // time limit is enforced by a watchdog that interrupts the worker and has the wire guard answer
        // the prompt with "".
        std::optional<InputWatchdog> watchdog;
        if (exchange.deadline != Clock::time_point::max() && input_releaser_) {
            watchdog.emplace(exchange.deadline, [&worker, this] {
                worker.signal(SIGINT);
                input_releaser_();
            });
        }
        answer["value"] = xeus::blocking_input_request(prompt, password);
        if (watchdog && watchdog->stop()) {
            exchange.timed_out = true;
            if (exchange.kill_cause == Exchange::KillCause::none) {
                exchange.kill_cause = Exchange::KillCause::time_limit;
                exchange.kill_at = Clock::now() + to_duration(settings_.limits.interrupt_grace_s);
            }
            log_event(LogLevel::info, "execution_timeout",
                      {{"timeout_s", exchange.timeout_s}, {"while", "input"}});
        }
        // An interrupt_request released the prompt: interrupt the worker before it gets the answer, so
        // KeyboardInterrupt is raised in input() itself.
        if (controls_.take_interrupt(exchange.msg_id)) {
            interrupt_worker(worker, exchange);
        }
    } else {
        answer["error"] = "this frontend does not support input requests (allow_stdin is false)";
    }
    if (!send_all(worker.channel_fd(), encode_frame(answer))) {
        log_event(LogLevel::warning, "worker_channel_closed", {{"while", "input_reply"}});
    }
}

bool PythonInterpreter::handle_worker_message(LiveWorker& worker, nl::json& message, Exchange& exchange) {
    const std::string type = message["type"].get<std::string>();
    if (type == "reply") {
        return true;
    }
    if (type == "display_data" || type == "update_display_data") {
        nl::json data = object_field(message, "data");
        nl::json metadata = object_field(message, "metadata");
        nl::json transient = object_field(message, "transient");
        if (!admit_rich_output(data, exchange)) {
            return false;
        }
        if (type == "display_data") {
            display_data(std::move(data), std::move(metadata), std::move(transient));
        } else {
            update_display_data(std::move(data), std::move(metadata), std::move(transient));
        }
    } else if (type == "clear_output") {
        const bool wait = bool_field(message, "wait");
        if (exchange.publish) {
            clear_output(wait);
        }
    } else if (type == "execute_result") {
        nl::json data = object_field(message, "data");
        nl::json metadata = object_field(message, "metadata");
        if (data.contains("text/plain") && data["text/plain"].is_string()) {
            exchange.result_text = data["text/plain"].get<std::string>();
        }
        if (!admit_rich_output(data, exchange)) {
            return false;
        }
        publish_execution_result(exchange.execution_count, std::move(data), std::move(metadata));
    } else if (type == "error") {
        std::string ename = string_field(message, "ename", "Error");
        std::string evalue = string_field(message, "evalue", std::string());
        const auto traceback = message.find("traceback");
        if (traceback != message.end() && !traceback->is_array() && !traceback->is_null()) {
            throw ProtocolError("worker frame field 'traceback' is not an array");
        }
        if (!exchange.publish) {
            return false;
        }
        if (exchange.timed_out) {
            ename = "TimeoutError";
            evalue = "the cell exceeded the time limit of " + seconds_text(exchange.timeout_s) +
                     " s and was interrupted";
        }
        publish_execution_error(
            ename, evalue,
            traceback_lines(traceback != message.end() && traceback->is_array() ? *traceback
                                                                                : nl::json::array()));
        exchange.error_published = true;
    } else if (type == "input_request") {
        flush_text(exchange);
        answer_input_request(worker, message, exchange);
    } else {
        log_event(LogLevel::debug, "worker_message_ignored", {{"type", type}});
    }
    return false;
}

PythonInterpreter::Ending PythonInterpreter::run(nl::json request, Exchange& exchange) {
    const RunningRequest running(controls_, exchange.msg_id);
    std::string error;
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
    if (!worker) {
        return {Ending::Kind::unavailable, nullptr, error};
    }
    bool earlier_state_lost = false;
    if (exchange.publish) {
        if (auto note = supervisor_.take_lost_state_note()) {
            earlier_state_lost = true;
            publish_stream("stderr",
                           "[cellblock] The Python worker was restarted (the previous one was " + *note +
                               "); variables, imports and other state from earlier cells are gone.\n");
        }
    }

    const std::uint64_t id = ++next_request_id_;
    request["id"] = id;
    bool channel_open = send_all(worker->channel_fd(), encode_frame(request));
    bool killed_for_protocol = false;
    const auto started = Clock::now();
    const auto never = Clock::time_point::max();
    exchange.deadline = exchange.timeout_s > 0 ? started + to_duration(exchange.timeout_s) : never;
    if (!channel_open) {
        worker->kill();  // it is gone or going; the pidfd tells why
    }
    // An interrupt that arrived before the request reached the worker belongs to it.
    if (controls_.take_interrupt(exchange.msg_id)) {
        interrupt_worker(*worker, exchange);
    }
    std::array<char, read_chunk_bytes> buffer{};

    while (true) {
        const auto now = Clock::now();
        if (!exchange.timed_out && now >= exchange.deadline) {
            exchange.timed_out = true;
            log_event(LogLevel::info, "execution_timeout", {{"timeout_s", exchange.timeout_s}});
            worker->signal(SIGINT);
            if (exchange.kill_cause == Exchange::KillCause::none) {
                exchange.kill_cause = Exchange::KillCause::time_limit;
                exchange.kill_at = now + to_duration(settings_.limits.interrupt_grace_s);
            }
        }
        if (exchange.kill_cause != Exchange::KillCause::none && !exchange.killed && now >= exchange.kill_at) {
            exchange.killed = true;
            log_event(LogLevel::warning, "worker_kill_after_interrupt",
                      {{"grace_s", settings_.limits.interrupt_grace_s},
                       {"cause", exchange.kill_cause == Exchange::KillCause::time_limit ? "time_limit"
                                                                                        : "interrupt"}});
            worker->kill();
        }
        auto next_event = exchange.timed_out ? never : exchange.deadline;
        if (exchange.kill_cause != Exchange::KillCause::none && !exchange.killed) {
            next_event = std::min(next_event, exchange.kill_at);
        }
        next_event = std::min(next_event, exchange.flush_at);
        int wait_ms = -1;
        if (next_event != never) {
            wait_ms = static_cast<int>(std::max<long long>(
                0, std::chrono::duration_cast<std::chrono::milliseconds>(next_event - now).count() + 1));
        }
        std::array<pollfd, 5> fds = {{{channel_open ? worker->channel_fd() : -1, POLLIN, 0},
                                      {exchange.stdout_open ? worker->stdout_fd() : -1, POLLIN, 0},
                                      {exchange.stderr_open ? worker->stderr_fd() : -1, POLLIN, 0},
                                      {worker->pidfd(), POLLIN, 0},
                                      {controls_.wakeup_fd(), POLLIN, 0}}};
        const int ready = ::poll(fds.data(), fds.size(), wait_ms);
        if (ready < 0) {
            if (errno == EINTR) {
                continue;
            }
            log_event(LogLevel::error, "poll_failed", {{"errno", errno}});
            worker->kill();
        }
        // The channel before the pipes: the worker sends a frame only after the kernel has read what it
        // wrote to fds 1/2 before it, so pipe text readable together with a frame was written after it.
        if (fds[0].revents & (POLLIN | POLLHUP | POLLERR)) {
            const ssize_t got = ::recv(worker->channel_fd(), buffer.data(), buffer.size(), MSG_DONTWAIT);
            if (got > 0) {
                worker->frames.append({buffer.data(), static_cast<std::size_t>(got)});
                try {
                    while (auto message = worker->frames.next()) {
                        // Text read before the frame was written before it: publish it first.
                        flush_text(exchange);
                        if (handle_worker_message(*worker, *message, exchange)) {
                            const auto reply_id = message->find("id");
                            if (reply_id == message->end() || !reply_id->is_number_unsigned()) {
                                throw ProtocolError("worker reply without a numeric id");
                            }
                            if (reply_id->get<std::uint64_t>() != id) {
                                log_event(LogLevel::warning, "stale_worker_reply", {{"id", *reply_id}});
                                continue;
                            }
                            // Output of children or C code that raced with the reply still belongs here.
                            drain_streams(*worker, exchange);
                            Ending ending{Ending::Kind::reply, object_field(*message, "content"), {}};
                            ending.earlier_state_lost = earlier_state_lost;
                            return ending;
                        }
                    }
                } catch (const std::exception& failure) {
                    // ProtocolError, or a field of the wrong type (nlohmann::json::type_error): either way
                    // the channel cannot be trusted any more.
                    log_event(LogLevel::error, "worker_protocol_error", {{"error", failure.what()}});
                    killed_for_protocol = true;
                    channel_open = false;
                    worker->kill();
                }
            } else if (got == 0 || (errno != EAGAIN && errno != EINTR)) {
                // The worker closed its end: it is exiting. Make sure it does, then report why.
                channel_open = false;
                if (fds[3].revents == 0) {
                    if (!worker->wait_for(std::chrono::milliseconds(500))) {
                        worker->kill();
                    }
                }
            }
        }
        if (fds[1].revents & (POLLIN | POLLHUP)) {
            read_stream(*worker, false, exchange);
        }
        if (fds[2].revents & (POLLIN | POLLHUP)) {
            read_stream(*worker, true, exchange);
        }
        if (Clock::now() >= exchange.flush_at) {
            flush_text(exchange);
        }
        if (fds[4].revents & POLLIN) {
            controls_.drain_wakeup();
            if (controls_.take_interrupt(exchange.msg_id)) {
                interrupt_worker(*worker, exchange);
            }
        }
        if (fds[3].revents != 0) {
            drain_streams(*worker, exchange);
            const auto outcome = supervisor_.retire(worker);
            std::string reason = outcome.describe();
            if (exchange.killed && exchange.kill_cause == Exchange::KillCause::time_limit) {
                reason = "killed by the time limit (the cell ran longer than " +
                         seconds_text(exchange.timeout_s) + " s and did not stop within " +
                         seconds_text(settings_.limits.interrupt_grace_s) + " s of the interrupt)";
            } else if (exchange.killed) {
                reason = "killed because the code did not stop within " +
                         seconds_text(settings_.limits.interrupt_grace_s) + " s of the interrupt";
            } else if (killed_for_protocol) {
                reason = "killed after a protocol error on the worker channel";
            }
            log_event(LogLevel::warning, "worker_died", {{"reason", reason}});
            Ending ending{Ending::Kind::worker_died, nullptr, reason};
            ending.memory_limit =
                outcome.reason == sandbox::Outcome::Reason::memory_limit && !exchange.killed;
            ending.earlier_state_lost = earlier_state_lost;
            return ending;
        }
    }
}

namespace {

std::string parent_msg_id(const nl::json& parent_header) {
    if (parent_header.is_object()) {
        const auto found = parent_header.find("msg_id");
        if (found != parent_header.end() && found->is_string()) {
            return found->get<std::string>();
        }
    }
    return {};
}

// What the execute_reply's metadata says happened (the wire guard moves it there from the content;
// xeus 2.4.1 gives interpreters no say over reply metadata).
nl::json outcome_metadata(std::string_view outcome, bool state_lost, bool output_truncated) {
    return {{"outcome", outcome}, {"state_lost", state_lost}, {"output_truncated", output_truncated}};
}

}  // namespace

nl::json PythonInterpreter::execute_request_impl(int execution_counter, const std::string& code, bool silent,
                                                 bool store_history, nl::json user_expressions,
                                                 bool allow_stdin) try {
    const std::string msg_id = parent_msg_id(parent_header());
    const ExecuteOptions options = controls_.take_options(msg_id);
    Exchange exchange(effective_output_limit(options.output_bytes, settings_.limits.output_bytes));
    exchange.msg_id = msg_id;
    exchange.publish = !silent;
    exchange.allow_stdin = allow_stdin;
    exchange.execution_count = execution_counter;
    exchange.timeout_s = settings_.limits.timeout_s;
    if (options.timeout_s && (exchange.timeout_s <= 0 || *options.timeout_s < exchange.timeout_s)) {
        exchange.timeout_s = *options.timeout_s;  // a client may ask for less time, never for more
    }

    nl::json request = {
        {"type", "execute"},
        {"code", code},
        {"silent", silent},
        {"store_history", store_history},
        {"user_expressions", user_expressions.is_object() ? user_expressions : nl::json::object()},
        {"allow_stdin", allow_stdin},
        {"execution_count", execution_counter}};
    const Ending ending = run(std::move(request), exchange);
    publish_tails(exchange);

    if (store_history && !silent) {
        history_.record(execution_counter, code, exchange.result_text);
    }
    const bool truncated = exchange.output.truncated();

    if (ending.kind != Ending::Kind::reply) {
        std::string ename = ending.kind == Ending::Kind::worker_died ? "WorkerDied" : "WorkerUnavailable";
        std::string evalue = ending.kind == Ending::Kind::worker_died
                                 ? ending.reason + "; the next execution starts a fresh Python worker"
                                 : ending.reason;
        std::string_view outcome = "worker_unavailable";
        if (ending.kind == Ending::Kind::worker_died) {
            outcome = "worker_died";
            if (exchange.killed && exchange.kill_cause == Exchange::KillCause::time_limit) {
                outcome = "time_limit";
            } else if (exchange.killed) {
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
        if (!silent) {
            publish_execution_error(ename, evalue, traceback);
        }
        nl::json reply = make_error_reply(ename, evalue, traceback);
        reply["cellblock"] = outcome_metadata(
            outcome, ending.kind == Ending::Kind::worker_died || ending.earlier_state_lost, truncated);
        return reply;
    }
    const nl::json& content = ending.content;
    if (content.value("status", std::string("error")) == "ok") {
        nl::json reply = make_execute_ok_reply(content.value("payload", nl::json::array()),
                                               content.value("user_expressions", nl::json::object()));
        reply["cellblock"] =
            outcome_metadata(truncated ? "output_limit" : "ok", ending.earlier_state_lost, truncated);
        return reply;
    }
    std::string ename = content.value("ename", std::string("Error"));
    std::string evalue = content.value("evalue", std::string());
    nl::json traceback = content.value("traceback", nl::json::array());
    std::string_view outcome = "error";
    if (exchange.timed_out) {
        outcome = "time_limit";
        ename = "TimeoutError";
        evalue = "the cell exceeded the time limit of " + seconds_text(exchange.timeout_s) +
                 " s and was interrupted";
    } else if (exchange.interrupted && ename == "KeyboardInterrupt") {
        outcome = "interrupted";
    }
    if (!exchange.error_published && !silent) {
        publish_execution_error(ename, evalue, traceback_lines(traceback));
    }
    nl::json reply = make_error_reply(ename, evalue, traceback);
    reply["cellblock"] = outcome_metadata(outcome, ending.earlier_state_lost, truncated);
    return reply;
} catch (const std::exception& failure) {
    // xeus swallows exceptions from handlers and then sends no reply at all; answer with an error instead.
    log_event(LogLevel::error, "execute_failed", {{"error", failure.what()}});
    nl::json reply = make_error_reply("KernelError", failure.what());
    reply["cellblock"] = outcome_metadata("error", false, false);
    return reply;
}

nl::json PythonInterpreter::complete_request_impl(const std::string& code, int cursor_pos) try {
    Exchange exchange;
    exchange.msg_id = parent_msg_id(parent_header());
    exchange.timeout_s = std::chrono::duration<double>(settings_.assist_timeout).count();
    const Ending ending = run({{"type", "complete"}, {"code", code}, {"cursor_pos", cursor_pos}}, exchange);
    if (ending.kind == Ending::Kind::reply && ending.content.is_object() &&
        ending.content.contains("matches")) {
        return ending.content;
    }
    return make_empty_complete_reply(cursor_pos);
} catch (const std::exception& failure) {
    log_event(LogLevel::error, "complete_failed", {{"error", failure.what()}});
    return make_empty_complete_reply(cursor_pos);
}

nl::json PythonInterpreter::inspect_request_impl(const std::string& code, int cursor_pos,
                                                 int detail_level) try {
    Exchange exchange;
    exchange.msg_id = parent_msg_id(parent_header());
    exchange.timeout_s = std::chrono::duration<double>(settings_.assist_timeout).count();
    const Ending ending =
        run({{"type", "inspect"}, {"code", code}, {"cursor_pos", cursor_pos}, {"detail_level", detail_level}},
            exchange);
    if (ending.kind == Ending::Kind::reply && ending.content.is_object() &&
        ending.content.contains("found")) {
        return ending.content;
    }
    return make_not_found_inspect_reply();
} catch (const std::exception& failure) {
    log_event(LogLevel::error, "inspect_failed", {{"error", failure.what()}});
    return make_not_found_inspect_reply();
}

nl::json PythonInterpreter::is_complete_request_impl(const std::string& code) try {
    Exchange exchange;
    exchange.msg_id = parent_msg_id(parent_header());
    exchange.timeout_s = std::chrono::duration<double>(settings_.assist_timeout).count();
    const Ending ending = run({{"type", "is_complete"}, {"code", code}}, exchange);
    if (ending.kind == Ending::Kind::reply && ending.content.is_object() &&
        ending.content.contains("status")) {
        return ending.content;
    }
    return make_unknown_is_complete_reply();
} catch (const std::exception& failure) {
    log_event(LogLevel::error, "is_complete_failed", {{"error", failure.what()}});
    return make_unknown_is_complete_reply();
}

nl::json PythonInterpreter::kernel_info_request_impl() {
    KernelIdentity identity = settings_.identity;
    if (auto version = supervisor_.worker_python_version()) {
        identity.python_version = *version;
    }
    return make_kernel_info_reply(identity);
}

void PythonInterpreter::shutdown_request_impl() {
    // The wire guard answers shutdown_request itself; this runs only if xeus is stopped another way.
    supervisor_.shutdown();
}

}  // namespace cellblock::kernel
