#include "cellblock/gateway/kernels/state_directory.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

namespace cellblock::gateway {

namespace fs = std::filesystem;

namespace {
void make_private_directory(const fs::path& path) {
    if (::mkdir(path.c_str(), 0700) != 0 && errno != EEXIST)
        throw std::runtime_error("cannot create state directory " + path.string() + ": " +
                                 std::strerror(errno));
    struct stat status {};
    if (::lstat(path.c_str(), &status) != 0 || !S_ISDIR(status.st_mode))
        throw std::runtime_error("state directory " + path.string() + " is not a directory");
    if (::chmod(path.c_str(), 0700) != 0)
        throw std::runtime_error("cannot chmod 0700 " + path.string() + ": " + std::strerror(errno));
}
}  // namespace

fs::path StateDirectory::default_path() {
    if (const char* state = std::getenv("XDG_STATE_HOME"); state && *state)
        return fs::path(state) / "cellblock";
    if (const char* home = std::getenv("HOME"); home && *home)
        return fs::path(home) / ".local" / "state" / "cellblock";
    return {};
}

StateDirectory::StateDirectory(fs::path path) : path_(std::move(path)) {
    if (path_.empty())
        throw std::runtime_error("no state directory: set --state-dir (or HOME / XDG_STATE_HOME)");
    std::error_code error;
    fs::create_directories(path_.parent_path(), error);
    make_private_directory(path_);
    const fs::path lock_file = path_ / "lock";
    lock_fd_ = ::open(lock_file.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (lock_fd_ < 0)
        throw std::runtime_error("cannot open " + lock_file.string() + ": " + std::strerror(errno));
    if (::flock(lock_fd_, LOCK_EX | LOCK_NB) != 0) {
        const int saved = errno;
        char owner[32] = {};
        const ssize_t got = ::pread(lock_fd_, owner, sizeof owner - 1, 0);
        ::close(lock_fd_);
        lock_fd_ = -1;
        if (saved == EWOULDBLOCK) {
            std::string pid = got > 0 ? std::string(owner, static_cast<std::size_t>(got)) : "";
            while (!pid.empty() && (pid.back() == '\n' || pid.back() == ' '))
                pid.pop_back();
            throw std::runtime_error("another cellblock-gateway" + (pid.empty() ? "" : " (pid " + pid + ")") +
                                     " is using the state directory " + path_.string() +
                                     "; stop it first, or give this one its own --state-dir");
        }
        throw std::runtime_error("cannot lock " + lock_file.string() + ": " + std::strerror(saved));
    }
    const std::string pid = std::to_string(::getpid()) + "\n";
    if (::ftruncate(lock_fd_, 0) != 0 || ::pwrite(lock_fd_, pid.data(), pid.size(), 0) < 0)
        throw std::runtime_error("cannot write " + lock_file.string() + ": " + std::strerror(errno));
    make_private_directory(runtime_dir());
    make_private_directory(workspaces_dir());
}

StateDirectory::~StateDirectory() {
    if (lock_fd_ >= 0)
        ::close(lock_fd_);
}

}  // namespace cellblock::gateway
