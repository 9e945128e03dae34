// How the kernel process and everything it starts (its threads, the sandbox, the worker, a zygote template
// and its forks) are scheduled: SCHED_BATCH (tests/bench/README.md, "Batch scheduling").
#pragma once

namespace cellblock::kernel {

// Called first thing in main, before any thread exists: the policy is per thread and inherited by the
// threads and processes created after it. A failure is logged and the kernel runs as before.
void schedule_as_batch_work();

}  // namespace cellblock::kernel
