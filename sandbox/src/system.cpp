#include "system.hpp"

#include <fcntl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <cstring>

namespace cellblock::sandbox::detail {

void throw_errno(std::string_view step, int err) {
    throw SandboxError(std::string(step) + ": " + std::strerror(err));
}

Pipe make_pipe(std::string_view step) {
    int ends[2];
    if (::pipe2(ends, O_CLOEXEC) != 0) {
        throw_errno(step);
    }
    return {UniqueFd(ends[0]), UniqueFd(ends[1])};
}

std::string read_small_file(const std::filesystem::path& path) {
    UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY));
    if (!fd) {
        throw_errno("open " + path.string());
    }
    std::string content;
    std::array<char, 4096> buffer{};
    for (;;) {
        const ssize_t got = ::read(fd.get(), buffer.data(), buffer.size());
        if (got < 0) {
            if (errno == EINTR) {
                continue;
            }
            throw_errno("read " + path.string());
        }
        if (got == 0) {
            break;
        }
        content.append(buffer.data(), static_cast<std::size_t>(got));
        if (content.size() > (1U << 20)) {
            throw SandboxError("read " + path.string() + ": file too large");
        }
    }
    return content;
}

int try_write_existing_file(const std::filesystem::path& path, std::string_view content) noexcept {
    UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CLOEXEC | O_NOCTTY));
    if (!fd) {
        return errno;
    }
    const ssize_t written = ::write(fd.get(), content.data(), content.size());
    if (written < 0) {
        return errno;
    }
    if (static_cast<std::size_t>(written) != content.size()) {
        return EIO;
    }
    return 0;
}

void write_existing_file(const std::filesystem::path& path, std::string_view content) {
    if (const int err = try_write_existing_file(path, content); err != 0) {
        throw_errno("write " + path.string() + " '" + std::string(content.substr(0, 40)) + "'", err);
    }
}

void make_directories(const std::filesystem::path& path, unsigned mode) {
    if (::mkdir(path.c_str(), mode) == 0 || errno == EEXIST) {
        return;
    }
    if (errno != ENOENT || !path.has_relative_path() || path.parent_path() == path) {
        throw_errno("mkdir " + path.string());
    }
    make_directories(path.parent_path(), mode);
    if (::mkdir(path.c_str(), mode) != 0 && errno != EEXIST) {
        throw_errno("mkdir " + path.string());
    }
}

std::string random_hex(std::size_t bytes) {
    std::string raw(bytes, '\0');
    std::size_t filled = 0;
    while (filled < bytes) {
        const ssize_t got = ::getrandom(raw.data() + filled, bytes - filled, 0);
        if (got < 0) {
            if (errno == EINTR) {
                continue;
            }
            throw_errno("getrandom");
        }
        filled += static_cast<std::size_t>(got);
    }
    static constexpr char digits[] = "0123456789abcdef";
    std::string hex;
    hex.reserve(bytes * 2);
    for (const char c : raw) {
        const auto byte = static_cast<unsigned char>(c);
        hex.push_back(digits[byte >> 4]);
        hex.push_back(digits[byte & 0xf]);
    }
    return hex;
}

}  // namespace cellblock::sandbox::detail
