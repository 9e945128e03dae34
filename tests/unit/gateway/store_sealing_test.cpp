// Kernels' HMAC keys at rest: the store's bytes never hold one (host-side: the SQLite file and its WAL are
// read back and searched), the gateway that holds the store secret reads them back, and nobody else does.
#include "cellblock/gateway/store/store_sealing.hpp"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace cellblock::gateway {
namespace {

namespace fs = std::filesystem;

class StoreSealing : public ::testing::Test {
  protected:
    void SetUp() override {
        std::string pattern = (fs::temp_directory_path() / "cb-sealing-XXXXXX").string();
        ASSERT_NE(::mkdtemp(pattern.data()), nullptr) << std::strerror(errno);
        root_ = pattern;
    }
    void TearDown() override { fs::remove_all(root_); }

    // Every byte the SQLite store left on disk (the database, its WAL and shared memory).
    std::string store_bytes() const {
        std::string all;
        for (const auto& entry : fs::directory_iterator(root_))
            if (entry.path().filename().string().starts_with("store.sqlite3")) {
                std::ifstream input(entry.path(), std::ios::binary);
                std::stringstream text;
                text << input.rdbuf();
                all += text.str();
            }
        return all;
    }

    static KernelRecord kernel(const std::string& id, const std::string& key) {
        KernelRecord record;
        record.id = id;
        record.spec_name = "cellblock-python";
        record.key = key;
        record.process = *ProcessIdentity::of(::getpid());
        return record;
    }

    fs::path root_;
};

TEST_F(StoreSealing, NoKernelKeyAppearsInTheStoresBytesAndTheGatewayReadsItBack) {
    const std::string key = "hmac-key-0123456789abcdef0123456789abcdef";
    const auto secret = StoreSecret::load(root_ / "store-key", true);
    {
        auto store = seal_kernel_keys(open_sqlite_store(root_ / "store.sqlite3"), secret);
        store->put_kernel(kernel("k1", key));
        store->write_batch({[&](SessionStore& batch) { batch.put_kernel(kernel("k2", key + "-2")); }},
                           [](const std::exception& error) { FAIL() << error.what(); });
        EXPECT_EQ(store->kernel("k1")->key, key);
        EXPECT_EQ(store->kernels().size(), 2u);
        EXPECT_EQ(store_bytes().find(key), std::string::npos) << "a key is in the store in plaintext";
    }
    EXPECT_EQ(store_bytes().find(key), std::string::npos);
    auto reopened = seal_kernel_keys(open_sqlite_store(root_ / "store.sqlite3"),
                                     StoreSecret::load(root_ / "store-key", false));
    EXPECT_EQ(reopened->kernel("k2")->key, key + "-2");
    // The secret is the operator's alone: mode 0600.
    struct stat status {};
    ASSERT_EQ(::stat((root_ / "store-key").c_str(), &status), 0);
    EXPECT_EQ(status.st_mode & 0777, 0600u);
}

TEST_F(StoreSealing, AnotherSecretOrAnAlteredRecordIsRefusedNotMisread) {
    const auto secret = StoreSecret::load(root_ / "store-key", true);
    const auto other = StoreSecret::load(root_ / "other-key", true);
    const std::string sealed = secret.seal("key", "k1");
    EXPECT_TRUE(StoreSecret::is_sealed(sealed));
    EXPECT_EQ(secret.open(sealed, "k1"), "key");
    EXPECT_THROW(other.open(sealed, "k1"), StoreError);
    EXPECT_THROW(secret.open(sealed, "k2"), StoreError) << "a sealed key moved to another kernel's record";
    std::string altered = sealed;
    // A character of a whole base64 group (every bit used): the nonce changes.
    altered[20] = altered[20] == 'A' ? 'B' : 'A';
    EXPECT_THROW(secret.open(altered, "k1"), StoreError);
    EXPECT_NE(secret.seal("key", "k1"), sealed) << "each seal has its own nonce";
}

TEST_F(StoreSealing, AKeyWrittenBeforeSealingIsReadAndSealedOnItsNextWrite) {
    {
        auto plain = open_sqlite_store(root_ / "store.sqlite3");
        plain->put_kernel(kernel("old", "legacy-plaintext-key-0123456789"));
    }
    auto store = seal_kernel_keys(open_sqlite_store(root_ / "store.sqlite3"),
                                  StoreSecret::load(root_ / "store-key", true));
    auto record = store->kernel("old");
    ASSERT_TRUE(record);
    EXPECT_EQ(record->key, "legacy-plaintext-key-0123456789");
    store->put_kernel(*record);
    store.reset();
    EXPECT_EQ(store_bytes().find("legacy-plaintext-key-0123456789"), std::string::npos);
}

TEST_F(StoreSealing, ASecretFileThatIsNotOneIsRefusedWithItsName) {
    std::ofstream(root_ / "bad") << "not hex\n";
    try {
        StoreSecret::load(root_ / "bad", false);
        FAIL() << "accepted";
    } catch (const StoreError& error) {
        EXPECT_NE(std::string(error.what()).find((root_ / "bad").string()), std::string::npos);
    }
    EXPECT_THROW(StoreSecret::load(root_ / "missing", false), StoreError);
}

// In transit: a store on another machine with no sslmode said would let libpq fall back to plaintext (keys,
// notebooks); the gateway refuses it with what to write. A local store, or any sslmode the operator wrote, is
// taken as it is.
TEST(StoreTransport, ARemoteStoreWithoutSslmodeIsRefusedWithWhatToWrite) {
    for (const char* remote : {"postgresql://alice@db.example/cellblock", "host=10.0.0.5 dbname=cellblock",
                               "postgresql://alice@localhost,db.example/cellblock"}) {
        const auto refusal = unencrypted_remote_store(remote);
        ASSERT_TRUE(refusal) << remote;
        EXPECT_NE(refusal->find("sslmode=verify-full"), std::string::npos) << *refusal;
    }
    for (const char* fine : {"postgresql://alice@db.example/cellblock?sslmode=verify-full",
                             "host=db.example sslmode=require", "host=db.example sslmode=disable",
                             "postgresql://alice@localhost/cellblock", "postgresql://alice@127.0.0.1:5433/x",
                             "host=/var/run/postgresql dbname=cellblock", "dbname=cellblock"})
        EXPECT_FALSE(unencrypted_remote_store(fine)) << fine;
}

}  // namespace
}  // namespace cellblock::gateway
