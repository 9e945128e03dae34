// seccomp: the syscall filter of confinement.md §4 item 5, built with libseccomp and exported as
// classic BPF in the parent; the child only loads it.
#pragma once

#include <linux/filter.h>

#include <vector>

namespace cellblock::sandbox::detail {

// Builds the filter; throws SandboxError naming the rule if libseccomp rejects any of them.
std::vector<sock_filter> build_seccomp_filter();

}  // namespace cellblock::sandbox::detail
