// Process: the handle of a running sandbox (signals, waiting, limits, teardown).
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <utility>

#include "process_impl.hpp"
#include "system.hpp"
#include "zygote_client.hpp"

namespace cellblock::sandbox {

using namespace std::chrono;

Process::Impl::~Impl() {
    if (pid > 0 && !outcome) {
        kill_everything();
        try {
            reap(true);
        } catch (const std::exception&) {
            // Nothing more we can do in a destructor; the cgroup sweep below still runs.
        }
    }
    // cgroups' destructor sweeps and removes them; then the skeleton and the lease go.
}

void Process::Impl::kill_everything() noexcept {
    if (pid > 0 && !outcome && pidfd) {
        ::syscall(SYS_pidfd_send_signal, pidfd.get(), SIGKILL, nullptr, 0);
    }
    cgroups.kill_all();
}

std::optional<Outcome> Process::Impl::reap(bool block) {
    if (outcome) {
        return outcome;
    }
    if (pid <= 0) {
        return std::nullopt;
    }
    if (forked_by_template) {
        return reap_template_child(block);
    }
    siginfo_t info{};
    rusage usage{};
    for (;;) {
        const int options = WEXITED | (block ? 0 : WNOHANG);
        // The raw system call also reports the resource usage, which tells a CPU-limit kill apart.
        if (::syscall(SYS_waitid, P_PIDFD, pidfd.get(), &info, options, &usage) == 0) {
            break;
        }
        if (errno == EINTR) {
            continue;
        }
        detail::throw_errno("waitid for the sandbox");
    }
    if (info.si_pid == 0) {
        return std::nullopt;  // still running (WNOHANG)
    }
    const double cpu = static_cast<double>(usage.ru_utime.tv_sec + usage.ru_stime.tv_sec) +
                       static_cast<double>(usage.ru_utime.tv_usec + usage.ru_stime.tv_usec) / 1e6;
    return outcome_of(info.si_code == CLD_EXITED, info.si_status, cpu);
}

std::optional<Outcome> Process::Impl::reap_template_child(bool block) {
    // The pidfd of a process that is not our child is readable once it has ended.
    for (;;) {
        pollfd ended{pidfd.get(), POLLIN, 0};
        const int ready = ::poll(&ended, 1, block ? -1 : 0);
        if (ready > 0) {
            break;
        }
        if (ready == 0) {
            return std::nullopt;
        }
        if (errno != EINTR) {
            detail::throw_errno("poll the sandbox pidfd");
        }
    }
    // The template reaps it and says how it ended; generous, because a loaded template answers late.
    if (auto report = detail::read_exit_report(zygote_connection.get(), seconds(10))) {
        zygote_connection.reset();
        const int status = report->wait_status;
        return outcome_of(WIFEXITED(status), WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status),
                          report->cpu_seconds);
    }
    zygote_connection.reset();
    // The template is gone (or said nothing): whoever reaped the program instead (init, a subreaper) leaves
    // its wait status with the pidfd on Linux >= 6.15. Reaping follows the end by a moment.
    const auto give_up = steady_clock::now() + seconds(2);
    for (;;) {
        if (const auto status = detail::pidfd_exit_status(pidfd.get())) {
            return outcome_of(WIFEXITED(*status),
                              WIFEXITED(*status) ? WEXITSTATUS(*status) : WTERMSIG(*status), 0);
        }
        if (steady_clock::now() >= give_up) {
            break;
        }
        ::usleep(10000);
    }
    // Nobody can say: report what a kill would be, without claiming a cause.
    return outcome_of(false, SIGKILL, 0);
}

Outcome Process::Impl::outcome_of(bool exited, int status, double cpu_seconds) {
    Outcome result;
    if (exited) {
        result.reason = Outcome::Reason::exited;
        result.exit_code = status;
    } else {
        result.reason = Outcome::Reason::signaled;
        result.signal = status;
        if (killed_for_time) {
            result.reason = Outcome::Reason::time_limit;
        } else if (cgroups.memory_limit_hit() && result.signal == SIGKILL) {
            result.reason = Outcome::Reason::memory_limit;
        } else if (output_limit_noted && result.signal == SIGKILL) {
            result.reason = Outcome::Reason::output_limit;
        } else if (limits.cpu_seconds > 0 && (result.signal == SIGXCPU || result.signal == SIGKILL)) {
            // RLIMIT_CPU sends SIGXCPU at the soft limit and SIGKILL at the hard one (a second later).
            if (result.signal == SIGXCPU || cpu_seconds >= static_cast<double>(limits.cpu_seconds)) {
                result.reason = Outcome::Reason::cpu_limit;
            }
        }
    }
    // Anything that outlived pid 1 (it cannot: the pid namespace dies with it) is swept anyway.
    cgroups.kill_all();
    outcome = result;
    return result;
}

Process::Process(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Process::Process(Process&&) noexcept = default;
Process& Process::operator=(Process&&) noexcept = default;
Process::~Process() = default;

pid_t Process::pid() const noexcept {
    return impl_ ? impl_->pid : -1;
}
int Process::pidfd() const noexcept {
    return impl_ ? impl_->pidfd.get() : -1;
}
uid_t Process::host_uid() const noexcept {
    return impl_ ? impl_->lease.uid() : 0;
}

void Process::signal(int signo) {
    if (!impl_ || impl_->outcome) {
        return;
    }
    if (::syscall(SYS_pidfd_send_signal, impl_->pidfd.get(), signo, nullptr, 0) != 0 && errno != ESRCH) {
        detail::throw_errno("signal the sandbox");
    }
}

void Process::kill() {
    if (impl_) {
        impl_->kill_everything();
    }
}

void Process::note_output_limit() {
    if (impl_) {
        impl_->output_limit_noted = true;
    }
}

std::vector<UniqueFd> Process::take_loopback_listeners() {
    if (!impl_) {
        return {};
    }
    return std::exchange(impl_->loopback_listeners, {});
}

std::optional<Outcome> Process::try_wait() {
    if (!impl_) {
        return std::nullopt;
    }
    if (auto done = impl_->reap(false)) {
        return done;
    }
    // Enforce the wall clock even for callers that only poll.
    const auto limit = impl_->limits.wall_clock;
    if (limit.count() > 0 && steady_clock::now() - impl_->started >= limit) {
        impl_->killed_for_time = true;
        impl_->kill_everything();
        return impl_->reap(true);
    }
    return std::nullopt;
}

std::optional<Outcome> Process::wait_for(milliseconds timeout) {
    if (!impl_) {
        return std::nullopt;
    }
    const auto deadline = steady_clock::now() + timeout;
    for (;;) {
        if (auto done = try_wait()) {
            return done;
        }
        auto now = steady_clock::now();
        if (now >= deadline) {
            return std::nullopt;
        }
        auto remaining = duration_cast<milliseconds>(deadline - now) + milliseconds(1);
        const auto limit = impl_->limits.wall_clock;
        if (limit.count() > 0) {
            const auto until_limit =
                duration_cast<milliseconds>(impl_->started + limit - now) + milliseconds(1);
            remaining = std::min(remaining, std::max(until_limit, milliseconds(1)));
        }
        pollfd ready{impl_->pidfd.get(), POLLIN, 0};
        const int timeout_ms = static_cast<int>(std::min<long long>(remaining.count(), 1000LL * 60 * 60));
        if (::poll(&ready, 1, timeout_ms) < 0 && errno != EINTR) {
            detail::throw_errno("poll the sandbox pidfd");
        }
    }
}

Outcome Process::wait() {
    if (!impl_) {
        throw SandboxError("wait: this Process was moved from");
    }
    for (;;) {
        if (auto done = wait_for(hours(24))) {
            return *done;
        }
    }
}

}  // namespace cellblock::sandbox
