#include "credentials.hpp"

#include <linux/capability.h>
#include <linux/securebits.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <string>

#include "system.hpp"

namespace cellblock::sandbox::detail {

void plan_credentials(uid_t inside_uid, StepNames& steps, ChildPlan& plan) {
    plan.uid = inside_uid;
    plan.gid = static_cast<gid_t>(inside_uid);
    try {
        plan.last_capability = std::stoi(read_small_file("/proc/sys/kernel/cap_last_cap"));
    } catch (const std::exception&) {
        plan.last_capability = CAP_LAST_CAP;
    }
    plan.step_setgroups = steps.add("setgroups (clear supplementary groups)");
    plan.step_bounding = steps.add("prctl PR_CAPBSET_DROP");
    plan.step_securebits = steps.add("prctl PR_SET_SECUREBITS");
    plan.step_setresgid = steps.add("setresgid " + std::to_string(plan.gid));
    plan.step_setresuid = steps.add("setresuid " + std::to_string(plan.uid));
    plan.step_capset = steps.add("capset (drop all capabilities)");
    plan.step_ambient = steps.add("prctl PR_CAP_AMBIENT_CLEAR_ALL");
    plan.step_no_new_privs = steps.add("prctl PR_SET_NO_NEW_PRIVS");
}

bool drop_privileges(const ChildPlan& plan, int* failed_step) noexcept {
    auto fail = [&](int step) {
        *failed_step = step;
        return false;
    };
    if (::syscall(SYS_setgroups, 0, nullptr) != 0) {
        return fail(plan.step_setgroups);
    }
    for (int cap = 0; cap <= plan.last_capability; ++cap) {
        // EINVAL means the kernel does not know this capability: nothing to drop.
        if (::prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 && errno != EINVAL) {
            return fail(plan.step_bounding);
        }
    }
    // Lock the securebits so that nothing can regain capabilities through a uid change or exec.
    const unsigned long securebits = SECBIT_NOROOT | SECBIT_NOROOT_LOCKED | SECBIT_NO_SETUID_FIXUP |
                                     SECBIT_NO_SETUID_FIXUP_LOCKED | SECBIT_KEEP_CAPS_LOCKED |
                                     SECBIT_NO_CAP_AMBIENT_RAISE | SECBIT_NO_CAP_AMBIENT_RAISE_LOCKED;
    if (::prctl(PR_SET_SECUREBITS, securebits, 0, 0, 0) != 0) {
        return fail(plan.step_securebits);
    }
    // Raw syscalls: the glibc wrappers broadcast credential changes to all threads (setxid), which is
    // not safe in a child cloned from a multi-threaded process.
    if (::syscall(SYS_setresgid, plan.gid, plan.gid, plan.gid) != 0) {
        return fail(plan.step_setresgid);
    }
    if (::syscall(SYS_setresuid, plan.uid, plan.uid, plan.uid) != 0) {
        return fail(plan.step_setresuid);
    }
    __user_cap_header_struct header{_LINUX_CAPABILITY_VERSION_3, 0};
    __user_cap_data_struct data[_LINUX_CAPABILITY_U32S_3] = {};
    if (::syscall(SYS_capset, &header, data) != 0) {
        return fail(plan.step_capset);
    }
    if (::prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) != 0 && errno != EINVAL) {
        return fail(plan.step_ambient);
    }
    if (::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) {
        return fail(plan.step_no_new_privs);
    }
    return true;
}

}  // namespace cellblock::sandbox::detail
