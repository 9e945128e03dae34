// Host-side workspace access must not be fooled by what untrusted code plants in the workspace.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "cellblock/sandbox/sandbox.hpp"

namespace sb = cellblock::sandbox;
namespace fs = std::filesystem;
using Kind = sb::WorkspaceError::Kind;

namespace {

class WorkspaceTest : public ::testing::Test {
  protected:
    void SetUp() override {
        std::string pattern = (fs::temp_directory_path() / "cellblock-ws-test-XXXXXX").string();
        ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
        base_ = pattern;
        root_ = base_ / "ws";
        fs::create_directory(root_);
        secret_ = base_ / "host-secret.txt";
        std::ofstream(secret_) << "HOST-SECRET-CONTENT";
    }
    void TearDown() override { fs::remove_all(base_); }

    Kind kind_of(const std::function<void()>& action) {
        try {
            action();
        } catch (const sb::WorkspaceError& error) {
            return error.kind();
        }
        ADD_FAILURE() << "expected a WorkspaceError";
        return Kind::io;
    }

    std::string slurp(const fs::path& path) {
        std::ifstream in(path);
        return {std::istreambuf_iterator<char>(in), {}};
    }

    fs::path base_, root_, secret_;
};

}  // namespace

TEST_F(WorkspaceTest, WritesReadsListsAndRemovesRegularFiles) {
    sb::Workspace workspace(root_);
    workspace.write_file("data/report.csv", "a,b\n1,2\n", 1024);
    EXPECT_EQ(workspace.read_file("data/report.csv", 1024), "a,b\n1,2\n");
    workspace.write_file("data/report.csv", "replaced", 1024);
    EXPECT_EQ(workspace.read_file("data/report.csv", 1024), "replaced");
    const auto entries = workspace.list();
    ASSERT_EQ(entries.size(), 2U);
    workspace.remove_file("data/report.csv");
    EXPECT_EQ(kind_of([&] { workspace.read_file("data/report.csv", 1024); }), Kind::not_found);
}

TEST_F(WorkspaceTest, NewFilesBelongToTheWorkspaceOwner) {
    ASSERT_EQ(::chown(root_.c_str(), 123456, 123456), 0);
    sb::Workspace workspace(root_);
    workspace.write_file("sub/f.txt", "x", 10);
    struct stat info {};
    ASSERT_EQ(::stat((root_ / "sub/f.txt").c_str(), &info), 0);
    EXPECT_EQ(info.st_uid, 123456U);
    ASSERT_EQ(::stat((root_ / "sub").c_str(), &info), 0);
    EXPECT_EQ(info.st_uid, 123456U);
}

TEST_F(WorkspaceTest, PlantedSymlinkToAHostFileIsNotFollowed) {
    fs::create_symlink(secret_, root_ / "report.csv");
    sb::Workspace workspace(root_);
    EXPECT_EQ(kind_of([&] { workspace.read_file("report.csv", 1 << 20); }), Kind::bad_path);
    // Writing through the name must not modify the host file either.
    EXPECT_EQ(kind_of([&] { workspace.write_file("report.csv", "overwritten", 100); }), Kind::not_regular);
    EXPECT_EQ(slurp(secret_), "HOST-SECRET-CONTENT");
    // Removing removes the link only.
    workspace.remove_file("report.csv");
    EXPECT_TRUE(fs::exists(secret_));
}

TEST_F(WorkspaceTest, SymlinkedDirectoryComponentIsRefused) {
    fs::create_directory_symlink(base_, root_ / "escape");
    sb::Workspace workspace(root_);
    EXPECT_EQ(kind_of([&] { workspace.read_file("escape/host-secret.txt", 1 << 20); }), Kind::bad_path);
    EXPECT_EQ(kind_of([&] { workspace.write_file("escape/new.txt", "x", 10); }), Kind::bad_path);
    EXPECT_FALSE(fs::exists(base_ / "new.txt"));
    for (const auto& entry : workspace.list())
        EXPECT_NE(entry.path.rfind("escape/", 0), 0U) << entry.path;
}

TEST_F(WorkspaceTest, DotDotAndAbsolutePathsAreRefused) {
    sb::Workspace workspace(root_);
    EXPECT_EQ(kind_of([&] { workspace.read_file("../host-secret.txt", 1 << 20); }), Kind::bad_path);
    EXPECT_EQ(kind_of([&] { workspace.read_file("a/../../host-secret.txt", 1 << 20); }), Kind::bad_path);
    EXPECT_EQ(kind_of([&] { workspace.read_file(secret_.string(), 1 << 20); }), Kind::bad_path);
    EXPECT_EQ(kind_of([&] { workspace.write_file("../evil.txt", "x", 10); }), Kind::bad_path);
    EXPECT_EQ(kind_of([&] { workspace.read_file("", 10); }), Kind::bad_path);
    EXPECT_FALSE(fs::exists(base_ / "evil.txt"));
}

TEST_F(WorkspaceTest, PlantedFifoDoesNotBlockAndIsRefused) {
    ASSERT_EQ(::mkfifo((root_ / "out.txt").c_str(), 0666), 0);
    sb::Workspace workspace(root_);
    const auto started = std::chrono::steady_clock::now();
    EXPECT_EQ(kind_of([&] { workspace.read_file("out.txt", 1 << 20); }), Kind::not_regular);
    EXPECT_EQ(kind_of([&] { workspace.write_file("out.txt", "x", 10); }), Kind::not_regular);
    EXPECT_LT(std::chrono::steady_clock::now() - started, std::chrono::seconds(5));
    for (const auto& entry : workspace.list())
        EXPECT_NE(entry.path, "out.txt");
}

TEST_F(WorkspaceTest, HardLinkedFileIsNotRead) {
    fs::create_hard_link(secret_, root_ / "linked.txt");
    sb::Workspace workspace(root_);
    EXPECT_EQ(kind_of([&] { workspace.read_file("linked.txt", 1 << 20); }), Kind::not_regular);
    // Writing replaces the name; the other link keeps its content.
    workspace.write_file("linked.txt", "new content", 100);
    EXPECT_EQ(slurp(secret_), "HOST-SECRET-CONTENT");
    EXPECT_EQ(workspace.read_file("linked.txt", 100), "new content");
}

TEST_F(WorkspaceTest, SizesAreCapped) {
    sb::Workspace workspace(root_);
    std::ofstream(root_ / "big.bin") << std::string(5000, 'x');
    EXPECT_EQ(kind_of([&] { workspace.read_file("big.bin", 4999); }), Kind::too_large);
    EXPECT_EQ(workspace.read_file("big.bin", 5000).size(), 5000U);
    EXPECT_EQ(kind_of([&] { workspace.write_file("w.bin", std::string(100, 'y'), 99); }), Kind::too_large);
    EXPECT_FALSE(fs::exists(root_ / "w.bin"));
}

TEST_F(WorkspaceTest, DirectoriesAreNotFiles) {
    fs::create_directory(root_ / "dir");
    sb::Workspace workspace(root_);
    EXPECT_EQ(kind_of([&] { workspace.read_file("dir", 100); }), Kind::not_regular);
    EXPECT_EQ(kind_of([&] { workspace.remove_file("dir"); }), Kind::not_regular);
    EXPECT_EQ(kind_of([&] { workspace.read_file("missing.txt", 100); }), Kind::not_found);
}

TEST_F(WorkspaceTest, RootThatIsASymlinkIsRefused) {
    fs::create_directory_symlink(root_, base_ / "link-to-ws");
    EXPECT_THROW(sb::Workspace(base_ / "link-to-ws"), sb::WorkspaceError);
}

// remove_tree: the lease cleanup (and any removal of a directory untrusted code wrote into) must delete
// links, never what they point to.
TEST_F(WorkspaceTest, RemoveTreeRemovesEverythingInsideButNoLinkTarget) {
    const fs::path outside_dir = base_ / "outside-dir";
    fs::create_directory(outside_dir);
    std::ofstream(outside_dir / "keep.txt") << "KEEP";
    fs::create_directories(root_ / "a" / "b" / "c");
    std::ofstream(root_ / "a" / "b" / "c" / "deep.txt") << "x";
    std::ofstream(root_ / "top.txt") << "y";
    fs::create_symlink(secret_, root_ / "link-to-secret");
    fs::create_directory_symlink(outside_dir, root_ / "a" / "link-to-dir");
    ASSERT_EQ(::mkfifo((root_ / "a" / "fifo").c_str(), 0600), 0);
    sb::remove_tree(root_);

    EXPECT_FALSE(fs::exists(fs::symlink_status(root_)));
    EXPECT_EQ(slurp(secret_), "HOST-SECRET-CONTENT");
    EXPECT_EQ(slurp(outside_dir / "keep.txt"), "KEEP");
}

TEST_F(WorkspaceTest, RemoveTreeHandlesDeepTreesAndMissingDirectories) {
    fs::path deep = root_;
    for (int level = 0; level < 300; ++level) {
        deep /= "d";
    }
    fs::create_directories(deep);
    std::ofstream(deep / "bottom.txt") << "z";
    sb::remove_tree(root_);
    EXPECT_FALSE(fs::exists(root_));
    EXPECT_NO_THROW(sb::remove_tree(root_));  // already gone: nothing to do
    EXPECT_NO_THROW(sb::remove_tree(base_ / "never-existed" / "x"));
}

TEST_F(WorkspaceTest, RemoveTreeRefusesASymlinkAsTheTreeItself) {
    const fs::path outside_dir = base_ / "outside-dir";
    fs::create_directory(outside_dir);
    std::ofstream(outside_dir / "keep.txt") << "KEEP";
    const fs::path link = base_ / "tree-link";
    fs::create_directory_symlink(outside_dir, link);
    EXPECT_THROW(sb::remove_tree(link), sb::SandboxError);
    EXPECT_EQ(slurp(outside_dir / "keep.txt"), "KEEP");
    EXPECT_THROW(sb::remove_tree("/"), sb::SandboxError);
}

TEST_F(WorkspaceTest, RemoveTreeLeavesMountPointsInsideAlone) {
    if (::geteuid() != 0) {
        GTEST_SKIP() << "mounting a tmpfs inside the tree needs root";
    }
    const fs::path mount_point = root_ / "sub" / "mnt";
    fs::create_directories(mount_point);
    ASSERT_EQ(::system(("mount -t tmpfs -o size=1m cbtest " + mount_point.string()).c_str()), 0);
    std::ofstream(mount_point / "on-other-fs.txt") << "OTHER";
    std::ofstream(root_ / "sub" / "mine.txt") << "mine";
    try {
        sb::remove_tree(root_);
        ADD_FAILURE() << "a tree with a mount point inside cannot be removed completely";
    } catch (const sb::SandboxError& error) {
        EXPECT_NE(std::string(error.what()).find("mount point"), std::string::npos) << error.what();
    }
    EXPECT_EQ(slurp(mount_point / "on-other-fs.txt"), "OTHER");
    EXPECT_FALSE(fs::exists(root_ / "sub" / "mine.txt"));
    EXPECT_EQ(::system(("umount " + mount_point.string()).c_str()), 0);
}

// adopt_tree gives a workspace to a new session's uid: only what is inside the tree, never what a bind
// mount inside or a symlink leads to, and never a file hard-linked from outside.
TEST_F(WorkspaceTest, AdoptTreeChangesOnlyWhatIsInsideTheTreeAndItsMount) {
    if (::geteuid() != 0) {
        GTEST_SKIP() << "chown and mount need root";
    }
    constexpr uid_t session_uid = 281234;
    const fs::path outside = base_ / "outside";
    fs::create_directories(outside / "deep");
    std::ofstream(outside / "deep" / "host-file.txt") << "HOST";
    const fs::path mount_point = root_ / "sub" / "mnt";
    fs::create_directories(mount_point);
    ASSERT_EQ(::system(("mount --bind " + outside.string() + " " + mount_point.string()).c_str()), 0);
    std::ofstream(root_ / "sub" / "mine.txt") << "mine";
    fs::create_symlink(secret_, root_ / "link-to-secret");
    fs::create_directory_symlink(outside, root_ / "link-to-outside");
    fs::create_hard_link(secret_, root_ / "hardlink-to-secret");

    try {
        sb::adopt_tree(
            root_, session_uid, [](uid_t owner) { return owner == 0; }, 100000);
    } catch (const std::exception& error) {
        ADD_FAILURE() << error.what();
    }
    const auto owner = [](const fs::path& path) {
        struct stat info {};
        EXPECT_EQ(::lstat(path.c_str(), &info), 0) << path;
        return info.st_uid;
    };
    EXPECT_EQ(::system(("umount " + mount_point.string()).c_str()), 0);
    EXPECT_EQ(owner(root_ / "sub"), session_uid);
    EXPECT_EQ(owner(root_ / "sub" / "mine.txt"), session_uid);
    EXPECT_EQ(owner(root_ / "link-to-secret"), session_uid);  // the link itself
    EXPECT_EQ(owner(secret_), 0u);
    EXPECT_EQ(owner(outside), 0u);
    EXPECT_EQ(owner(outside / "deep"), 0u);
    EXPECT_EQ(owner(outside / "deep" / "host-file.txt"), 0u);
}
