#include "rlimits.hpp"

#include <sys/resource.h>

#include <algorithm>
#include <string>

#include "system.hpp"

namespace cellblock::sandbox::detail {
namespace {

// This process may only lower hard limits (it may lack CAP_SYS_RESOURCE), so clamp to what we have.
rlimit clamped(int resource, std::uint64_t wanted) {
    rlimit current{};
    if (::getrlimit(resource, &current) != 0) {
        throw_errno("getrlimit " + std::to_string(resource));
    }
    const rlim_t value = std::min<rlim_t>(static_cast<rlim_t>(wanted), current.rlim_max);
    return rlimit{value, value};
}

}  // namespace

void plan_rlimits(const ResourceLimits& limits, StepNames& steps, ChildPlan& plan) {
    auto add = [&](int resource, const char* name, std::uint64_t value) {
        plan.rlimits.push_back(
            RlimitOp{resource, clamped(resource, value),
                     steps.add(std::string("setrlimit ") + name + " " + std::to_string(value))});
    };
    // 1, not 0: a core_pattern that pipes to a helper (systemd-coredump, apport) ignores a limit of 0
    // and runs the helper as host root on our process; 1 is the kernel's "skip" value for pipes, and
    // is below the smallest ELF core for files.
    add(RLIMIT_CORE, "CORE", 1);
    add(RLIMIT_NOFILE, "NOFILE", limits.open_files);
    if (limits.processes > 0) {
        add(RLIMIT_NPROC, "NPROC", limits.processes);
    }
    if (limits.file_size_bytes > 0) {
        add(RLIMIT_FSIZE, "FSIZE", limits.file_size_bytes);
    }
    if (limits.cpu_seconds > 0) {
        // Soft limit sends SIGXCPU; the hard limit one second later SIGKILLs.
        rlimit cpu = clamped(RLIMIT_CPU, limits.cpu_seconds + 1);
        cpu.rlim_cur = std::min<rlim_t>(cpu.rlim_max, limits.cpu_seconds);
        plan.rlimits.push_back(
            RlimitOp{RLIMIT_CPU, cpu, steps.add("setrlimit CPU " + std::to_string(limits.cpu_seconds))});
    }
    // Locked memory is a host-wide resource; a sandbox needs none beyond a little for io.
    add(RLIMIT_MEMLOCK, "MEMLOCK", 64ULL * 1024);
    add(RLIMIT_MSGQUEUE, "MSGQUEUE", 0);
}

}  // namespace cellblock::sandbox::detail
