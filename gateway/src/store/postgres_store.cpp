// The shared SessionStore: PostgreSQL through libpq, for several gateways over one store. With
// sqlite_store.cpp the only file with SQL in it; the semantics are SqliteStore's (same tables, savepoint per
// write in a batch, versioned migrations, foreign or newer schemas refused).
#include <libpq-fe.h>

#include <array>
#include <atomic>
#include <chrono>
#include <mutex>
#include <random>
#include <regex>
#include <sstream>
#include <string_view>
#include <thread>

#include "cellblock/gateway/common/time_format.hpp"
#include "cellblock/gateway/store/store.hpp"

namespace cellblock::gateway {

using nlohmann::json;

namespace {

constexpr int current_schema_version = 3;

// Each migration brings the schema from version N-1 to N; all pending ones run in one transaction under
// an advisory lock, so two gateways starting together never migrate twice.
constexpr std::array<const char*, current_schema_version> migrations = {
    R"sql(
    CREATE TABLE kernels (
        id TEXT PRIMARY KEY, spec_name TEXT NOT NULL, key TEXT NOT NULL, endpoint_base TEXT NOT NULL,
        connection_file TEXT NOT NULL, workspace_dir TEXT NOT NULL, log_file TEXT NOT NULL,
        pid INTEGER NOT NULL, start_ticks BIGINT NOT NULL, boot_id TEXT NOT NULL,
        pooled BOOLEAN NOT NULL, last_iopub_id TEXT NOT NULL DEFAULT '', created TEXT NOT NULL,
        environment JSONB NOT NULL,
        extra JSONB NOT NULL DEFAULT '{}');  -- fields added later (kernel_record_extra), no migration needed
    CREATE TABLE jupyter_sessions (id TEXT PRIMARY KEY, model TEXT NOT NULL);
    CREATE TABLE agent_sessions (seq BIGSERIAL, id TEXT PRIMARY KEY, record TEXT NOT NULL);
    CREATE TABLE cells (seq BIGSERIAL PRIMARY KEY, session TEXT NOT NULL, cell TEXT NOT NULL);
    CREATE INDEX cells_by_session ON cells (session, seq);
    CREATE TABLE inflight_executes (seq BIGSERIAL, session TEXT NOT NULL, msg_id TEXT NOT NULL,
                                    request TEXT NOT NULL, PRIMARY KEY (session, msg_id));
    CREATE TABLE audit (seq BIGSERIAL PRIMARY KEY, session TEXT NOT NULL, time TEXT NOT NULL,
                        event TEXT NOT NULL, entry TEXT NOT NULL);
    CREATE INDEX audit_by_session ON audit (session, time);
    CREATE INDEX audit_by_event ON audit (event, time);
    )sql",
    // Tenants and their tokens (digests only); a session's or kernel's tenant lives in its record / extra.
    R"sql(
    CREATE TABLE tenants (name TEXT PRIMARY KEY, record TEXT NOT NULL);
    CREATE TABLE tenant_tokens (id TEXT PRIMARY KEY, tenant TEXT NOT NULL, role TEXT NOT NULL,
                                digest TEXT NOT NULL UNIQUE, created TEXT NOT NULL);
    CREATE INDEX tenant_tokens_by_tenant ON tenant_tokens (tenant);
    )sql",
    // Fencing tokens of leases: the advisory lock says who holds a lease now, this row which taking of it is
    // the newest (token), by which gateway (holder) and since which taking that gateway has held it without
    // another taking it in between (held_since): try_lease and the fenced writes.
    R"sql(
    CREATE TABLE leases (name TEXT PRIMARY KEY, token BIGINT NOT NULL, holder TEXT NOT NULL,
                         held_since BIGINT NOT NULL, taken_at TIMESTAMPTZ NOT NULL DEFAULT now());
    )sql"};

// Advisory lock keys: (class, object). Leases hash their name into the object.
constexpr int migration_lock_class = 0x63626d67;  // "cbmg"
constexpr int lease_lock_class = 0x63626c73;      // "cbls"

std::string without_password(const std::string& url) {
    static const std::regex in_uri(R"(://([^:/@]*):[^@/]*@)");
    static const std::regex in_keywords(R"(password\s*=\s*('[^']*'|\S+))");
    return std::regex_replace(std::regex_replace(url, in_uri, "://$1:***@"), in_keywords, "password=***");
}

struct ConnectionCloser {
    void operator()(PGconn* connection) const { PQfinish(connection); }
};
struct ResultClearer {
    void operator()(PGresult* result) const { PQclear(result); }
};
using Connection = std::unique_ptr<PGconn, ConnectionCloser>;

class Result {
  public:
    explicit Result(PGresult* result) : result_(result) {}
    int rows() const { return PQntuples(result_.get()); }
    std::string text(int row, int column) const {
        return std::string(PQgetvalue(result_.get(), row, column),
                           static_cast<std::size_t>(PQgetlength(result_.get(), row, column)));
    }
    std::int64_t integer(int row, int column) const { return std::stoll(text(row, column)); }
    // Rows an INSERT, UPDATE or DELETE touched.
    std::int64_t affected() const {
        const std::string count = PQcmdTuples(result_.get());
        return count.empty() ? 0 : std::stoll(count);
    }

  private:
    std::unique_ptr<PGresult, ResultClearer> result_;
};

// The server chose this call as a deadlock's (or a serialization failure's) victim: the statement was rolled
// back, and the same call may succeed once the other transaction is done. In a batch it ends the whole
// transaction (write_batch), which StoreWriter applies again as after a dropped connection.
class StoreConflict final : public StoreUnavailable {
  public:
    using StoreUnavailable::StoreUnavailable;
};

bool is_conflict(const PGresult* result) {
    const char* state = result ? PQresultErrorField(result, PG_DIAG_SQLSTATE) : nullptr;
    return state && (std::string_view(state) == "40P01" || std::string_view(state) == "40001");
}

Result run(PGconn* connection, const std::string& sql, const std::vector<std::string>& parameters = {}) {
    std::vector<const char*> values;
    values.reserve(parameters.size());
    for (const auto& parameter : parameters)
        values.push_back(parameter.c_str());
    PGresult* raw = parameters.empty()
                        ? PQexec(connection, sql.c_str())
                        : PQexecParams(connection, sql.c_str(), static_cast<int>(values.size()), nullptr,
                                       values.data(), nullptr, nullptr, 0);
    Result result(raw);
    const ExecStatusType status = raw ? PQresultStatus(raw) : PGRES_FATAL_ERROR;
    if (status != PGRES_COMMAND_OK && status != PGRES_TUPLES_OK) {
        std::string message = raw ? PQresultErrorMessage(raw) : "";
        if (message.empty())
            message = PQerrorMessage(connection);
        while (!message.empty() && (message.back() == '\n' || message.back() == ' '))
            message.pop_back();
        // A connection that broke under the call (server restarted, network gone): nothing was applied.
        if (PQstatus(connection) == CONNECTION_BAD)
            throw StoreUnavailable("store: " + message);
        if (is_conflict(raw))
            throw StoreConflict("store: " + message);
        throw StoreError("store: " + message);
    }
    return result;
}

Connection connect(const std::string& url) {
    // connect_timeout first: a URL that names its own wins (expand_dbname puts its keywords after ours).
    const std::array<const char*, 3> keywords = {"connect_timeout", "dbname", nullptr};
    const std::array<const char*, 3> values = {"10", url.c_str(), nullptr};
    Connection connection(PQconnectdbParams(keywords.data(), values.data(), 1));
    if (!connection)
        throw StoreError("store: cannot allocate a PostgreSQL connection");
    if (PQstatus(connection.get()) != CONNECTION_OK) {
        std::string message = PQerrorMessage(connection.get());
        while (!message.empty() && (message.back() == '\n' || message.back() == ' '))
            message.pop_back();
        throw StoreError("store: cannot connect to PostgreSQL at " + without_password(url) + ": " + message);
    }
    // Notices (e.g. "relation already exists, skipping") are not the operator's business.
    PQsetNoticeProcessor(
        connection.get(), [](void*, const char*) {}, nullptr);
    return connection;
}

// The channel release_lease notifies with the lease's name.
constexpr const char* lease_channel = "cellblock_lease";

class ReleasesHeard final : public LeaseReleases {
  public:
    explicit ReleasesHeard(Connection connection) : connection_(std::move(connection)) {
        run(connection_.get(), std::string("LISTEN ") + lease_channel);
        PQsetnonblocking(connection_.get(), 1);
    }
    int socket() const override {
        return PQstatus(connection_.get()) == CONNECTION_OK ? PQsocket(connection_.get()) : -1;
    }
    std::vector<std::string> take() override {
        std::vector<std::string> names;
        if (PQconsumeInput(connection_.get()) == 0)
            return names;  // the connection broke: socket() answers -1 from now on
        while (PGnotify* notice = PQnotifies(connection_.get())) {
            names.emplace_back(notice->extra);
            PQfreemem(notice);
        }
        return names;
    }

  private:
    Connection connection_;
};

class PostgresStore final : public SessionStore {
  public:
    explicit PostgresStore(const std::string& url) : url_(url) {
        primary_ = connect(url);
        batch_ = connect(url);
        try {
            migrate(primary_.get());
            holder_ = run(primary_.get(), "SELECT current_setting('application_name')").text(0, 0) + "/" +
                      random_id();
        } catch (const StoreError& error) {
            throw StoreError(std::string(error.what()) + " (" + without_password(url) +
                             "; nothing was changed)");
        }
    }

    void put_kernel(const KernelRecord& kernel) override {
        with_connection([&](PGconn* connection) {
            run(connection,
                "INSERT INTO kernels (id, spec_name, key, endpoint_base, connection_file, workspace_dir, "
                "log_file, pid, start_ticks, boot_id, pooled, last_iopub_id, created, environment, extra) "
                "VALUES ($1, $2, $3, $4, $5, $6, $7, $8::integer, $9::bigint, $10, $11::boolean, $12, $13, "
                "$14::jsonb, $15::jsonb) "
                "ON CONFLICT (id) DO UPDATE SET spec_name = excluded.spec_name, key = excluded.key, "
                "endpoint_base = excluded.endpoint_base, connection_file = excluded.connection_file, "
                "workspace_dir = excluded.workspace_dir, log_file = excluded.log_file, pid = excluded.pid, "
                "start_ticks = excluded.start_ticks, boot_id = excluded.boot_id, pooled = excluded.pooled, "
                "last_iopub_id = excluded.last_iopub_id, created = excluded.created, "
                "environment = excluded.environment, extra = excluded.extra",
                {kernel.id, kernel.spec_name, kernel.key, kernel.endpoint_base, kernel.connection_file,
                 kernel.workspace_dir, kernel.log_file, std::to_string(kernel.process.pid),
                 std::to_string(kernel.process.start_ticks), kernel.process.boot_id,
                 kernel.pooled ? "true" : "false", kernel.last_iopub_id, kernel.created,
                 dump(kernel.environment), dump(kernel_record_extra(kernel))});
        });
    }
    void remove_kernel(const std::string& kernel_id) override {
        // Its restart lease's row and its jobs' watch leases' rows go with it (nothing is fenced by them, and
        // the id is never used again): the leases table does not grow with every kernel ever started.
        with_connection([&](PGconn* c) {
            run(c,
                "WITH lease_gone AS (DELETE FROM leases WHERE name = 'kernel-restart:' || $1 "
                "OR starts_with(name, 'slurm-watch:' || $1 || ':')) "
                "DELETE FROM kernels WHERE id = $1",
                {kernel_id});
        });
    }
    void set_kernel_progress(const std::string& kernel_id, const std::string& last_iopub_id) override {
        with_connection([&](PGconn* c) {
            run(c, "UPDATE kernels SET last_iopub_id = $2 WHERE id = $1", {kernel_id, last_iopub_id});
        });
    }
    void set_kernel_activity(const std::string& kernel_id, const std::string& last_activity) override {
        with_connection([&](PGconn* c) {
            run(c,
                "UPDATE kernels SET extra = jsonb_set(extra, '{last_activity}', to_jsonb($2::text)) WHERE id "
                "= $1",
                {kernel_id, last_activity});
        });
    }
    std::vector<KernelRecord> kernels() override { return kernel_rows("ORDER BY created", {}); }
    std::optional<KernelRecord> kernel(const std::string& kernel_id) override {
        auto found = kernel_rows("WHERE id = $1", {kernel_id});
        if (found.empty())
            return std::nullopt;
        return std::move(found.front());
    }

    void put_jupyter_session(const std::string& id, const json& model) override {
        with_connection([&](PGconn* c) {
            run(c,
                "INSERT INTO jupyter_sessions (id, model) VALUES ($1, $2) "
                "ON CONFLICT (id) DO UPDATE SET model = excluded.model",
                {id, dump(model)});
        });
    }
    void remove_jupyter_session(const std::string& id) override {
        with_connection([&](PGconn* c) { run(c, "DELETE FROM jupyter_sessions WHERE id = $1", {id}); });
    }
    std::vector<json> jupyter_sessions() override {
        return json_column("SELECT model FROM jupyter_sessions ORDER BY id", {});
    }

    void put_agent_session(const json& record) override {
        with_connection([&](PGconn* c) {
            run(c,
                "INSERT INTO agent_sessions (id, record) VALUES ($1, $2) "
                "ON CONFLICT (id) DO UPDATE SET record = excluded.record",
                {record.value("id", std::string()), dump(record)});
        });
    }
    std::vector<json> agent_sessions() override {
        return json_column("SELECT record FROM agent_sessions ORDER BY seq", {});
    }
    std::optional<json> agent_session(const std::string& id) override {
        auto found = json_column("SELECT record FROM agent_sessions WHERE id = $1", {id});
        if (found.empty())
            return std::nullopt;
        return std::move(found.front());
    }
    void append_cell(const std::string& session, const json& cell) override {
        with_connection([&](PGconn* c) {
            run(c, "INSERT INTO cells (session, cell) VALUES ($1, $2)", {session, dump(cell)});
        });
    }
    void clear_cells(const std::string& session) override {
        with_connection([&](PGconn* c) { run(c, "DELETE FROM cells WHERE session = $1", {session}); });
    }
    std::vector<json> cells(const std::string& session) override {
        return json_column("SELECT cell FROM cells WHERE session = $1 ORDER BY seq", {session});
    }
    std::size_t purge_deleted_agent_sessions(const std::string& deleted_before) override {
        std::size_t purged = 0;
        // Gateways sharing the store take turns (a lock held until the transaction ends) rather than delete
        // the same rows at once. One statement: every part sees the same snapshot, so the fallback to the
        // newest audit entry reads the entries before they are deleted. COLLATE "C": ISO 8601 strings
        // compare as times in byte order.
        with_connection([&](PGconn* c) {
            if (run(c, "SELECT pg_try_advisory_xact_lock($1::integer, hashtext('agent-session-purge'))",
                    {std::to_string(lease_lock_class)})
                    .text(0, 0) != "t")
                return;
            Result rows = run(
                c,
                "WITH purged AS ("
                "  DELETE FROM agent_sessions s WHERE (s.record::jsonb ->> 'deleted') = 'true' AND "
                "  coalesce(s.record::jsonb ->> 'deleted_at', "
                "           (SELECT max(a.time) FROM audit a WHERE a.session = s.id), "
                "           '') COLLATE \"C\" < $1::text "
                "  RETURNING s.id), "
                "cells_gone AS (DELETE FROM cells WHERE session IN (SELECT id FROM purged)), "
                "inflight_gone AS (DELETE FROM inflight_executes WHERE session IN (SELECT id FROM purged)), "
                "audit_gone AS (DELETE FROM audit WHERE session IN (SELECT id FROM purged)), "
                "leases_gone AS (DELETE FROM leases WHERE name IN (SELECT 'agent-session:' || id FROM "
                "purged)) "
                "SELECT id FROM purged",
                {deleted_before});
            purged = static_cast<std::size_t>(rows.rows());
        });
        return purged;
    }
    void put_inflight(const InflightExecute& execute) override {
        with_connection([&](PGconn* c) {
            run(c,
                "INSERT INTO inflight_executes (session, msg_id, request) VALUES ($1, $2, $3) "
                "ON CONFLICT (session, msg_id) DO UPDATE SET request = excluded.request",
                {execute.session, execute.msg_id, dump(execute.request)});
        });
    }
    void remove_inflight(const std::string& session, const std::string& msg_id) override {
        with_connection([&](PGconn* c) {
            run(c, "DELETE FROM inflight_executes WHERE session = $1 AND msg_id = $2", {session, msg_id});
        });
    }
    std::vector<InflightExecute> inflight(const std::string& session) override {
        std::vector<InflightExecute> found;
        with_connection([&](PGconn* c) {
            Result rows =
                run(c, "SELECT msg_id, request FROM inflight_executes WHERE session = $1 ORDER BY seq",
                    {session});
            for (int row = 0; row < rows.rows(); ++row)
                found.push_back({session, rows.text(row, 0), json::parse(rows.text(row, 1), nullptr, false)});
        });
        return found;
    }

    void append_audit(const json& entry) override {
        with_connection([&](PGconn* c) {
            run(c, "INSERT INTO audit (session, time, event, entry) VALUES ($1, $2, $3, $4)",
                {entry.value("session", std::string()), entry.value("time", std::string()),
                 entry.value("event", std::string()), dump(entry)});
        });
    }
    std::vector<json> audit(const AuditQuery& query) override {
        // ISO 8601 UTC strings of one format compare as times (COLLATE "C": byte order, whatever the
        // database's locale).
        return json_column(
            "SELECT entry FROM audit WHERE session = $1 AND ($2::text = '' OR event = $2::text) AND "
            "($3::text = '' OR time COLLATE \"C\" >= $3::text) AND ($4::text = '' OR time COLLATE \"C\" < "
            "$4::text) ORDER BY seq",
            {query.session, query.event, query.since, query.until});
    }

    void write_batch(const std::vector<std::function<void(SessionStore&)>>& writes,
                     const std::function<void(const std::exception&)>& on_failure) override {
        // The batch has its own connection: reads from other threads meanwhile see committed data and cannot
        // abort the batch's transaction with an error of theirs.
        std::lock_guard lock(batch_mutex_);
        reconnect_if_broken(batch_);
        PGconn* connection = batch_.get();
        batch_thread_ = std::this_thread::get_id();
        struct ThreadReset {
            std::atomic<std::thread::id>& owner;
            ~ThreadReset() { owner = std::thread::id(); }
        } reset{batch_thread_};
        run(connection, "BEGIN");
        for (const auto& write : writes) {
            run(connection, "SAVEPOINT one_write");
            try {
                write(*this);
                run(connection, "RELEASE one_write");
            } catch (const StoreConflict&) {
                // The whole transaction, not back to the savepoint alone: the batch's earlier writes would
                // keep their locks, the other transaction would go on waiting for them, and each later write
                // of this batch on the other's rows would deadlock again (one deadlock_timeout, 1 s, each)
                // and be dropped. Two gateways flushing the same kernels' progress in another order, queued
                // up while the store stalled, lost over a minute so (tests/agent/test_store_outage.py).
                PQclear(PQexec(connection, "ROLLBACK"));
                throw;
            } catch (const std::exception& error) {
                try {
                    run(connection, "ROLLBACK TO one_write");
                    run(connection, "RELEASE one_write");
                } catch (const StoreError&) {
                    PQclear(PQexec(connection, "ROLLBACK"));
                    throw;
                }
                on_failure(error);
            }
        }
        try {
            run(connection, "COMMIT");
        } catch (const StoreUnavailable&) {
            throw;  // whether the server committed is unknown; StoreWriter applies the batch again
        } catch (const StoreError& error) {
            PQclear(PQexec(connection, "ROLLBACK"));
            throw StoreError("store: cannot commit a batch of " + std::to_string(writes.size()) +
                             " writes: " + error.what());
        }
    }

    void put_tenant(const json& tenant) override {
        with_connection([&](PGconn* c) {
            run(c,
                "INSERT INTO tenants (name, record) VALUES ($1, $2) "
                "ON CONFLICT (name) DO UPDATE SET record = excluded.record",
                {tenant.value("name", std::string()), dump(tenant)});
        });
    }
    void remove_tenant(const std::string& name) override {
        // One statement: the tokens go with the tenant or neither does.
        with_connection([&](PGconn* c) {
            run(c,
                "WITH tokens_gone AS (DELETE FROM tenant_tokens WHERE tenant = $1) "
                "DELETE FROM tenants WHERE name = $1",
                {name});
        });
    }
    std::vector<json> tenants() override {
        return json_column("SELECT record FROM tenants ORDER BY name", {});
    }
    void put_tenant_token(const TenantToken& token) override {
        with_connection([&](PGconn* c) {
            run(c,
                "INSERT INTO tenant_tokens (id, tenant, role, digest, created) VALUES ($1, $2, $3, $4, $5) "
                "ON CONFLICT (id) DO UPDATE SET tenant = excluded.tenant, role = excluded.role, "
                "digest = excluded.digest, created = excluded.created",
                {token.id, token.tenant, token.role, token.digest, token.created});
        });
    }
    void remove_tenant_token(const std::string& id) override {
        with_connection([&](PGconn* c) { run(c, "DELETE FROM tenant_tokens WHERE id = $1", {id}); });
    }
    std::vector<TenantToken> tenant_tokens() override {
        std::vector<TenantToken> found;
        with_connection([&](PGconn* c) {
            Result rows = run(c,
                              "SELECT id, tenant, role, digest, created FROM tenant_tokens "
                              "ORDER BY created COLLATE \"C\", id");
            for (int row = 0; row < rows.rows(); ++row)
                found.push_back({rows.text(row, 0), rows.text(row, 1), rows.text(row, 2), rows.text(row, 3),
                                 rows.text(row, 4)});
        });
        return found;
    }

    bool shared() const override { return true; }
    std::optional<std::int64_t> try_lease(const std::string& name) override {
        std::optional<std::int64_t> token;
        with_connection([&](PGconn* c) { token = take_lease(c, name, holder_); });
        return token;
    }
    void release_lease(const std::string& name) override {
        with_connection([&](PGconn* c) {
            run(c, "SELECT pg_advisory_unlock($1::integer, hashtext($2)), pg_notify($3, $2)",
                {std::to_string(lease_lock_class), name, lease_channel});
        });
    }
    bool holds_lease(const std::string& name) override {
        // Asked on the connection that takes leases: a connection that broke since (the lock went with it)
        // fails here and is opened anew, holding nothing.
        bool held = false;
        with_connection([&](PGconn* c) {
            held = run(c,
                       "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE pid = pg_backend_pid() AND locktype = "
                       "'advisory' AND granted AND classid = $1::integer::oid AND objid = "
                       "((hashtext($2)::bigint + 4294967296) % 4294967296)::oid AND objsubid = 2)",
                       {std::to_string(lease_lock_class), name})
                       .text(0, 0) == "t";
        });
        return held;
    }
    std::unique_ptr<LeaseReleases> listen_for_lease_releases() override {
        return std::make_unique<ReleasesHeard>(connect(url_));
    }
    // Applied while the lease is still this gateway's since `fence.token` (its own later takings do not
    // fence off its earlier writes, which are queued before them). The lease row is locked FOR SHARE until
    // the write's transaction ends: another gateway's taking (an update of the row) waits for the batch to
    // commit, or the write sees the new holder and is refused.
    bool append_cell_fenced(const std::string& session, const json& cell, const LeaseFence& fence) override {
        bool applied = false;
        with_connection([&](PGconn* c) {
            applied =
                run(c,
                    "INSERT INTO cells (session, cell) SELECT $1, $2 WHERE EXISTS (SELECT 1 FROM leases "
                    "WHERE name = $3 AND holder = $4 AND held_since <= $5::bigint FOR SHARE)",
                    {session, dump(cell), fence.lease, holder_, std::to_string(fence.token)})
                    .affected() == 1;
        });
        return applied;
    }
    bool put_inflight_fenced(const InflightExecute& execute, const LeaseFence& fence) override {
        bool applied = false;
        with_connection([&](PGconn* c) {
            applied = run(c,
                          "INSERT INTO inflight_executes (session, msg_id, request) SELECT $1, $2, $3 WHERE "
                          "EXISTS (SELECT 1 FROM leases WHERE name = $4 AND holder = $5 AND held_since <= "
                          "$6::bigint "
                          "FOR SHARE) ON CONFLICT (session, msg_id) DO UPDATE SET request = excluded.request",
                          {execute.session, execute.msg_id, dump(execute.request), fence.lease, holder_,
                           std::to_string(fence.token)})
                          .affected() == 1;
        });
        return applied;
    }

  private:
    static std::string dump(const json& value) {
        return value.dump(-1, ' ', false, json::error_handler_t::replace);
    }

    // A lease is taken in one round trip (it is on every agent execute's path): the advisory lock, then, if
    // this connection got it, the lease's next token, one more than the previous taking's. The row may be
    // held by a fenced write of the previous holder's open batch (FOR SHARE): waited for at most 2 s
    // (lock_timeout, set for this statement's own transaction before the row is reached), then the lock is
    // let go again and the caller hears the error (the execute lease asks again). nullopt: another gateway
    // holds the lock.
    static std::optional<std::int64_t> take_lease(PGconn* connection, const std::string& name,
                                                  const std::string& holder) {
        try {
            const Result taken = run(
                connection,
                "WITH got AS (SELECT pg_try_advisory_lock($3::integer, hashtext($1)) AS locked, "
                "set_config('lock_timeout', '2s', true)) "
                "INSERT INTO leases (name, token, holder, held_since) SELECT $1, 1, $2, 1 FROM got WHERE "
                "locked ON CONFLICT (name) DO UPDATE SET token = leases.token + 1, held_since = CASE WHEN "
                "leases.holder = excluded.holder THEN leases.held_since ELSE leases.token + 1 END, "
                "holder = excluded.holder, taken_at = now() RETURNING token",
                {name, holder, std::to_string(lease_lock_class)});
            if (taken.rows() == 0)
                return std::nullopt;
            return taken.integer(0, 0);
        } catch (const StoreError&) {
            try {  // the lock outlives the failed statement's transaction (it is the session's)
                run(connection, "SELECT pg_advisory_unlock($1::integer, hashtext($2))",
                    {std::to_string(lease_lock_class), name});
            } catch (const StoreError&) {
                // a broken connection has let go of the lock with itself
            }
            throw;
        }
    }

    // The batch's connection when called from inside write_batch (by its thread), else the primary one.
    template <typename Use>
    void with_connection(Use&& use) {
        if (batch_thread_.load() == std::this_thread::get_id()) {
            use(batch_.get());
            return;
        }
        std::lock_guard lock(primary_mutex_);
        reconnect_if_broken(primary_);
        use(primary_.get());
    }

    // A restarted server or a dropped connection is reconnected on the next call (leases held on the old
    // connection are gone with it, as they are for a killed gateway). Callers run on StoreWriter's threads,
    // never the io_context's, so the blocking PQreset stalls no client; after a failed attempt the next ones
    // wait a backoff (0.1 s doubling to 5 s) and calls meanwhile fail at once instead of queueing behind it.
    void reconnect_if_broken(Connection& connection) {
        if (PQstatus(connection.get()) == CONNECTION_OK)
            return;
        Backoff& backoff = &connection == &primary_ ? primary_backoff_ : batch_backoff_;
        const auto now = std::chrono::steady_clock::now();
        if (now < backoff.next_attempt)
            throw StoreUnavailable("store: PostgreSQL at " + without_password(url_) +
                                   " is unreachable; reconnecting");
        PQreset(connection.get());
        if (PQstatus(connection.get()) == CONNECTION_OK) {
            backoff = Backoff{};
            return;
        }
        backoff.next_attempt = std::chrono::steady_clock::now() + backoff.wait;
        backoff.wait = std::min(backoff.wait * 2, std::chrono::milliseconds(5000));
        throw StoreUnavailable("store: lost the connection to PostgreSQL at " + without_password(url_) +
                               ": " + PQerrorMessage(connection.get()));
    }
    struct Backoff {
        std::chrono::steady_clock::time_point next_attempt{};
        std::chrono::milliseconds wait{100};
    };

    std::vector<KernelRecord> kernel_rows(const std::string& condition,
                                          const std::vector<std::string>& parameters) {
        std::vector<KernelRecord> found;
        with_connection([&](PGconn* c) {
            Result rows = run(c,
                              "SELECT id, spec_name, key, endpoint_base, connection_file, workspace_dir, "
                              "log_file, pid, start_ticks, boot_id, pooled, last_iopub_id, created, "
                              "environment::text, extra::text FROM kernels " +
                                  condition,
                              parameters);
            for (int row = 0; row < rows.rows(); ++row) {
                KernelRecord kernel;
                kernel.id = rows.text(row, 0);
                kernel.spec_name = rows.text(row, 1);
                kernel.key = rows.text(row, 2);
                kernel.endpoint_base = rows.text(row, 3);
                kernel.connection_file = rows.text(row, 4);
                kernel.workspace_dir = rows.text(row, 5);
                kernel.log_file = rows.text(row, 6);
                kernel.process.pid = static_cast<pid_t>(rows.integer(row, 7));
                kernel.process.start_ticks = static_cast<std::uint64_t>(rows.integer(row, 8));
                kernel.process.boot_id = rows.text(row, 9);
                kernel.pooled = rows.text(row, 10) == "t";
                kernel.last_iopub_id = rows.text(row, 11);
                kernel.created = rows.text(row, 12);
                kernel.environment = json::parse(rows.text(row, 13), nullptr, false);
                if (!kernel.environment.is_object())
                    kernel.environment = json::object();
                read_kernel_record_extra(json::parse(rows.text(row, 14), nullptr, false), kernel);
                found.push_back(std::move(kernel));
            }
        });
        return found;
    }

    std::vector<json> json_column(const std::string& sql, const std::vector<std::string>& parameters) {
        std::vector<json> found;
        with_connection([&](PGconn* c) {
            Result rows = run(c, sql, parameters);
            for (int row = 0; row < rows.rows(); ++row) {
                json value = json::parse(rows.text(row, 0), nullptr, false);
                if (!value.is_discarded())
                    found.push_back(std::move(value));
            }
        });
        return found;
    }

    static void migrate(PGconn* connection) {
        run(connection, "BEGIN");
        try {
            run(connection, "SELECT pg_advisory_xact_lock(" + std::to_string(migration_lock_class) + ", 0)");
            Result tables = run(connection,
                                "SELECT table_name FROM information_schema.tables WHERE table_schema = "
                                "current_schema()");
            bool has_user_tables = false, has_migrations = false;
            for (int row = 0; row < tables.rows(); ++row) {
                if (tables.text(row, 0) == "schema_migrations")
                    has_migrations = true;
                else
                    has_user_tables = true;
            }
            if (has_user_tables && !has_migrations)
                throw StoreError(
                    "store: the database has tables but no schema_migrations: not a cellblock store");
            if (!has_migrations)
                run(connection,
                    "CREATE TABLE schema_migrations (version INTEGER PRIMARY KEY, applied TEXT NOT NULL)");
            const int version = static_cast<int>(
                run(connection, "SELECT coalesce(max(version), 0) FROM schema_migrations").integer(0, 0));
            if (version > current_schema_version)
                throw StoreError("store: schema version " + std::to_string(version) +
                                 " was written by a newer cellblock-gateway (this one knows up to " +
                                 std::to_string(current_schema_version) + ")");
            for (int next = version + 1; next <= current_schema_version; ++next) {
                try {
                    run(connection, migrations[static_cast<std::size_t>(next - 1)]);
                } catch (const StoreError& error) {
                    throw StoreError("store: migration " + std::to_string(next) + " failed: " + error.what());
                }
                run(connection, "INSERT INTO schema_migrations (version, applied) VALUES ($1::integer, $2)",
                    {std::to_string(next), format_iso8601_utc(std::chrono::system_clock::now())});
            }
            run(connection, "COMMIT");
        } catch (...) {
            PQclear(PQexec(connection, "ROLLBACK"));
            throw;
        }
    }

    // This gateway's name in the leases table: its connections' application_name and a random part, so that
    // two gateways never share one (and a restarted gateway is another holder).
    static std::string random_id() {
        std::random_device device;
        std::ostringstream id;
        id << std::hex << device() << device();
        return id.str();
    }

    std::string url_;
    std::string holder_;
    std::mutex primary_mutex_, batch_mutex_;
    Connection primary_, batch_;
    Backoff primary_backoff_, batch_backoff_;  // each guarded by its connection's mutex
    std::atomic<std::thread::id> batch_thread_{};
};

}  // namespace

std::optional<std::string> unencrypted_remote_store(const std::string& url) {
    char* error = nullptr;
    std::unique_ptr<PQconninfoOption, decltype(&PQconninfoFree)> options(PQconninfoParse(url.c_str(), &error),
                                                                         &PQconninfoFree);
    if (error)
        PQfreemem(error);
    if (!options)
        return std::nullopt;  // open_postgres_store says what is wrong with it
    std::string hosts, sslmode;
    for (const PQconninfoOption* option = options.get(); option->keyword; ++option) {
        if (!option->val)
            continue;
        if (std::string_view(option->keyword) == "host" || std::string_view(option->keyword) == "hostaddr")
            hosts += std::string(hosts.empty() ? "" : ",") + option->val;
        if (std::string_view(option->keyword) == "sslmode")
            sslmode = option->val;
    }
    if (!sslmode.empty())
        return std::nullopt;  // the operator chose, whatever the choice
    std::string remote;
    std::size_t start = 0;
    for (std::size_t at = 0; at <= hosts.size(); ++at) {
        if (at != hosts.size() && hosts[at] != ',')
            continue;
        const std::string host = hosts.substr(start, at - start);
        start = at + 1;
        const bool local = host.empty() || host.starts_with('/') || host.starts_with('@') ||
                           host == "localhost" || host.starts_with("127.") || host == "::1";
        if (!local)
            remote = host;
    }
    if (remote.empty())
        return std::nullopt;
    return "the PostgreSQL store at " + remote +
           " is reached over the network without TLS: add sslmode=verify-full (or require) to the store's "
           "connection string, or sslmode=disable to accept that";
}

std::unique_ptr<SessionStore> open_postgres_store(const std::string& url) {
    return std::make_unique<PostgresStore>(url);
}

}  // namespace cellblock::gateway
