// The kernel's getpid: read once, and again in the child of a fork().
//
// libzmq checks getpid() each time it signals or waits on one of its mailboxes (its fork detection): about
// 22 getpid system calls per `1+1`, a third of the kernel's, at 1.1 us each on this VM (bench_floors.py).
// glibc stopped caching the pid (2.25) because a raw clone() child would see its parent's. The kernel's
// children never reach this function before execve: posix_spawn's child runs glibc's internal getpid, not
// this symbol, and the sandbox's clone child (run_child) calls none; a fork() child refreshes the value
// (pthread_atfork). The executable exports this definition (CMakeLists.txt), so libzmq and libxeus resolve
// getpid to it. The value is process-wide by nature: getpid has no other place to keep it.
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>

namespace {

pid_t system_pid() noexcept {
    return static_cast<pid_t>(::syscall(SYS_getpid));
}

std::atomic<pid_t>& cached_pid() noexcept {
    static std::atomic<pid_t> pid{0};
    return pid;
}

void refresh_in_child() noexcept {
    cached_pid().store(system_pid(), std::memory_order_relaxed);
}

// Filled before main, while the process has one thread and no child: a vfork-style child (posix_spawn
// shares the parent's memory until its execve) must never be the one that fills it.
[[maybe_unused]] const bool pid_cached_at_start = [] {
    refresh_in_child();
    return ::pthread_atfork(nullptr, nullptr, refresh_in_child) == 0;
}();

}  // namespace

extern "C" pid_t getpid() noexcept {
    const pid_t pid = cached_pid().load(std::memory_order_relaxed);
    return pid != 0 ? pid : system_pid();
}
