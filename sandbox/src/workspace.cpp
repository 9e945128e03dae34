// Workspace: host-side access to a directory that untrusted code also writes. Every path is resolved
// with openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS) from the root's fd, so a
// planted symlink, a ".." or a bind mount cannot lead outside; only regular, singly-linked files are
// read, without blocking (a planted FIFO), and with a size cap. remove_tree lives here too: the one
// no-follow recursive removal, for workspaces and the other directories untrusted code wrote into.
#include <dirent.h>
#include <fcntl.h>
#include <linux/openat2.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <vector>

#include "cellblock/sandbox/sandbox.hpp"
#include "system.hpp"
#include "unique_fd.hpp"

namespace cellblock::sandbox {
namespace {

using detail::UniqueFd;
using Kind = WorkspaceError::Kind;

constexpr std::uint64_t resolve_flags = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS;

[[noreturn]] void fail(Kind kind, const std::string& relative, const std::string& what) {
    throw WorkspaceError(kind, "workspace: " + relative + ": " + what);
}

[[noreturn]] void fail_errno(const std::string& relative, const std::string& action, int err) {
    Kind kind = Kind::io;
    std::string what = action + ": " + std::strerror(err);
    switch (err) {
        case ENOENT:
            kind = Kind::not_found;
            what = "no such file";
            break;
        case ELOOP:
            kind = Kind::bad_path;
            what = "refusing to follow a symbolic link";
            break;
        case EXDEV:
            kind = Kind::bad_path;
            what = "path leaves the workspace";
            break;
        case ENOTDIR:
            kind = Kind::not_found;
            what = "a parent is not a directory";
            break;
        case ENXIO:
            kind = Kind::not_regular;
            what = "not a regular file";
            break;
        case EISDIR:
            kind = Kind::not_regular;
            what = "is a directory";
            break;
        case EFBIG:
            kind = Kind::too_large;
            what = "file too large";
            break;
        default:
            break;
    }
    fail(kind, relative, what);
}

// A relative, '/'-separated path without empty, "." or ".." components (and no NUL).
std::string checked_relative(const std::string& relative) {
    if (relative.empty()) {
        fail(Kind::bad_path, "(empty)", "empty path");
    }
    if (relative.front() == '/') {
        fail(Kind::bad_path, relative, "must be relative to the workspace");
    }
    if (relative.find('\0') != std::string::npos) {
        fail(Kind::bad_path, "(binary)", "path contains a NUL byte");
    }
    if (relative.size() > 4096) {
        fail(Kind::bad_path, relative.substr(0, 64) + "...", "path too long");
    }
    std::size_t start = 0;
    while (start <= relative.size()) {
        const auto end = std::min(relative.find('/', start), relative.size());
        const auto part = relative.substr(start, end - start);
        if (part.empty() || part == "." || part == "..") {
            fail(Kind::bad_path, relative, "empty, '.' or '..' component");
        }
        start = end + 1;
    }
    return relative;
}

int openat2_beneath(int dir_fd, const std::string& path, std::uint64_t flags, mode_t mode = 0) {
    open_how how{};
    how.flags = flags | O_CLOEXEC | O_NOCTTY;
    how.mode = (flags & O_CREAT) ? mode : 0;
    how.resolve = resolve_flags;
    long fd;
    do {
        fd = ::syscall(SYS_openat2, dir_fd, path.c_str(), &how, sizeof how);
    } while (fd < 0 && errno == EAGAIN);  // RESOLVE_* may ask to retry after a concurrent rename
    return static_cast<int>(fd);
}

std::pair<std::string, std::string> split_parent(const std::string& relative) {
    const auto slash = relative.rfind('/');
    if (slash == std::string::npos) {
        return {"", relative};
    }
    return {relative.substr(0, slash), relative.substr(slash + 1)};
}

}  // namespace

Workspace::Workspace(const std::filesystem::path& root) : root_(root) {
    root_fd_ = ::open(root.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (root_fd_ < 0) {
        const int err = errno;
        throw WorkspaceError(err == ENOENT ? Kind::not_found : Kind::io,
                             "workspace: open " + root.string() + ": " + std::strerror(err));
    }
}

Workspace::Workspace(Workspace&& other) noexcept
    : root_(std::move(other.root_)), root_fd_(std::exchange(other.root_fd_, -1)) {}

Workspace& Workspace::operator=(Workspace&& other) noexcept {
    if (this != &other) {
        if (root_fd_ >= 0) {
            ::close(root_fd_);
        }
        root_ = std::move(other.root_);
        root_fd_ = std::exchange(other.root_fd_, -1);
    }
    return *this;
}

Workspace::~Workspace() {
    if (root_fd_ >= 0) {
        ::close(root_fd_);
    }
}

const std::filesystem::path& Workspace::root() const noexcept {
    return root_;
}

std::string Workspace::read_file(const std::string& relative, std::uint64_t max_bytes) const {
    checked_relative(relative);
    // O_NONBLOCK: opening a planted FIFO must not wait for a writer.
    UniqueFd fd(openat2_beneath(root_fd_, relative, O_RDONLY | O_NONBLOCK | O_NOFOLLOW));
    if (!fd) {
        fail_errno(relative, "open", errno);
    }
    struct stat info {};
    if (::fstat(fd.get(), &info) != 0) {
        fail_errno(relative, "stat", errno);
    }
    if (S_ISDIR(info.st_mode)) {
        fail(Kind::not_regular, relative, "is a directory");
    }
    if (!S_ISREG(info.st_mode)) {
        fail(Kind::not_regular, relative, "not a regular file");
    }
    if (info.st_nlink != 1) {
        fail(Kind::not_regular, relative, "refusing a file with several hard links");
    }
    if (static_cast<std::uint64_t>(info.st_size) > max_bytes) {
        fail(Kind::too_large, relative,
             std::to_string(info.st_size) + " bytes exceeds the limit of " + std::to_string(max_bytes));
    }
    std::string content;
    content.resize(static_cast<std::size_t>(info.st_size));
    std::size_t done = 0;
    for (;;) {
        if (done == content.size()) {
            // The file may grow while we read: allow up to the cap, and no further.
            if (content.size() >= max_bytes) {
                char probe;
                const ssize_t more = ::read(fd.get(), &probe, 1);
                if (more > 0) {
                    fail(Kind::too_large, relative,
                         "exceeds the limit of " + std::to_string(max_bytes) + " bytes");
                }
                break;
            }
            content.resize(std::min<std::uint64_t>(max_bytes, content.size() + 65536));
        }
        const ssize_t got = ::read(fd.get(), content.data() + done, content.size() - done);
        if (got < 0) {
            if (errno == EINTR) {
                continue;
            }
            fail_errno(relative, "read", errno);
        }
        if (got == 0) {
            break;
        }
        done += static_cast<std::size_t>(got);
    }
    content.resize(done);
    return content;
}

void Workspace::write_file(const std::string& relative, std::string_view bytes,
                           std::uint64_t max_bytes) const {
    checked_relative(relative);
    if (bytes.size() > max_bytes) {
        fail(Kind::too_large, relative,
             std::to_string(bytes.size()) + " bytes exceeds the limit of " + std::to_string(max_bytes));
    }
    struct stat root_info {};
    if (::fstat(root_fd_, &root_info) != 0) {
        fail_errno(relative, "stat the workspace", errno);
    }
    const auto [parent, name] = split_parent(relative);

    // Create missing parents one component at a time, each beneath the root, owned like the root.
    UniqueFd parent_fd(::dup(root_fd_));
    if (!parent_fd) {
        fail_errno(relative, "dup", errno);
    }
    if (!parent.empty()) {
        std::size_t start = 0;
        while (start < parent.size()) {
            const auto end = std::min(parent.find('/', start), parent.size());
            const auto component = parent.substr(start, end - start);
            if (::mkdirat(parent_fd.get(), component.c_str(), 0755) == 0) {
                if (::fchownat(parent_fd.get(), component.c_str(), root_info.st_uid, root_info.st_gid,
                               AT_SYMLINK_NOFOLLOW) != 0) {
                    fail_errno(relative, "chown directory " + component, errno);
                }
            } else if (errno != EEXIST) {
                fail_errno(relative, "mkdir " + component, errno);
            }
            UniqueFd next(openat2_beneath(parent_fd.get(), component, O_RDONLY | O_DIRECTORY | O_NOFOLLOW));
            if (!next && (errno == ENOTDIR || errno == ELOOP)) {
                // A symlink (or a file) where a directory should be: never write through it.
                fail(Kind::bad_path, relative,
                     "'" + component + "' is not a directory (refusing symbolic links)");
            }
            if (!next) {
                fail_errno(relative, "open directory " + component, errno);
            }
            parent_fd = std::move(next);
            start = end + 1;
        }
    }
    struct stat existing {};
    if (::fstatat(parent_fd.get(), name.c_str(), &existing, AT_SYMLINK_NOFOLLOW) == 0) {
        if (S_ISDIR(existing.st_mode)) {
            fail(Kind::not_regular, relative, "is a directory");
        }
        if (!S_ISREG(existing.st_mode)) {
            fail(Kind::not_regular, relative, "exists and is not a regular file");
        }
    } else if (errno != ENOENT) {
        fail_errno(relative, "stat", errno);
    }
    // Write a new file and rename it over the old one: nothing is written through an existing inode
    // (which untrusted code may have hard-linked), and readers never see a half-written file.
    const std::string temporary = "." + name + ".cellblock-" + detail::random_hex(6);
    UniqueFd fd(openat2_beneath(parent_fd.get(), temporary, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW, 0644));
    if (!fd) {
        fail_errno(relative, "create", errno);
    }
    auto discard = [&] { ::unlinkat(parent_fd.get(), temporary.c_str(), 0); };
    std::size_t done = 0;
    while (done < bytes.size()) {
        const ssize_t written = ::write(fd.get(), bytes.data() + done, bytes.size() - done);
        if (written < 0) {
            if (errno == EINTR) {
                continue;
            }
            const int err = errno;
            discard();
            fail_errno(relative, "write", err);
        }
        done += static_cast<std::size_t>(written);
    }
    if (::fchown(fd.get(), root_info.st_uid, root_info.st_gid) != 0) {
        const int err = errno;
        discard();
        fail_errno(relative, "chown", err);
    }
    if (::renameat(parent_fd.get(), temporary.c_str(), parent_fd.get(), name.c_str()) != 0) {
        const int err = errno;
        discard();
        fail_errno(relative, "rename into place", err);
    }
}

void Workspace::remove_file(const std::string& relative) const {
    checked_relative(relative);
    const auto [parent, name] = split_parent(relative);
    UniqueFd parent_fd(parent.empty()
                           ? ::dup(root_fd_)
                           : openat2_beneath(root_fd_, parent, O_RDONLY | O_DIRECTORY | O_NOFOLLOW));
    if (!parent_fd) {
        fail_errno(relative, "open parent", errno);
    }
    struct stat info {};
    if (::fstatat(parent_fd.get(), name.c_str(), &info, AT_SYMLINK_NOFOLLOW) != 0) {
        fail_errno(relative, "stat", errno);
    }
    if (S_ISDIR(info.st_mode)) {
        fail(Kind::not_regular, relative, "is a directory");
    }
    // Removing a name (even of a symlink or FIFO) never touches what it points to.
    if (::unlinkat(parent_fd.get(), name.c_str(), 0) != 0) {
        fail_errno(relative, "unlink", errno);
    }
}

std::vector<Workspace::Entry> Workspace::list(std::size_t max_entries) const {
    std::vector<Entry> entries;
    struct Pending {
        UniqueFd fd;
        std::string prefix;
        int depth;
    };
    std::vector<Pending> pending;
    pending.push_back({UniqueFd(::dup(root_fd_)), "", 0});
    if (!pending.back().fd) {
        fail_errno(".", "dup", errno);
    }
    while (!pending.empty() && entries.size() < max_entries) {
        Pending current = std::move(pending.back());
        pending.pop_back();
        const int listing_fd = ::dup(current.fd.get());
        if (listing_fd < 0) {
            fail_errno(current.prefix, "dup", errno);
        }
        std::unique_ptr<DIR, int (*)(DIR*)> listing(::fdopendir(listing_fd), ::closedir);
        if (!listing) {
            ::close(listing_fd);
            fail_errno(current.prefix.empty() ? "." : current.prefix, "read directory", errno);
        }
        ::rewinddir(listing.get());
        while (dirent* entry = ::readdir(listing.get())) {
            if (std::strcmp(entry->d_name, ".") == 0 || std::strcmp(entry->d_name, "..") == 0) {
                continue;
            }
            if (entries.size() >= max_entries) {
                break;
            }
            struct stat info {};
            if (::fstatat(current.fd.get(), entry->d_name, &info, AT_SYMLINK_NOFOLLOW) != 0) {
                continue;
            }
            const std::string path = current.prefix + entry->d_name;
            // Only what a reader could use: directories and regular files. Symlinks, FIFOs, sockets
            // and devices are left out.
            if (S_ISDIR(info.st_mode)) {
                entries.push_back({path, 0, true});
                if (current.depth < 32) {
                    UniqueFd child(openat2_beneath(current.fd.get(), entry->d_name,
                                                   O_RDONLY | O_DIRECTORY | O_NOFOLLOW));
                    if (child) {
                        pending.push_back({std::move(child), path + "/", current.depth + 1});
                    }
                }
            } else if (S_ISREG(info.st_mode)) {
                entries.push_back({path, static_cast<std::uint64_t>(info.st_size), false});
            }
        }
    }
    return entries;
}

namespace {

struct NodeIdentity {
    dev_t device = 0;
    ino_t inode = 0;
    std::uint64_t mount_id = 0;
    bool has_mount_id = false;
    mode_t mode = 0;
    uid_t owner = 0;
    nlink_t links = 0;

    bool same_node(const NodeIdentity& other) const noexcept {
        return device == other.device && inode == other.inode;
    }
    bool same_mount(const NodeIdentity& other) const noexcept {
        return device == other.device && (!has_mount_id || !other.has_mount_id || mount_id == other.mount_id);
    }
};

// `name` under `dir_fd` without following a final symlink, or `dir_fd` itself when name is "".
std::optional<NodeIdentity> identify(int dir_fd, const char* name) {
    struct statx info {};
    const int flags = AT_SYMLINK_NOFOLLOW | AT_NO_AUTOMOUNT | (*name == '\0' ? AT_EMPTY_PATH : 0);
    if (::statx(dir_fd, name, flags, STATX_TYPE | STATX_INO | STATX_MNT_ID | STATX_UID | STATX_NLINK,
                &info) != 0) {
        return std::nullopt;
    }
    NodeIdentity identity;
    identity.device = makedev(info.stx_dev_major, info.stx_dev_minor);
    identity.inode = info.stx_ino;
    identity.has_mount_id = (info.stx_mask & STATX_MNT_ID) != 0;
    identity.mount_id = info.stx_mnt_id;
    identity.mode = info.stx_mode;
    identity.owner = info.stx_uid;
    identity.links = info.stx_nlink;
    return identity;
}

std::string errno_text(const std::string& what, int err) {
    return what + ": " + std::strerror(err);
}

// One directory on the way down: its name in its parent, its identity (checked on the way back up) and
// the entries already handled (skipped when the directory is listed again).
struct Level {
    std::string name;
    NodeIdentity identity;
    std::set<std::string> handled;
};

// What a tree walk does at each entry. Each callback returns "" or the reason the entry was not handled.
struct TreeVisitor {
    // A non-directory entry on the tree's mount, named under `dir_fd`.
    std::function<std::string(int dir_fd, const std::string& name, const NodeIdentity& identity)> entry;
    // A directory, opened without following and checked to be the one listed (the tree's root too, with
    // depth 0); set `descend` to false to leave its contents alone.
    std::function<std::string(int fd, const NodeIdentity& identity, std::size_t depth, bool& descend)> enter;
    // A directory whose contents are done, named under `parent_fd` (the tree's root too).
    std::function<std::string(int parent_fd, const std::string& name)> leave;
    // Whether a mount point inside is reported as not handled (removal) or silently skipped.
    bool mount_point_is_an_error = true;
    std::size_t max_entries = 0;  // 0: no limit
};

// A tree's root, opened from its parent's descriptor without following and checked to be the directory
// named.
struct TreeRoot {
    std::filesystem::path target;  // the normalised path walked
    std::string name;              // its last component
    std::filesystem::path parent_path;
    UniqueFd parent;
    NodeIdentity identity;
    UniqueFd fd;
};

// Returns nullopt when `directory` does not exist.
std::optional<TreeRoot> open_tree_root(const std::filesystem::path& directory, const std::string& who) {
    std::filesystem::path target = directory.lexically_normal();
    if (!target.has_filename()) {
        target = target.parent_path();  // "dir/" -> "dir"
    }
    std::string name = target.filename().string();
    if (name.empty() || name == "." || name == ".." || target == target.root_path()) {
        throw SandboxError(who + ": refusing to walk '" + directory.string() + "'");
    }
    std::filesystem::path parent_path = target.has_parent_path() ? target.parent_path() : ".";
    UniqueFd parent(::open(parent_path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    if (!parent) {
        if (errno == ENOENT) {
            return std::nullopt;
        }
        throw SandboxError(errno_text(who + ": open " + parent_path.string(), errno));
    }
    const auto root = identify(parent.get(), name.c_str());
    if (!root) {
        if (errno == ENOENT) {
            return std::nullopt;
        }
        throw SandboxError(errno_text(who + ": stat " + target.string(), errno));
    }
    if (!S_ISDIR(root->mode)) {
        throw SandboxError(who + ": " + target.string() +
                           " is not a directory (a symlink is never followed)");
    }
    UniqueFd current(::openat(parent.get(), name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
    const auto opened = current ? identify(current.get(), "") : std::nullopt;
    if (!opened || !opened->same_node(*root)) {
        throw SandboxError(errno_text(who + ": open " + target.string(), current ? ESTALE : errno));
    }
    return TreeRoot{std::move(target), std::move(name), std::move(parent_path),
                    std::move(parent), *root,           std::move(current)};
}

// A subdirectory about to be entered: its level and its descriptor.
struct Subdirectory {
    Level level;
    UniqueFd fd;
};

// The walk below an opened root: the directory it is in (one descriptor), the levels above it, and the
// first entry a callback could not handle.
class TreeWalk {
  public:
    TreeWalk(const std::string& who, const TreeVisitor& visitor, TreeRoot& root)
        : who_(who),
          visitor_(visitor),
          parent_path_(root.parent_path),
          root_(root.identity),
          entries_left_(visitor.max_entries),
          current_(std::move(root.fd)) {
        levels_.push_back(Level{root.name, root.identity, {}});
    }

    // Enters the root, then walks depth first until everything is handled or the entry budget is spent.
    void run() {
        bool descend_root = true;
        note("", visitor_.enter ? visitor_.enter(current_.get(), root_, 0, descend_root) : std::string());
        while (descend_root) {
            bool budget_spent = false;
            if (auto child = next_subdirectory(budget_spent)) {
                levels_.push_back(std::move(child->level));
                current_ = std::move(child->fd);
                continue;
            }
            if (budget_spent || levels_.size() == 1) {
                break;
            }
            climb();
        }
    }

    std::string take_error() { return std::move(first_error_); }

  private:
    std::string where(const std::string& entry) const {
        std::string path = parent_path_.string();
        for (const auto& level : levels_) {
            path += "/" + level.name;
        }
        return entry.empty() ? path : path + "/" + entry;
    }

    void note(const std::string& entry, const std::string& why) {
        if (!why.empty() && first_error_.empty()) {
            first_error_ = where(entry) + ": " + why;
        }
    }

    // Lists the current directory from its start, skipping the entries already handled and handling the
    // others until one is a subdirectory to enter, which is returned; nullopt when none is left or the
    // budget is spent.
    std::optional<Subdirectory> next_subdirectory(bool& budget_spent) {
        const int listing_fd = ::dup(current_.get());
        if (listing_fd < 0) {
            throw SandboxError(errno_text(who_ + ": dup " + where(""), errno));
        }
        std::unique_ptr<DIR, int (*)(DIR*)> listing(::fdopendir(listing_fd), ::closedir);
        if (!listing) {
            ::close(listing_fd);
            throw SandboxError(errno_text(who_ + ": read directory " + where(""), errno));
        }
        ::rewinddir(listing.get());
        while (const dirent* entry = ::readdir(listing.get())) {
            std::string entry_name = entry->d_name;
            if (entry_name == "." || entry_name == ".." || levels_.back().handled.contains(entry_name)) {
                continue;
            }
            if (visitor_.max_entries != 0) {
                if (entries_left_ == 0) {
                    budget_spent = true;
                    break;
                }
                --entries_left_;
            }
            levels_.back().handled.insert(entry_name);
            if (auto child = visit(entry_name)) {
                return child;
            }
        }
        return std::nullopt;
    }

    // Handles one entry of the current directory; returns it when it is a subdirectory to enter.
    std::optional<Subdirectory> visit(const std::string& entry_name) {
        const auto identity = identify(current_.get(), entry_name.c_str());
        if (!identity) {
            if (errno != ENOENT) {
                note(entry_name, errno_text("stat", errno));
            }
            return std::nullopt;
        }
        if (!identity->same_mount(root_)) {
            if (visitor_.mount_point_is_an_error) {
                note(entry_name, "a mount point, left alone");
            }
            return std::nullopt;
        }
        if (!S_ISDIR(identity->mode)) {
            note(entry_name, visitor_.entry ? visitor_.entry(current_.get(), entry_name, *identity) : "");
            return std::nullopt;
        }
        UniqueFd child(
            ::openat(current_.get(), entry_name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
        const auto child_identity = child ? identify(child.get(), "") : std::nullopt;
        if (!child_identity || !child_identity->same_node(*identity)) {
            note(entry_name, child ? "replaced during the walk" : errno_text("open", errno));
            return std::nullopt;
        }
        bool descend = true;
        note(entry_name,
             visitor_.enter ? visitor_.enter(child.get(), *child_identity, levels_.size(), descend) : "");
        if (!descend) {
            return std::nullopt;
        }
        return Subdirectory{Level{entry_name, *identity, {}}, std::move(child)};
    }

    // Goes back up through "..", checking the parent is the directory it was, then leaves the finished one.
    void climb() {
        UniqueFd up(::openat(current_.get(), "..", O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
        const auto up_identity = up ? identify(up.get(), "") : std::nullopt;
        const Level finished = std::move(levels_.back());
        levels_.pop_back();
        if (!up_identity || !up_identity->same_node(levels_.back().identity)) {
            throw SandboxError(who_ + ": " + where(finished.name) +
                               ": moved during the walk; stopped without following it");
        }
        current_ = std::move(up);
        note(finished.name, visitor_.leave ? visitor_.leave(current_.get(), finished.name) : "");
    }

    const std::string& who_;
    const TreeVisitor& visitor_;
    const std::filesystem::path& parent_path_;
    NodeIdentity root_;
    std::size_t entries_left_;
    UniqueFd current_;
    std::vector<Level> levels_;
    std::string first_error_;
};

// The one fd-relative, no-follow walk of a tree untrusted code may be writing into (remove_tree and
// adopt_tree): every entry is looked at with statx(AT_SYMLINK_NOFOLLOW) from its parent's descriptor,
// directories are entered with openat(O_NOFOLLOW | O_DIRECTORY) and checked to be the node listed, other
// mounts are never entered, and going back up through ".." each parent is checked to be the directory it
// was, so a tree moved during the walk stops it instead of redirecting it. Only ancestors' names and
// identities are kept, so a deep tree does not cost one descriptor per level. Returns false when
// `directory` does not exist; throws SandboxError (prefixed with `who`) naming the first entry a callback
// could not handle, after walking everything else.
bool walk_tree(const std::filesystem::path& directory, const std::string& who, const TreeVisitor& visitor) {
    auto root = open_tree_root(directory, who);
    if (!root) {
        return false;
    }
    std::string first_error;
    {
        TreeWalk walk(who, visitor, *root);
        walk.run();
        first_error = walk.take_error();
    }  // closes the walk's last directory before the root is left
    if (visitor.leave && first_error.empty()) {
        const std::string why = visitor.leave(root->parent.get(), root->name);
        if (!why.empty()) {
            first_error = root->target.string() + ": " + why;
        }
    }
    if (!first_error.empty()) {
        throw SandboxError(who + ": " + first_error);
    }
    return true;
}

}  // namespace

void remove_tree(const std::filesystem::path& directory) {
    TreeVisitor removal;
    // Unlinking a name (a symlink, FIFO, device, file) never touches what it refers to.
    removal.entry = [](int dir_fd, const std::string& name, const NodeIdentity&) -> std::string {
        if (::unlinkat(dir_fd, name.c_str(), 0) != 0 && errno != ENOENT) {
            return errno_text("unlink", errno);
        }
        return "";
    };
    removal.leave = [](int parent_fd, const std::string& name) -> std::string {
        if (::unlinkat(parent_fd, name.c_str(), AT_REMOVEDIR) != 0 && errno != ENOENT) {
            return errno_text("remove directory", errno);
        }
        return "";
    };
    walk_tree(directory, "remove_tree", removal);
}

void adopt_tree(const std::filesystem::path& directory, uid_t uid,
                const std::function<bool(uid_t)>& adoptable, std::size_t max_entries) {
    const auto wanted = [&](const NodeIdentity& identity) {
        return identity.owner != uid && adoptable(identity.owner);
    };
    TreeVisitor adoption;
    adoption.mount_point_is_an_error = false;
    adoption.max_entries = max_entries;
    // Changed through a descriptor of the entry itself (O_PATH, no follow: a symlink is the link), checked
    // to be the node listed, so a name swapped after the listing is never what gets changed.
    adoption.entry = [&](int dir_fd, const std::string& name, const NodeIdentity& listed) -> std::string {
        if (listed.links > 1 || !wanted(listed)) {
            return "";
        }
        UniqueFd node(::openat(dir_fd, name.c_str(), O_PATH | O_NOFOLLOW | O_CLOEXEC));
        if (!node) {
            return errno == ENOENT ? "" : errno_text("open", errno);
        }
        const auto opened = identify(node.get(), "");
        if (!opened || !opened->same_node(listed) || opened->links > 1 || !wanted(*opened)) {
            return "";  // replaced or linked since it was listed: not ours to change
        }
        if (::fchownat(node.get(), "", uid, uid, AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW) != 0) {
            return errno_text("chown", errno);
        }
        return "";
    };
    adoption.enter = [&](int fd, const NodeIdentity& identity, std::size_t depth,
                         bool& descend) -> std::string {
        descend = depth <= 64;
        if (depth == 0 || !wanted(identity)) {
            return "";
        }
        if (::fchown(fd, uid, uid) != 0) {
            return errno_text("chown", errno);
        }
        return "";
    };
    walk_tree(directory, "adopt_tree", adoption);
}

}  // namespace cellblock::sandbox
