#pragma once
// The ceilings every duration and memory limit a kernel takes must respect, whoever sets it: the gateway
// checks its settings and the agent API's limits against them before a kernel gets them, and the kernel
// checks its config file, environment and a request's metadata against the same numbers.

#include <cstdint>

namespace cellblock::contract {

// The longest duration, in seconds (about 47 years): deadlines count nanoseconds (the kernel) or milliseconds
// (the gateway's timers) in 64 bits, and now minus it stays after 1970; 1e300 s overflowed.
inline constexpr double longest_duration_s = 1.5e9;

// memory_mb becomes the sandbox's byte limit: at most 1 PiB, so that the bytes fit in 64 bits (2^44 MiB
// wrapped to 0, which means no limit).
inline constexpr std::uint64_t largest_memory_mb = std::uint64_t{1} << 30;

}  // namespace cellblock::contract
