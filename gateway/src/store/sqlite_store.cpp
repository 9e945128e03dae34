// The embedded SessionStore: one SQLite file in the gateway's state directory. The only file with SQL in it.
#include <fcntl.h>
#include <sqlite3.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cstring>
#include <fstream>
#include <mutex>
#include <sstream>

#include "cellblock/gateway/common/time_format.hpp"
#include "cellblock/gateway/store/store.hpp"

namespace cellblock::gateway {

using nlohmann::json;
namespace fs = std::filesystem;

// --------------------------------------------------------------------------------------- ProcessIdentity

namespace {
std::string read_boot_id() {
    std::ifstream input("/proc/sys/kernel/random/boot_id");
    std::string id;
    std::getline(input, id);
    return id;
}

std::optional<std::uint64_t> read_start_ticks(pid_t pid) {
    std::ifstream input("/proc/" + std::to_string(pid) + "/stat");
    std::string text;
    if (!std::getline(input, text))
        return std::nullopt;
    // Field 2 (comm) may contain spaces and parentheses: count fields after the last ')'.
    const auto end_of_name = text.rfind(')');
    if (end_of_name == std::string::npos)
        return std::nullopt;
    std::istringstream fields(text.substr(end_of_name + 2));
    std::string field;
    for (int index = 3; fields >> field; ++index) {
        if (index == 3 && field == "Z")
            return std::nullopt;  // a zombie is as good as gone
        if (index == 22)
            return std::stoull(field);
    }
    return std::nullopt;
}
}  // namespace

std::optional<ProcessIdentity> ProcessIdentity::of(pid_t pid) {
    auto ticks = read_start_ticks(pid);
    if (!ticks)
        return std::nullopt;
    return ProcessIdentity{pid, *ticks, read_boot_id()};
}

bool ProcessIdentity::alive() const {
    if (pid <= 0)
        return false;
    auto now = of(pid);
    return now && *now == *this;
}

// --------------------------------------------------------------------------------------------- SQLite

namespace {

constexpr int current_schema_version = 3;

// Each migration brings the schema from version N-1 to N; applied in order inside one transaction each.
constexpr std::array<const char*, current_schema_version> migrations = {
    R"sql(
    CREATE TABLE kernels (
        id TEXT PRIMARY KEY, spec_name TEXT NOT NULL, key TEXT NOT NULL, endpoint_base TEXT NOT NULL,
        connection_file TEXT NOT NULL, workspace_dir TEXT NOT NULL, log_file TEXT NOT NULL,
        pid INTEGER NOT NULL, start_ticks INTEGER NOT NULL, boot_id TEXT NOT NULL,
        pooled INTEGER NOT NULL, last_iopub_id TEXT NOT NULL DEFAULT '', created TEXT NOT NULL,
        environment TEXT NOT NULL);
    CREATE TABLE jupyter_sessions (id TEXT PRIMARY KEY, model TEXT NOT NULL);
    CREATE TABLE agent_sessions (id TEXT PRIMARY KEY, record TEXT NOT NULL);
    CREATE TABLE cells (seq INTEGER PRIMARY KEY AUTOINCREMENT, session TEXT NOT NULL, cell TEXT NOT NULL);
    CREATE INDEX cells_by_session ON cells (session, seq);
    CREATE TABLE inflight_executes (session TEXT NOT NULL, msg_id TEXT NOT NULL, request TEXT NOT NULL,
                                    PRIMARY KEY (session, msg_id));
    CREATE TABLE audit (seq INTEGER PRIMARY KEY AUTOINCREMENT, session TEXT NOT NULL, time TEXT NOT NULL,
                        event TEXT NOT NULL, entry TEXT NOT NULL);
    CREATE INDEX audit_by_session ON audit (session, time);
    CREATE INDEX audit_by_event ON audit (event, time);
    )sql",
    // Fields of KernelRecord added later live in one JSON object (kernel_record_extra).
    R"sql(
    ALTER TABLE kernels ADD COLUMN extra TEXT NOT NULL DEFAULT '{}';
    )sql",
    // Tenants and their tokens (digests only); a session's or kernel's tenant lives in its record / extra.
    R"sql(
    CREATE TABLE tenants (name TEXT PRIMARY KEY, record TEXT NOT NULL);
    CREATE TABLE tenant_tokens (id TEXT PRIMARY KEY, tenant TEXT NOT NULL, role TEXT NOT NULL,
                                digest TEXT NOT NULL UNIQUE, created TEXT NOT NULL);
    CREATE INDEX tenant_tokens_by_tenant ON tenant_tokens (tenant);
    )sql"};

struct DatabaseCloser {
    void operator()(sqlite3* database) const { sqlite3_close_v2(database); }
};
struct StatementFinalizer {
    void operator()(sqlite3_stmt* statement) const { sqlite3_finalize(statement); }
};
using Database = std::unique_ptr<sqlite3, DatabaseCloser>;

class Statement {
  public:
    Statement(sqlite3* database, std::string_view sql) : database_(database) {
        sqlite3_stmt* raw = nullptr;
        if (sqlite3_prepare_v2(database, sql.data(), static_cast<int>(sql.size()), &raw, nullptr) !=
            SQLITE_OK)
            throw StoreError(std::string("store: cannot prepare statement: ") + sqlite3_errmsg(database));
        statement_.reset(raw);
    }
    Statement& bind(int index, std::string_view text) {
        check(sqlite3_bind_text(statement_.get(), index, text.data(), static_cast<int>(text.size()),
                                SQLITE_TRANSIENT));
        return *this;
    }
    Statement& bind(int index, std::int64_t number) {
        check(sqlite3_bind_int64(statement_.get(), index, number));
        return *this;
    }
    // True while a row is available.
    bool step() {
        const int rc = sqlite3_step(statement_.get());
        if (rc == SQLITE_ROW)
            return true;
        if (rc == SQLITE_DONE)
            return false;
        throw StoreError(std::string("store: ") + sqlite3_errmsg(database_));
    }
    void run() {
        while (step()) {
        }
    }
    std::string text(int column) const {
        const auto* data = sqlite3_column_text(statement_.get(), column);
        return data ? std::string(reinterpret_cast<const char*>(data),
                                  static_cast<std::size_t>(sqlite3_column_bytes(statement_.get(), column)))
                    : std::string();
    }
    std::int64_t integer(int column) const { return sqlite3_column_int64(statement_.get(), column); }

  private:
    void check(int rc) {
        if (rc != SQLITE_OK)
            throw StoreError(std::string("store: cannot bind: ") + sqlite3_errmsg(database_));
    }
    sqlite3* database_;
    std::unique_ptr<sqlite3_stmt, StatementFinalizer> statement_;
};

void execute_script(sqlite3* database, const char* sql, const std::string& what) {
    char* message = nullptr;
    if (sqlite3_exec(database, sql, nullptr, nullptr, &message) != SQLITE_OK) {
        std::string text = message ? message : sqlite3_errmsg(database);
        sqlite3_free(message);
        throw StoreError("store: " + what + ": " + text);
    }
}

// A file that exists and is not empty must start with SQLite's magic before SQLite may touch it, so that a
// wrong path never gets a journal written next to (or into) somebody else's file.
void check_header(const fs::path& file) {
    std::error_code error;
    if (!fs::exists(file, error) || fs::file_size(file, error) == 0)
        return;
    std::ifstream input(file, std::ios::binary);
    std::array<char, 16> header{};
    input.read(header.data(), header.size());
    if (input.gcount() != static_cast<std::streamsize>(header.size()) ||
        std::memcmp(header.data(), "SQLite format 3", 16) != 0)
        throw StoreError("store " + file.string() +
                         " is not an SQLite database (corrupt, or not a cellblock store); it was left "
                         "untouched: move it away to start with an empty store");
}

class SqliteStore final : public SessionStore {
  public:
    explicit SqliteStore(const fs::path& file) : file_(file) {
        check_header(file);
        // Created 0600: the store holds HMAC keys.
        const int fd = ::open(file.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
        if (fd < 0)
            throw StoreError("store: cannot open " + file.string() + ": " + std::strerror(errno));
        ::fchmod(fd, 0600);
        ::close(fd);
        sqlite3* raw = nullptr;
        const int rc =
            sqlite3_open_v2(file.c_str(), &raw, SQLITE_OPEN_READWRITE | SQLITE_OPEN_FULLMUTEX, nullptr);
        database_.reset(raw);
        if (rc != SQLITE_OK)
            throw StoreError("store: cannot open " + file.string() + ": " +
                             (raw ? sqlite3_errmsg(raw) : sqlite3_errstr(rc)));
        sqlite3_busy_timeout(database_.get(), 5000);
        try {
            // Reading the schema proves the file is a readable database before anything is written to it.
            Statement(database_.get(), "SELECT count(*) FROM sqlite_master").run();
            migrate();
            // secure_delete: a replaced or removed row (a key written before keys were sealed) is zeroed, not
            // left in the file's free space.
            execute_script(database_.get(),
                           "PRAGMA journal_mode=WAL; PRAGMA synchronous=FULL; PRAGMA secure_delete=ON;",
                           "cannot configure");
        } catch (const StoreError& error) {
            throw StoreError(std::string(error.what()) + " (" + file.string() +
                             "; left untouched: move it away to start with an empty store)");
        }
    }

    void put_kernel(const KernelRecord& kernel) override {
        std::lock_guard lock(mutex_);
        Statement(database_.get(),
                  "INSERT OR REPLACE INTO kernels (id, spec_name, key, endpoint_base, connection_file, "
                  "workspace_dir, log_file, pid, start_ticks, boot_id, pooled, last_iopub_id, created, "
                  "environment, extra) "
                  "VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15)")
            .bind(1, kernel.id)
            .bind(2, kernel.spec_name)
            .bind(3, kernel.key)
            .bind(4, kernel.endpoint_base)
            .bind(5, kernel.connection_file)
            .bind(6, kernel.workspace_dir)
            .bind(7, kernel.log_file)
            .bind(8, static_cast<std::int64_t>(kernel.process.pid))
            .bind(9, static_cast<std::int64_t>(kernel.process.start_ticks))
            .bind(10, kernel.process.boot_id)
            .bind(11, static_cast<std::int64_t>(kernel.pooled ? 1 : 0))
            .bind(12, kernel.last_iopub_id)
            .bind(13, kernel.created)
            .bind(14, dump(kernel.environment))
            .bind(15, dump(kernel_record_extra(kernel)))
            .run();
    }
    void remove_kernel(const std::string& kernel_id) override {
        std::lock_guard lock(mutex_);
        Statement(database_.get(), "DELETE FROM kernels WHERE id = ?1").bind(1, kernel_id).run();
    }
    void set_kernel_progress(const std::string& kernel_id, const std::string& last_iopub_id) override {
        std::lock_guard lock(mutex_);
        Statement(database_.get(), "UPDATE kernels SET last_iopub_id = ?2 WHERE id = ?1")
            .bind(1, kernel_id)
            .bind(2, last_iopub_id)
            .run();
    }
    void set_kernel_activity(const std::string& kernel_id, const std::string& last_activity) override {
        std::lock_guard lock(mutex_);
        Statement(database_.get(),
                  "UPDATE kernels SET extra = json_set(extra, '$.last_activity', ?2) WHERE id = ?1")
            .bind(1, kernel_id)
            .bind(2, last_activity)
            .run();
    }
    std::vector<KernelRecord> kernels() override { return kernel_rows("ORDER BY created", {}); }
    std::optional<KernelRecord> kernel(const std::string& kernel_id) override {
        auto found = kernel_rows("WHERE id = ?1", {kernel_id});
        if (found.empty())
            return std::nullopt;
        return std::move(found.front());
    }

    void put_jupyter_session(const std::string& id, const json& model) override {
        std::lock_guard lock(mutex_);
        Statement(database_.get(), "INSERT OR REPLACE INTO jupyter_sessions (id, model) VALUES (?1, ?2)")
            .bind(1, id)
            .bind(2, dump(model))
            .run();
    }
    void remove_jupyter_session(const std::string& id) override {
        std::lock_guard lock(mutex_);
        Statement(database_.get(), "DELETE FROM jupyter_sessions WHERE id = ?1").bind(1, id).run();
    }
    std::vector<json> jupyter_sessions() override {
        return json_column("SELECT model FROM jupyter_sessions ORDER BY id", {});
    }

    void put_agent_session(const json& record) override {
        std::lock_guard lock(mutex_);
        Statement(database_.get(), "INSERT OR REPLACE INTO agent_sessions (id, record) VALUES (?1, ?2)")
            .bind(1, record.value("id", std::string()))
            .bind(2, dump(record))
            .run();
    }
    std::vector<json> agent_sessions() override {
        return json_column("SELECT record FROM agent_sessions ORDER BY rowid", {});
    }
    std::optional<json> agent_session(const std::string& id) override {
        auto found = json_column("SELECT record FROM agent_sessions WHERE id = ?1", {id});
        if (found.empty())
            return std::nullopt;
        return std::move(found.front());
    }
    void append_cell(const std::string& session, const json& cell) override {
        std::lock_guard lock(mutex_);
        Statement(database_.get(), "INSERT INTO cells (session, cell) VALUES (?1, ?2)")
            .bind(1, session)
            .bind(2, dump(cell))
            .run();
    }
    void clear_cells(const std::string& session) override {
        std::lock_guard lock(mutex_);
        Statement(database_.get(), "DELETE FROM cells WHERE session = ?1").bind(1, session).run();
    }
    std::vector<json> cells(const std::string& session) override {
        return json_column("SELECT cell FROM cells WHERE session = ?1 ORDER BY seq", {session});
    }
    std::size_t purge_deleted_agent_sessions(const std::string& deleted_before) override {
        std::lock_guard lock(mutex_);
        // ISO 8601 UTC strings of one format compare as times.
        Statement select(database_.get(),
                         "SELECT id FROM agent_sessions WHERE CASE WHEN json_valid(record) THEN "
                         "  json_extract(record, '$.deleted') = 1 AND "
                         "  coalesce(json_extract(record, '$.deleted_at'), "
                         "           (SELECT max(time) FROM audit WHERE audit.session = agent_sessions.id), "
                         "           '') < ?1 "
                         "ELSE 0 END");
        select.bind(1, deleted_before);
        json purged = json::array();
        while (select.step())
            purged.push_back(select.text(0));
        if (purged.empty())
            return 0;
        const std::string ids = dump(purged);
        for (const char* table : {"cells", "inflight_executes", "audit"})
            Statement(database_.get(), std::string("DELETE FROM ") + table +
                                           " WHERE session IN (SELECT value FROM json_each(?1))")
                .bind(1, ids)
                .run();
        Statement(database_.get(), "DELETE FROM agent_sessions WHERE id IN (SELECT value FROM json_each(?1))")
            .bind(1, ids)
            .run();
        return purged.size();
    }
    void put_inflight(const InflightExecute& execute) override {
        std::lock_guard lock(mutex_);
        Statement(database_.get(),
                  "INSERT OR REPLACE INTO inflight_executes (session, msg_id, request) VALUES (?1, ?2, ?3)")
            .bind(1, execute.session)
            .bind(2, execute.msg_id)
            .bind(3, dump(execute.request))
            .run();
    }
    void remove_inflight(const std::string& session, const std::string& msg_id) override {
        std::lock_guard lock(mutex_);
        Statement(database_.get(), "DELETE FROM inflight_executes WHERE session = ?1 AND msg_id = ?2")
            .bind(1, session)
            .bind(2, msg_id)
            .run();
    }
    std::vector<InflightExecute> inflight(const std::string& session) override {
        std::lock_guard lock(mutex_);
        Statement query(database_.get(),
                        "SELECT msg_id, request FROM inflight_executes WHERE session = ?1 ORDER BY rowid");
        query.bind(1, session);
        std::vector<InflightExecute> found;
        while (query.step())
            found.push_back({session, query.text(0), json::parse(query.text(1), nullptr, false)});
        return found;
    }

    void append_audit(const json& entry) override {
        std::lock_guard lock(mutex_);
        Statement(database_.get(), "INSERT INTO audit (session, time, event, entry) VALUES (?1, ?2, ?3, ?4)")
            .bind(1, entry.value("session", std::string()))
            .bind(2, entry.value("time", std::string()))
            .bind(3, entry.value("event", std::string()))
            .bind(4, dump(entry))
            .run();
    }
    std::vector<json> audit(const AuditQuery& query) override {
        // ISO 8601 UTC strings of one format compare as times.
        return json_column(
            "SELECT entry FROM audit WHERE session = ?1 AND (?2 = '' OR event = ?2) AND (?3 = '' OR time >= "
            "?3) AND (?4 = '' OR time < ?4) ORDER BY seq",
            {query.session, query.event, query.since, query.until});
    }

    void write_batch(const std::vector<std::function<void(SessionStore&)>>& writes,
                     const std::function<void(const std::exception&)>& on_failure) override {
        {
            std::lock_guard lock(mutex_);
            execute_script(database_.get(), "BEGIN IMMEDIATE", "cannot begin a batch");
        }
        for (const auto& write : writes) {
            {
                std::lock_guard lock(mutex_);
                execute_script(database_.get(), "SAVEPOINT one_write", "cannot open a savepoint");
            }
            try {
                write(*this);
                std::lock_guard lock(mutex_);
                execute_script(database_.get(), "RELEASE one_write", "cannot release a savepoint");
            } catch (const std::exception& error) {
                {
                    std::lock_guard lock(mutex_);
                    sqlite3_exec(database_.get(), "ROLLBACK TO one_write; RELEASE one_write", nullptr,
                                 nullptr, nullptr);
                }
                on_failure(error);
            }
        }
        std::lock_guard lock(mutex_);
        if (sqlite3_exec(database_.get(), "COMMIT", nullptr, nullptr, nullptr) != SQLITE_OK) {
            const std::string message = sqlite3_errmsg(database_.get());
            sqlite3_exec(database_.get(), "ROLLBACK", nullptr, nullptr, nullptr);
            throw StoreError("store: cannot commit a batch of " + std::to_string(writes.size()) +
                             " writes: " + message);
        }
    }

    void put_tenant(const json& tenant) override {
        std::lock_guard lock(mutex_);
        Statement(database_.get(), "INSERT OR REPLACE INTO tenants (name, record) VALUES (?1, ?2)")
            .bind(1, tenant.value("name", std::string()))
            .bind(2, dump(tenant))
            .run();
    }
    void remove_tenant(const std::string& name) override {
        std::lock_guard lock(mutex_);
        execute_script(database_.get(), "SAVEPOINT remove_tenant", "cannot open a savepoint");
        try {
            Statement(database_.get(), "DELETE FROM tenant_tokens WHERE tenant = ?1").bind(1, name).run();
            Statement(database_.get(), "DELETE FROM tenants WHERE name = ?1").bind(1, name).run();
        } catch (...) {
            sqlite3_exec(database_.get(), "ROLLBACK TO remove_tenant; RELEASE remove_tenant", nullptr,
                         nullptr, nullptr);
            throw;
        }
        execute_script(database_.get(), "RELEASE remove_tenant", "cannot release a savepoint");
    }
    std::vector<json> tenants() override {
        return json_column("SELECT record FROM tenants ORDER BY name", {});
    }
    void put_tenant_token(const TenantToken& token) override {
        std::lock_guard lock(mutex_);
        Statement(database_.get(),
                  "INSERT OR REPLACE INTO tenant_tokens (id, tenant, role, digest, created) "
                  "VALUES (?1, ?2, ?3, ?4, ?5)")
            .bind(1, token.id)
            .bind(2, token.tenant)
            .bind(3, token.role)
            .bind(4, token.digest)
            .bind(5, token.created)
            .run();
    }
    void remove_tenant_token(const std::string& id) override {
        std::lock_guard lock(mutex_);
        Statement(database_.get(), "DELETE FROM tenant_tokens WHERE id = ?1").bind(1, id).run();
    }
    std::vector<TenantToken> tenant_tokens() override {
        std::lock_guard lock(mutex_);
        Statement query(database_.get(),
                        "SELECT id, tenant, role, digest, created FROM tenant_tokens ORDER BY created, id");
        std::vector<TenantToken> found;
        while (query.step())
            found.push_back({query.text(0), query.text(1), query.text(2), query.text(3), query.text(4)});
        return found;
    }

    bool shared() const override { return false; }
    // One gateway per state directory (its flock): every lease is this gateway's, and no write is fenced off.
    // Tokens still grow with each taking, as the interface promises.
    std::optional<std::int64_t> try_lease(const std::string&) override { return ++last_lease_token_; }
    void release_lease(const std::string&) override {}
    bool holds_lease(const std::string&) override { return true; }
    bool append_cell_fenced(const std::string& session, const json& cell, const LeaseFence&) override {
        append_cell(session, cell);
        return true;
    }
    bool put_inflight_fenced(const InflightExecute& execute, const LeaseFence&) override {
        put_inflight(execute);
        return true;
    }

  private:
    std::vector<KernelRecord> kernel_rows(const std::string& condition,
                                          const std::vector<std::string>& parameters) {
        std::lock_guard lock(mutex_);
        Statement query(
            database_.get(),
            "SELECT id, spec_name, key, endpoint_base, connection_file, workspace_dir, log_file, "
            "pid, start_ticks, boot_id, pooled, last_iopub_id, created, environment, extra FROM kernels " +
                condition);
        for (std::size_t i = 0; i < parameters.size(); ++i)
            query.bind(static_cast<int>(i + 1), parameters[i]);
        std::vector<KernelRecord> found;
        while (query.step()) {
            KernelRecord kernel;
            kernel.id = query.text(0);
            kernel.spec_name = query.text(1);
            kernel.key = query.text(2);
            kernel.endpoint_base = query.text(3);
            kernel.connection_file = query.text(4);
            kernel.workspace_dir = query.text(5);
            kernel.log_file = query.text(6);
            kernel.process.pid = static_cast<pid_t>(query.integer(7));
            kernel.process.start_ticks = static_cast<std::uint64_t>(query.integer(8));
            kernel.process.boot_id = query.text(9);
            kernel.pooled = query.integer(10) != 0;
            kernel.last_iopub_id = query.text(11);
            kernel.created = query.text(12);
            kernel.environment = json::parse(query.text(13), nullptr, false);
            if (!kernel.environment.is_object())
                kernel.environment = json::object();
            read_kernel_record_extra(json::parse(query.text(14), nullptr, false), kernel);
            found.push_back(std::move(kernel));
        }
        return found;
    }

    static std::string dump(const json& value) {
        return value.dump(-1, ' ', false, json::error_handler_t::replace);
    }

    std::vector<json> json_column(const char* sql, const std::vector<std::string>& parameters) {
        std::lock_guard lock(mutex_);
        Statement query(database_.get(), sql);
        for (std::size_t i = 0; i < parameters.size(); ++i)
            query.bind(static_cast<int>(i + 1), parameters[i]);
        std::vector<json> rows;
        while (query.step()) {
            json row = json::parse(query.text(0), nullptr, false);
            if (!row.is_discarded())
                rows.push_back(std::move(row));
        }
        return rows;
    }

    void migrate() {
        sqlite3* database = database_.get();
        bool has_user_tables = false, has_migrations = false;
        {
            Statement tables(database, "SELECT name FROM sqlite_master WHERE type = 'table'");
            while (tables.step()) {
                const std::string name = tables.text(0);
                if (name == "schema_migrations")
                    has_migrations = true;
                else if (!name.starts_with("sqlite_"))
                    has_user_tables = true;
            }
        }
        if (has_user_tables && !has_migrations)
            throw StoreError(
                "store: the database has tables but no schema_migrations: not a cellblock store");
        if (!has_migrations)
            execute_script(
                database,
                "CREATE TABLE schema_migrations (version INTEGER PRIMARY KEY, applied TEXT NOT NULL)",
                "cannot create schema_migrations");
        int version = 0;
        {
            Statement query(database, "SELECT coalesce(max(version), 0) FROM schema_migrations");
            if (query.step())
                version = static_cast<int>(query.integer(0));
        }
        if (version > current_schema_version)
            throw StoreError("store: schema version " + std::to_string(version) +
                             " was written by a newer cellblock-gateway (this one knows up to " +
                             std::to_string(current_schema_version) + ")");
        for (int next = version + 1; next <= current_schema_version; ++next) {
            execute_script(database, "BEGIN IMMEDIATE", "cannot begin migration");
            try {
                execute_script(database, migrations[static_cast<std::size_t>(next - 1)],
                               "migration " + std::to_string(next) + " failed");
                Statement(database, "INSERT INTO schema_migrations (version, applied) VALUES (?1, ?2)")
                    .bind(1, static_cast<std::int64_t>(next))
                    .bind(2, format_iso8601_utc(std::chrono::system_clock::now()))
                    .run();
                execute_script(database, "COMMIT", "cannot commit migration");
            } catch (...) {
                sqlite3_exec(database, "ROLLBACK", nullptr, nullptr, nullptr);
                throw;
            }
        }
    }

    fs::path file_;
    std::mutex mutex_;
    Database database_;
    std::atomic<std::int64_t> last_lease_token_{0};
};

}  // namespace

std::unique_ptr<SessionStore> open_sqlite_store(const fs::path& file) {
    return std::make_unique<SqliteStore>(file);
}

}  // namespace cellblock::gateway
