// The kernel's getpid (src/process_id.cpp): the process's own pid, in a forked child too, and the definition
// that the libraries (libzmq's fork checks) resolve getpid to.
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

namespace {

pid_t pid_from_the_system() {
    return static_cast<pid_t>(::syscall(SYS_getpid));
}

TEST(ProcessId, IsTheProcesssPid) {
    EXPECT_EQ(::getpid(), pid_from_the_system());
}

TEST(ProcessId, AForkedChildSeesItsOwnPid) {
    const pid_t parent = ::getpid();
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
        // Exit status 0 only if the child's getpid is its own pid, not the parent's.
        const pid_t seen = ::getpid();
        ::_exit(seen == pid_from_the_system() && seen != parent ? 0 : 1);
    }
    int status = 0;
    ASSERT_EQ(::waitpid(child, &status, 0), child);
    ASSERT_TRUE(WIFEXITED(status));
    EXPECT_EQ(WEXITSTATUS(status), 0) << "the child's getpid returned a pid other than its own";
    EXPECT_EQ(::getpid(), parent);
}

TEST(ProcessId, LibrariesResolveGetpidToTheKernels) {
    // As libzmq.so resolves it: the first definition in the global lookup order, which must be the one in
    // this executable (linked with the kernel's core, as cellblock-kernel is), not libc's.
    void* resolved = ::dlsym(RTLD_DEFAULT, "getpid");
    ASSERT_NE(resolved, nullptr);
    Dl_info resolved_info{}, executable_info{};
    ASSERT_NE(::dladdr(resolved, &resolved_info), 0);
    ASSERT_NE(::dladdr(reinterpret_cast<void*>(&pid_from_the_system), &executable_info), 0);
    ASSERT_NE(resolved_info.dli_fname, nullptr);
    ASSERT_NE(executable_info.dli_fname, nullptr);
    EXPECT_STREQ(resolved_info.dli_fname, executable_info.dli_fname) << "getpid resolves to libc's";
    EXPECT_EQ(resolved, reinterpret_cast<void*>(&::getpid));
}

}  // namespace
