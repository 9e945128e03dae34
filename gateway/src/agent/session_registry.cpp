#include "cellblock/gateway/agent/session_registry.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <fstream>

#include "cellblock/gateway/common/crypto.hpp"
#include "cellblock/gateway/common/time_format.hpp"
#include "cellblock/gateway/http/rest_handlers.hpp"

namespace cellblock::gateway::agent {

using nlohmann::json;
namespace fs = std::filesystem;

bool valid_session_name(std::string_view name) {
    if (name.empty() || name.size() > 64)
        return false;
    if (!std::isalnum(static_cast<unsigned char>(name.front())))
        return false;
    for (char c : name)
        if (!std::isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != '-')
            return false;
    return !looks_like_kernel_id(name);  // ids and names share one namespace in URLs
}

AgentSessionRegistry::AgentSessionRegistry(AgentSessionServices& services)
    : services_(services), expiry_sweep_(services.io), purge_sweep_(services.io) {
    sessions_by_state_ = services.metrics.registry.sampled_gauge(
        "cellblock_agent_sessions", "Agent sessions by what they are doing now.", "state", [this] {
            std::vector<GaugeSample> samples;
            using State = AgentSession::State;
            for (State state : {State::starting, State::busy, State::idle, State::without_kernel})
                samples.emplace_back(std::string(AgentSession::state_name(state)), 0.0);
            for (const auto& [id, session] : by_id_)
                for (auto& [state, count] : samples)
                    if (state == AgentSession::state_name(session->state()))
                        count += 1;
            return samples;
        });
    sessions_by_tenant_ = services.metrics.registry.sampled_gauge(
        "cellblock_tenant_sessions",
        "Agent sessions of tenants, by tenant (the operator's own are not in it).", "tenant", [this] {
            std::map<std::string, double> counts;
            for (const auto& [id, session] : by_id_)
                if (!session->tenant().empty())
                    counts[session->tenant()] += 1;
            return std::vector<GaugeSample>(counts.begin(), counts.end());
        });
}

AgentSessionRegistry::~AgentSessionRegistry() {
    expiry_sweep_.stop();
    purge_sweep_.stop();
    services_.writer.drain();
}

void AgentSessionRegistry::start() {
    load_sessions();
    if (const double ttl = services_.config.session_ttl_s; ttl > 0)
        expiry_sweep_.start(std::chrono::duration<double>(std::clamp(ttl / 4, 0.25, 30.0)),
                            [this] { expire_idle(); });
    if (const double retention = services_.config.deleted_retention_s; retention > 0)
        purge_sweep_.start(std::chrono::duration<double>(std::clamp(retention / 4, 0.25, 3600.0)),
                           [this] { purge_deleted(); });
}

void AgentSessionRegistry::load_sessions() {
    SessionStore& store = services_.writer.store();
    for (const json& record : store.agent_sessions()) {
        if (!record.is_object() || record.value("deleted", false))
            continue;
        if (store.shared()) {
            // Only sessions whose kernel this gateway re-adopted (or that have none): the others are
            // another gateway's, loaded when a request names them.
            const std::string kernel_id = record.contains("kernel_id") && record["kernel_id"].is_string()
                                              ? record["kernel_id"].get<std::string>()
                                              : "";
            if (!kernel_id.empty() && !services_.kernels.find(kernel_id))
                continue;
        }
        load_record(record, true);
    }
    if (!by_id_.empty())
        services_.logger.info("agent_sessions_reloaded", {{"count", by_id_.size()}});
}

std::shared_ptr<AgentSession> AgentSessionRegistry::load_record(const json& record, bool at_start) {
    // At start, before the gateway serves: reading the store here blocks nobody.
    SessionStore& store = services_.writer.store();
    const std::string id = record.value("id", std::string());
    std::vector<json> cells;
    try {
        cells = store.cells(id);
    } catch (const std::exception& failure) {
        services_.logger.warn("agent_session_unreadable",
                              {{"record", record.dump()}, {"error", failure.what()}});
        return nullptr;
    }
    const std::string kernel_id = record.contains("kernel_id") && record["kernel_id"].is_string()
                                      ? record["kernel_id"].get<std::string>()
                                      : "";
    auto kernel = kernel_id.empty() ? nullptr : services_.kernels.find(kernel_id);
    return build_session(record, std::move(cells), kernel,
                         at_start ? store.inflight(id) : std::vector<InflightExecute>{}, at_start);
}

std::shared_ptr<AgentSession> AgentSessionRegistry::build_session(const json& record, std::vector<json> cells,
                                                                  const std::shared_ptr<Kernel>& kernel,
                                                                  std::vector<InflightExecute> inflight,
                                                                  bool at_start) {
    try {
        AgentSession::Record loaded{
            record.at("id").get<std::string>(), record.at("name").get<std::string>(),
            record.value("created", std::string()),
            parse_limits(record.value("limits", json::object()), services_.config.default_limits,
                         AgentLimits{1e12, UINT64_MAX / 2, UINT64_MAX / 2}),
            // Kept as created: the kernel's proxy still applies the ceiling in force when a kernel starts.
            parse_network_request(record.value("network", json(nullptr))),
            record.value("tenant", std::string())};
        const std::string key = name_key(loaded.tenant, loaded.name);
        if (by_id_.contains(loaded.id) || id_by_name_.contains(key))
            return nullptr;
        auto session = std::make_shared<AgentSession>(services_, loaded, std::move(cells));
        session->mark_record_committed();
        id_by_name_[key] = loaded.id;
        by_id_[loaded.id] = session;
        const std::string kernel_id = record.contains("kernel_id") && record["kernel_id"].is_string()
                                          ? record["kernel_id"].get<std::string>()
                                          : "";
        // Attached on demand, the execute in flight (if any) is the other gateway's to finish.
        if (at_start)
            session->audit({{"event", "session_reloaded"},
                            {"kernel_id", kernel ? json(kernel_id) : json(nullptr)},
                            {"note", kernel ? "gateway restarted; the session's kernel was re-adopted"
                                            : "gateway restarted; a new kernel starts on first use"}});
        else
            services_.logger.info("agent_session_attached_from_store",
                                  {{"session", loaded.id}, {"kernel_id", kernel_id}});
        if (kernel)
            session->resume(kernel, "", std::move(inflight));
        else if (!kernel_id.empty())
            session->resume(nullptr,
                            services_.kernels.lost_cause(kernel_id).value_or(
                                at_start ? "the previous gateway stopped its kernels when it exited"
                                         : "the kernel process is no longer running"),
                            std::move(inflight));
        return session;
    } catch (const std::exception& failure) {
        services_.logger.warn("agent_session_unreadable",
                              {{"record", record.dump()}, {"error", failure.what()}});
        return nullptr;
    }
}

std::optional<json> AgentSessionRegistry::stored_record(SessionStore& store, const std::string& tenant,
                                                        const std::string& id_or_name) {
    if (looks_like_kernel_id(id_or_name)) {
        auto record = store.agent_session(id_or_name);
        if (record && record->is_object() && !record->value("deleted", false))
            return record;
        return std::nullopt;
    }
    for (json& record : store.agent_sessions())
        if (record.is_object() && !record.value("deleted", false) &&
            record.value("name", std::string()) == id_or_name &&
            record.value("tenant", std::string()) == tenant)
            return std::move(record);
    return std::nullopt;
}

std::shared_ptr<AgentSession> AgentSessionRegistry::held(const std::string& tenant,
                                                         const std::string& id_or_name) const {
    if (auto by_id = by_id_.find(id_or_name); by_id != by_id_.end())
        return by_id->second;
    if (auto named = id_by_name_.find(name_key(tenant, id_or_name)); named != id_by_name_.end())
        if (auto by_name = by_id_.find(named->second); by_name != by_id_.end())
            return by_name->second;
    return nullptr;
}

void AgentSessionRegistry::resolve(const std::string& tenant, const std::string& id_or_name,
                                   std::function<void()> then) {
    if (!services_.writer.shared())
        return then();
    if (auto found = held(tenant, id_or_name))
        return check_still_stored(found, std::move(then));
    // Another gateway's session: its record, history and kernel record, read together off the io thread.
    struct Stored {
        std::optional<json> record;
        std::vector<json> cells;
        std::optional<KernelRecord> kernel;
    };
    services_.writer.read<Stored>(
        [tenant, id_or_name](SessionStore& store) {
            Stored stored{stored_record(store, tenant, id_or_name), {}, std::nullopt};
            if (!stored.record)
                return stored;
            stored.cells = store.cells(stored.record->value("id", std::string()));
            const json& kernel_id =
                stored.record->contains("kernel_id") ? (*stored.record)["kernel_id"] : json();
            if (kernel_id.is_string() && !kernel_id.get<std::string>().empty())
                stored.kernel = store.kernel(kernel_id.get<std::string>());
            return stored;
        },
        StoreWriter::default_read_limit,
        [this, tenant, id_or_name, then = std::move(then)](StoreAnswer<Stored> answer) {
            if (!answer.ok())
                services_.logger.error("store_read_failed",
                                       {{"session", id_or_name}, {"error", answer.error}});
            else if (answer.value->record && !held(tenant, id_or_name)) {
                const json& record = *answer.value->record;
                const json& kernel_id = record.contains("kernel_id") ? record["kernel_id"] : json();
                auto kernel =
                    kernel_id.is_string() && !kernel_id.get<std::string>().empty()
                        ? services_.kernels.attach_stored(kernel_id.get<std::string>(), answer.value->kernel)
                        : nullptr;
                build_session(record, std::move(answer.value->cells), kernel, {}, false);
            }
            then();
        });
}

void AgentSessionRegistry::check_still_stored(const std::shared_ptr<AgentSession>& found,
                                              std::function<void()> then) {
    // Deleted through another gateway: let it go here too (its kernel is shut down already). No answer in
    // time: the session held here serves, as it would have without a shared store (briefly asked: the
    // request's own time limit runs meanwhile).
    services_.writer.read<std::optional<json>>(
        [id = found->id()](SessionStore& store) { return store.agent_session(id); }, held_check_limit,
        [this, found, then = std::move(then)](StoreAnswer<std::optional<json>> answer) {
            if (!answer.ok()) {
                services_.logger.error("store_read_failed",
                                       {{"session", found->id()}, {"error", answer.error}});
                return then();
            }
            const auto& record = *answer.value;
            // No record at all: deleted there longer ago than the retention, and purged.
            if ((record ? record->value("deleted", false) : found->record_committed()) &&
                held(found->tenant(), found->id()) == found)
                let_go(found);
            then();
        });
}

void AgentSessionRegistry::create(std::string name, const std::string& tenant, AgentLimits limits,
                                  const NetworkRequest& network, const std::string& client_address,
                                  const std::string& token_id, CreateHandler done) {
    if (services_.config.max_sessions > 0 && by_id_.size() >= services_.config.max_sessions)
        return done(nullptr, HttpError(http::status::too_many_requests,
                                       "too many agent sessions (" + std::to_string(by_id_.size()) +
                                           "); delete some first",
                                       "too_many_sessions"));
    std::string id = new_uuid();
    if (name.empty())
        name = "session-" + id.substr(0, 8);
    if (!valid_session_name(name))
        return done(nullptr,
                    HttpError(http::status::bad_request,
                              "name must be 1-64 characters of A-Z a-z 0-9 . _ - starting with a letter or "
                              "digit (and not look like a session id)",
                              "bad_name"));
    if (id_by_name_.contains(name_key(tenant, name)))
        return done(nullptr, name_taken(name));
    if (!services_.writer.shared())
        return create_named(id, std::move(name), tenant, limits, network, client_address, token_id,
                            std::move(done));
    // A session of that name created through another gateway: asked off the io thread.
    services_.writer.read<bool>(
        [tenant, name](SessionStore& store) { return stored_record(store, tenant, name).has_value(); },
        StoreWriter::default_read_limit,
        [this, id, name, tenant, limits, network, client_address, token_id,
         done = std::move(done)](StoreAnswer<bool> taken) mutable {
            if (!taken.ok())
                return done(nullptr,
                            HttpError(http::status::service_unavailable,
                                      "the store did not answer: " + taken.error, "store_unavailable"));
            if (*taken.value || id_by_name_.contains(name_key(tenant, name)))
                return done(nullptr, name_taken(name));
            create_named(id, std::move(name), tenant, limits, network, client_address, token_id,
                         std::move(done));
        });
}

HttpError AgentSessionRegistry::name_taken(const std::string& name) {
    return HttpError(http::status::conflict, "a session named " + name + " already exists", "name_taken");
}

void AgentSessionRegistry::create_named(const std::string& id, std::string name, const std::string& tenant,
                                        AgentLimits limits, const NetworkRequest& network,
                                        const std::string& client_address, const std::string& token_id,
                                        CreateHandler done) {
    AgentSession::Record record{id,     name,    format_iso8601_utc(std::chrono::system_clock::now()),
                                limits, network, tenant};
    auto session = std::make_shared<AgentSession>(services_, record, std::vector<json>{});
    by_id_[id] = session;
    id_by_name_[name_key(tenant, name)] = id;  // reserved while the kernel starts
    session->persist_record();
    session->audit({{"event", "session_created"},
                    {"client", client_address},
                    {"token_id", token_id},
                    {"name", name},
                    {"limits", limits.to_json()},
                    {"network", network.none() ? json(nullptr) : network.to_json()}});
    std::weak_ptr<AgentSession> weak = session;
    session->ensure_kernel([this, weak, done = std::move(done), client_address,
                            token_id](std::optional<std::string> failure) {
        auto created = weak.lock();
        if (!created || created->closed())
            return done(nullptr,
                        HttpError(http::status::gone, "the session was deleted while its kernel was starting",
                                  "session_deleted"));
        if (failure) {
            remove(created, "kernel failed to start", client_address, token_id);
            return done(nullptr,
                        HttpError(http::status::service_unavailable,
                                  "the session's kernel did not start: " + *failure, "kernel_unavailable"));
        }
        // Answered once the session's and its kernel's records are in the store, as every creation and
        // deletion is: a client may use the session through another gateway on a shared store right after.
        services_.writer.after_pending([created, done] {
            created->mark_record_committed();
            done(created, std::nullopt);
        });
    });
}

std::shared_ptr<AgentSession> AgentSessionRegistry::find(const Principal& principal,
                                                         const std::string& id_or_name) {
    auto found = held(principal.tenant, id_or_name);
    return found && principal.sees_session(found->tenant(), found->id()) ? found : nullptr;
}

std::vector<std::shared_ptr<AgentSession>> AgentSessionRegistry::list() const {
    std::vector<std::shared_ptr<AgentSession>> sessions;
    for (const auto& [id, session] : by_id_)
        sessions.push_back(session);
    return sessions;
}

void AgentSessionRegistry::remove(const std::shared_ptr<AgentSession>& session, const std::string& reason,
                                  const std::string& client, const std::string& token_id) {
    if (!session)
        return;
    unregister(*session);
    session->audit(
        {{"event", "session_deleted"}, {"reason", reason}, {"client", client}, {"token_id", token_id}});
    session->close(reason);
}

void AgentSessionRegistry::unregister(const AgentSession& session) {
    by_id_.erase(session.id());
    if (auto named = id_by_name_.find(name_key(session.tenant(), session.name()));
        named != id_by_name_.end() && named->second == session.id())
        id_by_name_.erase(named);
}

void AgentSessionRegistry::let_go(const std::shared_ptr<AgentSession>& session) {
    unregister(*session);
    services_.logger.info("agent_session_let_go",
                          {{"session", session->id()}, {"reason", "deleted through another gateway"}});
    session->close("deleted through another gateway", false);
}

void AgentSessionRegistry::expire_idle() {
    const auto now = std::chrono::steady_clock::now();
    const auto ttl = std::chrono::milliseconds(static_cast<long long>(services_.config.session_ttl_s * 1000));
    std::vector<std::shared_ptr<AgentSession>> idle;
    for (const auto& [id, session] : by_id_)
        if (!session->busy() && now - session->last_used() > ttl)
            idle.push_back(session);
    for (const auto& session : idle) {
        services_.logger.info("agent_session_expired",
                              {{"session", session->id()}, {"name", session->name()}});
        remove(session,
               "idle for longer than the session TTL (" + json(services_.config.session_ttl_s).dump() + " s)",
               "");
    }
}

void AgentSessionRegistry::purge_deleted() {
    const auto retention =
        std::chrono::milliseconds(static_cast<long long>(services_.config.deleted_retention_s * 1000));
    const std::string deleted_before = format_iso8601_utc(std::chrono::system_clock::now() - retention);
    const Logger& logger = services_.logger;
    // On the writer's thread, in its order: the deletions queued before are committed first.
    services_.writer.submit([deleted_before, &logger](SessionStore& store) {
        const std::size_t purged = store.purge_deleted_agent_sessions(deleted_before);
        if (purged > 0)
            logger.info("agent_sessions_purged", {{"count", purged}, {"deleted_before", deleted_before}});
    });
}

}  // namespace cellblock::gateway::agent
