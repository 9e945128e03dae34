#include "launch/heap_policy.hpp"

#include <malloc.h>

#include "common/logging.hpp"

namespace cellblock::kernel {

// Large messages (a 1 MiB stream text is read, serialized, signed and sent) would otherwise get fresh mmap'd
// blocks that glibc unmaps after use, and on a VM faulting a MiB in again costs more than copying it. Same
// setting as the worker's (cellblock_runtime/main.py); not GLIBC_TUNABLES, which every process the kernel
// starts would inherit.
void keep_large_blocks_on_the_heap() {
    constexpr int mmap_threshold = 4 * 1024 * 1024;
    constexpr int trim_threshold = 8 * 1024 * 1024;
    // One arena for every thread: malloc_trim gives back the top of the main arena only, so a large output
    // handled on another thread would leave its arena's top resident for as long as the kernel idles.
    if (::mallopt(M_MMAP_THRESHOLD, mmap_threshold) != 1 ||
        ::mallopt(M_TRIM_THRESHOLD, trim_threshold) != 1 || ::mallopt(M_ARENA_MAX, 1) != 1) {
        log_event(LogLevel::warning, "mallopt_failed", {});
    }
}

void release_free_heap() {
    // The result only says whether anything was released.
    static_cast<void>(::malloc_trim(0));
}

}  // namespace cellblock::kernel
