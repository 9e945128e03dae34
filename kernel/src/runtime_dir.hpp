// A private (0700) directory removed with its contents on destruction: the kernel's ipc:// endpoints for
// xeus, and the worker workspace the kernel creates when the gateway did not provide one.
#pragma once

#include <filesystem>
#include <string>

namespace cellblock::kernel {

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
