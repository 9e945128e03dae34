// Filesystem: the sandbox's root. The parent builds a skeleton directory (mount points, the policy's
// small files, symlinks) on the host; the child bind-mounts it as its root, mounts the policy's binds,
// tmpfs, proc and dev onto it, pivots into it and remounts it read-only.
#pragma once

#include <filesystem>
#include <string>

#include "cellblock/sandbox/sandbox.hpp"
#include "child.hpp"
#include "unique_fd.hpp"

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

// An owned template's share of its root skeleton <state_dir>/roots/<name> (with <name>.fingerprint): every
// template started under that name uses the one skeleton, and their lives overlap (a tenant's retired
// generation serves its last workers while the next one runs; during a gateway restart two template services
// of one tenant may each run one). Each holds a shared flock on <name>.lock for its life, and the last to let
// go (the only one that then gets the exclusive lock) removes the skeleton, its fingerprint and the lock
// file. Workers need no share: a template's fork enters the host's mount namespace before it clones
// (src/zygote_spawn.cpp) and roots itself in its own roots/<uid>, so the template's skeleton can go as soon
// as its last template has ended, while workers forked from it run on. A template nobody owns (a kernel
// without a supervisor starts it and lets it go) holds no share and removes nothing; its skeleton is reused
// by the next one, as its workspace is.
class SkeletonClaim {
  public:
    SkeletonClaim() = default;
    SkeletonClaim(SkeletonClaim&&) noexcept;
    SkeletonClaim& operator=(SkeletonClaim&&) noexcept;
    SkeletonClaim(const SkeletonClaim&) = delete;
    SkeletonClaim& operator=(const SkeletonClaim&) = delete;
    ~SkeletonClaim();

    // Before RootSkeleton::prepare: a last holder that is removing the skeleton finishes first.
    static SkeletonClaim acquire(const std::filesystem::path& state_dir, const std::string& name);

  private:
    SkeletonClaim(UniqueFd lock, std::filesystem::path skeleton) noexcept
        : lock_(std::move(lock)), skeleton_(std::move(skeleton)) {}
    void release() noexcept;
    UniqueFd lock_;
    std::filesystem::path skeleton_;
};

}  // namespace cellblock::sandbox::detail
