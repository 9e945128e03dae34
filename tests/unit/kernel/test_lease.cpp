// The orphan lease decision: when a kernel whose gateway went away stops itself.
#include <gtest/gtest.h>

#include <stdexcept>

#include "server/lease.hpp"

namespace cellblock::kernel {
namespace {

using namespace std::chrono_literals;

TEST(Lease, ExpiresOnlyAfterTheWholeDurationWithoutRenewal) {
    const auto start = Lease::Clock::time_point{} + 1h;
    Lease lease(2000ms, start);
    EXPECT_FALSE(lease.expired(start));
    EXPECT_FALSE(lease.expired(start + 1999ms));
    EXPECT_EQ(lease.remaining(start + 500ms), 1500ms);
    EXPECT_TRUE(lease.expired(start + 2000ms));
    EXPECT_EQ(lease.remaining(start + 5s), 0ms);
    EXPECT_DOUBLE_EQ(lease.idle(start + 5s).count(), 5.0);
}

TEST(Lease, RenewalPushesExpiryBack) {
    const auto start = Lease::Clock::time_point{} + 1h;
    Lease lease(2000ms, start);
    for (auto now = start; now < start + 10s; now += 500ms) {
        lease.renew(now);
        EXPECT_FALSE(lease.expired(now + 1999ms));
    }
    lease.renew(start + 10s);
    EXPECT_FALSE(lease.expired(start + 11s));
    EXPECT_TRUE(lease.expired(start + 12s));
    // A renewal stamped earlier than the last one (threads reading the clock in another order) never
    // shortens the lease.
    lease.renew(start);
    EXPECT_FALSE(lease.expired(start + 11s));
}

TEST(Lease, DurationFromEnvironment) {
    EXPECT_EQ(Lease::duration_from_environment(nullptr), std::nullopt);
    EXPECT_EQ(Lease::duration_from_environment(""), std::nullopt);
    EXPECT_EQ(Lease::duration_from_environment("0"), std::nullopt);
    EXPECT_EQ(Lease::duration_from_environment("-5"), std::nullopt);
    EXPECT_EQ(Lease::duration_from_environment("600"), std::chrono::milliseconds(600000));
    EXPECT_EQ(Lease::duration_from_environment("0.5"), std::chrono::milliseconds(500));
    EXPECT_THROW(Lease::duration_from_environment("ten"), std::invalid_argument);
    EXPECT_THROW(Lease::duration_from_environment("10s"), std::invalid_argument);
    EXPECT_THROW(Lease::duration_from_environment("nan"), std::invalid_argument);
}

}  // namespace
}  // namespace cellblock::kernel
