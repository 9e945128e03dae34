// WorkerExchange's execute and assist, what they answer (the one owner of what the reply says happened),
// and what the worker's outputs become: stream text from the pipes and frames (batched, held to the output
// limit, checked as UTF-8), rich outputs, errors and input requests. The conversation that carries them
// (sending the request, the poll loop, time limits, interrupts, the worker's death) is conversation.cpp's.
#include "worker/worker_exchange.hpp"

#include <poll.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string_view>
#include <thread>

#include "common/json_text.hpp"
#include "common/logging.hpp"
#include "worker/output_budget.hpp"
#include "worker/reply_builders.hpp"
#include "worker/worker_exchange_internal.hpp"

namespace cellblock::kernel {
namespace {

using exchange_internal::Clock;
using exchange_internal::kill_for_time_limit;
using exchange_internal::object_field;
using exchange_internal::seconds_text;
using exchange_internal::stderr_index;
using exchange_internal::stdout_index;
using exchange_internal::stream_names;
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

namespace exchange_internal {

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

}  // namespace exchange_internal

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
