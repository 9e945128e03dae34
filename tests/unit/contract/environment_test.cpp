#include "cellblock/contract/environment.hpp"

#include <gtest/gtest.h>

namespace cellblock::contract {
namespace {

TEST(EnvironmentName, PortableNamesOnly) {
    for (const char* name : {"A", "_", "KERNEL_X", "path", "a1_B2"})
        EXPECT_TRUE(valid_environment_name(name)) << name;
    for (const char* name :
         {"", "1A", "KERNEL_X$(touch /tmp/owned)", "A B", "A=B", "A-B", "A;B", "Ä", "A\nB", "`id`"})
        EXPECT_FALSE(valid_environment_name(name)) << name;
}

TEST(EnvironmentCheck, NamesTheBadVariable) {
    try {
        check_environment({{"GOOD", "1"}, {"KERNEL_X$(id)", "1"}});
        FAIL() << "a bad name passed";
    } catch (const InvalidEnvironment& error) {
        EXPECT_EQ(error.variable(), "KERNEL_X$(id)");
        EXPECT_NE(std::string(error.what()).find("KERNEL_X$(id)"), std::string::npos);
    }
    EXPECT_THROW(check_environment({{"A", std::string("x\0y", 3)}}), InvalidEnvironment);
}

TEST(EnvironmentDocument, RoundTripsAnyValueOnOnePrintableLine) {
    const Environment environment = {{"PLAIN", "1"},
                                     {"SHELL_WORDS", "$(touch x) `id` '\"; exit 1"},
                                     {"LINES", "a\nCELLBLOCK_LAUNCH_ENVIRONMENT\nb\r\t"},
                                     {"UNICODE", "\xc3\xa9\xe2\x82\xac"},
                                     {"EMPTY", ""}};
    const std::string document = encode_environment(environment);
    for (char c : document)
        EXPECT_TRUE(c >= 0x20 && c < 0x7f) << "byte " << static_cast<int>(static_cast<unsigned char>(c));
    EXPECT_EQ(decode_environment(document), environment);
}

TEST(EnvironmentDocument, RefusesWhatIsNotAVersionOneDocumentOfGoodNames) {
    for (const char* document :
         {"", "[]", "{}", R"({"version": 2, "environment": {}})", R"({"version": "1", "environment": {}})",
          R"({"version": 1})", R"({"version": 1, "environment": []})",
          R"({"version": 1, "environment": {"A": 1}})", R"({"version": 1, "environment": {"A B": "1"}})"})
        EXPECT_THROW(decode_environment(document), InvalidEnvironment) << document;
    EXPECT_THROW(encode_environment({{"$(id)", "1"}}), InvalidEnvironment);
}

}  // namespace
}  // namespace cellblock::contract
