// A private (0700) directory removed with its contents on destruction: the kernel's ipc:// endpoints for
// xeus, and the worker workspace the kernel creates when the gateway did not provide one.
#pragma once

#include <filesystem>
#include <string>

namespace cellblock::kernel {

// sandbox::remove_tree (never follows a symlink the worker planted), logging instead of throwing: for exit
// paths and destructors.
void remove_tree_logged(const std::filesystem::path& directory) noexcept;

class PrivateDirectory {
  public:
    // Creates a fresh directory `prefix`XXXXXX under `parent` (mkdtemp, mode 0700). Throws on failure.
    PrivateDirectory(const std::filesystem::path& parent, const std::string& prefix);
    ~PrivateDirectory();
    PrivateDirectory(const PrivateDirectory&) = delete;
    PrivateDirectory& operator=(const PrivateDirectory&) = delete;

    const std::filesystem::path& path() const noexcept { return path_; }
    // Removes it now (idempotent); used on the exit path, where destructors do not run.
    void remove() noexcept;

  private:
    std::filesystem::path path_;
};

}  // namespace cellblock::kernel

namespace cellblock::kernel {

// Records, inside the kernel's private runtime directory, which process owns it and which private
// workspace it created, so that a later kernel can clean up after one that was SIGKILLed.
void write_owner_marker(const std::filesystem::path& runtime_dir, const std::filesystem::path& own_workspace);

// Removes `parent`/`prefix`* runtime directories (and the private workspaces they name) whose owner
// process is gone. Directories without a marker (a kernel still starting) are left alone.
void sweep_abandoned_kernel_dirs(const std::filesystem::path& parent, const std::string& prefix,
                                 const std::filesystem::path& keep);

}  // namespace cellblock::kernel
