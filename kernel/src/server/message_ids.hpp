// Where the ids of the kernel's messages come from. xeus 2.4.1 makes every message id (and the server
// its own) with libuuid's uuid_generate, which costs five or six syscalls per call (getrandom, getpid,
// getppid, getuid, gettid: libuuid reseeds its fallback generator each time), about 30 of the kernel's
// syscalls per `1+1`. The kernel defines uuid_generate itself (the executable's definition wins over
// libuuid's for libxeus as well, see kernel/CMakeLists.txt) and draws the bytes from OpenSSL's DRBG, which
// keeps its state per thread, reseeds after a fork and makes no syscall per id.
#pragma once

#include <array>

namespace cellblock::kernel {

// A random (version 4, RFC 4122) UUID. Throws std::runtime_error if no random bytes can be had.
std::array<unsigned char, 16> random_uuid();

}  // namespace cellblock::kernel

// libuuid's interface, for xeus::new_xguid: a random UUID (the kernel needs no time-based ones). Aborts if
// no random bytes can be had: an id that is not unique would let messages be confused.
extern "C" void uuid_generate(unsigned char* out);
