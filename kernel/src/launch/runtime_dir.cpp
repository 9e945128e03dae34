#include "launch/runtime_dir.hpp"

#include <sys/stat.h>

#include <cellblock/sandbox/sandbox.hpp>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <system_error>
#include <vector>

#include "common/logging.hpp"

namespace cellblock::kernel {

void remove_tree_logged(const std::filesystem::path& directory) noexcept {
    try {
        sandbox::remove_tree(directory);
    } catch (const std::exception& error) {
        log_event(LogLevel::warning, "directory_not_removed",
                  {{"path", directory.string()}, {"error", error.what()}});
    }
}

PrivateDirectory::PrivateDirectory(const std::filesystem::path& parent, const std::string& prefix) {
    std::string pattern = (parent / (prefix + "XXXXXX")).string();
    std::vector<char> buffer(pattern.begin(), pattern.end());
    buffer.push_back('\0');
    if (::mkdtemp(buffer.data()) == nullptr) {
        throw std::runtime_error("cannot create a private directory in " + parent.string() + ": " +
                                 std::strerror(errno));
    }
    path_ = buffer.data();
}

PrivateDirectory::~PrivateDirectory() {
    remove();
}

void PrivateDirectory::remove() noexcept {
    if (path_.empty()) {
        return;
    }
    remove_tree_logged(path_);
    path_.clear();
}

}  // namespace cellblock::kernel

#include <signal.h>
#include <unistd.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "common/logging.hpp"

namespace cellblock::kernel {
namespace {

constexpr const char* owner_file = "owner.json";

bool process_gone(pid_t pid) {
    return pid > 0 && ::kill(pid, 0) != 0 && errno == ESRCH;
}

// Only directories the kernel itself names private workspaces may be removed on its behalf.
bool is_private_workspace_name(const std::filesystem::path& path) {
    const std::string name = path.filename().string();
    return path.is_absolute() &&
           (name.rfind("kernel-", 0) == 0 || name.rfind("cellblock-workspace-", 0) == 0);
}

}  // namespace

void write_owner_marker(const std::filesystem::path& runtime_dir,
                        const std::filesystem::path& own_workspace) {
    const nlohmann::json marker = {{"pid", ::getpid()}, {"workspace", own_workspace.string()}};
    std::ofstream(runtime_dir / owner_file) << marker.dump();
}

void sweep_abandoned_kernel_dirs(const std::filesystem::path& parent, const std::string& prefix,
                                 const std::filesystem::path& keep) {
    std::error_code error;
    for (const auto& entry : std::filesystem::directory_iterator(parent, error)) {
        const auto& path = entry.path();
        if (path == keep || path.filename().string().rfind(prefix, 0) != 0) {
            continue;
        }
        struct stat info {};
        // Ours only: a directory (not a symlink) owned by this uid.
        if (::lstat(path.c_str(), &info) != 0 || !S_ISDIR(info.st_mode) || info.st_uid != ::geteuid()) {
            continue;
        }
        std::ifstream input(path / owner_file);
        if (!input) {
            continue;
        }
        const auto marker = nlohmann::json::parse(input, nullptr, false);
        if (!marker.is_object() || !marker.contains("pid") || !marker["pid"].is_number_integer()) {
            continue;
        }
        if (!process_gone(marker["pid"].get<pid_t>())) {
            continue;
        }
        const std::filesystem::path workspace = marker.value("workspace", std::string());
        if (!workspace.empty() && is_private_workspace_name(workspace)) {
            remove_tree_logged(workspace);
        }
        remove_tree_logged(path);
        log_event(LogLevel::info, "swept_abandoned_kernel_dir",
                  {{"path", path.string()}, {"workspace", workspace.string()}});
    }
}

}  // namespace cellblock::kernel
