#pragma once
// The gateway's state directory (--state-dir): 0700, held with an exclusive lock for the life of the process
// so that two gateways never adopt the same kernels, and holding the store and the kernels' runtime files:
//   lock            flock'ed; holds the owner's pid for the error message of a second gateway
//   store.sqlite3   the SessionStore (0600: it holds HMAC keys)
//   run/            connection files and ipc:// sockets of kernels (kept across restarts for re-adoption)
//   workspaces/     per-kernel workspaces unless --workspace-root says otherwise
#include <filesystem>
#include <string>

namespace cellblock::gateway {

class StateDirectory {
  public:
    // Creates and locks `path`; throws std::runtime_error with a message for the operator when another
    // gateway holds it or it cannot be created.
    explicit StateDirectory(std::filesystem::path path);
    ~StateDirectory();
    StateDirectory(const StateDirectory&) = delete;
    StateDirectory& operator=(const StateDirectory&) = delete;

    const std::filesystem::path& path() const { return path_; }
    std::filesystem::path store_file() const { return path_ / "store.sqlite3"; }
    std::filesystem::path runtime_dir() const { return path_ / "run"; }
    std::filesystem::path workspaces_dir() const { return path_ / "workspaces"; }

    // $XDG_STATE_HOME/cellblock, else ~/.local/state/cellblock; empty when neither is known.
    static std::filesystem::path default_path();

  private:
    std::filesystem::path path_;
    int lock_fd_ = -1;
};

}  // namespace cellblock::gateway
