#include "mounts.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <system_error>

#include "system.hpp"
#include "unique_fd.hpp"

namespace cellblock::sandbox::detail {
namespace {

namespace fs = std::filesystem;

// Device nodes bound from the host /dev; everything else in /dev is absent.
constexpr const char* device_nodes[] = {"null", "zero", "full", "random", "urandom", "tty"};
constexpr std::pair<const char*, const char*> device_links[] = {{"fd", "/proc/self/fd"},
                                                                {"stdin", "/proc/self/fd/0"},
                                                                {"stdout", "/proc/self/fd/1"},
                                                                {"stderr", "/proc/self/fd/2"}};
constexpr std::uint64_t default_shm_bytes = 64ULL << 20;

fs::path inside(const fs::path& root, const std::string& target) {
    return root / fs::path(target).relative_path();
}

void make_empty_file(const fs::path& path) {
    make_directories(path.parent_path(), 0755);
    UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644));
    if (!fd) {
        throw_errno("root skeleton: create " + path.string());
    }
}

void write_file(const fs::path& path, const std::string& content) {
    make_directories(path.parent_path(), 0755);
    UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0644));
    if (!fd) {
        throw_errno("root skeleton: create " + path.string());
    }
    std::size_t done = 0;
    while (done < content.size()) {
        const ssize_t written = ::write(fd.get(), content.data() + done, content.size() - done);
        if (written < 0) {
            throw_errno("root skeleton: write " + path.string());
        }
        done += static_cast<std::size_t>(written);
    }
}

void make_symlink(const fs::path& path, const std::string& text) {
    make_directories(path.parent_path(), 0755);
    if (::symlink(text.c_str(), path.c_str()) != 0) {
        throw_errno("root skeleton: symlink " + path.string());
    }
}

MountOp mount_op(StepNames& steps, const std::string& what, std::string source, std::string target,
                 std::string fstype, unsigned long flags, std::string data) {
    MountOp op;
    op.action = MountOp::Action::mount;
    op.step = steps.add(what);
    op.has_source = !source.empty();
    op.has_fstype = !fstype.empty();
    op.has_data = !data.empty();
    op.source = std::move(source);
    op.target = std::move(target);
    op.fstype = std::move(fstype);
    op.flags = flags;
    op.data = std::move(data);
    return op;
}

MountOp remount_op(StepNames& steps, const std::string& what, std::string target, unsigned long flags) {
    MountOp op;
    op.action = MountOp::Action::remount_bind;
    op.step = steps.add(what);
    op.target = std::move(target);
    op.flags = flags;
    return op;
}

// A bind and the remount that gives it its flags (a bind ignores flags other than MS_REC).
void add_bind(std::vector<MountOp>& ops, StepNames& steps, const std::string& source, const fs::path& target,
              const std::string& shown, unsigned long flags) {
    ops.push_back(mount_op(steps, "mount " + shown, source, target, "", MS_BIND, ""));
    ops.push_back(remount_op(steps, "remount " + shown, target, flags));
}

std::string tmpfs_options(std::uint64_t size, const char* mode) {
    std::string data = std::string("mode=") + mode;
    if (size > 0) {
        data += ",size=" + std::to_string(size);
    }
    return data;
}

}  // namespace

RootSkeleton::RootSkeleton(RootSkeleton&& other) noexcept : path_(std::move(other.path_)) {
    other.path_.clear();
}

RootSkeleton& RootSkeleton::operator=(RootSkeleton&& other) noexcept {
    if (this != &other) {
        remove();
        path_ = std::move(other.path_);
        other.path_.clear();
    }
    return *this;
}

RootSkeleton::~RootSkeleton() {
    remove();
}

void RootSkeleton::remove() noexcept {
    // Kept for the next launch with this uid (see the class comment); only forget it.
    path_.clear();
}

SkeletonClaim::SkeletonClaim(SkeletonClaim&& other) noexcept
    : lock_(std::move(other.lock_)), skeleton_(std::move(other.skeleton_)) {}

SkeletonClaim& SkeletonClaim::operator=(SkeletonClaim&& other) noexcept {
    if (this != &other) {
        release();
        lock_ = std::move(other.lock_);
        skeleton_ = std::move(other.skeleton_);
    }
    return *this;
}

SkeletonClaim::~SkeletonClaim() {
    release();
}

SkeletonClaim SkeletonClaim::acquire(const fs::path& state_dir, const std::string& name) {
    const auto roots = state_dir / "roots";
    make_directories(roots, 0711);
    const auto lock_path = roots / (name + ".lock");
    for (;;) {
        UniqueFd lock(::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600));
        if (!lock) {
            throw_errno("root skeleton: open " + lock_path.string());
        }
        while (::flock(lock.get(), LOCK_SH) != 0) {
            if (errno != EINTR) {
                throw_errno("root skeleton: flock " + lock_path.string());
            }
        }
        // The last holder unlinks the file under its exclusive lock: a file we opened before that and locked
        // after it is no longer the one the next template finds, so take the one there now.
        struct stat held {};
        struct stat named {};
        if (::fstat(lock.get(), &held) != 0) {
            throw_errno("root skeleton: fstat " + lock_path.string());
        }
        if (::lstat(lock_path.c_str(), &named) == 0 && named.st_dev == held.st_dev &&
            named.st_ino == held.st_ino) {
            return SkeletonClaim(std::move(lock), roots / name);
        }
    }
}

void SkeletonClaim::release() noexcept {
    if (!lock_) {
        return;
    }
    // The conversion drops our shared lock and takes the exclusive one only if no other holder is left (one
    // step under the file's lock list); a holder that fails has let go, so of several that end at once the
    // last one removes.
    if (::flock(lock_.get(), LOCK_EX | LOCK_NB) == 0) {
        std::error_code ignored;
        // The fingerprint first: a skeleton without it is rebuilt, never taken as whole.
        fs::remove(skeleton_.string() + ".fingerprint", ignored);
        fs::remove_all(skeleton_, ignored);
        fs::remove(skeleton_.string() + ".lock", ignored);
    }
    lock_.reset();
    skeleton_.clear();
}

namespace {

// FNV-1a: a stable fingerprint of everything that shapes the skeleton.
std::string fingerprint_of(const Policy& policy) {
    std::string text = policy.workspace_target + '\n';
    for (const auto& spec : policy.mounts) {
        text += std::to_string(static_cast<int>(spec.kind)) + '\x1f' + spec.source + '\x1f' + spec.target +
                '\x1f' + spec.content + '\x1f' + std::to_string(spec.size_bytes) + '\x1f';
        if (spec.kind == MountSpec::Kind::bind) {
            // Whether an optional source exists decides whether its mount point is there.
            struct stat info {};
            const bool exists = ::stat(spec.source.c_str(), &info) == 0;
            text += exists ? (S_ISDIR(info.st_mode) ? "d" : "f") : "-";
        }
        text += '\n';
    }
    std::uint64_t hash = 1469598103934665603ULL;
    for (const char c : text) {
        hash ^= static_cast<unsigned char>(c);
        hash *= 1099511628211ULL;
    }
    return std::to_string(hash) + "\n";
}

bool file_equals(const fs::path& path, const std::string& expected) {
    try {
        return read_small_file(path) == expected;
    } catch (const SandboxError&) {
        return false;
    }
}

}  // namespace

RootSkeleton RootSkeleton::prepare(const Policy& policy, const std::string& name, const fs::path& workspace,
                                   StepNames& steps, ChildPlan& plan) {
    const auto roots = policy.state_dir / "roots";
    make_directories(roots, 0711);
    RootSkeleton skeleton(roots / name);
    const auto& root = skeleton.path_;
    const auto fingerprint_file = roots / (name + ".fingerprint");
    const auto fingerprint = fingerprint_of(policy);
    // Reuse the skeleton the previous holder of this uid left, if it was built for the same mounts.
    const bool build = !file_equals(fingerprint_file, fingerprint);
    if (build) {
        std::error_code ignored;
        fs::remove(fingerprint_file, ignored);
        fs::remove_all(root, ignored);
        if (::mkdir(root.c_str(), 0755) != 0) {
            throw_errno("root skeleton: mkdir " + root.string());
        }
    }

    auto& ops = plan.mounts_before_pivot;
    // Nothing we mount may propagate back to the host.
    ops.push_back(mount_op(steps, "make / private (MS_PRIVATE)", "", "/", "", MS_REC | MS_PRIVATE, ""));
    ops.push_back(
        mount_op(steps, "bind the new root " + root.string(), root.string(), root.string(), "", MS_BIND, ""));

    for (const auto& spec : policy.mounts) {
        const auto target = inside(root, spec.target);
        switch (spec.kind) {
            case MountSpec::Kind::bind: {
                struct stat source_info {};
                if (::stat(spec.source.c_str(), &source_info) != 0) {
                    if (spec.optional && errno == ENOENT) {
                        break;
                    }
                    throw_errno("bind source " + spec.source);
                }
                if (build && S_ISDIR(source_info.st_mode)) {
                    make_directories(target, 0755);
                } else if (build) {
                    make_empty_file(target);
                }
                unsigned long flags = MS_NOSUID | MS_NODEV;
                if (!spec.writable) {
                    flags |= MS_RDONLY;
                }
                add_bind(ops, steps, spec.source, target, spec.target, flags);
                break;
            }
            case MountSpec::Kind::tmpfs: {
                if (build) {
                    make_directories(target, 0755);
                }
                unsigned long flags = MS_NOSUID | MS_NODEV;
                if (!spec.writable) {
                    flags |= MS_RDONLY;
                }
                ops.push_back(mount_op(steps, "mount tmpfs " + spec.target, "tmpfs", target, "tmpfs", flags,
                                       tmpfs_options(spec.size_bytes, spec.writable ? "1777" : "0755")));
                break;
            }
            case MountSpec::Kind::proc:
                if (build) {
                    make_directories(target, 0555);
                }
                // A fresh proc of the sandbox's own pid namespace, read-only.
                ops.push_back(mount_op(steps, "mount proc " + spec.target, "proc", target, "proc",
                                       MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY, ""));
                break;
            case MountSpec::Kind::dev: {
                if (build) {
                    make_directories(target, 0755);
                }
                for (const char* node : device_nodes) {
                    if (build) {
                        make_empty_file(target / node);
                    }
                    add_bind(ops, steps, std::string("/dev/") + node, target / node, spec.target + "/" + node,
                             MS_NOSUID | MS_NOEXEC);
                }
                if (build) {
                    for (const auto& [link, text] : device_links) {
                        make_symlink(target / link, text);
                    }
                    make_directories(target / "shm", 0755);
                }
                ops.push_back(
                    mount_op(steps, "mount tmpfs " + spec.target + "/shm", "tmpfs", target / "shm", "tmpfs",
                             MS_NOSUID | MS_NODEV | MS_NOEXEC,
                             tmpfs_options(spec.size_bytes ? spec.size_bytes : default_shm_bytes, "1777")));
                break;
            }
            case MountSpec::Kind::file:
                if (build) {
                    write_file(target, spec.content);
                }
                break;
            case MountSpec::Kind::symlink:
                if (build) {
                    make_symlink(target, spec.source);
                }
                break;
        }
    }

    // The workspace: the only writable host directory; no setuid binaries or devices from it.
    const auto workspace_target = inside(root, policy.workspace_target);
    if (build) {
        make_directories(workspace_target, 0755);
        // Written last: a half-built skeleton (a crash, an error above) is rebuilt next time.
        write_file(fingerprint_file, fingerprint);
    }
    add_bind(ops, steps, workspace.string(), workspace_target, policy.workspace_target + " (workspace)",
             MS_NOSUID | MS_NODEV);

    plan.new_root = root.string();
    plan.step_chdir_root = steps.add("chdir to the new root");
    plan.step_pivot = steps.add("pivot_root");
    plan.step_umount_old = steps.add("unmount the old root");
    plan.mounts_after_pivot.push_back(
        remount_op(steps, "remount / read-only", "/", MS_RDONLY | MS_NOSUID | MS_NODEV));
    return skeleton;
}

}  // namespace cellblock::sandbox::detail
