// Identity: leasing a host uid from the policy's range and mapping the sandbox's uid onto it.
#pragma once

#include <sys/types.h>

#include <filesystem>

#include "cellblock/sandbox/sandbox.hpp"
#include "unique_fd.hpp"

namespace cellblock::sandbox::detail {

// Where every launcher on the host leases uids, whatever its policy's state_dir.
inline constexpr const char* host_uid_lease_dir = "/run/cellblock/uids";

// Exclusive use of one host uid (and the gid with the same number) while the object lives. Leases are
// flock(2)s on files under host_uid_lease_dir, so concurrent launchers in different processes (and with
// different policies) never hand out the same uid, and a crashed holder releases its lease automatically.
class UidLease {
  public:
    static UidLease acquire(const Policy& policy);
    UidLease() = default;
    uid_t uid() const noexcept { return uid_; }
    explicit operator bool() const noexcept { return static_cast<bool>(lock_); }

  private:
    UidLease(UniqueFd lock, uid_t uid) : lock_(std::move(lock)), uid_(uid) {}
    UniqueFd lock_;
    uid_t uid_ = 0;
};

// Writes /proc/<pid>/{uid_map,gid_map}: `inside` maps to `host` and nothing else (never host root).
void write_id_maps(pid_t pid, uid_t inside, uid_t host);

// True when this kernel lets us create user namespaces.
bool user_namespaces_available();

}  // namespace cellblock::sandbox::detail
