#pragma once
// What the gateway must remember across its own restarts, behind one interface: kernels (with the identity of
// their process, so a restarted gateway can re-adopt them), Jupyter sessions (/api/sessions), agent sessions
// with their cell history and in-flight executes, and the audit trail. `SqliteStore` is the embedded
// implementation; a shared store (PostgreSQL) can implement the same interface. No SQL lives outside the
// implementations.
//
// Every method is safe to call from any thread (the implementation serialises). Writes are durable when the
// call returns (fsync'd commit); callers that must not block the io_context go through `StoreWriter`.
#include <sys/types.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace cellblock::gateway {

// Identifies one process across pid reuse and reboots: the pid, its start time in clock ticks since boot
// (/proc/<pid>/stat field 22) and the boot id.
struct ProcessIdentity {
    pid_t pid = -1;
    std::uint64_t start_ticks = 0;
    std::string boot_id;

    // The identity of the live process `pid`; nullopt when it does not exist.
    static std::optional<ProcessIdentity> of(pid_t pid);
    // True when `pid` still names the very process this identity was taken from.
    bool alive() const;
    bool operator==(const ProcessIdentity&) const = default;
};

struct KernelRecord {
    std::string id;
    std::string spec_name;
    std::string key;            // HMAC key (the state directory is 0700, the store file 0600)
    std::string endpoint_base;  // ipc path prefix of the kernel's sockets
    std::string connection_file;
    std::string workspace_dir;
    std::string log_file;
    nlohmann::json environment = nlohmann::json::object();  // the process's environment, for restarts
    ProcessIdentity process;
    bool pooled = false;        // a warm-pool kernel not yet handed out
    std::string last_iopub_id;  // the last IOPub message the gateway received (where a replay starts)
    std::string created;        // ISO 8601
    // Where the kernel runs, for re-adoption: {} = a local process (`process` above); a kernel that reported
    // its connection: {"name": "slurm", "job_id", "host", "ip", "ports": [shell, iopub, stdin, control, hb],
    // "curve_public_key"}. Kept in the stores' `extra` column (below).
    nlohmann::json provisioner = nlohmann::json::object();
    // The gateway that started the kernel and re-adopts it after its own restart ("host:state dir"); other
    // gateways on a shared store attach it on demand. Empty in records of gateways before the shared store.
    std::string owner;
    // When a client last used the kernel through any gateway (ISO 8601; shared stores: culling is decided
    // from it by one gateway, the cull leader). Empty = unknown.
    std::string last_activity;
    // The tenant the kernel belongs to (principal.hpp); empty = the operator's.
    std::string tenant;
};

// Fields of KernelRecord kept in the stores' `extra` JSON column, so that adding one needs no schema
// migration: write it in `kernel_record_extra`, read it in `read_kernel_record_extra` (both stores use
// these).
inline nlohmann::json kernel_record_extra(const KernelRecord& kernel) {
    return {{"owner", kernel.owner},
            {"tenant", kernel.tenant},
            {"last_activity", kernel.last_activity},
            {"provisioner", kernel.provisioner}};
}
inline void read_kernel_record_extra(const nlohmann::json& extra, KernelRecord& kernel) {
    if (!extra.is_object())
        return;
    kernel.owner = extra.value("owner", std::string());
    kernel.last_activity = extra.value("last_activity", std::string());
    kernel.tenant = extra.value("tenant", std::string());
    kernel.provisioner = extra.value("provisioner", nlohmann::json::object());
    if (!kernel.provisioner.is_object())
        kernel.provisioner = nlohmann::json::object();
}

struct AuditQuery {
    std::string session;  // required
    std::string event;    // empty = every event
    std::string since;    // ISO 8601, inclusive; empty = from the start
    std::string until;    // ISO 8601, exclusive; empty = to the end
};

// An execute that was sent to a kernel and has not been answered and recorded yet.
struct InflightExecute {
    std::string session;
    std::string msg_id;
    nlohmann::json request;  // code, client, via, timeout_s, started
};

// A lease as taken (SessionStore::try_lease): its name and the token that taking got.
struct LeaseFence {
    std::string lease;
    std::int64_t token = 0;
};

// Releases of leases on a shared store, heard on a connection of their own, for waiters that would otherwise
// ask again and again (StoreWriter::when_lease_released). Non-blocking; used from one thread.
class LeaseReleases {
  public:
    virtual ~LeaseReleases() = default;
    // The descriptor to watch for readability; -1 once the connection is gone (waiters keep their timers).
    virtual int socket() const = 0;
    // The names of the leases released since the last call, from what the socket has received (no wait).
    virtual std::vector<std::string> take() = 0;
};

class StoreError : public std::runtime_error {
  public:
    using std::runtime_error::runtime_error;
};
// The store could not be reached (a broken or refused connection): nothing of the call was applied, and the
// same call may succeed once the store is back (StoreWriter retries a batch that failed so).
class StoreUnavailable : public StoreError {
  public:
    using StoreError::StoreError;
};

// A tenant's token as the store keeps it: never the token, only its keyed digest (TenantDirectory,
// gateway/include/cellblock/gateway/access/tenants.hpp).
struct TenantToken {
    std::string id;       // shown to the operator, written in audit entries
    std::string tenant;   // the tenant's name
    std::string role;     // "agent" or "approver"
    std::string digest;   // HMAC-SHA256 of the token under a key derived from the store secret, hex
    std::string created;  // ISO 8601
};

class SessionStore {
  public:
    virtual ~SessionStore() = default;

    virtual void put_kernel(const KernelRecord& kernel) = 0;
    virtual void remove_kernel(const std::string& kernel_id) = 0;
    virtual void set_kernel_progress(const std::string& kernel_id, const std::string& last_iopub_id) = 0;
    virtual std::vector<KernelRecord> kernels() = 0;
    virtual std::optional<KernelRecord> kernel(const std::string& kernel_id) = 0;
    // Sets the record's last_activity (only this field).
    virtual void set_kernel_activity(const std::string& kernel_id, const std::string& last_activity) = 0;

    // /api/sessions models, keyed by session id.
    virtual void put_jupyter_session(const std::string& id, const nlohmann::json& model) = 0;
    virtual void remove_jupyter_session(const std::string& id) = 0;
    virtual std::vector<nlohmann::json> jupyter_sessions() = 0;

    // Agent session records ({id, name, created, limits, network, kernel_id, deleted, deleted_at}).
    virtual void put_agent_session(const nlohmann::json& record) = 0;
    virtual std::vector<nlohmann::json> agent_sessions() = 0;
    // One record by session id (deleted ones included); nullopt when unknown.
    virtual std::optional<nlohmann::json> agent_session(const std::string& id) = 0;
    // The session's notebook history, in order; `clear_cells` is a reset.
    virtual void append_cell(const std::string& session, const nlohmann::json& cell) = 0;
    virtual void clear_cells(const std::string& session) = 0;
    virtual std::vector<nlohmann::json> cells(const std::string& session) = 0;
    // Removes every agent session marked deleted before `deleted_before` (ISO 8601 UTC), with its cells, its
    // in-flight executes and its audit entries; answers how many sessions were removed. The deletion time is
    // the record's `deleted_at`; a record written before that field existed counts from its newest audit
    // entry. Live sessions and sessions deleted since are untouched. Gateways sharing a store may call it at
    // once: one of them purges, the others answer 0.
    virtual std::size_t purge_deleted_agent_sessions(const std::string& deleted_before) = 0;
    virtual void put_inflight(const InflightExecute& execute) = 0;
    virtual void remove_inflight(const std::string& session, const std::string& msg_id) = 0;
    virtual std::vector<InflightExecute> inflight(const std::string& session) = 0;

    // Group commit: runs `writes` in one transaction (one fsync), each write in its own savepoint so that a
    // failing one is rolled back alone and reported through `on_failure`.
    virtual void write_batch(const std::vector<std::function<void(SessionStore&)>>& writes,
                             const std::function<void(const std::exception&)>& on_failure) = 0;

    // Audit entries ({time, session, event, ...}), oldest first.
    virtual void append_audit(const nlohmann::json& entry) = 0;
    virtual std::vector<nlohmann::json> audit(const AuditQuery& query) = 0;

    // True when other gateways may use this store at the same time (PostgreSQL): kernels and sessions this
    // gateway does not hold are looked up here on demand, and the leases below exclude the other gateways.
    // Tenants ({name, quota, self_approve, created}), keyed by name, and their tokens. Removing a tenant
    // removes its tokens in the same transaction.
    virtual void put_tenant(const nlohmann::json& tenant) = 0;
    virtual void remove_tenant(const std::string& name) = 0;
    virtual std::vector<nlohmann::json> tenants() = 0;
    virtual void put_tenant_token(const TenantToken& token) = 0;
    virtual void remove_tenant_token(const std::string& id) = 0;
    virtual std::vector<TenantToken> tenant_tokens() = 0;

    virtual bool shared() const = 0;
    // Leases between gateways sharing the store: `try_lease` takes the named lease for this gateway without
    // waiting and answers its fencing token (nullopt = another gateway holds it); it is held until
    // `release_lease` or until this gateway's connection to the store ends (a killed gateway never wedges a
    // lease). Each taking of a name gets a larger token than every earlier one, so a gateway that lost the
    // lease unawares (its connection dropped) is refused by the fenced writes below. Not re-entrant across
    // callers of one gateway: each name has one holder in the gateway. An embedded store has one gateway and
    // grants every lease.
    virtual std::optional<std::int64_t> try_lease(const std::string& name) = 0;
    virtual void release_lease(const std::string& name) = 0;
    // Whether this gateway's store connection holds the lease now: taken and neither released nor lost with a
    // connection that ended (a held lease has held it without a break since its taking).
    virtual bool holds_lease(const std::string& name) = 0;
    // A new connection that hears every release_lease of the gateways on this store (this one's included);
    // nullptr where there is no one else to hear (an embedded store).
    virtual std::unique_ptr<LeaseReleases> listen_for_lease_releases() { return nullptr; }
    // Writes made under a lease: applied only while no other gateway has taken `fence.lease` since the taking
    // that got `fence.token` (this gateway's own later takings refuse nothing). false = refused, nothing
    // written.
    virtual bool append_cell_fenced(const std::string& session, const nlohmann::json& cell,
                                    const LeaseFence& fence) = 0;
    virtual bool put_inflight_fenced(const InflightExecute& execute, const LeaseFence& fence) = 0;
};

// Opens (creating if absent) the SQLite store at `file`: WAL, synchronous=FULL, schema migrated to the
// current version. A file that is not a cellblock store, is corrupt, or comes from a newer gateway throws
// StoreError and is left untouched.
std::unique_ptr<SessionStore> open_sqlite_store(const std::filesystem::path& file);

// Connects to the PostgreSQL store at `url` (postgresql://user@host:port/database, or a libpq keyword string)
// and migrates its schema to the current version (one gateway at a time: an advisory lock). A bad URL, an
// unreachable server, a database holding another application's tables or a newer schema throw StoreError
// (the URL in messages has its password hidden).
std::unique_ptr<SessionStore> open_postgres_store(const std::string& url);

// Why the gateway refuses to use `url` as it is: a host other than this machine (not a Unix socket, localhost
// or 127.0.0.0/8) with no sslmode said, which libpq would let fall back to plaintext. nullopt when it is
// fine, including any sslmode the operator wrote (sslmode=disable is their explicit choice).
std::optional<std::string> unencrypted_remote_store(const std::string& url);

}  // namespace cellblock::gateway
