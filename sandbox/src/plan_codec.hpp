// A ChildPlan as bytes, for a zygote template that clones the child in another process (sandbox/README.md
// "Worker zygote"). The fds a plan refers to travel beside the bytes (SCM_RIGHTS) and are named in them by
// their index in that array, never by number: the template receives them under numbers of its own.
#pragma once

#include <linux/filter.h>

#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "child.hpp"
#include "fds.hpp"

namespace cellblock::sandbox::detail {

// At most this many fds go with one plan (the wire protocol's limit).
inline constexpr std::size_t max_plan_fds = max_fds_per_message;

struct EncodedPlan {
    std::vector<unsigned char> bytes;
    std::vector<int> fds;  // to send, in this order, with the bytes
};

// Only the child's ends go: the parent's (sync_write_fd, error_read_fd, listener_parent_fd) stay with the
// caller and decode as -1. An fd used twice (/dev/null for stdin and stdout) is sent once. Throws
// SandboxError when the plan needs more than max_plan_fds fds.
EncodedPlan encode_plan(const ChildPlan& plan);

// A decoded plan with the storage its pointers refer to (the seccomp filter, argv, envp); not movable,
// so those pointers stay valid.
struct DecodedPlan {
    ChildPlan plan;
    std::vector<sock_filter> seccomp_filter;
    std::vector<std::string> argv;
    std::vector<std::string> envp;

    DecodedPlan() = default;
    DecodedPlan(const DecodedPlan&) = delete;
    DecodedPlan& operator=(const DecodedPlan&) = delete;
    // A template serves every session of its tenant: one session's plan (paths of its workspace, cgroup,
    // environment) must not linger in the template's heap for a later fork to read, so it is zeroed before
    // the memory is freed.
    ~DecodedPlan() { wipe(); }
    // Zeroes every string of the plan in place (explicit_bzero: not optimised away).
    void wipe() noexcept;
};

// `fds` are the received descriptors, in the order they were sent. The fd scratch base is computed for
// these numbers. Throws SandboxError on anything malformed (a truncated field, an fd index out of range,
// trailing bytes, an absurd count).
std::unique_ptr<DecodedPlan> decode_plan(std::span<const unsigned char> bytes, std::span<const int> fds);

}  // namespace cellblock::sandbox::detail
