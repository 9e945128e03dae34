#include "user_namespace.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <string>

#include "system.hpp"

namespace cellblock::sandbox::detail {

UidLease UidLease::acquire(const Policy& policy) {
    if (policy.uid_first == 0) {
        throw SandboxError("uid lease: the uid range must not include host root");
    }
    // One lease directory per host, not per state_dir: host uids and their cgroups (/cellblock/<uid>) are
    // host-wide, so policies with different state_dirs leasing the same uid would share files and signals,
    // and the second launch would clear the first's cgroup as stale (killing it).
    const std::filesystem::path lease_dir = host_uid_lease_dir;
    make_directories(lease_dir, 0700);
    // First fit: the lowest free uid. Low uids are reused, and with them their root skeletons
    // (mounts.hpp), which makes a launch cheaper; a held lease costs one open + flock to skip.
    const auto count = policy.uid_count;
    for (uid_t i = 0; i < count; ++i) {
        const uid_t uid = policy.uid_first + i;
        const auto path = lease_dir / std::to_string(uid);
        UniqueFd lock(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600));
        if (!lock) {
            throw_errno("uid lease: open " + path.string());
        }
        if (::flock(lock.get(), LOCK_EX | LOCK_NB) == 0) {
            return UidLease(std::move(lock), uid);
        }
        if (errno != EWOULDBLOCK) {
            throw_errno("uid lease: flock " + path.string());
        }
    }
    throw SandboxError("uid lease: all " + std::to_string(count) + " uids from " +
                       std::to_string(policy.uid_first) + " are in use");
}

void write_id_maps(pid_t pid, uid_t inside, uid_t host) {
    if (host == 0) {
        throw SandboxError("id map: refusing to map host root into a sandbox");
    }
    const std::string proc = "/proc/" + std::to_string(pid);
    const std::string line = std::to_string(inside) + " " + std::to_string(host) + " 1\n";
    write_existing_file(proc + "/uid_map", line);
    write_existing_file(proc + "/gid_map", line);
}

bool user_namespaces_available() {
    try {
        const auto text = read_small_file("/proc/sys/user/max_user_namespaces");
        return std::stoul(text) > 0;
    } catch (const std::exception&) {
        return false;
    }
}

}  // namespace cellblock::sandbox::detail
