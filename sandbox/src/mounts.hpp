// Filesystem: the sandbox's root. The parent builds a skeleton directory (mount points, the policy's
// small files, symlinks) on the host; the child bind-mounts it as its root, mounts the policy's binds,
// tmpfs, proc and dev onto it, pivots into it and remounts it read-only.
#pragma once

#include <filesystem>
#include <string>

#include "cellblock/sandbox/sandbox.hpp"
#include "child.hpp"

namespace cellblock::sandbox::detail {

// The skeleton directory of one leased uid: <state_dir>/roots/<uid>. It holds no mounts on the host
// side (they live in the sandbox's mount namespace) and nothing the sandbox can change (it is bound
// read-only), so it is kept and reused by the next launch with the same uid and the same policy
// mounts (a fingerprint file next to it records which); deleting a tree on ext4 costs tens of ms.
class RootSkeleton {
  public:
    RootSkeleton() = default;
    RootSkeleton(RootSkeleton&&) noexcept;
    RootSkeleton& operator=(RootSkeleton&&) noexcept;
    RootSkeleton(const RootSkeleton&) = delete;
    RootSkeleton& operator=(const RootSkeleton&) = delete;
    ~RootSkeleton();

    // Creates (or reuses) <state_dir>/roots/<name> with every mount point the policy needs, and fills
    // plan.mounts_before_pivot / new_root / mounts_after_pivot to mount them and the workspace.
    static RootSkeleton prepare(const Policy& policy, const std::string& name,
                                const std::filesystem::path& workspace, StepNames& steps, ChildPlan& plan);
    const std::filesystem::path& path() const noexcept { return path_; }

  private:
    explicit RootSkeleton(std::filesystem::path path) : path_(std::move(path)) {}
    void remove() noexcept;
    std::filesystem::path path_;
};

}  // namespace cellblock::sandbox::detail
