#include "cellblock/gateway/kernels/kernel_process.hpp"

#include <fcntl.h>
#include <poll.h>
#include <spawn.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstring>
#include <system_error>

namespace cellblock::gateway {

namespace {
struct SpawnAttributes {
    posix_spawnattr_t attributes;
    SpawnAttributes() {
        if (int rc = posix_spawnattr_init(&attributes); rc != 0)
            throw std::system_error(rc, std::generic_category(), "posix_spawnattr_init");
    }
    ~SpawnAttributes() { posix_spawnattr_destroy(&attributes); }
};
struct SpawnFileActions {
    posix_spawn_file_actions_t actions;
    SpawnFileActions() {
        if (int rc = posix_spawn_file_actions_init(&actions); rc != 0)
            throw std::system_error(rc, std::generic_category(), "posix_spawn_file_actions_init");
    }
    ~SpawnFileActions() { posix_spawn_file_actions_destroy(&actions); }
};
}  // namespace

std::string ProcessExit::describe() const {
    if (status_unknown)
        return "exited (adopted from an earlier gateway, so its exit status is unknown)";
    if (signaled)
        return "killed by signal " + std::to_string(signal) + " (" + strsignal(signal) + ")";
    return "exited with status " + std::to_string(exit_code);
}

ChildProcess::ChildProcess(boost::asio::io_context& io, const std::vector<std::string>& argv,
                           const std::map<std::string, std::string>& environment,
                           const std::string& working_directory, const std::string& output_file)
    : pidfd_(io) {
    if (argv.empty())
        throw std::system_error(EINVAL, std::generic_category(), "kernelspec argv is empty");
    std::vector<char*> argument_pointers;
    argument_pointers.reserve(argv.size() + 1);
    for (const std::string& argument : argv)
        argument_pointers.push_back(const_cast<char*>(argument.c_str()));
    argument_pointers.push_back(nullptr);
    std::vector<std::string> environment_lines;
    environment_lines.reserve(environment.size());
    for (const auto& [name, value] : environment)
        environment_lines.push_back(name + "=" + value);
    std::vector<char*> environment_pointers;
    environment_pointers.reserve(environment_lines.size() + 1);
    for (std::string& line : environment_lines)
        environment_pointers.push_back(line.data());
    environment_pointers.push_back(nullptr);

    SpawnAttributes attributes;
    SpawnFileActions file_actions;
    // Own session: interrupts and kills address the process group; the gateway's terminal signals do not
    // reach it.
    short flags = POSIX_SPAWN_SETSID | POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF;
    sigset_t empty_mask, default_signals;
    sigemptyset(&empty_mask);
    sigemptyset(&default_signals);
    for (int sig : {SIGINT, SIGTERM, SIGPIPE, SIGCHLD, SIGHUP})
        sigaddset(&default_signals, sig);
    posix_spawnattr_setflags(&attributes.attributes, flags);
    posix_spawnattr_setsigmask(&attributes.attributes, &empty_mask);
    posix_spawnattr_setsigdefault(&attributes.attributes, &default_signals);
    if (!working_directory.empty())
        if (int rc = posix_spawn_file_actions_addchdir_np(&file_actions.actions, working_directory.c_str());
            rc != 0)
            throw std::system_error(rc, std::generic_category(), "posix_spawn_file_actions_addchdir_np");
    if (int rc = posix_spawn_file_actions_addopen(&file_actions.actions, 0, "/dev/null", O_RDONLY, 0);
        rc != 0)
        throw std::system_error(rc, std::generic_category(), "posix_spawn_file_actions_addopen /dev/null");
    if (!output_file.empty()) {
        // Kernel chatter (banners, warnings, crash traces) goes to a per-kernel log instead of the gateway's
        // output.
        if (int rc = posix_spawn_file_actions_addopen(&file_actions.actions, 1, output_file.c_str(),
                                                      O_WRONLY | O_CREAT | O_APPEND, 0600);
            rc != 0)
            throw std::system_error(rc, std::generic_category(),
                                    "posix_spawn_file_actions_addopen " + output_file);
        if (int rc = posix_spawn_file_actions_adddup2(&file_actions.actions, 1, 2); rc != 0)
            throw std::system_error(rc, std::generic_category(), "posix_spawn_file_actions_adddup2");
    }
    // Only stdin/stdout/stderr are inherited; the gateway's sockets must not leak into kernels.
    if (int rc = posix_spawn_file_actions_addclosefrom_np(&file_actions.actions, 3); rc != 0)
        throw std::system_error(rc, std::generic_category(), "posix_spawn_file_actions_addclosefrom_np");
    if (int rc = posix_spawnp(&pid_, argument_pointers[0], &file_actions.actions, &attributes.attributes,
                              argument_pointers.data(), environment_pointers.data());
        rc != 0)
        throw std::system_error(rc, std::generic_category(), "cannot start kernel '" + argv[0] + "'");

    const int pidfd = static_cast<int>(::syscall(SYS_pidfd_open, pid_, 0));
    if (pidfd < 0) {
        const int saved = errno;
        ::kill(pid_, SIGKILL);
        ::waitpid(pid_, nullptr, 0);
        exited_ = true;
        throw std::system_error(saved, std::generic_category(), "pidfd_open");
    }
    pidfd_.assign(pidfd);
    watch();
}

ChildProcess::ChildProcess(boost::asio::io_context& io, Adopt, pid_t pid)
    : pid_(pid), adopted_(true), pidfd_(io) {
    const int pidfd = static_cast<int>(::syscall(SYS_pidfd_open, pid_, 0));
    if (pidfd < 0)
        throw std::system_error(errno, std::generic_category(), "pidfd_open " + std::to_string(pid));
    pidfd_.assign(pidfd);
    watch();
}

void ChildProcess::watch() {
    pidfd_.async_wait(boost::asio::posix::stream_descriptor::wait_read,
                      [this](const boost::system::error_code& error) {
                          if (error)
                              return;  // cancelled: the destructor reaps
                          reap();
                      });
}

void ChildProcess::reap() {
    if (exited_)
        return;
    if (adopted_) {
        // Not our child: init (or a subreaper) collects the status. A readable pidfd means it has exited.
        pollfd readable{pidfd_.native_handle(), POLLIN, 0};
        if (::poll(&readable, 1, 0) <= 0) {
            watch();
            return;
        }
        exited_ = true;
        ProcessExit exit;
        exit.status_unknown = true;
        ::kill(-pid_, SIGKILL);
        if (exit_handler_) {
            auto handler = std::move(exit_handler_);
            handler(exit);
        }
        return;
    }
    int status = 0;
    pid_t reaped = 0;
    do {
        reaped = ::waitpid(pid_, &status, WNOHANG);
    } while (reaped < 0 && errno == EINTR);
    if (reaped == 0) {  // spurious wakeup: keep watching
        watch();
        return;
    }
    exited_ = true;
    ProcessExit exit;
    if (reaped > 0 && WIFSIGNALED(status)) {
        exit.signaled = true;
        exit.signal = WTERMSIG(status);
    } else if (reaped > 0) {
        exit.exit_code = WEXITSTATUS(status);
    }
    // Whatever the kernel left behind in its group goes too.
    ::kill(-pid_, SIGKILL);
    if (exit_handler_) {
        auto handler = std::move(exit_handler_);
        handler(exit);
    }
}

void ChildProcess::on_exit(std::function<void(ProcessExit)> handler) {
    exit_handler_ = std::move(handler);
}

bool ChildProcess::wait_for_exit(std::chrono::milliseconds timeout) {
    if (exited_)
        return true;
    pollfd watch{pidfd_.native_handle(), POLLIN, 0};
    const int ready = ::poll(&watch, 1, static_cast<int>(timeout.count()));
    if (ready <= 0)
        return false;
    exit_handler_ = nullptr;
    reap();
    return exited_;
}

void ChildProcess::release() {
    released_ = true;
    exit_handler_ = nullptr;
    boost::system::error_code ignored;
    pidfd_.cancel(ignored);
}

bool ChildProcess::signal_group(int signal_number) const {
    if (exited_ || released_)
        return false;
    return ::kill(-pid_, signal_number) == 0 || ::kill(pid_, signal_number) == 0;
}

ChildProcess::~ChildProcess() {
    exit_handler_ = nullptr;
    boost::system::error_code ignored;
    pidfd_.cancel(ignored);
    if (exited_ || released_)
        return;
    ::kill(-pid_, SIGKILL);
    ::kill(pid_, SIGKILL);
    if (adopted_) {
        pollfd readable{pidfd_.native_handle(), POLLIN, 0};
        ::poll(&readable, 1, 2000);
        return;
    }
    while (::waitpid(pid_, nullptr, 0) < 0 && errno == EINTR) {
    }
}

}  // namespace cellblock::gateway
