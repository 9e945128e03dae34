#include "worker/zygote_template.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <utility>

#include "common/logging.hpp"
#include "common/unique_fd.hpp"

namespace cellblock::kernel {
namespace {

std::runtime_error system_error(const std::string& what) {
    return std::runtime_error(what + ": " + std::strerror(errno));
}

sockaddr_un socket_address(const std::filesystem::path& socket_path) {
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    const std::string path = socket_path.string();
    if (path.size() >= sizeof address.sun_path) {
        throw std::runtime_error("the template socket path " + path + " is too long");
    }
    std::memcpy(address.sun_path, path.c_str(), path.size() + 1);
    return address;
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

// A listening SOCK_SEQPACKET socket, mode 0600 from its first moment: bound under a temporary name in the
// socket's directory (returned), which is renamed over whatever (dead) socket was there when the template is
// published.
std::pair<UniqueFd, std::filesystem::path> listen_beside(const std::filesystem::path& socket_path) {
    const auto temporary = socket_path.parent_path() / ("." + socket_path.filename().string() + "." +
                                                        std::to_string(::getpid()) + ".new");
    const std::string path = temporary.string();
    const auto address = socket_address(temporary);
    UniqueFd listening(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
    if (!listening) {
        throw system_error("socket (zygote template)");
    }
    ::unlink(path.c_str());  // a leftover of a process that died here (ENOENT otherwise)
    if (::bind(listening.get(), reinterpret_cast<const sockaddr*>(&address), sizeof address) != 0) {
        throw system_error("bind " + path);
    }
    if (::chmod(path.c_str(), 0600) != 0 || ::listen(listening.get(), 128) != 0) {
        const auto error = system_error("listen on " + path);
        ::unlink(path.c_str());
        throw error;
    }
    return {std::move(listening), temporary};
}

}  // namespace

std::filesystem::path template_socket(const sandbox::Launcher& launcher, const std::string& tenant) {
    return launcher.policy().state_dir / ("zygote-" + tenant + ".sock");
}

std::filesystem::path template_log(const sandbox::Launcher& launcher, const std::string& tenant) {
    return launcher.policy().state_dir / ("zygote-" + tenant + ".log");
}

sandbox::Policy worker_policy(const std::filesystem::path& policy_file, const std::filesystem::path& script) {
    auto policy = sandbox::Policy::load(policy_file);
    sandbox::MountSpec runtime;
    runtime.kind = sandbox::MountSpec::Kind::bind;
    runtime.source = script.parent_path().string();
    runtime.target = worker_dir_inside;
    policy.mounts.push_back(runtime);
    return policy;
}

std::vector<std::string> worker_argv(const std::filesystem::path& python,
                                     const std::filesystem::path& script) {
    return {python.string(), std::string(worker_dir_inside) + "/" + script.filename().string()};
}

std::vector<std::string> worker_base_environment() {
    return {"PYTHONIOENCODING=utf-8", "PYTHONUNBUFFERED=1"};
}

bool template_listens(const std::filesystem::path& socket_path) {
    if (socket_path.string().size() >= sizeof(sockaddr_un::sun_path)) {
        return false;
    }
    const auto address = socket_address(socket_path);
    UniqueFd probe(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (!probe) {
        throw system_error("socket (probe the zygote template)");
    }
    if (::connect(probe.get(), reinterpret_cast<const sockaddr*>(&address), sizeof address) == 0) {
        return true;  // closed at once: the template drops a connection that sends no request
    }
    return errno != ECONNREFUSED && errno != ENOENT;  // EAGAIN: a full backlog is a busy, live template
}

void publish_template(const std::filesystem::path& pending_socket, const std::filesystem::path& socket_path) {
    if (::rename(pending_socket.c_str(), socket_path.c_str()) != 0) {
        throw system_error("rename " + pending_socket.string() + " to " + socket_path.string());
    }
}

StartedTemplate start_template(sandbox::Launcher& launcher, const TemplateSpec& spec,
                               const std::vector<std::string>& argv,
                               const std::vector<std::string>& environment, int log_fd,
                               std::optional<sandbox::ResourceLimits> limits, bool publish) {
    const auto socket_path = template_socket(launcher, spec.tenant);
    auto [listening, pending_socket] = listen_beside(socket_path);
    sandbox::TemplateRequest request;
    request.name = "zygote-" + spec.tenant;
    request.argv = argv;
    request.environment = environment;
    request.environment.insert(request.environment.end(), spec.template_environment.begin(),
                               spec.template_environment.end());
    request.listening_socket = listening.get();
    request.stdout_fd = log_fd;
    request.stderr_fd = log_fd;
    request.zygote_library = spec.library;
    request.limits = limits;
    try {
        auto started = launcher.launch_template(request);
        if (publish) {
            publish_template(pending_socket, socket_path);
        }
        log_event(LogLevel::warning, "zygote_template_started",
                  {{"tenant", spec.tenant}, {"pid", started.pid()}, {"socket", socket_path.string()}});
        return {std::move(started), publish ? std::filesystem::path() : pending_socket};
    } catch (...) {
        ::unlink(pending_socket.c_str());
        throw;
    }
}

bool request_retire(const std::filesystem::path& socket_path, std::chrono::milliseconds timeout) {
    UniqueFd connection(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
    if (!connection) {
        throw system_error("socket (retire the zygote template)");
    }
    const auto address = socket_address(socket_path);
    if (::connect(connection.get(), reinterpret_cast<const sockaddr*>(&address), sizeof address) != 0) {
        return false;
    }
    static constexpr char retire_magic[] = {'C', 'B', 'Z', 'R'};
    if (::send(connection.get(), retire_magic, sizeof retire_magic, MSG_NOSIGNAL) != sizeof retire_magic) {
        return false;
    }
    pollfd readable{connection.get(), POLLIN, 0};
    if (::poll(&readable, 1, static_cast<int>(timeout.count())) <= 0) {
        return false;
    }
    char answer[256];
    const ssize_t got = ::recv(connection.get(), answer, sizeof answer, 0);
    if (got <= 0) {
        return false;
    }
    const auto message =
        nlohmann::json::parse(std::string(answer, static_cast<std::size_t>(got)), nullptr, false);
    return message.is_object() && message.value("retired", false);
}

// Starts the tenant's template unless one listens or another kernel is starting it. Returns what happened,
// for the fallback's log line.
std::string start_template_if_dead(sandbox::Launcher& launcher, const TemplateSpec& spec,
                                   const std::vector<std::string>& argv,
                                   const std::vector<std::string>& environment) {
    const auto& state_dir = launcher.policy().state_dir;
    const std::string name = "zygote-" + spec.tenant;
    const auto socket_path = template_socket(launcher, spec.tenant);
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
        const auto log_path = template_log(launcher, spec.tenant);
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
        // Marks the start (size > 0, and its time) before it happens, so a failing start is not retried at
        // once.
        if (::ftruncate(lock.get(), 1) != 0 || ::futimens(lock.get(), nullptr) != 0) {
            throw system_error("mark " + lock_path.string());
        }
        // In the kernel's cgroups, and it outlives the kernel: nobody here owns it.
        const auto started = start_template(launcher, spec, argv, environment, log.get(), std::nullopt, true);
        return "started the template (pid " + std::to_string(started.process.pid()) +
               ") for the next launches";
    } catch (const std::exception& error) {
        return std::string("could not start the template: ") + error.what();
    }
}

}  // namespace cellblock::kernel
