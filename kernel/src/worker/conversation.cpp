// One request's conversation with the worker (WorkerExchange::converse and its steps): take a live worker,
// send the request, then pump the channel, the pipes, the pidfd and the interrupt wake-up until the reply
// (and the sync after an interrupted one) or the worker's end, enforcing the time limit and escalating an
// interrupt the code ignores. What the frames and pipe text become is worker_exchange.cpp's.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <memory>
#include <string>

#include "common/logging.hpp"
#include "worker/worker_exchange_internal.hpp"

namespace cellblock::kernel {
namespace {

using exchange_internal::Clock;
using exchange_internal::kill_for_interrupt;
using exchange_internal::kill_for_time_limit;
using exchange_internal::KillCause;
using exchange_internal::no_kill;
using exchange_internal::object_field;
using exchange_internal::seconds_text;
using exchange_internal::stderr_index;
using exchange_internal::stdout_index;
using exchange_internal::stream_names;
using exchange_internal::to_duration;
using nlohmann::json;

// The worker's pipes hold this much (Linux's default /proc/sys/fs/pipe-max-size) instead of 64 KiB, so a
// large print is one write in the worker and one read here rather than a ping-pong of 16 wake-ups per MiB.
// Pipe pages are allocated as they are written: an idle worker's pipes cost nothing.
constexpr int pipe_capacity_bytes = 1 << 20;

// A worker that answered a request answers the sync after it at once (it is idle); one that does not within
// this time is stuck in a thread of its own, and the held reply is returned anyway.
constexpr double sync_timeout_s = 5;

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

}  // namespace

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
}  // namespace cellblock::kernel
