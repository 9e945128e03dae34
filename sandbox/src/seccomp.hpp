// seccomp: the syscall filter of confinement.md §4 item 5, built with libseccomp and exported as
// classic BPF in the parent; the child only loads it.
#pragma once

#include <linux/filter.h>

#include <vector>

namespace cellblock::sandbox::detail {

// Which socket families socket(2) may create. AF_UNIX always; AF_INET/AF_INET6 only for a sandbox with
// a loopback listener (LaunchRequest::loopback_listener), whose program must be able to connect to it.
enum class SocketFamilies { unix_only, unix_and_inet };

// Builds the filter; throws SandboxError naming the rule if libseccomp rejects any of them.
std::vector<sock_filter> build_seccomp_filter(SocketFamilies families);

}  // namespace cellblock::sandbox::detail
