// cellblock-sandbox: runs one command confined, for people and tests.
//   cellblock-sandbox [--policy FILE] [--workspace DIR] [--memory-mb N] [--timeout S] [--output-bytes N]
//                     [--loopback-listener PORT [--loopback-listener-ipv6] --send-listeners-to SOCKET] --
//   CMD ARGS...
// The command's stdout and stderr are streamed through (and cut at --output-bytes); the exit status is
// the command's, or 128 + signal; when a limit ended it, the reason is printed on stderr.
// SIGTERM, SIGINT or SIGHUP to the CLI kills the sandbox and exits 128 + that signal once its cgroups,
// uid and temporary workspace are let go (a service manager's stop, a Ctrl-C, a closed terminal).
// --loopback-listener: a socket listening on 127.0.0.1:PORT inside the sandbox, sent (SCM_RIGHTS, one
// byte per socket) to whoever listens on the unix stream socket at SOCKET, who then serves it.
#include <fcntl.h>
#include <poll.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <array>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <optional>

#include "cellblock/sandbox/sandbox.hpp"

namespace {

namespace sb = cellblock::sandbox;
namespace fs = std::filesystem;

#ifndef CELLBLOCK_DEFAULT_POLICY
#define CELLBLOCK_DEFAULT_POLICY "/usr/local/share/cellblock/sandbox-policy.json"
#endif

struct Options {
    std::string policy_file = CELLBLOCK_DEFAULT_POLICY;
    std::string workspace;
    std::optional<std::uint64_t> memory_mb;
    std::optional<double> timeout_seconds;
    std::optional<std::uint64_t> output_bytes;
    std::optional<std::uint16_t> listener_port;
    bool listener_ipv6 = false;
    std::string listener_destination;
    std::vector<std::string> command;
};

// A temporary workspace, removed (with whatever the command left in it) when the CLI exits.
class TemporaryWorkspace {
  public:
    TemporaryWorkspace() {
        std::string pattern = (fs::temp_directory_path() / "cellblock-workspace-XXXXXX").string();
        if (::mkdtemp(pattern.data()) == nullptr) {
            throw sb::SandboxError(std::string("mkdtemp: ") + std::strerror(errno));
        }
        path_ = pattern;
    }
    ~TemporaryWorkspace() {
        std::error_code ignored;
        fs::remove_all(path_, ignored);
    }
    TemporaryWorkspace(const TemporaryWorkspace&) = delete;
    TemporaryWorkspace& operator=(const TemporaryWorkspace&) = delete;
    const fs::path& path() const { return path_; }

  private:
    fs::path path_;
};

struct Pipe {
    int read_end = -1;
    int write_end = -1;
    Pipe() {
        int ends[2];
        if (::pipe2(ends, O_CLOEXEC) != 0) {
            throw sb::SandboxError(std::string("pipe: ") + std::strerror(errno));
        }
        read_end = ends[0];
        write_end = ends[1];
    }
    ~Pipe() {
        if (read_end >= 0) {
            ::close(read_end);
        }
        if (write_end >= 0) {
            ::close(write_end);
        }
    }
    Pipe(const Pipe&) = delete;
    Pipe& operator=(const Pipe&) = delete;
    void close_write() {
        ::close(write_end);
        write_end = -1;
    }
};

// The signals that stop the CLI, taken as data from a signalfd instead of ending the process: killed by
// their default action, the CLI would leave the sandbox's cgroups, its uid lease and the temporary
// workspace behind. Blocked from before the workspace is made and the sandbox launched (a stop during
// either is not lost) until the CLI exits: a second stop during the clean-up must not cut it short. The
// sandboxed program starts with no signal blocked (the launcher unblocks them).
class StopSignals {
  public:
    StopSignals() {
        sigemptyset(&signals_);
        for (const int signo : {SIGTERM, SIGINT, SIGHUP}) {
            sigaddset(&signals_, signo);
        }
        if (::sigprocmask(SIG_BLOCK, &signals_, nullptr) != 0) {
            throw sb::SandboxError(std::string("sigprocmask: ") + std::strerror(errno));
        }
        fd_ = sb::UniqueFd(::signalfd(-1, &signals_, SFD_CLOEXEC | SFD_NONBLOCK));
        if (!fd_) {
            throw sb::SandboxError(std::string("signalfd: ") + std::strerror(errno));
        }
    }

    int fd() const { return fd_.get(); }
    // The signal that arrived, or 0.
    int take() const {
        signalfd_siginfo info{};
        if (::read(fd_.get(), &info, sizeof info) != static_cast<ssize_t>(sizeof info)) {
            return 0;
        }
        return static_cast<int>(info.ssi_signo);
    }

  private:
    sigset_t signals_{};
    sb::UniqueFd fd_;
};

bool write_all(int fd, const char* data, std::size_t size) {
    while (size > 0) {
        const ssize_t written = ::write(fd, data, size);
        if (written < 0) {
            if (errno == EINTR) {
                continue;
            }
            return false;
        }
        data += written;
        size -= static_cast<std::size_t>(written);
    }
    return true;
}

// Hands each listening socket to whoever listens on the unix stream socket at `destination`.
void send_listeners(const std::string& destination, std::vector<sb::UniqueFd> listeners) {
    const auto failure = [&destination](const char* step) {
        return sb::SandboxError("--send-listeners-to " + destination + ": " + step + ": " +
                                std::strerror(errno));
    };
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    if (destination.size() >= sizeof address.sun_path) {
        errno = ENAMETOOLONG;
        throw failure("socket path");
    }
    std::memcpy(address.sun_path, destination.c_str(), destination.size() + 1);
    sb::UniqueFd connection(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!connection) {
        throw failure("socket");
    }
    if (::connect(connection.get(), reinterpret_cast<const sockaddr*>(&address), sizeof address) != 0) {
        throw failure("connect");
    }
    for (const auto& listener : listeners) {
        char byte = 0;
        iovec data{&byte, 1};
        alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
        msghdr message{};
        message.msg_iov = &data;
        message.msg_iovlen = 1;
        message.msg_control = control;
        message.msg_controllen = sizeof control;
        cmsghdr* header = CMSG_FIRSTHDR(&message);
        header->cmsg_level = SOL_SOCKET;
        header->cmsg_type = SCM_RIGHTS;
        header->cmsg_len = CMSG_LEN(sizeof(int));
        const int fd = listener.get();
        std::memcpy(CMSG_DATA(header), &fd, sizeof fd);
        if (::sendmsg(connection.get(), &message, MSG_NOSIGNAL) != 1) {
            throw failure("sendmsg");
        }
    }
}

// Copies the program's stdout/stderr to ours until both close, counting bytes against the cap.
// The pipes close when every process of the sandbox is gone (they all die with its pid 1).
// A stop signal kills the sandbox; the relay then drains what it wrote and returns that signal (else 0).
int relay_output(sb::Process& process, Pipe& out, Pipe& err, std::uint64_t cap, const StopSignals& stop) {
    std::array<pollfd, 3> fds{pollfd{out.read_end, POLLIN, 0}, pollfd{err.read_end, POLLIN, 0},
                              pollfd{stop.fd(), POLLIN, 0}};
    const std::array<int, 2> targets{STDOUT_FILENO, STDERR_FILENO};
    std::uint64_t total = 0;
    int stopped_by = 0;
    std::array<char, 65536> buffer{};
    while (fds[0].fd >= 0 || fds[1].fd >= 0) {
        // Wake up every 100 ms so that the wall-clock limit is enforced while the output is idle.
        const int ready = ::poll(fds.data(), fds.size(), 100);
        if (ready < 0 && errno != EINTR) {
            break;
        }
        process.try_wait();
        if (fds[2].fd >= 0 && (fds[2].revents & POLLIN) != 0) {
            if (const int signo = stop.take(); signo != 0) {
                stopped_by = signo;
                fds[2].fd = -1;  // a second signal changes nothing: the sandbox is being killed
                process.kill();
            }
        }
        for (std::size_t i = 0; i < targets.size(); ++i) {
            if (fds[i].fd < 0 || fds[i].revents == 0) {
                continue;
            }
            const ssize_t got = ::read(fds[i].fd, buffer.data(), buffer.size());
            if (got < 0 && errno == EINTR) {
                continue;
            }
            if (got <= 0) {
                fds[i].fd = -1;
                continue;
            }
            auto forward = static_cast<std::uint64_t>(got);
            const bool over = cap > 0 && total + forward > cap;
            if (over) {
                forward = cap - total;
            }
            total += forward;
            write_all(targets[i], buffer.data(), static_cast<std::size_t>(forward));
            if (over) {
                process.note_output_limit();
                process.kill();
                return stopped_by;
            }
        }
    }
    return stopped_by;
}

int run(const Options& options, const StopSignals& stop) {
    sb::Policy policy = sb::Policy::load(options.policy_file);
    if (options.memory_mb) {
        policy.limits.memory_bytes = *options.memory_mb << 20;
    }
    if (options.timeout_seconds) {
        policy.limits.wall_clock =
            std::chrono::milliseconds(static_cast<std::int64_t>(*options.timeout_seconds * 1000));
    }
    if (options.output_bytes) {
        policy.limits.output_bytes = *options.output_bytes;
    }
    if (options.command.empty()) {
        throw sb::SandboxError("no command given (usage: cellblock-sandbox [options] -- CMD ARGS...)");
    }

    std::optional<TemporaryWorkspace> temporary;
    fs::path workspace;
    if (options.workspace.empty()) {
        temporary.emplace();
        workspace = temporary->path();
    } else {
        workspace = fs::absolute(options.workspace);
    }

    sb::Launcher launcher(policy);
    Pipe out, err;
    sb::LaunchRequest request;
    request.argv = options.command;
    if (request.argv.front().find('/') == std::string::npos) {
        request.argv.front() = "/usr/bin/" + request.argv.front();
    }
    request.workspace = workspace;
    request.stdin_fd = STDIN_FILENO;
    request.stdout_fd = out.write_end;
    request.stderr_fd = err.write_end;
    if (options.listener_port) {
        request.loopback_listener = sb::LoopbackListener{*options.listener_port, options.listener_ipv6};
    }
    sb::Process process = launcher.launch(request);
    out.close_write();
    err.close_write();
    if (options.listener_port) {
        send_listeners(options.listener_destination, process.take_loopback_listeners());
    }

    const int stopped_by = relay_output(process, out, err, policy.limits.output_bytes, stop);
    const sb::Outcome outcome = process.wait();
    if (stopped_by != 0) {
        std::cerr << "cellblock-sandbox: stopped by SIG" << ::sigabbrev_np(stopped_by)
                  << "; the sandbox was killed" << std::endl;
        return 128 + stopped_by;
    }
    switch (outcome.reason) {
        case sb::Outcome::Reason::exited:
        case sb::Outcome::Reason::signaled:
            break;
        default:
            std::cerr << "cellblock-sandbox: " << outcome.describe() << std::endl;
    }
    return outcome.shell_status();
}

}  // namespace

int main(int argc, char** argv) {
    // A closed stdin/stdout/stderr would be reused by our own pipes (and the sandbox would read its
    // own output as input): occupy them with /dev/null first.
    for (int fd = 0; fd <= 2; ++fd) {
        if (::fcntl(fd, F_GETFD) < 0 && ::open("/dev/null", fd == 0 ? O_RDONLY : O_WRONLY) < 0) {
            return 125;
        }
    }
    CLI::App app{"Run one command confined by the cellblock sandbox."};
    Options options;
    app.add_option("--policy", options.policy_file, "policy JSON file")->check(CLI::ExistingFile);
    app.add_option("--workspace", options.workspace,
                   "host directory mounted read-write as the workspace "
                   "(default: a temporary directory removed afterwards)")
        ->check(CLI::ExistingDirectory);
    app.add_option("--memory-mb", options.memory_mb, "memory limit in MiB (overrides the policy)");
    app.add_option("--timeout", options.timeout_seconds,
                   "wall-clock limit in seconds (overrides the policy)");
    app.add_option("--output-bytes", options.output_bytes, "stop and kill after this much stdout+stderr");
    auto* listener = app.add_option("--loopback-listener", options.listener_port,
                                    "create a socket listening on 127.0.0.1:PORT inside the sandbox "
                                    "(and admit AF_INET/AF_INET6 sockets there); needs --send-listeners-to")
                         ->check(CLI::Range(1, 65535));
    app.add_flag("--loopback-listener-ipv6", options.listener_ipv6, "also listen on [::1]:PORT")
        ->needs(listener);
    auto* destination = app.add_option("--send-listeners-to", options.listener_destination,
                                       "a unix stream socket (path) to send each listening socket to "
                                       "(SCM_RIGHTS, one byte each) once the command runs")
                            ->needs(listener);
    listener->needs(destination);
    app.add_option("command", options.command, "the command and its arguments (after --)")->required();
    try {
        app.parse(argc, argv);
    } catch (const CLI::ParseError& error) {
        return app.exit(error) == 0 ? 0 : 125;
    }
    try {
        const StopSignals stop;
        return run(options, stop);
    } catch (const std::exception& error) {
        std::cerr << "cellblock-sandbox: " << error.what() << std::endl;
        return 125;
    }
}
