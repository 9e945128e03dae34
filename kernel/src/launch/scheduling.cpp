#include "launch/scheduling.hpp"

#include <sched.h>

#include <cerrno>
#include <cstring>

#include "common/logging.hpp"

namespace cellblock::kernel {

// A session is a chain of wake-ups (client -> libzmq -> kernel -> worker and back). Under the default policy
// each woken task preempts whatever runs on its core, so the kernel's interpreter thread was preempted
// several times per `1+1`, each a context switch and a cold cache (kernel/README.md, "Scheduling", has the
// figures). SCHED_BATCH tasks do not preempt on wake-up: they run when the current task blocks or its slice
// ends. On an idle core nothing changes (a woken task runs at once), and the gateway and other interactive
// processes, under the default policy, still preempt kernels. Unprivileged; a worker may change its own.
void schedule_as_batch_work() {
    const sched_param no_priority{};  // SCHED_BATCH takes priority 0; nice values still apply
    if (::sched_setscheduler(0, SCHED_BATCH, &no_priority) != 0) {
        log_event(LogLevel::warning, "sched_batch_failed", {{"error", std::strerror(errno)}});
    }
}

}  // namespace cellblock::kernel
