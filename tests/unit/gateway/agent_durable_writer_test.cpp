#include "cellblock/gateway/agent/durable_writer.hpp"
#include "cellblock/gateway/log.hpp"

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <unistd.h>

using namespace cellblock::gateway;
using namespace cellblock::gateway::agent;
namespace fs = std::filesystem;

namespace {
fs::path scratch_dir(const std::string& name) {
    fs::path directory = fs::temp_directory_path() / ("agent-writer-" + name + "-" + std::to_string(::getpid()));
    fs::remove_all(directory);
    fs::create_directories(directory);
    return directory;
}

std::string read(const fs::path& file) {
    std::ifstream input(file);
    std::stringstream text;
    text << input.rdbuf();
    return text.str();
}
}  // namespace

TEST(AgentDurableWriter, AppendsInOrderAndNotifiesAfterEverythingQueuedBefore) {
    const fs::path directory = scratch_dir("append");
    boost::asio::io_context io;
    const Logger logger(LogLevel::error);
    DurableWriter writer(io, logger);
    for (int i = 0; i < 50; ++i) writer.append_line(directory / "audit.jsonl", "{\"n\":" + std::to_string(i) + "}");
    std::string seen;
    auto keep_running = boost::asio::make_work_guard(io);  // the notification is posted later, from the writer thread
    writer.after_pending([&] {
        seen = read(directory / "audit.jsonl");
        keep_running.reset();
    });
    io.run_for(std::chrono::seconds(10));
    std::string expected;
    for (int i = 0; i < 50; ++i) expected += "{\"n\":" + std::to_string(i) + "}\n";
    EXPECT_EQ(seen, expected);
    EXPECT_EQ((fs::status(directory / "audit.jsonl").permissions() & fs::perms::all), fs::perms::owner_read | fs::perms::owner_write);
    fs::remove_all(directory);
}

TEST(AgentDurableWriter, ReplaceIsAtomicAndLeavesNoTemporaryFile) {
    const fs::path directory = scratch_dir("replace");
    boost::asio::io_context io;
    const Logger logger(LogLevel::error);
    {
        DurableWriter writer(io, logger);
        writer.replace_file(directory / "session.json", "first");
        writer.replace_file(directory / "session.json", "second");
        writer.drain();
    }
    EXPECT_EQ(read(directory / "session.json"), "second");
    EXPECT_FALSE(fs::exists(directory / "session.json.tmp"));
    fs::remove_all(directory);
}

TEST(AgentDurableWriter, AFailedWriteIsLoggedAndLaterWritesStillHappen) {
    const fs::path directory = scratch_dir("failure");
    boost::asio::io_context io;
    const Logger logger(LogLevel::error);  // the expected failure is logged on stderr
    {
        DurableWriter writer(io, logger);
        writer.append_line(directory / "missing-dir" / "audit.jsonl", "{}");
        writer.append_line(directory / "audit.jsonl", "{\"ok\":true}");
        writer.drain();
    }
    EXPECT_EQ(read(directory / "audit.jsonl"), "{\"ok\":true}\n");
    fs::remove_all(directory);
}
