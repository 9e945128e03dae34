// How the kernel process keeps its heap (glibc malloc): large blocks stay on it while cells follow each
// other, and what is free goes back to the system once the shell has been quiet for a while, because an idle
// session is what a host holds many of (a 1 MiB print otherwise left ≈ 6 MiB of free heap resident
// per kernel).
#pragma once

#include <chrono>

namespace cellblock::kernel {

// How long the shell stays quiet after a request before release_free_heap() (shorter than an agent's pause
// for its model, longer than the gap between two cells a client sends back to back).
inline constexpr std::chrono::milliseconds quiet_before_heap_release{1500};

// mallopt at start: blocks under 4 MiB come from the heap and up to 8 MiB of free heap stays mapped.
void keep_large_blocks_on_the_heap();

// malloc_trim(0): every arena's free pages back to the system (the top beyond the threshold and whole free
// pages inside). Cheap when little is free; called once per quiet period, never while a cell runs.
void release_free_heap();

}  // namespace cellblock::kernel
