// Small checked wrappers around system calls used by the parent (never by the cloned child).
#pragma once

#include <cerrno>
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>

#include "cellblock/sandbox/sandbox.hpp"
#include "unique_fd.hpp"

namespace cellblock::sandbox::detail {

// "step: strerror(err)" as a SandboxError.
[[noreturn]] void throw_errno(std::string_view step, int err = errno);

// Reads a whole (small) file; throws SandboxError with the path on failure.
std::string read_small_file(const std::filesystem::path& path);
// Writes `content` to an existing file (procfs, cgroupfs): one write call, checked.
void write_existing_file(const std::filesystem::path& path, std::string_view content);
// As above but returns errno instead of throwing (0 on success).
int try_write_existing_file(const std::filesystem::path& path, std::string_view content) noexcept;

// mkdir -p with a mode; existing directories are fine.
void make_directories(const std::filesystem::path& path, unsigned mode);

// A close-on-exec pipe; throws SandboxError naming `step` on failure.
struct Pipe {
    UniqueFd read_end;
    UniqueFd write_end;
};
Pipe make_pipe(std::string_view step);

// A random lowercase hex string (for unique names), from getrandom.
std::string random_hex(std::size_t bytes);

}  // namespace cellblock::sandbox::detail
