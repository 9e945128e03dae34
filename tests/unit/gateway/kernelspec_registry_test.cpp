#include "cellblock/gateway/jupyter/kernelspec_registry.hpp"

#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>

using namespace cellblock::gateway;
namespace fs = std::filesystem;

namespace {
class KernelSpecDirectory : public ::testing::Test {
  protected:
    void SetUp() override {
        std::string pattern = (fs::temp_directory_path() / "cbgw-specs-XXXXXX").string();
        ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
        root_ = pattern;
    }
    void TearDown() override { fs::remove_all(root_); }
    void add_spec(const std::string& name, const std::string& display_name) {
        fs::create_directories(root_ / name);
        std::ofstream(root_ / name / "kernel.json")
            << R"({"argv": ["/bin/true", "{connection_file}"], "display_name": ")" << display_name
            << R"(", "language": "python"})";
    }
    fs::path root_;
};
}  // namespace

TEST_F(KernelSpecDirectory, Python3AliasPrefersCellblockWhenInstalled) {
    add_spec("python3", "ipykernel");
    add_spec("cellblock-python", "cellblock");
    KernelSpecRegistry registry({root_.string()}, {{"python3", "cellblock-python"}, {"python", "python3"}},
                                "python3");
    EXPECT_EQ(registry.find("python3")->spec["display_name"], "cellblock");
    EXPECT_EQ(registry.find("python")->spec["display_name"], "cellblock");
    EXPECT_EQ(registry.find("python")->name, "python3");  // reported like jupyter_client does
    EXPECT_FALSE(registry.find("nope"));
}

TEST_F(KernelSpecDirectory, AliasWithMissingTargetFallsBackToDirectory) {
    add_spec("python3", "ipykernel");
    KernelSpecRegistry registry({root_.string()}, {{"python3", "cellblock-python"}, {"python", "python3"}},
                                "python3");
    EXPECT_EQ(registry.find("python3")->spec["display_name"], "ipykernel");
    EXPECT_EQ(registry.find("python")->spec["display_name"], "ipykernel");
}

TEST_F(KernelSpecDirectory, ListingHasDefaultAndFullModels) {
    add_spec("cellblock-python", "cellblock");
    std::ofstream(root_ / "cellblock-python" / "logo-64x64.png") << "png";
    KernelSpecRegistry registry({root_.string()}, {{"python3", "cellblock-python"}}, "python3");
    auto listing = registry.list_model("/");
    EXPECT_EQ(listing["default"], "python3");
    ASSERT_TRUE(listing["kernelspecs"].contains("python3"));
    auto model = listing["kernelspecs"]["python3"];
    EXPECT_EQ(model["name"], "python3");
    EXPECT_EQ(model["spec"]["language"], "python");
    EXPECT_EQ(model["resources"]["logo-64x64"], "/kernelspecs/python3/logo-64x64.png");
}

TEST_F(KernelSpecDirectory, ResourcesStayInsideTheSpecDirectory) {
    add_spec("cellblock-python", "cellblock");
    KernelSpecRegistry registry({root_.string()}, {}, "cellblock-python");
    EXPECT_TRUE(registry.resource_path("cellblock-python", "kernel.json"));
    EXPECT_FALSE(registry.resource_path("cellblock-python", "../cellblock-python/kernel.json"));
    EXPECT_FALSE(registry.resource_path("cellblock-python", ".."));
    EXPECT_FALSE(registry.resource_path("cellblock-python", "missing.png"));
}

TEST_F(KernelSpecDirectory, BrokenKernelJsonIsIgnored) {
    fs::create_directories(root_ / "broken");
    std::ofstream(root_ / "broken" / "kernel.json") << "{not json";
    add_spec("ok", "fine");
    KernelSpecRegistry registry({root_.string(), "/nonexistent"}, {}, "ok");
    EXPECT_FALSE(registry.find("broken"));
    EXPECT_TRUE(registry.find("ok"));
}
