// The SessionStores (SQLite, and PostgreSQL on a server the test starts itself), the StoreWriter thread and
// the state directory lock: what a restarted gateway (or another gateway on a shared store) relies on to find
// kernels and sessions again, and what must refuse to start rather than lose or corrupt them. The contract
// tests (StoreContract.*) run against both implementations.
#include "cellblock/gateway/store/store.hpp"

#include <gtest/gtest.h>
#include <poll.h>
#include <sqlite3.h>
#include <unistd.h>

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "cellblock/gateway/kernels/state_directory.hpp"
#include "cellblock/gateway/observability/log.hpp"
#include "cellblock/gateway/store/store_writer.hpp"
#include "postgres_server.hpp"

using namespace cellblock::gateway;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {
// A fresh directory of its own under $TMPDIR, removed with everything in it when the test ends.
class ScratchDirectory {
  public:
    explicit ScratchDirectory(const std::string& name) {
        std::string pattern = (fs::temp_directory_path() / ("cb-store-" + name + "-XXXXXX")).string();
        if (!::mkdtemp(pattern.data()))
            throw std::runtime_error("mkdtemp " + pattern + ": " + std::strerror(errno));
        path_ = pattern;
    }
    ~ScratchDirectory() {
        std::error_code ignored;
        fs::remove_all(path_, ignored);
    }
    ScratchDirectory(const ScratchDirectory&) = delete;
    ScratchDirectory& operator=(const ScratchDirectory&) = delete;
    const fs::path& path() const { return path_; }

  private:
    fs::path path_;
};

std::string read(const fs::path& file) {
    std::ifstream input(file, std::ios::binary);
    std::stringstream text;
    text << input.rdbuf();
    return text.str();
}

KernelRecord sample_kernel(const std::string& id) {
    KernelRecord kernel;
    kernel.id = id;
    kernel.spec_name = "cellblock-python";
    kernel.key = "secret";
    kernel.endpoint_base = "/tmp/k-1";
    kernel.connection_file = "/tmp/kernel-" + id + ".json";
    kernel.workspace_dir = "/tmp/ws-" + id;
    kernel.log_file = "/tmp/kernel-" + id + ".log";
    kernel.environment = {{"PATH", "/usr/bin"}};
    kernel.process = *ProcessIdentity::of(::getpid());
    kernel.created = "2026-12-01T10:00:00.000000Z";
    return kernel;
}
}  // namespace

// Opens the same store again and again: a file in a scratch directory, or a database on a server of the
// test's own.
class StoreContract : public ::testing::TestWithParam<std::string> {
  protected:
    void SetUp() override {
        if (GetParam() == "postgres")
            server_ = std::make_unique<cellblock::test::TemporaryPostgres>();
        else
            scratch_.emplace("contract");
    }
    std::unique_ptr<SessionStore> open() {
        return server_ ? open_postgres_store(server_->url())
                       : open_sqlite_store(scratch_->path() / "store.sqlite3");
    }
    std::unique_ptr<cellblock::test::TemporaryPostgres> server_;
    std::optional<ScratchDirectory> scratch_;
};
INSTANTIATE_TEST_SUITE_P(Stores, StoreContract, ::testing::Values("sqlite", "postgres"),
                         [](const auto& info) { return info.param; });

TEST_P(StoreContract, KeepsKernelsSessionsCellsAndAuditAcrossReopening) {
    {
        auto store = open();
        KernelRecord kernel = sample_kernel("k1");
        kernel.owner = "host:/state/a";
        store->put_kernel(kernel);
        store->put_kernel(sample_kernel("k2"));
        store->set_kernel_progress("k1", "msg-7");
        store->set_kernel_activity("k1", "2026-12-01T10:05:00.000000Z");
        store->put_agent_session({{"id", "s1"}, {"name", "alpha"}, {"kernel_id", "k1"}});
        store->put_agent_session({{"id", "s1"}, {"name", "alpha"}, {"kernel_id", "k2"}});
        store->append_cell("s1", {{"source", "x = 1"}});
        store->append_cell("s1", {{"source", "x"}});
        store->put_inflight({"s1", "m1", {{"code", "print(x)"}}});
        store->append_audit(
            {{"session", "s1"}, {"time", "2026-12-01T10:00:00.000000Z"}, {"event", "created"}});
        store->append_audit(
            {{"session", "s1"}, {"time", "2026-12-01T11:00:00.000000Z"}, {"event", "execute"}});
        store->put_jupyter_session("j1", {{"id", "j1"}, {"kernel_id", "k1"}});
    }
    if (!server_)
        EXPECT_EQ(fs::status(scratch_->path() / "store.sqlite3").permissions() & fs::perms::all,
                  fs::perms::owner_read | fs::perms::owner_write);
    auto store = open();
    const auto kernels = store->kernels();
    ASSERT_EQ(kernels.size(), 2u);
    const auto k1 = store->kernel("k1");
    ASSERT_TRUE(k1.has_value());
    EXPECT_EQ(k1->key, "secret");
    EXPECT_EQ(k1->last_iopub_id, "msg-7");
    EXPECT_EQ(k1->environment.value("PATH", ""), "/usr/bin");
    EXPECT_EQ(k1->process, *ProcessIdentity::of(::getpid()));
    EXPECT_EQ(k1->owner, "host:/state/a");
    EXPECT_EQ(k1->last_activity, "2026-12-01T10:05:00.000000Z");
    EXPECT_EQ(store->kernel("k2")->owner, "");
    EXPECT_FALSE(store->kernel("k3").has_value());
    ASSERT_EQ(store->agent_sessions().size(), 1u);
    ASSERT_TRUE(store->agent_session("s1").has_value());
    EXPECT_EQ(store->agent_session("s1")->value("kernel_id", ""), "k2");
    EXPECT_FALSE(store->agent_session("s2").has_value());
    ASSERT_EQ(store->cells("s1").size(), 2u);
    EXPECT_EQ(store->cells("s1")[1].value("source", ""), "x");
    ASSERT_EQ(store->inflight("s1").size(), 1u);
    EXPECT_EQ(store->inflight("s1")[0].request.value("code", ""), "print(x)");
    EXPECT_EQ(store->audit({"s1", "", "", ""}).size(), 2u);
    EXPECT_EQ(store->audit({"s1", "execute", "", ""}).size(), 1u);
    EXPECT_EQ(store->audit({"s1", "", "2026-12-01T10:30:00.000000Z", ""}).size(), 1u);
    EXPECT_EQ(store->audit({"s1", "", "", "2026-12-01T10:30:00.000000Z"}).size(), 1u);
    EXPECT_EQ(store->jupyter_sessions().size(), 1u);
    store->remove_jupyter_session("j1");
    store->clear_cells("s1");
    store->remove_inflight("s1", "m1");
    store->remove_kernel("k1");
    EXPECT_TRUE(store->jupyter_sessions().empty());
    EXPECT_TRUE(store->cells("s1").empty());
    EXPECT_TRUE(store->inflight("s1").empty());
    EXPECT_EQ(store->kernels().size(), 1u);
}

TEST_P(StoreContract, ABatchCommitsTogetherAndAFailingWriteIsRolledBackAlone) {
    auto store = open();
    std::vector<std::string> failures;
    store->write_batch({[](SessionStore& s) {
                            s.append_cell("s", {{"n", 1}});
                        },
                        [](SessionStore& s) {
                            s.append_cell("s", {{"n", "half of a failed write"}});
                            throw StoreError("disk full");
                        },
                        [](SessionStore& s) {
                            s.append_cell("s", {{"n", 3}});
                        }},
                       [&failures](const std::exception& error) { failures.push_back(error.what()); });
    ASSERT_EQ(failures.size(), 1u);
    EXPECT_EQ(failures[0], "disk full");
    auto reopened = open();
    const auto cells = reopened->cells("s");
    ASSERT_EQ(cells.size(), 2u);
    EXPECT_EQ(cells[0].value("n", 0), 1);
    EXPECT_EQ(cells[1].value("n", 0), 3);
}

// Five sessions, each with a cell, an execute in flight and two audit entries: deleted before the cut-off,
// deleted after it, live, and two deleted by a gateway older than `deleted_at` (their time is their newest
// audit entry), one of each side of the cut-off.
TEST_P(StoreContract, PurgesOnlySessionsDeletedBeforeTheCutOffWithEverythingTheyLeft) {
    const std::string cut_off = "2026-12-01T00:00:00.000000Z";
    struct Sample {
        std::string id;
        json record;
        std::string last_audit;
        bool purged;
    };
    const std::vector<Sample> samples = {
        {"old",
         {{"deleted", true}, {"deleted_at", "2026-11-30T23:59:59.999999Z"}},
         "2026-12-02T00:00:00.000000Z",
         true},
        {"recent",
         {{"deleted", true}, {"deleted_at", "2026-12-01T00:00:00.000000Z"}},
         "2026-11-01T00:00:00.000000Z",
         false},
        {"live", {{"deleted", false}}, "2026-10-01T00:00:00.000000Z", false},
        {"legacy-old", {{"deleted", true}}, "2026-11-15T08:00:00.000000Z", true},
        {"legacy-recent", {{"deleted", true}}, "2026-12-01T08:00:00.000000Z", false},
    };
    {
        auto store = open();
        for (const Sample& sample : samples) {
            json record = sample.record;
            record["id"] = sample.id;
            record["name"] = "name-" + sample.id;
            store->put_agent_session(record);
            store->append_cell(sample.id, {{"source", "x = 1"}});
            store->put_inflight({sample.id, "m-" + sample.id, {{"code", "x"}}});
            store->append_audit(
                {{"session", sample.id}, {"time", "2026-09-01T00:00:00.000000Z"}, {"event", "a"}});
            store->append_audit({{"session", sample.id}, {"time", sample.last_audit}, {"event", "b"}});
        }
        EXPECT_EQ(store->purge_deleted_agent_sessions(cut_off), 2u);
        EXPECT_EQ(store->purge_deleted_agent_sessions(cut_off), 0u);
    }
    auto store = open();
    EXPECT_EQ(store->agent_sessions().size(), 3u);
    for (const Sample& sample : samples) {
        SCOPED_TRACE(sample.id);
        EXPECT_EQ(store->agent_session(sample.id).has_value(), !sample.purged);
        EXPECT_EQ(store->cells(sample.id).size(), sample.purged ? 0u : 1u);
        EXPECT_EQ(store->inflight(sample.id).size(), sample.purged ? 0u : 1u);
        EXPECT_EQ(store->audit({sample.id, "", "", ""}).size(), sample.purged ? 0u : 2u);
    }
}

TEST_P(StoreContract, StoreWriterAppliesWritesInOrderAndNotifiesAfterEverythingQueuedBefore) {
    auto store = open();
    boost::asio::io_context io;
    auto work = boost::asio::make_work_guard(io);
    const Logger logger(LogLevel::error);
    StoreWriter writer(io, logger, *store);
    for (int i = 0; i < 50; ++i)
        writer.submit([i](SessionStore& s) { s.append_cell("s", {{"n", i}}); });
    std::vector<json> seen;
    writer.after_pending([&] {
        seen = writer.store().cells("s");
        io.stop();
    });
    io.run();
    ASSERT_EQ(seen.size(), 50u);
    for (int i = 0; i < 50; ++i)
        EXPECT_EQ(seen[static_cast<std::size_t>(i)].value("n", -1), i);
}

TEST(PostgresStore, ALeaseHasOneHolderAcrossGatewaysAndEndsWithTheHoldersConnection) {
    cellblock::test::TemporaryPostgres server;
    auto gateway_a = open_postgres_store(server.url());
    auto gateway_b = open_postgres_store(server.url());
    EXPECT_TRUE(gateway_a->shared());
    EXPECT_TRUE(gateway_a->try_lease("agent-session:s1"));
    EXPECT_FALSE(gateway_b->try_lease("agent-session:s1"));
    EXPECT_TRUE(gateway_b->try_lease("agent-session:s2"));
    EXPECT_TRUE(gateway_a->holds_lease("agent-session:s1"));
    EXPECT_FALSE(gateway_b->holds_lease("agent-session:s1"));
    EXPECT_FALSE(gateway_a->holds_lease("agent-session:s2"));
    gateway_a->release_lease("agent-session:s1");
    EXPECT_FALSE(gateway_a->holds_lease("agent-session:s1"));
    EXPECT_TRUE(gateway_b->try_lease("agent-session:s1"));
    EXPECT_FALSE(gateway_a->try_lease("agent-session:s1"));
    gateway_b.reset();  // the holder goes away (a killed gateway's connection ends the same way)
    bool taken = false;
    for (int attempt = 0; attempt < 100 && !taken; ++attempt) {
        taken = gateway_a->try_lease("agent-session:s1").has_value();
        if (!taken)
            ::usleep(50000);
    }
    EXPECT_TRUE(taken);
    // A batch on the writer's connection does not see or disturb the leases of the primary one.
    gateway_a->write_batch({[](SessionStore& s) {
                               s.append_cell("s", {{"n", 1}});
                           }},
                           [](const std::exception&) { FAIL(); });
    EXPECT_EQ(gateway_a->cells("s").size(), 1u);
}

// A lease's row counts its takings (the token starts at 1); it goes with the kernel (its restart lease, its
// Slurm jobs' watch leases) or purged session it is for, so the leases table does not grow with every kernel
// and session ever made.
TEST(PostgresStore, ALeasesRowGoesWithItsKernelOrPurgedSession) {
    cellblock::test::TemporaryPostgres server;
    auto store = open_postgres_store(server.url());
    store->put_kernel(sample_kernel("k1"));
    store->put_agent_session(
        {{"id", "s1"}, {"name", "s1"}, {"deleted", true}, {"deleted_at", "2026-11-01T00:00:00Z"}});
    for (const std::string lease :
         {"kernel-restart:k1", "agent-session:s1", "slurm-watch:k1:101", "slurm-watch:k10:102"}) {
        ASSERT_EQ(store->try_lease(lease), 1) << lease;
        store->release_lease(lease);
        ASSERT_EQ(store->try_lease(lease), 2) << lease;
        store->release_lease(lease);
    }
    store->remove_kernel("k1");
    EXPECT_EQ(store->purge_deleted_agent_sessions("2026-12-01T00:00:00.000000Z"), 1u);
    EXPECT_EQ(store->try_lease("kernel-restart:k1"), 1) << "the restart lease's row outlived its kernel";
    EXPECT_EQ(store->try_lease("slurm-watch:k1:101"), 1) << "a job's watch lease's row outlived its kernel";
    EXPECT_EQ(store->try_lease("slurm-watch:k10:102"), 3) << "another kernel's watch lease's row went too";
    EXPECT_EQ(store->try_lease("agent-session:s1"), 1)
        << "the execute lease's row outlived its purged session";
}

// A taking that finds the lease's row held by the previous holder's open fenced batch waits at most 2 s
// (lock_timeout), then says so and lets go of the advisory lock it got: a later taking by anyone succeeds.
TEST(PostgresStore, ATakingBehindTheLastHoldersOpenBatchGivesUpAfterTwoSecondsAndLetsGo) {
    cellblock::test::TemporaryPostgres server;
    auto gateway_a = open_postgres_store(server.url());
    auto gateway_b = open_postgres_store(server.url());
    auto gateway_c = open_postgres_store(server.url());
    const auto token = gateway_a->try_lease("agent-session:s1");
    ASSERT_EQ(token, 1);
    std::mutex mutex;
    std::condition_variable changed;
    bool row_held = false, finish = false;
    std::thread batch([&] {
        gateway_a->write_batch(
            {[&](SessionStore& s) {
                EXPECT_TRUE(s.append_cell_fenced("s1", {{"n", 1}}, {"agent-session:s1", *token}));
                std::unique_lock lock(mutex);
                row_held = true;
                changed.notify_all();
                changed.wait_for(lock, std::chrono::seconds(20), [&] { return finish; });
            }},
            [](const std::exception&) { FAIL(); });
    });
    {
        std::unique_lock lock(mutex);
        ASSERT_TRUE(changed.wait_for(lock, std::chrono::seconds(10), [&] { return row_held; }));
    }
    gateway_a->release_lease("agent-session:s1");
    const auto asked = std::chrono::steady_clock::now();
    EXPECT_ANY_THROW(gateway_b->try_lease("agent-session:s1"));
    const auto waited = std::chrono::steady_clock::now() - asked;
    EXPECT_GE(waited, std::chrono::milliseconds(1500));
    EXPECT_LT(waited, std::chrono::seconds(8)) << "the taking waited past its lock_timeout";
    {
        std::lock_guard lock(mutex);
        finish = true;
    }
    changed.notify_all();
    batch.join();
    EXPECT_EQ(gateway_c->try_lease("agent-session:s1"), 2) << "the failed taking kept the lease's lock";
}

TEST(PostgresStore, EachTakingOfALeaseHasALargerTokenAndWritesUnderAnOlderOneAreRefused) {
    cellblock::test::TemporaryPostgres server;
    auto gateway_a = open_postgres_store(server.url());
    auto gateway_b = open_postgres_store(server.url());
    const auto first = gateway_a->try_lease("agent-session:s1");
    ASSERT_TRUE(first);
    const LeaseFence stale{"agent-session:s1", *first};
    EXPECT_TRUE(gateway_a->append_cell_fenced("s1", {{"by", "a"}}, stale));
    EXPECT_TRUE(gateway_a->put_inflight_fenced({"s1", "m-a", {{"code", "a"}}}, stale));
    gateway_a->release_lease("agent-session:s1");  // as a dropped connection would
    const auto second = gateway_b->try_lease("agent-session:s1");
    ASSERT_TRUE(second);
    EXPECT_GT(*second, *first);
    const LeaseFence current{"agent-session:s1", *second};
    // Inside a batch (the writer's connection), as the gateway writes them.
    bool refused_cell = false, refused_inflight = false, cell_of_b = false;
    gateway_a->write_batch({[&](SessionStore& s) {
                               refused_cell = !s.append_cell_fenced("s1", {{"by", "a late"}}, stale);
                               refused_inflight = !s.put_inflight_fenced({"s1", "m-late", {}}, stale);
                           }},
                           [](const std::exception&) { FAIL(); });
    gateway_b->write_batch({[&](SessionStore& s) {
                               cell_of_b = s.append_cell_fenced("s1", {{"by", "b"}}, current);
                           }},
                           [](const std::exception&) { FAIL(); });
    EXPECT_TRUE(refused_cell);
    EXPECT_TRUE(refused_inflight);
    EXPECT_TRUE(cell_of_b);
    const auto cells = gateway_a->cells("s1");
    ASSERT_EQ(cells.size(), 2u);
    EXPECT_EQ(cells[0].value("by", ""), "a");
    EXPECT_EQ(cells[1].value("by", ""), "b");
    ASSERT_EQ(gateway_a->inflight("s1").size(), 1u);
    // A takes the lease again (twice: its own later taking refuses none of its writes); its first token stays
    // fenced off, as B held the lease in between.
    gateway_b->release_lease("agent-session:s1");
    const auto third = gateway_a->try_lease("agent-session:s1");
    const auto fourth = gateway_a->try_lease("agent-session:s1");
    ASSERT_TRUE(third && fourth);
    EXPECT_GT(*fourth, *third);
    EXPECT_TRUE(gateway_a->append_cell_fenced("s1", {{"by", "a again"}}, {"agent-session:s1", *third}));
    EXPECT_FALSE(gateway_a->append_cell_fenced("s1", {{"by", "a stale"}}, stale));
    EXPECT_EQ(gateway_a->cells("s1").size(), 3u);
    // An unknown lease fences off everything; the embedded store grants every lease, with growing tokens.
    EXPECT_FALSE(gateway_a->append_cell_fenced("s1", {}, {"agent-session:never", 1}));
    ScratchDirectory scratch("fenced");
    auto embedded = open_sqlite_store(scratch.path() / "store.sqlite3");
    const auto one = embedded->try_lease("x"), two = embedded->try_lease("x");
    ASSERT_TRUE(one && two);
    EXPECT_GT(*two, *one);
    EXPECT_TRUE(embedded->append_cell_fenced("s1", {{"n", 1}}, {"x", *one}));
}

// Two gateways' batches that update the same rows in another order deadlock. The server's victim gives up its
// whole batch, and its locks with it, for StoreWriter to apply again (StoreUnavailable); rolled back to the
// failed write's savepoint alone, it would go on holding them, and each later write of it on the other's rows
// would be a deadlock again (one deadlock_timeout, 1 s, each) and be dropped.
TEST(PostgresStore, ABatchChosenAsADeadlocksVictimIsRolledBackWholeToBeAppliedAgain) {
    cellblock::test::TemporaryPostgres server;
    auto gateway_a = open_postgres_store(server.url());
    auto gateway_b = open_postgres_store(server.url());
    gateway_a->put_kernel(sample_kernel("k1"));
    gateway_a->put_kernel(sample_kernel("k2"));
    // Each batch updates one kernel's row, waits until the other batch has updated the other kernel's, then
    // updates that one five times (as the gateways' 200 ms progress flushes do): the first of these
    // deadlocks.
    std::mutex mutex;
    std::condition_variable changed;
    int first_rows_updated = 0;
    using Writes = std::vector<std::function<void(SessionStore&)>>;
    auto batch = [&](const std::string& first, const std::string& then, const std::string& by) {
        Writes writes{[&, first, by](SessionStore& s) {
            s.set_kernel_progress(first, by);
            std::unique_lock lock(mutex);
            ++first_rows_updated;
            changed.notify_all();
            changed.wait_for(lock, std::chrono::seconds(10), [&] { return first_rows_updated >= 2; });
        }};
        for (int n = 0; n < 5; ++n)
            writes.emplace_back(
                [then, by, n](SessionStore& s) { s.set_kernel_progress(then, by + std::to_string(n)); });
        return writes;
    };
    struct Outcome {
        bool to_apply_again = false;
        int dropped_writes = 0;
    };
    auto apply = [](SessionStore& store, const Writes& writes, Outcome& outcome) {
        try {
            store.write_batch(writes, [&](const std::exception&) { ++outcome.dropped_writes; });
        } catch (const StoreUnavailable&) {
            outcome.to_apply_again = true;
        }
    };
    const Writes batch_a = batch("k1", "k2", "a"), batch_b = batch("k2", "k1", "b");
    Outcome a, b;
    std::thread thread_a([&] { apply(*gateway_a, batch_a, a); });
    apply(*gateway_b, batch_b, b);
    thread_a.join();
    EXPECT_EQ(a.dropped_writes + b.dropped_writes, 0) << "writes of the deadlock's victim were dropped";
    ASSERT_NE(a.to_apply_again, b.to_apply_again) << "the deadlock's victim is to be applied again, alone";
    // Applied again, as StoreWriter does, the victim's batch goes through whole, after the other one.
    const bool victim_a = a.to_apply_again;
    Outcome again;
    apply(victim_a ? *gateway_a : *gateway_b, victim_a ? batch_a : batch_b, again);
    EXPECT_FALSE(again.to_apply_again);
    EXPECT_EQ(again.dropped_writes, 0);
    const std::string victim = victim_a ? "a" : "b";
    EXPECT_EQ(gateway_a->kernel(victim_a ? "k1" : "k2")->last_iopub_id, victim);
    EXPECT_EQ(gateway_a->kernel(victim_a ? "k2" : "k1")->last_iopub_id, victim + "4");
}

TEST(PostgresStore, AReleaseOfALeaseIsHeardOnTheListeningConnectionWithoutWaiting) {
    cellblock::test::TemporaryPostgres server;
    auto gateway_a = open_postgres_store(server.url());
    auto gateway_b = open_postgres_store(server.url());
    auto heard = gateway_b->listen_for_lease_releases();
    ASSERT_TRUE(heard);
    ASSERT_GE(heard->socket(), 0);
    EXPECT_TRUE(heard->take().empty());  // nothing received: answers at once
    ASSERT_TRUE(gateway_a->try_lease("agent-session:s1"));
    gateway_a->release_lease("agent-session:s1");
    pollfd readable{heard->socket(), POLLIN, 0};
    ASSERT_EQ(::poll(&readable, 1, 5000), 1);
    std::vector<std::string> names = heard->take();
    for (int attempt = 0; attempt < 50 && names.empty(); ++attempt) {
        ::usleep(10000);  // the notice may come in more than one read
        names = heard->take();
    }
    EXPECT_EQ(names, std::vector<std::string>{"agent-session:s1"});
    ScratchDirectory scratch("listen");
    EXPECT_EQ(open_sqlite_store(scratch.path() / "store.sqlite3")->listen_for_lease_releases(), nullptr);
}

TEST(PostgresStore, ABadUrlAnUnreachableServerAndAForeignOrNewerSchemaAreRefusedWithTheReason) {
    cellblock::test::TemporaryPostgres server;
    auto message_of = [](const std::string& url) {
        try {
            open_postgres_store(url);
        } catch (const StoreError& error) {
            return std::string(error.what());
        }
        return std::string("opened");
    };
    EXPECT_NE(message_of("postgresql://[not a url").find("cannot connect"), std::string::npos);
    const std::string unreachable =
        message_of("postgresql://cellblock:hunter2@127.0.0.1:1/postgres?connect_timeout=3");
    EXPECT_NE(unreachable.find("cannot connect"), std::string::npos) << unreachable;
    EXPECT_EQ(unreachable.find("hunter2"), std::string::npos) << "the password was printed: " << unreachable;
    server.psql("CREATE DATABASE other");
    server.psql("CREATE TABLE invoices (id integer)", "other");
    const std::string foreign = message_of(server.url("other"));
    EXPECT_NE(foreign.find("not a cellblock store"), std::string::npos) << foreign;
    server.psql("SELECT count(*) FROM invoices", "other");  // left as it was
    { auto store = open_postgres_store(server.url()); }
    server.psql("INSERT INTO schema_migrations (version, applied) VALUES (999, 'future')");
    const std::string newer = message_of(server.url());
    EXPECT_NE(newer.find("newer"), std::string::npos) << newer;
}

TEST(SqliteStore, KeepsWhereAKernelRunsAndUpgradesAVersionOneStore) {
    const ScratchDirectory scratch("provisioner");
    const fs::path& directory = scratch.path();
    // A store written by a gateway before kernels could run elsewhere (schema 1): its kernels come back as
    // local ones.
    {
        sqlite3* raw = nullptr;
        ASSERT_EQ(sqlite3_open((directory / "store.sqlite3").c_str(), &raw), SQLITE_OK);
        const char* version_one = R"sql(
            CREATE TABLE schema_migrations (version INTEGER PRIMARY KEY, applied TEXT NOT NULL);
            INSERT INTO schema_migrations VALUES (1, 'earlier');
            CREATE TABLE kernels (
                id TEXT PRIMARY KEY, spec_name TEXT NOT NULL, key TEXT NOT NULL, endpoint_base TEXT NOT NULL,
                connection_file TEXT NOT NULL, workspace_dir TEXT NOT NULL, log_file TEXT NOT NULL,
                pid INTEGER NOT NULL, start_ticks INTEGER NOT NULL, boot_id TEXT NOT NULL,
                pooled INTEGER NOT NULL, last_iopub_id TEXT NOT NULL DEFAULT '', created TEXT NOT NULL,
                environment TEXT NOT NULL);
            CREATE TABLE jupyter_sessions (id TEXT PRIMARY KEY, model TEXT NOT NULL);
            CREATE TABLE agent_sessions (id TEXT PRIMARY KEY, record TEXT NOT NULL);
            CREATE TABLE cells (seq INTEGER PRIMARY KEY AUTOINCREMENT, session TEXT NOT NULL, cell TEXT NOT NULL);
            CREATE TABLE inflight_executes (session TEXT NOT NULL, msg_id TEXT NOT NULL, request TEXT NOT NULL,
                                            PRIMARY KEY (session, msg_id));
            CREATE TABLE audit (seq INTEGER PRIMARY KEY AUTOINCREMENT, session TEXT NOT NULL, time TEXT NOT NULL,
                                event TEXT NOT NULL, entry TEXT NOT NULL);
            INSERT INTO kernels VALUES ('old', 'cellblock-python', 'k', '/tmp/k', '/tmp/c', '/tmp/w', '/tmp/l',
                                        1, 2, 'boot', 0, '', '2026-11-01T00:00:00Z', '{}');
        )sql";
        ASSERT_EQ(sqlite3_exec(raw, version_one, nullptr, nullptr, nullptr), SQLITE_OK)
            << sqlite3_errmsg(raw);
        sqlite3_close(raw);
    }
    const json slurm = {{"name", "slurm"},
                        {"job_id", "42"},
                        {"host", "node7"},
                        {"ip", "10.0.0.7"},
                        {"ports", {5001, 5002, 5003, 5004, 5005}},
                        {"curve_public_key", std::string(40, 'x')}};
    {
        auto store = open_sqlite_store(directory / "store.sqlite3");
        auto kernels = store->kernels();
        ASSERT_EQ(kernels.size(), 1u);
        EXPECT_EQ(kernels[0].id, "old");
        EXPECT_EQ(kernels[0].provisioner, json::object());
        KernelRecord on_slurm = sample_kernel("on-slurm");
        on_slurm.provisioner = slurm;
        store->put_kernel(on_slurm);
    }
    auto store = open_sqlite_store(directory / "store.sqlite3");
    for (const KernelRecord& kernel : store->kernels()) {
        if (kernel.id == "on-slurm") {
            EXPECT_EQ(kernel.provisioner, slurm);
        }
    }
    EXPECT_EQ(store->kernels().size(), 2u);
}

TEST(SqliteStore, RefusesAFileThatIsNotADatabaseAndLeavesItUntouched) {
    const ScratchDirectory scratch("corrupt");
    const fs::path& directory = scratch.path();
    const fs::path file = directory / "store.sqlite3";
    const std::string garbage = "this is not a database, but somebody's notes\n";
    std::ofstream(file) << garbage;
    try {
        open_sqlite_store(file);
        FAIL() << "a corrupt store was opened";
    } catch (const StoreError& error) {
        EXPECT_NE(std::string(error.what()).find("untouched"), std::string::npos) << error.what();
    }
    EXPECT_EQ(read(file), garbage);
    EXPECT_FALSE(fs::exists(directory / "store.sqlite3-wal"));
}

TEST(SqliteStore, RefusesAnotherApplicationsDatabaseAndANewerSchema) {
    const ScratchDirectory scratch("foreign");
    const fs::path& directory = scratch.path();
    {
        sqlite3* raw = nullptr;
        ASSERT_EQ(sqlite3_open((directory / "other.db").c_str(), &raw), SQLITE_OK);
        sqlite3_exec(raw, "CREATE TABLE invoices (id INTEGER)", nullptr, nullptr, nullptr);
        sqlite3_close(raw);
    }
    EXPECT_THROW(open_sqlite_store(directory / "other.db"), StoreError);
    { auto store = open_sqlite_store(directory / "store.sqlite3"); }
    {
        sqlite3* raw = nullptr;
        ASSERT_EQ(sqlite3_open((directory / "store.sqlite3").c_str(), &raw), SQLITE_OK);
        sqlite3_exec(raw, "INSERT INTO schema_migrations (version, applied) VALUES (999, 'future')", nullptr,
                     nullptr, nullptr);
        sqlite3_close(raw);
    }
    try {
        open_sqlite_store(directory / "store.sqlite3");
        FAIL() << "a store from a newer gateway was opened";
    } catch (const StoreError& error) {
        EXPECT_NE(std::string(error.what()).find("newer"), std::string::npos) << error.what();
    }
}

TEST(StoreWriter, AFailedWriteIsLoggedAndLaterWritesStillHappen) {
    const ScratchDirectory scratch("failure");
    const fs::path& directory = scratch.path();
    auto store = open_sqlite_store(directory / "store.sqlite3");
    boost::asio::io_context io;
    const Logger logger(LogLevel::error);
    {
        StoreWriter writer(io, logger, *store);
        writer.submit([](SessionStore&) { throw StoreError("disk full"); });
        writer.submit([](SessionStore& s) { s.append_cell("s", {{"ok", true}}); });
        writer.drain();
    }
    ASSERT_EQ(store->cells("s").size(), 1u);
}

TEST(StateDirectory, ASecondGatewayOnTheSameDirectoryIsRefusedWithTheOwnersPid) {
    const ScratchDirectory scratch("lock");
    const fs::path directory = scratch.path() / "state";
    StateDirectory first(directory);
    EXPECT_EQ(fs::status(directory).permissions() & fs::perms::all, fs::perms::owner_all);
    EXPECT_TRUE(fs::is_directory(first.runtime_dir()));
    // flock locks belong to the open file description: a second open in the same process conflicts too.
    try {
        StateDirectory second(directory);
        FAIL() << "two gateways locked one state directory";
    } catch (const std::runtime_error& error) {
        EXPECT_NE(std::string(error.what()).find("pid " + std::to_string(::getpid())), std::string::npos)
            << error.what();
    }
}

TEST(ProcessIdentity, TellsALiveProcessFromAReusedOrVanishedPid) {
    auto self = ProcessIdentity::of(::getpid());
    ASSERT_TRUE(self.has_value());
    EXPECT_TRUE(self->alive());
    ProcessIdentity reused = *self;
    reused.start_ticks += 1;  // same pid, another process
    EXPECT_FALSE(reused.alive());
    ProcessIdentity rebooted = *self;
    rebooted.boot_id = "another-boot";
    EXPECT_FALSE(rebooted.alive());
}
