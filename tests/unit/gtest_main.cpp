// GoogleTest's main, except that a skipped test fails the run: a registered test runs or fails
// (tests/README.md).
#include <gtest/gtest.h>

#include <iostream>

int main(int argc, char** argv) {
    ::testing::InitGoogleTest(&argc, argv);
    const int status = RUN_ALL_TESTS();
    const int skipped = ::testing::UnitTest::GetInstance()->skipped_test_count();
    if (skipped > 0) {
        std::cerr << "cellblock: " << skipped << " skipped test(s); a skip is a failure in this suite\n";
        return 1;
    }
    return status;
}
