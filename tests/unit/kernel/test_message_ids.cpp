// The ids of the kernel's messages (src/message_ids.hpp): unique version 4 UUIDs, and xeus's own ids come
// from the kernel's generator rather than libuuid's (five syscalls per id).
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <set>
#include <string>
#include <xeus/xguid.hpp>

#include "server/message_ids.hpp"

namespace cellblock::kernel {
namespace {

TEST(MessageIds, XeusIdsAreUniqueVersion4Uuids) {
    std::set<std::string> seen;
    for (int i = 0; i < 20000; ++i) {
        const std::string id = xeus::new_xguid().c_str();
        ASSERT_EQ(id.size(), 32u) << id;
        ASSERT_EQ(id.find_first_not_of("0123456789abcdef"), std::string::npos) << id;
        ASSERT_EQ(id[12], '4') << "version nibble of " << id;
        ASSERT_NE(std::string("89ab").find(id[16]), std::string::npos) << "variant of " << id;
        ASSERT_TRUE(seen.insert(id).second) << "repeated id " << id;
    }
}

TEST(MessageIds, XeusTakesTheKernelsGenerator) {
    // Resolved as libxeus.so resolves it: the first definition in the global lookup order.
    void* resolved = ::dlsym(RTLD_DEFAULT, "uuid_generate");
    ASSERT_NE(resolved, nullptr);
    Dl_info resolved_info{}, own_info{};
    ASSERT_NE(::dladdr(resolved, &resolved_info), 0);
    ASSERT_NE(::dladdr(reinterpret_cast<void*>(&uuid_generate), &own_info), 0);
    EXPECT_EQ(resolved, reinterpret_cast<void*>(&uuid_generate))
        << "uuid_generate resolves to " << (resolved_info.dli_fname ? resolved_info.dli_fname : "?")
        << ", not to the kernel's in " << (own_info.dli_fname ? own_info.dli_fname : "?");
}

TEST(MessageIds, RandomUuidsDiffer) {
    EXPECT_NE(random_uuid(), random_uuid());
}

}  // namespace
}  // namespace cellblock::kernel
