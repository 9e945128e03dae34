#include "cgroups.hpp"

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <sstream>
#include <thread>

#include "system.hpp"

namespace cellblock::sandbox::detail {
namespace {

namespace fs = std::filesystem;

struct MountInfo {
    std::string root;  // the cgroup path mounted there
    fs::path mount_point;
    std::string fstype;
    std::string super_options;
};

std::vector<MountInfo> cgroup_mounts() {
    std::vector<MountInfo> mounts;
    std::istringstream lines(read_small_file("/proc/self/mountinfo"));
    std::string line;
    while (std::getline(lines, line)) {
        // id parent major:minor root mount-point options [optional...] - fstype source super-options
        std::istringstream fields(line);
        std::string id, parent, device, root, mount_point, options, field;
        fields >> id >> parent >> device >> root >> mount_point >> options;
        while (fields >> field && field != "-") {
        }
        MountInfo info;
        std::string source;
        fields >> info.fstype >> source >> info.super_options;
        if (info.fstype != "cgroup" && info.fstype != "cgroup2") {
            continue;
        }
        info.root = root;
        info.mount_point = mount_point;
        mounts.push_back(std::move(info));
    }
    return mounts;
}

bool has_option(const std::string& options, const std::string& wanted) {
    std::istringstream list(options);
    std::string option;
    while (std::getline(list, option, ',')) {
        if (option == wanted) {
            return true;
        }
    }
    return false;
}

// Our own cgroup in the hierarchy that has `controller` ("" = the v2 unified hierarchy).
std::optional<std::string> own_cgroup(const std::string& controller) {
    std::istringstream lines(read_small_file("/proc/self/cgroup"));
    std::string line;
    while (std::getline(lines, line)) {
        const auto first = line.find(':');
        const auto second = line.find(':', first + 1);
        if (first == std::string::npos || second == std::string::npos) {
            continue;
        }
        const std::string controllers = line.substr(first + 1, second - first - 1);
        const std::string path = line.substr(second + 1);
        if (controller.empty() ? (line.compare(0, 3, "0::") == 0) : has_option(controllers, controller)) {
            return path;
        }
    }
    return std::nullopt;
}

// "<mount point>/<our cgroup relative to the mount's root>/cellblock", created if possible. Every session's
// cgroup sits under this one parent on purpose: the scheduler weighs the parent as one process, so that busy
// workers in any number of sessions leave the kernels that start, supervise and interrupt them their share
// (tests/sandbox/test_resources.py). Per-session cgroups without it made 50 concurrent creates three times
// slower (tests/bench/README.md, "Tried, not kept: per-session cgroups without the common parent").
fs::path session_base(const MountInfo& mount, const std::string& own) {
    std::string relative = own;
    if (mount.root != "/" && relative.compare(0, mount.root.size(), mount.root) == 0) {
        relative = relative.substr(mount.root.size());
    }
    fs::path base = mount.mount_point;
    base += relative;
    base /= "cellblock";
    if (::mkdir(base.c_str(), 0755) != 0 && errno != EEXIST) {
        return {};
    }
    return base;
}

std::string read_key(const fs::path& file, const std::string& key) {
    std::istringstream lines(read_small_file(file));
    std::string name, value;
    while (lines >> name >> value) {
        if (name == key) {
            return value;
        }
    }
    return {};
}

}  // namespace

CgroupHost CgroupHost::probe() {
    CgroupHost host;
    std::vector<MountInfo> mounts;
    try {
        mounts = cgroup_mounts();
    } catch (const SandboxError&) {
        return host;
    }
    // cgroup v1: one hierarchy per controller.
    for (const auto& mount : mounts) {
        if (mount.fstype != "cgroup") {
            continue;
        }
        for (const auto& [controller, base] : {std::pair<std::string, fs::path*>{"memory", &host.memory_base},
                                               {"pids", &host.pids_base},
                                               {"cpu", &host.cpu_base}}) {
            if (!base->empty() || !has_option(mount.super_options, controller)) {
                continue;
            }
            if (const auto own = own_cgroup(controller)) {
                *base = session_base(mount, *own);
            }
        }
    }
    if (!host.memory_base.empty() || !host.pids_base.empty() || !host.cpu_base.empty()) {
        host.version = Version::v1;
        host.memory_swap = !host.memory_base.empty() &&
                           ::access((host.memory_base / "memory.memsw.limit_in_bytes").c_str(), F_OK) == 0;
        return host;
    }
    // cgroup v2: one hierarchy; controllers must be enabled for our subtree.
    for (const auto& mount : mounts) {
        if (mount.fstype != "cgroup2") {
            continue;
        }
        const auto own = own_cgroup("");
        if (!own) {
            continue;
        }
        fs::path ours = mount.mount_point;
        ours += *own;
        std::string available;
        try {
            available = read_small_file(ours / "cgroup.controllers");
        } catch (const SandboxError&) {
            continue;
        }
        const auto base = ours / "cellblock";
        if (::mkdir(base.c_str(), 0755) != 0 && errno != EEXIST) {
            continue;
        }
        for (const auto& [controller, field] :
             {std::pair<std::string, fs::path*>{"memory", &host.memory_base},
              {"pids", &host.pids_base},
              {"cpu", &host.cpu_base}}) {
            if (available.find(controller) == std::string::npos) {
                continue;
            }
            // Fails (EBUSY) when our own cgroup holds processes and is not the root: then the
            // controller is simply unavailable to us.
            if (try_write_existing_file(ours / "cgroup.subtree_control", "+" + controller) != 0) {
                continue;
            }
            if (try_write_existing_file(base / "cgroup.subtree_control", "+" + controller) != 0) {
                continue;
            }
            *field = base;
        }
        if (!host.memory_base.empty() || !host.pids_base.empty() || !host.cpu_base.empty()) {
            host.version = Version::v2;
            return host;
        }
    }
    return host;
}

CgroupSession CgroupSession::create(const CgroupHost& host, const std::string& name,
                                    const ResourceLimits& limits) {
    CgroupSession session;
    session.version_ = host.version;
    auto make = [&](const fs::path& base) {
        auto dir = base / name;
        if (::mkdir(dir.c_str(), 0755) != 0) {
            if (errno != EEXIST) {
                throw_errno("cgroup mkdir " + dir.string());
            }
            // Left by a launcher that crashed while holding this uid (we hold its lease now): start
            // from a fresh cgroup so that old OOM counts and processes cannot leak into this session.
            CgroupSession stale;
            stale.dirs_.push_back(dir);
            stale.remove();
            if (::mkdir(dir.c_str(), 0755) != 0) {
                throw_errno("cgroup mkdir " + dir.string() + " (after removing a stale one)");
            }
        }
        session.dirs_.push_back(dir);
        return dir;
    };
    const bool v2 = host.version == CgroupHost::Version::v2;
    if (v2) {
        // One directory holds every controller.
        const auto base = !host.memory_base.empty() ? host.memory_base
                          : !host.pids_base.empty() ? host.pids_base
                                                    : host.cpu_base;
        if (base.empty() || (limits.memory_bytes == 0 && limits.pids == 0 && limits.cpu_cores <= 0)) {
            return session;
        }
        const auto dir = make(base);
        if (limits.memory_bytes > 0 && !host.memory_base.empty()) {
            write_existing_file(dir / "memory.max", std::to_string(limits.memory_bytes));
            // No swap beyond the limit; ignore hosts without swap accounting.
            try_write_existing_file(dir / "memory.swap.max", "0");
            session.memory_dir_ = dir;
        }
        if (limits.pids > 0 && !host.pids_base.empty()) {
            write_existing_file(dir / "pids.max", std::to_string(limits.pids));
        }
        if (limits.cpu_cores > 0 && !host.cpu_base.empty()) {
            const auto quota = static_cast<long>(std::ceil(limits.cpu_cores * 100000));
            write_existing_file(dir / "cpu.max", std::to_string(quota) + " 100000");
        }
        return session;
    }
    if (limits.memory_bytes > 0 && !host.memory_base.empty()) {
        const auto dir = make(host.memory_base);
        write_existing_file(dir / "memory.limit_in_bytes", std::to_string(limits.memory_bytes));
        if (host.memory_swap) {
            write_existing_file(dir / "memory.memsw.limit_in_bytes", std::to_string(limits.memory_bytes));
        }
        session.memory_dir_ = dir;
    }
    if (limits.pids > 0 && !host.pids_base.empty()) {
        const auto dir = make(host.pids_base);
        write_existing_file(dir / "pids.max", std::to_string(limits.pids));
    }
    if (limits.cpu_cores > 0 && !host.cpu_base.empty()) {
        const auto dir = make(host.cpu_base);
        write_existing_file(dir / "cpu.cfs_period_us", "100000");
        const auto quota = static_cast<long>(std::ceil(limits.cpu_cores * 100000));
        write_existing_file(dir / "cpu.cfs_quota_us", std::to_string(quota));
    }
    return session;
}

CgroupSession::CgroupSession(CgroupSession&& other) noexcept
    : version_(other.version_), dirs_(std::move(other.dirs_)), memory_dir_(std::move(other.memory_dir_)) {
    other.dirs_.clear();
}

CgroupSession& CgroupSession::operator=(CgroupSession&& other) noexcept {
    if (this != &other) {
        remove();
        version_ = other.version_;
        dirs_ = std::move(other.dirs_);
        memory_dir_ = std::move(other.memory_dir_);
        other.dirs_.clear();
    }
    return *this;
}

CgroupSession::~CgroupSession() {
    remove();
}

std::vector<fs::path> CgroupSession::self_join_files() const {
    std::vector<fs::path> files;
    if (version_ == CgroupHost::Version::v1) {
        for (const auto& dir : dirs_) {
            files.push_back(dir / "tasks");
        }
    }
    return files;
}

void CgroupSession::add_process(pid_t pid) const {
    if (version_ == CgroupHost::Version::v1) {
        return;  // the child joined by itself
    }
    for (const auto& dir : dirs_) {
        write_existing_file(dir / "cgroup.procs", std::to_string(pid));
    }
}

bool CgroupSession::memory_limit_hit() const {
    if (memory_dir_.empty()) {
        return false;
    }
    try {
        const auto count = version_ == CgroupHost::Version::v2
                               ? read_key(memory_dir_ / "memory.events", "oom_kill")
                               : read_key(memory_dir_ / "memory.oom_control", "oom_kill");
        return !count.empty() && std::stoull(count) > 0;
    } catch (const std::exception&) {
        return false;
    }
}

void CgroupSession::kill_all() const noexcept {
    for (const auto& dir : dirs_) {
        try {
            std::istringstream pids(read_small_file(dir / "cgroup.procs"));
            pid_t pid = 0;
            while (pids >> pid) {
                ::kill(pid, SIGKILL);
            }
        } catch (const std::exception&) {
            // The directory may already be gone; nothing to kill.
        }
    }
}

void CgroupSession::remove() noexcept {
    if (dirs_.empty()) {
        return;
    }
    // Processes leave a cgroup shortly after they die; retry for up to ~2 s, killing stragglers.
    for (int attempt = 0; attempt < 200 && !dirs_.empty(); ++attempt) {
        kill_all();
        std::erase_if(dirs_,
                      [](const fs::path& dir) { return ::rmdir(dir.c_str()) == 0 || errno == ENOENT; });
        if (!dirs_.empty()) {
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
    }
    dirs_.clear();
}

}  // namespace cellblock::sandbox::detail
