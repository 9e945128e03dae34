#include "worker/worker_supervisor.hpp"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>

#include "common/logging.hpp"

namespace cellblock::kernel {
namespace {

constexpr std::size_t startup_tail_bytes = 4096;

std::runtime_error system_error(const std::string& what) {
    return std::runtime_error(what + ": " + std::strerror(errno));
}

void set_nonblocking(int fd) {
    const int flags = ::fcntl(fd, F_GETFL);
    if (flags < 0 || ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0) {
        throw system_error("fcntl(O_NONBLOCK)");
    }
}

void keep_tail(std::string& tail, const char* data, std::size_t size) {
    tail.append(data, size);
    if (tail.size() > startup_tail_bytes) {
        tail.erase(0, tail.size() - startup_tail_bytes);
    }
}

// Takes the start-up frames read so far: true once 'ready' came (kept as the worker's ready_info); output
// before it goes to `tail`, any other message before it is refused.
bool take_ready(LiveWorker& worker, std::string& tail) {
    while (auto frame = worker.frames.next()) {
        if (frame->kind != WorkerFrame::Kind::message) {
            // Python-level output of the start-up (the runtime prints nothing before 'ready').
            keep_tail(tail, frame->text.data(), frame->text.size());
            continue;
        }
        auto& message = frame->message;
        if (message["type"] != "ready") {
            worker.kill();
            throw std::runtime_error("the worker sent '" + message["type"].get<std::string>() +
                                     "' before 'ready'");
        }
        worker.ready_info = std::move(message);
        return true;
    }
    return false;
}

}  // namespace

LiveWorker::LiveWorker(sandbox::Process process, UniqueFd channel, UniqueFd stdout_pipe, UniqueFd stderr_pipe)
    : process_(std::move(process)),
      channel_(std::move(channel)),
      stdout_(std::move(stdout_pipe)),
      stderr_(std::move(stderr_pipe)) {
    pidfd_ = UniqueFd(::fcntl(process_->pidfd(), F_DUPFD_CLOEXEC, 0));
    if (!pidfd_) {
        throw system_error("dup the worker's pidfd");
    }
    pid_ = process_->pid();
    host_uid_ = process_->host_uid();
}

LiveWorker::~LiveWorker() {
    std::lock_guard lock(mutex_);
    process_.reset();  // kills whatever is left of the sandbox and releases its cgroup and uid
}

void LiveWorker::signal(int signo) {
    std::lock_guard lock(mutex_);
    if (process_) {
        process_->signal(signo);
    }
}

void LiveWorker::kill() {
    std::lock_guard lock(mutex_);
    if (process_) {
        process_->kill();
    }
}

void LiveWorker::terminate() {
    std::lock_guard lock(mutex_);
    process_.reset();
}

std::optional<sandbox::Outcome> LiveWorker::wait_for(std::chrono::milliseconds timeout) {
    std::lock_guard lock(mutex_);
    if (!process_) {
        return std::nullopt;
    }
    return process_->wait_for(timeout);
}

WorkerSupervisor::WorkerSupervisor(WorkerLaunchSpec spec) : spec_(std::move(spec)) {}

void WorkerSupervisor::start() {
    if (!launcher_thread_.joinable()) {
        launcher_thread_ = std::thread([this] { launcher_loop(); });
    }
}

WorkerSupervisor::~WorkerSupervisor() {
    shutdown();
    if (launcher_thread_.joinable()) {
        launcher_thread_.join();
    }
}

void WorkerSupervisor::launcher_loop() {
    std::optional<sandbox::Launcher> launcher;
    std::unique_lock lock(mutex_);
    while (true) {
        changed_.wait(lock, [this] { return launch_requested_ || state_ == State::stopped; });
        if (state_ == State::stopped) {
            break;
        }
        launch_requested_ = false;
        state_ = State::starting;
        lock.unlock();
        std::shared_ptr<LiveWorker> worker;
        std::string error;
        const auto started = std::chrono::steady_clock::now();
        try {
            if (!launcher) {
                launcher.emplace(worker_policy(spec_.policy_file, spec_.worker_script));
                for (const auto& weakened : launcher->weakened()) {
                    log_event(LogLevel::warning, "sandbox_weakened", {{"mechanism", weakened}});
                }
            }
            worker = launch_one(*launcher);
        } catch (const std::exception& failure) {
            error = failure.what();
        }
        const double elapsed_ms =
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - started).count();
        lock.lock();
        if (state_ == State::stopped) {
            lock.unlock();
            worker.reset();  // shutdown raced with the launch: do not leave it running
            lock.lock();
            break;
        }
        if (worker) {
            log_event(LogLevel::info, "worker_ready", {{"worker_pid", worker->pid()}, {"ms", elapsed_ms}});
            if (worker->ready_info.contains("python") && worker->ready_info["python"].is_string()) {
                python_version_ = worker->ready_info["python"].get<std::string>();
            }
            current_ = std::move(worker);
            state_ = State::ready;
        } else {
            log_event(LogLevel::error, "worker_launch_failed", {{"error", error}, {"ms", elapsed_ms}});
            launch_error_ = error;
            state_ = State::failed;
        }
        changed_.notify_all();
    }
}

std::shared_ptr<LiveWorker> WorkerSupervisor::launch_one(sandbox::Launcher& launcher) {
    auto worker = start_worker(launcher);
    await_ready(*worker);
    return worker;
}

std::shared_ptr<LiveWorker> WorkerSupervisor::start_worker(sandbox::Launcher& launcher) {
    std::array<int, 2> pair{};
    if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair.data()) != 0) {
        throw system_error("socketpair");
    }
    UniqueFd kernel_end(pair[0]), worker_end(pair[1]);
    // Python-level output is in band (PROTOCOL.md): let the worker's end queue a 1 MiB print as one piece
    // (Linux doubles the value, capped by net.core.wmem_max) rather than hand it over in 200 KiB pieces, one
    // wake-up of each side per piece, as the pipes are enlarged for the same reason.
    const int send_buffer_bytes = 1 << 20;
    if (::setsockopt(worker_end.get(), SOL_SOCKET, SO_SNDBUF, &send_buffer_bytes,
                     sizeof(send_buffer_bytes)) != 0) {
        log_event(LogLevel::debug, "channel_resize_failed", {{"errno", errno}});
    }
    std::array<int, 2> out{}, err{};
    if (::pipe2(out.data(), O_CLOEXEC) != 0) {
        throw system_error("pipe2 (worker stdout)");
    }
    UniqueFd out_read(out[0]), out_write(out[1]);
    if (::pipe2(err.data(), O_CLOEXEC) != 0) {
        throw system_error("pipe2 (worker stderr)");
    }
    UniqueFd err_read(err[0]), err_write(err[1]);

    sandbox::LaunchRequest request =
        worker_request(launcher, out_write.get(), err_write.get(), worker_end.get());
    auto process = launch_process(launcher, request);
    std::vector<UniqueFd> listeners = process.take_loopback_listeners();
    worker_end.reset();
    out_write.reset();
    err_write.reset();
    set_nonblocking(out_read.get());
    set_nonblocking(err_read.get());
    auto worker = std::make_shared<LiveWorker>(std::move(process), std::move(kernel_end), std::move(out_read),
                                               std::move(err_read));
    if (spec_.loopback_service) {
        if (listeners.size() != 1) {
            throw std::runtime_error("the sandbox handed over " + std::to_string(listeners.size()) +
                                     " loopback listeners instead of 1");
        }
        spec_.loopback_service->serve(std::move(listeners.front()));
    }
    return worker;
}

sandbox::LaunchRequest WorkerSupervisor::worker_request(sandbox::Launcher& launcher, int stdout_fd,
                                                        int stderr_fd, int channel_fd) const {
    sandbox::LaunchRequest request;
    request.argv = worker_argv(spec_.python, spec_.worker_script);
    // Explicit and minimal: the policy's base environment (nothing is inherited from the kernel, which
    // holds the connection key) plus what the worker's pipes need.
    request.environment = worker_base_environment();
    request.environment.insert(request.environment.end(), spec_.environment.begin(), spec_.environment.end());
    request.workspace = spec_.workspace;
    request.stdout_fd = stdout_fd;
    request.stderr_fd = stderr_fd;
    request.pass_fds = {channel_fd};
    if (spec_.memory_bytes != 0) {
        auto limits = launcher.policy().limits;
        limits.memory_bytes = spec_.memory_bytes;
        request.limits = limits;
    }
    if (spec_.loopback_service) {
        request.loopback_listener = sandbox::LoopbackListener{spec_.loopback_service->port, false};
    }
    return request;
}

void WorkerSupervisor::await_ready(LiveWorker& worker) {
    // Wait for "ready", keeping the tail of what the worker printed for the error message.
    std::string tail;
    const auto deadline = std::chrono::steady_clock::now() + spec_.ready_timeout;
    std::array<char, 65536> buffer{};
    while (true) {
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
            deadline - std::chrono::steady_clock::now());
        if (left.count() <= 0) {
            worker.kill();
            throw std::runtime_error("the worker did not report ready within " +
                                     std::to_string(spec_.ready_timeout.count() / 1000) +
                                     " s; output: " + tail);
        }
        std::array<pollfd, 4> fds = {{{worker.channel_fd(), POLLIN, 0},
                                      {worker.stdout_fd(), POLLIN, 0},
                                      {worker.stderr_fd(), POLLIN, 0},
                                      {worker.pidfd(), POLLIN, 0}}};
        if (stopping_) {
            worker.kill();
            throw std::runtime_error("the kernel is shutting down");
        }
        // Wake up now and then to notice a shutdown.
        const int ready =
            ::poll(fds.data(), fds.size(), static_cast<int>(std::min<long long>(left.count(), 100)));
        if (ready < 0) {
            if (errno == EINTR) {
                continue;
            }
            throw system_error("poll (worker start-up)");
        }
        for (std::size_t i = 1; i <= 2; ++i) {
            if (fds[i].revents & (POLLIN | POLLHUP)) {
                const ssize_t got = ::read(fds[i].fd, buffer.data(), buffer.size());
                if (got > 0) {
                    keep_tail(tail, buffer.data(), static_cast<std::size_t>(got));
                }
            }
        }
        if (fds[0].revents & (POLLIN | POLLHUP)) {
            const ssize_t got = worker.frames.read_from(worker.channel_fd());
            if (got > 0) {
                if (take_ready(worker, tail)) {
                    return;
                }
            } else if (got == 0) {
                fds[3].revents |= POLLIN;  // channel closed: the worker is ending
            }
        }
        if (fds[3].revents & POLLIN) {
            auto outcome = worker.wait_for(std::chrono::milliseconds(2000));
            throw std::runtime_error("the worker ended during start-up (" +
                                     (outcome ? outcome->describe() : std::string("unknown reason")) +
                                     "); output: " + tail);
        }
    }
}

sandbox::Process WorkerSupervisor::launch_process(sandbox::Launcher& launcher,
                                                  sandbox::LaunchRequest& request) {
    if (!spec_.zygote) {
        return launcher.launch(request);
    }
    const TemplateSpec& zygote = spec_.zygote->template_spec;
    nlohmann::json fallback = {{"tenant", zygote.tenant}};
    if (spec_.loopback_service || !spec_.environment.empty()) {
        // A fork has the template's environment, which is one for every session of the tenant.
        fallback["reason"] = "this session's worker environment differs from the template's (network policy)";
    } else {
        request.zygote_socket = template_socket(launcher, zygote.tenant);
        try {
            return launcher.launch(request);
        } catch (const sandbox::ZygoteUnavailable& error) {
            fallback["reason"] = error.what();
        }
        request.zygote_socket.clear();
        fallback["template"] =
            spec_.zygote->supervised
                ? "its template service starts it"
                : start_template_if_dead(launcher, zygote, request.argv, request.environment);
    }
    log_event(LogLevel::warning, "zygote_fallback", fallback);
    return launcher.launch(request);
}

std::shared_ptr<LiveWorker> WorkerSupervisor::acquire(std::chrono::milliseconds timeout, std::string& error) {
    std::unique_lock lock(mutex_);
    if (state_ == State::ready && current_) {
        return current_;
    }
    if (state_ == State::stopped) {
        error = "the kernel is shutting down";
        return nullptr;
    }
    if (state_ == State::failed || state_ == State::idle) {
        state_ = State::starting;
        launch_requested_ = true;
        changed_.notify_all();
    }
    const bool settled = changed_.wait_for(lock, timeout, [this] {
        return (state_ == State::ready && current_) || state_ == State::failed || state_ == State::stopped;
    });
    if (settled && state_ == State::ready) {
        return current_;
    }
    if (!settled) {
        error = "the Python worker did not start within " + std::to_string(timeout.count() / 1000) + " s";
    } else if (state_ == State::failed) {
        error = "the Python worker could not be started: " + launch_error_;
    } else {
        error = "the kernel is shutting down";
    }
    return nullptr;
}

sandbox::Outcome WorkerSupervisor::retire(const std::shared_ptr<LiveWorker>& worker) {
    {
        std::lock_guard lock(mutex_);
        if (current_ == worker) {
            current_.reset();
            if (state_ != State::stopped) {
                state_ = State::idle;
                launch_requested_ = true;
                changed_.notify_all();
            }
        }
    }
    auto outcome = worker->wait_for(std::chrono::milliseconds(200));
    if (!outcome) {
        worker->kill();
        outcome = worker->wait_for(std::chrono::milliseconds(5000));
    }
    sandbox::Outcome result =
        outcome.value_or(sandbox::Outcome{sandbox::Outcome::Reason::signaled, 0, SIGKILL});
    std::lock_guard lock(mutex_);
    lost_state_note_ = result.describe();
    return result;
}

void WorkerSupervisor::shutdown() {
    std::shared_ptr<LiveWorker> worker;
    {
        std::lock_guard lock(mutex_);
        stopping_ = true;
        if (state_ == State::stopped && !current_) {
            return;
        }
        state_ = State::stopped;
        worker = std::move(current_);
        changed_.notify_all();
    }
    if (worker) {
        worker->terminate();
    }
}

std::optional<std::string> WorkerSupervisor::take_lost_state_note() {
    std::lock_guard lock(mutex_);
    return std::exchange(lost_state_note_, std::nullopt);
}

std::optional<std::string> WorkerSupervisor::worker_python_version() {
    std::lock_guard lock(mutex_);
    return python_version_;
}

}  // namespace cellblock::kernel
