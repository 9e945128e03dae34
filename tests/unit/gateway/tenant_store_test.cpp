// Tenants and their tokens in both stores, through the TenantDirectory the gateway resolves tokens with: a
// reopened store (a restarted gateway) knows every tenant, quota and live token; a revoked token or a removed
// tenant's is gone for good; the store holds digests only, under a key of the store secret.
#include <gtest/gtest.h>
#include <unistd.h>

#include <boost/asio/io_context.hpp>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "cellblock/gateway/access/tenants.hpp"
#include "cellblock/gateway/observability/log.hpp"
#include "cellblock/gateway/store/store_writer.hpp"
#include "postgres_server.hpp"

using namespace cellblock::gateway;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

StoreSecret secret_of(unsigned char fill) {
    std::array<unsigned char, StoreSecret::size> bytes{};
    bytes.fill(fill);
    return StoreSecret(bytes);
}

class TenantStore : public ::testing::TestWithParam<std::string> {
  protected:
    void SetUp() override {
        if (GetParam() == "postgres") {
            server_ = std::make_unique<cellblock::test::TemporaryPostgres>();
            return;
        }
        std::string pattern = (fs::temp_directory_path() / "cb-tenants-XXXXXX").string();
        ASSERT_TRUE(::mkdtemp(pattern.data())) << std::strerror(errno);
        directory_ = pattern;
    }
    void TearDown() override {
        std::error_code ignored;
        if (!directory_.empty())
            fs::remove_all(directory_, ignored);
    }
    std::unique_ptr<SessionStore> open() {
        return server_ ? open_postgres_store(server_->url())
                       : open_sqlite_store(directory_ / "store.sqlite3");
    }
    // A gateway's life over the store: `use` gets a loaded directory; everything it changed is committed
    // when this returns.
    template <class Use>
    void with_directory(const StoreSecret& secret, Use&& use) {
        auto store = open();
        boost::asio::io_context io;
        const Logger logger(LogLevel::error);
        StoreWriter writer(io, logger, *store);
        TenantDirectory tenants(writer, secret);
        tenants.load();
        use(tenants);
        writer.drain();
    }
    std::unique_ptr<cellblock::test::TemporaryPostgres> server_;
    fs::path directory_;
};
INSTANTIATE_TEST_SUITE_P(Stores, TenantStore, ::testing::Values("sqlite", "postgres"),
                         [](const auto& info) { return info.param; });

}  // namespace

TEST_P(TenantStore, AReopenedStoreKnowsTenantsQuotasAndLiveTokensAndNothingRevoked) {
    const StoreSecret secret = secret_of(7);
    std::string alice_agent, alice_approver, revoked, bob_agent;
    with_directory(secret, [&](TenantDirectory& tenants) {
        auto [alice, first] =
            tenants.add({{"name", "alice"}, {"quota", {{"sessions", 10}, {"executes", 0}}}});
        alice_agent = first.token;
        alice_approver = tenants.issue_token("alice", {{"role", "approver"}}).token;
        auto dropped = tenants.issue_token("alice", json::object());
        revoked = dropped.token;
        tenants.revoke_token("alice", dropped.record.id);
        bob_agent = tenants.add({{"name", "bob"}, {"self_approve", true}}).second.token;
        tenants.set_quota("bob", {{"quota", {{"memory_mb", 512}}}});
    });
    with_directory(secret, [&](TenantDirectory& tenants) {
        auto agent = tenants.resolve(alice_agent);
        ASSERT_TRUE(agent);
        EXPECT_EQ(agent->tenant, "alice");
        EXPECT_EQ(agent->role, Principal::Role::agent);
        EXPECT_FALSE(agent->token_id.empty());
        auto approver = tenants.resolve(alice_approver);
        ASSERT_TRUE(approver);
        EXPECT_EQ(approver->role, Principal::Role::approver);
        EXPECT_FALSE(tenants.resolve(revoked));
        EXPECT_EQ(tenants.get("alice").quota.to_json(),
                  json({{"sessions", 10}, {"memory_mb", nullptr}, {"executes", 0}}));
        EXPECT_TRUE(tenants.get("bob").self_approve);
        EXPECT_EQ(tenants.get("bob").quota.memory_mb, 512);
        EXPECT_EQ(tenants.tokens_of("alice").size(), 2u);
        tenants.remove("alice");
    });
    with_directory(secret, [&](TenantDirectory& tenants) {
        EXPECT_FALSE(tenants.resolve(alice_agent));
        EXPECT_FALSE(tenants.resolve(alice_approver));
        EXPECT_THROW(tenants.get("alice"), TenantRequestError);
        EXPECT_TRUE(tenants.resolve(bob_agent));
        EXPECT_EQ(open()->tenant_tokens().size(), 1u);
    });
    // Another store secret cannot use the digests: no token of a copied store works elsewhere.
    with_directory(secret_of(8), [&](TenantDirectory& tenants) { EXPECT_FALSE(tenants.resolve(bob_agent)); });
}

TEST(TenantSqliteStore, TheSqliteFileHoldsNoTokenAndNamesQuotasAndRolesAreChecked) {
    std::string pattern = (fs::temp_directory_path() / "cb-tenants-XXXXXX").string();
    ASSERT_TRUE(::mkdtemp(pattern.data()));
    const fs::path directory = pattern;
    std::string token;
    {
        auto store = open_sqlite_store(directory / "store.sqlite3");
        boost::asio::io_context io;
        const Logger logger(LogLevel::error);
        StoreWriter writer(io, logger, *store);
        TenantDirectory tenants(writer, secret_of(1));
        token = tenants.add({{"name", "carol-2"}}).second.token;
        auto refused = [&](const json& request, const std::string& field) {
            try {
                tenants.add(request);
                ADD_FAILURE() << request.dump() << " was accepted";
            } catch (const TenantRequestError& error) {
                EXPECT_EQ(error.field(), field) << request.dump();
            }
        };
        refused({{"name", "Carol"}}, "name");
        refused({{"name", std::string(65, 'a')}}, "name");
        refused(json::object(), "name");
        refused({{"name", "dave"}, {"quota", {{"sessions", -1}}}}, "quota.sessions");
        refused({{"name", "dave"}, {"quota", {{"cpus", 1}}}}, "quota.cpus");
        refused({{"name", "dave"}, {"self_approve", "yes"}}, "self_approve");
        refused({{"name", "carol-2"}}, "name");
        EXPECT_THROW(tenants.issue_token("carol-2", {{"role", "viewer"}}), TenantRequestError);
        EXPECT_THROW(tenants.issue_token("nobody", json::object()), TenantRequestError);
        writer.drain();
    }
    std::stringstream bytes;
    for (const auto& file : fs::directory_iterator(directory))
        bytes << std::ifstream(file.path(), std::ios::binary).rdbuf();
    EXPECT_NE(bytes.str().find("carol-2"), std::string::npos);
    EXPECT_EQ(bytes.str().find(token), std::string::npos);
    EXPECT_EQ(bytes.str().find(token.substr(4)), std::string::npos);
    std::error_code ignored;
    fs::remove_all(directory, ignored);
}
