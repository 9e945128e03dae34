#include "worker/worker_supervisor.hpp"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <stdexcept>
#include <string>

#include "common/logging.hpp"

namespace cellblock::kernel {
namespace {

// Where the worker runtime directory appears inside the sandbox.
constexpr const char* worker_dir_inside = "/opt/cellblock/worker";
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

// A template that is not listening is started again at most this often (per tenant and host).
constexpr std::chrono::seconds template_restart_interval{30};

// Whether the last template started for the tenant ended its generation (forks or age): its log (the file its
// stdout and stderr go to, truncated at each start) has its "retired" line, written before it stops
// listening. Only such an end lets the next template start within the restart interval; a template that died
// (while preparing or later) has none.
bool last_template_retired(const std::filesystem::path& log_path) {
    constexpr std::size_t read_limit = 1 << 20;  // a template logs a line per event of its life
    std::ifstream log(log_path);
    std::size_t read = 0;
    for (std::string line; read < read_limit && std::getline(log, line); read += line.size() + 1) {
        if (line.find("\"retired\"") == std::string::npos) {
            continue;
        }
        const auto event = nlohmann::json::parse(line, nullptr, false);
        if (event.is_object() && event.contains("component") && event["component"] == "cellblock-zygote" &&
            event.contains("event") && event["event"] == "retired") {
            // Used up or aged out; a template that retired because it could not fork ("threads") would do the
            // same again.
            return event.contains("reason") && (event["reason"] == "forks" || event["reason"] == "age");
        }
    }
    return false;
}

// Whether something listens on the template socket (a refused or missing socket is a dead template).
bool template_listens(const std::filesystem::path& socket_path) {
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    const std::string path = socket_path.string();
    if (path.size() >= sizeof address.sun_path) {
        return false;
    }
    std::memcpy(address.sun_path, path.c_str(), path.size() + 1);
    UniqueFd probe(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (!probe) {
        throw system_error("socket (probe the zygote template)");
    }
    if (::connect(probe.get(), reinterpret_cast<const sockaddr*>(&address), sizeof address) == 0) {
        return true;  // closed at once: the template drops a connection that sends no request
    }
    return errno != ECONNREFUSED && errno != ENOENT;  // EAGAIN: a full backlog is a busy, live template
}

// A listening SOCK_SEQPACKET socket at `socket_path`, mode 0600 from its first moment: bound under a
// temporary name in the same directory, then renamed over whatever (dead) socket was there.
UniqueFd listen_at(const std::filesystem::path& socket_path) {
    const auto temporary = socket_path.parent_path() / ("." + socket_path.filename().string() + "." +
                                                        std::to_string(::getpid()) + ".new");
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    const std::string path = temporary.string();
    if (path.size() >= sizeof address.sun_path) {
        throw std::runtime_error("the template socket path " + path + " is too long");
    }
    std::memcpy(address.sun_path, path.c_str(), path.size() + 1);
    UniqueFd listening(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
    if (!listening) {
        throw system_error("socket (zygote template)");
    }
    ::unlink(path.c_str());  // a leftover of a kernel that died here (ENOENT otherwise)
    if (::bind(listening.get(), reinterpret_cast<const sockaddr*>(&address), sizeof address) != 0) {
        throw system_error("bind " + path);
    }
    if (::chmod(path.c_str(), 0600) != 0 || ::listen(listening.get(), 128) != 0 ||
        ::rename(path.c_str(), socket_path.c_str()) != 0) {
        const auto error = system_error("listen on " + socket_path.string());
        ::unlink(path.c_str());
        throw error;
    }
    return listening;
}

// Starts the tenant's template unless one listens or another kernel is starting it. Returns what happened,
// for the fallback's log line.
std::string start_template_if_dead(sandbox::Launcher& launcher, const WorkerLaunchSpec::Zygote& zygote,
                                   const sandbox::LaunchRequest& worker) {
    const auto& state_dir = launcher.policy().state_dir;
    const std::string name = "zygote-" + zygote.tenant;
    const auto socket_path = state_dir / (name + ".sock");
    try {
        const auto lock_path = state_dir / (name + ".lock");
        UniqueFd lock(::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600));
        if (!lock) {
            throw system_error("open " + lock_path.string());
        }
        if (::flock(lock.get(), LOCK_EX | LOCK_NB) != 0) {
            if (errno == EWOULDBLOCK) {
                return "another kernel is starting the template";
            }
            throw system_error("flock " + lock_path.string());
        }
        if (template_listens(socket_path)) {
            return "the template listens (it answered nothing usable for this launch)";
        }
        // A template that dies while it prepares (a preload that fails) would otherwise be started again by
        // every launch: the lock file's time is when the last one was started.
        struct stat lock_info {};
        if (::fstat(lock.get(), &lock_info) != 0) {
            throw system_error("fstat " + lock_path.string());
        }
        const auto since_last = std::chrono::system_clock::now() -
                                std::chrono::system_clock::from_time_t(lock_info.st_mtim.tv_sec);
        const auto log_path = state_dir / (name + ".log");
        // A generation used up within the interval (200 forks at a few launches a second) is no failure.
        if (lock_info.st_size > 0 && since_last < template_restart_interval &&
            !last_template_retired(log_path)) {
            return "a template was started less than " + std::to_string(template_restart_interval.count()) +
                   " s ago and is not listening; not starting another yet";
        }
        UniqueFd log(::open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600));
        if (!log) {
            throw system_error("open " + log_path.string());
        }
        UniqueFd listening = listen_at(socket_path);
        sandbox::TemplateRequest request;
        request.name = name;
        request.argv = worker.argv;
        request.environment = worker.environment;
        request.environment.insert(request.environment.end(), zygote.template_environment.begin(),
                                   zygote.template_environment.end());
        request.listening_socket = listening.get();
        request.stdout_fd = log.get();
        request.stderr_fd = log.get();
        request.zygote_library = zygote.library;
        // Marks the start (size > 0, and its time) before it happens, so a failing start is not retried at
        // once.
        if (::ftruncate(lock.get(), 1) != 0 || ::futimens(lock.get(), nullptr) != 0) {
            throw system_error("mark " + lock_path.string());
        }
        try {
            const pid_t pid = launcher.launch_template(request);
            log_event(LogLevel::warning, "zygote_template_started",
                      {{"tenant", zygote.tenant}, {"pid", pid}, {"socket", socket_path.string()}});
            return "started the template (pid " + std::to_string(pid) + ") for the next launches";
        } catch (...) {
            ::unlink(socket_path.c_str());
            throw;
        }
    } catch (const std::exception& error) {
        return std::string("could not start the template: ") + error.what();
    }
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
                auto policy = sandbox::Policy::load(spec_.policy_file);
                sandbox::MountSpec runtime;
                runtime.kind = sandbox::MountSpec::Kind::bind;
                runtime.source = spec_.worker_script.parent_path().string();
                runtime.target = worker_dir_inside;
                policy.mounts.push_back(runtime);
                launcher.emplace(std::move(policy));
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

    sandbox::LaunchRequest request;
    request.argv = {spec_.python.string(),
                    std::string(worker_dir_inside) + "/" + spec_.worker_script.filename().string()};
    // Explicit and minimal: the policy's base environment (nothing is inherited from the kernel, which
    // holds the connection key) plus what the worker's pipes need.
    request.environment = {"PYTHONIOENCODING=utf-8", "PYTHONUNBUFFERED=1"};
    request.environment.insert(request.environment.end(), spec_.environment.begin(), spec_.environment.end());
    request.workspace = spec_.workspace;
    request.stdout_fd = out_write.get();
    request.stderr_fd = err_write.get();
    request.pass_fds = {worker_end.get()};
    if (spec_.memory_bytes != 0) {
        auto limits = launcher.policy().limits;
        limits.memory_bytes = spec_.memory_bytes;
        request.limits = limits;
    }
    if (spec_.loopback_service) {
        request.loopback_listener = sandbox::LoopbackListener{spec_.loopback_service->port, false};
    }
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

    // Wait for "ready", keeping the tail of what the worker printed for the error message.
    std::string tail;
    const auto deadline = std::chrono::steady_clock::now() + spec_.ready_timeout;
    std::array<char, 65536> buffer{};
    while (true) {
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
            deadline - std::chrono::steady_clock::now());
        if (left.count() <= 0) {
            worker->kill();
            throw std::runtime_error("the worker did not report ready within " +
                                     std::to_string(spec_.ready_timeout.count() / 1000) +
                                     " s; output: " + tail);
        }
        std::array<pollfd, 4> fds = {{{worker->channel_fd(), POLLIN, 0},
                                      {worker->stdout_fd(), POLLIN, 0},
                                      {worker->stderr_fd(), POLLIN, 0},
                                      {worker->pidfd(), POLLIN, 0}}};
        if (stopping_) {
            worker->kill();
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
            const ssize_t got = worker->frames.read_from(worker->channel_fd());
            if (got > 0) {
                while (auto frame = worker->frames.next()) {
                    if (frame->kind != WorkerFrame::Kind::message) {
                        // Python-level output of the start-up (the runtime prints nothing before 'ready').
                        keep_tail(tail, frame->text.data(), frame->text.size());
                        continue;
                    }
                    auto& message = frame->message;
                    if (message["type"] != "ready") {
                        worker->kill();
                        throw std::runtime_error("the worker sent '" + message["type"].get<std::string>() +
                                                 "' before 'ready'");
                    }
                    worker->ready_info = std::move(message);
                    return worker;
                }
            } else if (got == 0) {
                fds[3].revents |= POLLIN;  // channel closed: the worker is ending
            }
        }
        if (fds[3].revents & POLLIN) {
            auto outcome = worker->wait_for(std::chrono::milliseconds(2000));
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
    nlohmann::json fallback = {{"tenant", spec_.zygote->tenant}};
    if (spec_.loopback_service || !spec_.environment.empty()) {
        // A fork has the template's environment, which is one for every session of the tenant.
        fallback["reason"] = "this session's worker environment differs from the template's (network policy)";
    } else {
        request.zygote_socket = launcher.policy().state_dir / ("zygote-" + spec_.zygote->tenant + ".sock");
        try {
            return launcher.launch(request);
        } catch (const sandbox::ZygoteUnavailable& error) {
            fallback["reason"] = error.what();
        }
        request.zygote_socket.clear();
        fallback["template"] = start_template_if_dead(launcher, *spec_.zygote, request);
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
