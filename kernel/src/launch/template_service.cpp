#include "launch/template_service.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/logging.hpp"
#include "common/unique_fd.hpp"
#include "launch/kernel_config.hpp"
#include "worker/zygote_template.hpp"

namespace cellblock::kernel {
namespace {

using Clock = std::chrono::steady_clock;

// A template that died without retiring (a preload that fails, a crash) is started again after this long.
constexpr std::chrono::seconds restart_after_death{30};
// How long a stopping service lets its templates end by themselves before it kills them.
constexpr std::chrono::seconds stop_grace{5};
constexpr std::chrono::milliseconds retire_answer_limit{2000};

std::runtime_error system_error(const std::string& what) {
    return std::runtime_error(what + ": " + std::strerror(errno));
}

// SIGTERM and SIGINT stop the service, SIGCHLD says a template (or an orphaned worker of one) ended.
UniqueFd signal_fd() {
    sigset_t set;
    sigemptyset(&set);
    for (int signo : {SIGTERM, SIGINT, SIGHUP, SIGCHLD}) {
        sigaddset(&set, signo);
    }
    if (pthread_sigmask(SIG_BLOCK, &set, nullptr) != 0) {
        throw std::runtime_error("pthread_sigmask (template service)");
    }
    UniqueFd fd(::signalfd(-1, &set, SFD_CLOEXEC | SFD_NONBLOCK));
    if (!fd) {
        throw system_error("signalfd (template service)");
    }
    return fd;
}

// Readable when the process that started the service (the gateway) has ended, however it ended.
UniqueFd parent_pidfd() {
    const pid_t parent = ::getppid();
    UniqueFd fd(static_cast<int>(::syscall(SYS_pidfd_open, parent, 0)));
    if (!fd || ::getppid() != parent) {
        throw std::runtime_error("the process that started the template service has ended");
    }
    return fd;
}

// The tenant's template log this service writes (<state_dir>/zygote-<tenant>.log): a file of its own, renamed
// into place, and removed when the service ends unless another service of the tenant (the next gateway's) has
// put its own there since. Every gateway has its own operator tenant, so logs left behind piled up in the
// state directory.
class ServiceLog {
  public:
    explicit ServiceLog(std::filesystem::path path) : path_(std::move(path)) {
        const auto fresh = path_.parent_path() /
                           ("." + path_.filename().string() + "." + std::to_string(::getpid()) + ".new");
        ::unlink(fresh.c_str());  // a leftover of a service that died here (ENOENT otherwise)
        fd_ = UniqueFd(
            ::open(fresh.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_APPEND | O_CLOEXEC | O_NOFOLLOW, 0600));
        if (!fd_) {
            throw system_error("open " + fresh.string());
        }
        if (::rename(fresh.c_str(), path_.c_str()) != 0) {
            const auto error = system_error("rename " + fresh.string() + " to " + path_.string());
            ::unlink(fresh.c_str());
            throw error;
        }
    }
    ServiceLog(const ServiceLog&) = delete;
    ServiceLog& operator=(const ServiceLog&) = delete;
    ~ServiceLog() {
        struct stat ours {};
        struct stat named {};
        if (::fstat(fd_.get(), &ours) == 0 && ::lstat(path_.c_str(), &named) == 0 &&
            ours.st_dev == named.st_dev && ours.st_ino == named.st_ino) {
            ::unlink(path_.c_str());
        }
    }
    int fd() const noexcept { return fd_.get(); }

  private:
    std::filesystem::path path_;
    UniqueFd fd_;
};

// One generation of the tenant's template: its process (and cgroup) and the pipe its log lines come through.
struct Generation {
    sandbox::Template process;
    std::filesystem::path pending_socket;  // until it serves (its "serving" line): then renamed into place
    UniqueFd log_pipe;
    std::string partial_line;
    bool retired = false;
};

class Service {
  public:
    explicit Service(const KernelConfig& config);
    int run();

  private:
    enum class Phase { serving, stopping };
    void start_generation();
    void pump_log(Generation& generation);
    void on_log_line(Generation& generation, const std::string& line);
    void publish(Generation& generation);
    void unpublished(Generation& generation) noexcept;
    void remove_published_socket() const noexcept;
    void reap_children();
    void begin_stop(const std::string& why);
    int poll_timeout_ms() const;
    void drain_signals();

    sandbox::Launcher launcher_;
    TemplateSpec spec_;
    std::vector<std::string> argv_;
    std::vector<std::string> environment_;
    ServiceLog log_file_;
    UniqueFd signals_;
    UniqueFd parent_;
    std::vector<std::unique_ptr<Generation>>
        generations_;  // the newest last; older ones serve their last workers
    std::optional<Clock::time_point> next_start_ = Clock::now();
    Phase phase_ = Phase::serving;
    ino_t published_inode_ = 0;  // the socket our newest published template listens on
    Clock::time_point stop_deadline_{};
};

Service::Service(const KernelConfig& config)
    : launcher_(worker_policy(config.sandbox_policy, config.worker_script)),
      spec_{config.zygote.tenant, config.zygote.library, config.zygote.template_environment()},
      argv_(worker_argv(config.python, config.worker_script)),
      environment_(worker_base_environment()),
      log_file_(template_log(launcher_, spec_.tenant)),
      signals_(signal_fd()),
      parent_(parent_pidfd()) {}

void Service::start_generation() {
    next_start_.reset();
    std::array<int, 2> pipe{};
    if (::pipe2(pipe.data(), O_CLOEXEC) != 0) {
        throw system_error("pipe2 (template log)");
    }
    UniqueFd read_end(pipe[0]), write_end(pipe[1]);
    // Only our end: the template writes its lines blocking.
    if (::fcntl(read_end.get(), F_SETFL, O_NONBLOCK) != 0) {
        throw system_error("fcntl O_NONBLOCK (template log)");
    }
    try {
        auto started = start_template(launcher_, spec_, argv_, environment_, write_end.get(),
                                      launcher_.policy().limits, false);
        generations_.push_back(std::make_unique<Generation>(
            Generation{std::move(started.process), std::move(started.pending_socket), std::move(read_end)}));
    } catch (const std::exception& error) {
        log_event(LogLevel::error, "zygote_template_failed",
                  {{"tenant", spec_.tenant}, {"error", error.what()}});
        next_start_ = Clock::now() + restart_after_death;
    }
}

void Service::on_log_line(Generation& generation, const std::string& line) {
    const std::string copy = line + "\n";
    [[maybe_unused]] const auto written = ::write(log_file_.fd(), copy.data(), copy.size());
    const auto event = nlohmann::json::parse(line, nullptr, false);
    if (!event.is_object() || event.value("component", "") != "cellblock-zygote") {
        return;
    }
    if (event.value("event", "") == "serving") {
        publish(generation);
        return;
    }
    if (event.value("event", "") != "retired") {
        return;
    }
    generation.retired = true;
    const std::string reason = event.value("reason", "");
    if (phase_ == Phase::serving && &generation == generations_.back().get()) {
        // A used-up generation is followed at once; one that could not fork would do the same again soon.
        next_start_ =
            reason == "forks" || reason == "age" ? Clock::now() : Clock::now() + restart_after_death;
    }
}

// A template is found by launches only once it serves: before, a launch finds no socket and goes by exec at
// once.
void Service::publish(Generation& generation) {
    if (generation.pending_socket.empty() || phase_ != Phase::serving) {
        return;
    }
    try {
        const auto socket_path = template_socket(launcher_, spec_.tenant);
        publish_template(generation.pending_socket, socket_path);
        generation.pending_socket.clear();
        struct stat published {};
        published_inode_ = ::stat(socket_path.c_str(), &published) == 0 ? published.st_ino : 0;
    } catch (const std::exception& error) {
        log_event(LogLevel::error, "zygote_template_failed",
                  {{"tenant", spec_.tenant}, {"error", error.what()}});
        generation.process.kill_all();
    }
}

// The dead socket of our last template, unless a newer service (the next gateway's) has published its own
// there.
void Service::remove_published_socket() const noexcept {
    const auto socket_path = template_socket(launcher_, spec_.tenant);
    struct stat now {};
    if (published_inode_ != 0 && ::stat(socket_path.c_str(), &now) == 0 && now.st_ino == published_inode_) {
        ::unlink(socket_path.c_str());
    }
}

void Service::unpublished(Generation& generation) noexcept {
    if (!generation.pending_socket.empty()) {
        ::unlink(generation.pending_socket.c_str());
        generation.pending_socket.clear();
    }
}

void Service::pump_log(Generation& generation) {
    std::array<char, 4096> buffer{};
    const ssize_t got = ::read(generation.log_pipe.get(), buffer.data(), buffer.size());
    if (got <= 0) {
        if (got == 0 || (errno != EAGAIN && errno != EINTR)) {
            generation.log_pipe.reset();  // the template has ended (or closed its output)
        }
        return;
    }
    generation.partial_line.append(buffer.data(), static_cast<std::size_t>(got));
    for (auto end = generation.partial_line.find('\n'); end != std::string::npos;
         end = generation.partial_line.find('\n')) {
        on_log_line(generation, generation.partial_line.substr(0, end));
        generation.partial_line.erase(0, end + 1);
    }
}

// We are the templates' parent (subreaper): their end, and that of their workers orphaned by a template's
// end.
void Service::reap_children() {
    int status = 0;
    for (pid_t pid = ::waitpid(-1, &status, WNOHANG); pid > 0; pid = ::waitpid(-1, &status, WNOHANG)) {
        for (auto it = generations_.begin(); it != generations_.end(); ++it) {
            if ((*it)->process.pid() != pid) {
                continue;
            }
            const bool newest = std::next(it) == generations_.end();
            log_event(
                (*it)->retired ? LogLevel::info : LogLevel::warning, "zygote_template_ended",
                {{"tenant", spec_.tenant}, {"pid", pid}, {"retired", (*it)->retired}, {"status", status}});
            if (newest && !(*it)->retired && phase_ == Phase::serving) {
                next_start_ = Clock::now() + restart_after_death;
            }
            unpublished(**it);
            generations_.erase(it);
            break;
        }
    }
}

void Service::begin_stop(const std::string& why) {
    if (phase_ == Phase::stopping) {
        return;
    }
    phase_ = Phase::stopping;
    next_start_.reset();
    stop_deadline_ = Clock::now() + stop_grace;
    log_event(LogLevel::info, "zygote_service_stopping", {{"tenant", spec_.tenant}, {"why", why}});
    if (generations_.empty()) {
        return;
    }
    Generation& newest = *generations_.back();
    if (!newest.pending_socket.empty()) {
        unpublished(newest);  // still preparing: it has no worker to wait for
        newest.process.kill_all();
    } else if (!newest.retired) {
        request_retire(template_socket(launcher_, spec_.tenant), retire_answer_limit);
    }
}

void Service::drain_signals() {
    signalfd_siginfo info{};
    while (::read(signals_.get(), &info, sizeof info) == sizeof info) {
        if (info.ssi_signo == SIGCHLD) {
            reap_children();
        } else {
            begin_stop("signal " + std::to_string(info.ssi_signo));
        }
    }
}

int Service::poll_timeout_ms() const {
    const auto until = [](Clock::time_point when) {
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(when - Clock::now()).count();
        return static_cast<int>(std::max<long long>(0, left) + 1);
    };
    if (phase_ == Phase::stopping) {
        return until(stop_deadline_);
    }
    return next_start_ ? until(*next_start_) : -1;
}

int Service::run() {
    log_event(LogLevel::info, "zygote_service_started", {{"tenant", spec_.tenant}});
    while (phase_ == Phase::serving || !generations_.empty()) {
        if (phase_ == Phase::serving && next_start_ && Clock::now() >= *next_start_) {
            start_generation();
        }
        if (phase_ == Phase::stopping && Clock::now() >= stop_deadline_) {
            for (const auto& generation : generations_) {
                generation->process.kill_all();  // its workers are in their own cgroups and go on
            }
        }
        std::vector<pollfd> fds = {{signals_.get(), POLLIN, 0}, {parent_.get(), POLLIN, 0}};
        for (const auto& generation : generations_) {
            if (generation->log_pipe) {
                fds.push_back({generation->log_pipe.get(), POLLIN, 0});
            }
        }
        if (::poll(fds.data(), fds.size(), poll_timeout_ms()) < 0 && errno != EINTR) {
            throw system_error("poll (template service)");
        }
        if (fds[1].revents != 0) {
            begin_stop("the process that started the service ended");
            parent_
                .reset();  // readable for good: polled again, it would spin the loop until the templates end
        }
        for (const auto& generation : generations_) {
            if (generation->log_pipe) {
                pump_log(*generation);
            }
        }
        drain_signals();
    }
    remove_published_socket();
    log_event(LogLevel::info, "zygote_service_stopped", {{"tenant", spec_.tenant}});
    return 0;
}

}  // namespace

int run_template_service(const std::filesystem::path& config_file) {
    const auto config = KernelConfig::load(config_file, KernelConfig::process_environment());
    if (!config.zygote.active()) {
        log_event(LogLevel::info, "zygote_service_off",
                  {{"why", config.zygote.enabled ? "no tenant is named" : "worker.zygote is false"}});
        return template_service_off;
    }
    if (::prctl(PR_SET_CHILD_SUBREAPER, 1) != 0) {
        throw system_error("prctl PR_SET_CHILD_SUBREAPER");
    }
    Service service(config);
    return service.run();
}

}  // namespace cellblock::kernel
