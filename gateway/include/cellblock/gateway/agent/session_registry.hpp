#pragma once
// All agent sessions, by id and by name: creation (with limits checked against the maxima), lookup, deletion,
// the idle TTL, their reload from the store after a gateway restart (with the re-adopted kernels), and the
// retention of deleted sessions' records in the store.
#include <boost/asio/steady_timer.hpp>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cellblock/gateway/agent/agent_session.hpp"
#include "cellblock/gateway/common/repeating_timer.hpp"
#include "cellblock/gateway/http/router.hpp"

namespace cellblock::gateway::agent {

// True for names a session may be given: 1-64 of [A-Za-z0-9._-], starting with a letter or digit, not a UUID.
bool valid_session_name(std::string_view name);

class AgentSessionRegistry {
  public:
    explicit AgentSessionRegistry(AgentSessionServices& services);
    ~AgentSessionRegistry();

    // After KernelManager::start(): reloads the recorded sessions, each with its re-adopted kernel (or a note
    // of why it was lost; a new one then starts on first use), and starts the TTL timer.
    void start();

    using CreateHandler =
        std::function<void(std::shared_ptr<AgentSession> session, std::optional<HttpError> error)>;
    // Empty `name` = generated. Responds once the session's kernel is ready. The session is `tenant`'s; names
    // are unique within a tenant (two tenants may each have a session "main").
    // `network` has been checked against the ceiling (AgentOperations).
    // `token_id`: the tenant token that asked, for the audit trail (empty for the operator).
    void create(std::string name, const std::string& tenant, AgentLimits limits,
                const NetworkRequest& network, const std::string& client_address, const std::string& token_id,
                CreateHandler done);
    // By id, then by name (in the principal's tenant), among the sessions held here (never reads the store);
    // nullptr also for a session `principal` does not see.
    std::shared_ptr<AgentSession> find(const Principal& principal, const std::string& id_or_name);
    // On a shared store, brings this registry up to date for `id_or_name` (a name in `tenant`) and then calls
    // `then` (io thread):
    // a session another gateway created is loaded (its kernel attached), one deleted through another gateway
    // is let go here too. The store is read on StoreWriter's reader thread; without an answer in time the
    // registry stays as it is. At once on an embedded store.
    void resolve(const std::string& tenant, const std::string& id_or_name, std::function<void()> then);
    std::vector<std::shared_ptr<AgentSession>> list() const;
    void remove(const std::shared_ptr<AgentSession>& session, const std::string& reason,
                const std::string& client, const std::string& token_id = {});

  private:
    // Drops a session that another gateway deleted (and recorded, with its audit entry) from this gateway,
    // writing nothing.
    void let_go(const std::shared_ptr<AgentSession>& session);
    // Takes the session's id and name out of this registry.
    void unregister(const AgentSession& session);
    void load_sessions();
    // Builds the session of a stored record with its history; `at_start`: after this gateway's restart
    // (its kernel re-adopted with the execute in flight), else attached on demand from a shared store.
    std::shared_ptr<AgentSession> load_record(const nlohmann::json& record, bool at_start);
    // The session of `record` with what was read for it; nullptr when unreadable or its id or name is taken.
    std::shared_ptr<AgentSession> build_session(const nlohmann::json& record,
                                                std::vector<nlohmann::json> cells,
                                                const std::shared_ptr<Kernel>& kernel,
                                                std::vector<InflightExecute> inflight, bool at_start);
    // A stored, not deleted record by id or by `tenant`'s name (on StoreWriter's reader thread).
    static std::optional<nlohmann::json> stored_record(SessionStore& store, const std::string& tenant,
                                                       const std::string& id_or_name);
    std::shared_ptr<AgentSession> held(const std::string& tenant, const std::string& id_or_name) const;
    // The key of a session name in id_by_name_: names are per tenant.
    static std::string name_key(const std::string& tenant, const std::string& name) {
        return tenant + '/' + name;
    }
    void check_still_stored(const std::shared_ptr<AgentSession>& found, std::function<void()> then);
    static constexpr std::chrono::milliseconds held_check_limit{250};
    static HttpError name_taken(const std::string& name);
    void create_named(const std::string& id, std::string name, const std::string& tenant, AgentLimits limits,
                      const NetworkRequest& network, const std::string& client_address,
                      const std::string& token_id, CreateHandler done);
    void expire_idle();
    // The store forgets the sessions deleted longer ago than --agent-deleted-retention, with their notebooks
    // and audit trails.
    void purge_deleted();

    AgentSessionServices& services_;
    std::map<std::string, std::shared_ptr<AgentSession>> by_id_;
    std::map<std::string, std::string> id_by_name_;
    RepeatingTimer expiry_sweep_;  // expire_idle, every quarter of the TTL (0.25 to 30 s)
    RepeatingTimer purge_sweep_;   // purge_deleted, every quarter of the retention (0.25 s to an hour)
    MetricsRegistry::SamplerHandle sessions_by_state_;   // cellblock_agent_sessions, sampled from by_id_
    MetricsRegistry::SamplerHandle sessions_by_tenant_;  // cellblock_tenant_sessions, sampled from by_id_
};

}  // namespace cellblock::gateway::agent
