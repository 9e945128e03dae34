#include "cellblock/gateway/agent/session_registry.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <fstream>

#include "cellblock/gateway/crypto.hpp"
#include "cellblock/gateway/rest_handlers.hpp"
#include "cellblock/gateway/time_format.hpp"

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

AgentSessionRegistry::AgentSessionRegistry(SessionServices& services)
    : services_(services), expiry_timer_(services.io) {}

AgentSessionRegistry::~AgentSessionRegistry() {
    expiry_timer_.cancel();
    services_.writer.drain();
    if (lock_fd_ >= 0)
        ::close(lock_fd_);
}

namespace {
fs::path default_state_dir() {
    if (const char* state = std::getenv("XDG_STATE_HOME"); state && *state)
        return fs::path(state) / "cellblock" / "agent";
    if (const char* home = std::getenv("HOME"); home && *home)
        return fs::path(home) / ".local" / "state" / "cellblock" / "agent";
    return {};
}

// Returns the locked fd, or -1 when the directory cannot be used or another gateway holds it.
int lock_state_dir(const fs::path& directory, std::string& why) {
    std::error_code error;
    fs::create_directories(directory / "sessions", error);
    if (error) {
        why = "cannot create " + (directory / "sessions").string() + ": " + error.message();
        return -1;
    }
    fs::permissions(directory, fs::perms::owner_all, error);
    const int fd = ::open((directory / "lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0) {
        why = "cannot open " + (directory / "lock").string() + ": " + std::strerror(errno);
        return -1;
    }
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
        why = "another gateway uses " + directory.string();
        ::close(fd);
        return -1;
    }
    return fd;
}
}  // namespace

void AgentSessionRegistry::start(const fs::path& fallback_dir) {
    fs::path wanted =
        services_.config.state_dir.empty() ? default_state_dir() : fs::path(services_.config.state_dir);
    std::string why = "no state directory configured and no HOME";
    if (!wanted.empty())
        lock_fd_ = lock_state_dir(wanted, why);
    if (lock_fd_ >= 0) {
        state_dir_ = wanted;
    } else {
        if (!services_.config.state_dir.empty())
            throw std::runtime_error("agent state directory unusable: " + why);
        services_.logger.warn(
            "agent_state_dir_fallback",
            {{"wanted", wanted.string()}, {"reason", why}, {"using", fallback_dir.string()}});
        lock_fd_ = lock_state_dir(fallback_dir, why);
        if (lock_fd_ < 0)
            throw std::runtime_error("agent state directory unusable: " + why);
        state_dir_ = fallback_dir;
    }
    load_sessions();
    schedule_expiry();
}

void AgentSessionRegistry::load_sessions() {
    std::error_code error;
    for (const auto& entry : fs::directory_iterator(state_dir_ / "sessions", error)) {
        const fs::path record_file = entry.path() / "session.json";
        std::ifstream input(record_file);
        if (!input)
            continue;
        const json record = json::parse(input, nullptr, false);
        if (!record.is_object() || record.value("deleted", false))
            continue;
        try {
            AgentSession::Record loaded{
                record.at("id").get<std::string>(), record.at("name").get<std::string>(),
                record.value("created", std::string()),
                parse_limits(record.value("limits", json::object()), services_.config.default_limits,
                             AgentLimits{1e12, UINT64_MAX / 2, UINT64_MAX / 2})};
            if (loaded.id != entry.path().filename().string() || by_id_.contains(loaded.id) ||
                id_by_name_.contains(loaded.name))
                continue;
            std::vector<json> cells;
            std::ifstream history(entry.path() / "cells.jsonl");
            for (std::string line; std::getline(history, line);) {
                json cell = json::parse(line, nullptr, false);
                if (!cell.is_object())
                    continue;  // a torn last line after a crash
                if (cell.value("reset", false))
                    cells.clear();
                else
                    cells.push_back(std::move(cell));
            }
            auto session = std::make_shared<AgentSession>(services_, loaded, entry.path(), std::move(cells));
            id_by_name_[loaded.name] = loaded.id;
            by_id_[loaded.id] = session;
            session->audit({{"event", "session_reloaded"},
                            {"note", "gateway restarted; a new kernel starts on first use"}});
        } catch (const std::exception& failure) {
            services_.logger.warn("agent_session_unreadable",
                                  {{"file", record_file.string()}, {"error", failure.what()}});
        }
    }
    if (!by_id_.empty())
        services_.logger.info("agent_sessions_reloaded", {{"count", by_id_.size()}});
}

void AgentSessionRegistry::create(std::string name, AgentLimits limits, const std::string& client_address,
                                  CreateHandler done) {
    if (services_.config.max_sessions > 0 && by_id_.size() >= services_.config.max_sessions)
        return done(nullptr, HttpError(http::status::too_many_requests,
                                       "too many agent sessions (" + std::to_string(by_id_.size()) +
                                           "); delete some first",
                                       "too_many_sessions"));
    const std::string id = new_uuid();
    if (name.empty())
        name = "session-" + id.substr(0, 8);
    if (!valid_session_name(name))
        return done(nullptr,
                    HttpError(http::status::bad_request,
                              "name must be 1-64 characters of A-Z a-z 0-9 . _ - starting with a letter or "
                              "digit (and not look like a session id)",
                              "bad_name"));
    if (id_by_name_.contains(name))
        return done(nullptr, HttpError(http::status::conflict, "a session named " + name + " already exists",
                                       "name_taken"));

    const fs::path directory = state_dir_ / "sessions" / id;
    std::error_code error;
    fs::create_directories(directory, error);
    if (error)
        return done(nullptr, HttpError(http::status::internal_server_error,
                                       "cannot create " + directory.string() + ": " + error.message()));
    AgentSession::Record record{id, name, format_iso8601_utc(std::chrono::system_clock::now()), limits};
    auto session = std::make_shared<AgentSession>(services_, record, directory, std::vector<json>{});
    by_id_[id] = session;
    id_by_name_[name] = id;  // reserved while the kernel starts
    session->persist_record();
    session->audit({{"event", "session_created"},
                    {"client", client_address},
                    {"name", name},
                    {"limits", limits.to_json()}});
    std::weak_ptr<AgentSession> weak = session;
    session->ensure_kernel([this, weak, done = std::move(done),
                            client_address](std::optional<std::string> failure) {
        auto created = weak.lock();
        if (!created || created->closed())
            return done(nullptr,
                        HttpError(http::status::gone, "the session was deleted while its kernel was starting",
                                  "session_deleted"));
        if (failure) {
            remove(created, "kernel failed to start", client_address);
            return done(nullptr,
                        HttpError(http::status::service_unavailable,
                                  "the session's kernel did not start: " + *failure, "kernel_unavailable"));
        }
        done(created, std::nullopt);
    });
}

std::shared_ptr<AgentSession> AgentSessionRegistry::find(const std::string& id_or_name) const {
    if (auto found = by_id_.find(id_or_name); found != by_id_.end())
        return found->second;
    if (auto named = id_by_name_.find(id_or_name); named != id_by_name_.end()) {
        if (auto found = by_id_.find(named->second); found != by_id_.end())
            return found->second;
    }
    return nullptr;
}

std::vector<std::shared_ptr<AgentSession>> AgentSessionRegistry::list() const {
    std::vector<std::shared_ptr<AgentSession>> sessions;
    for (const auto& [id, session] : by_id_)
        sessions.push_back(session);
    return sessions;
}

void AgentSessionRegistry::remove(const std::shared_ptr<AgentSession>& session, const std::string& reason,
                                  const std::string& client) {
    if (!session)
        return;
    by_id_.erase(session->id());
    if (auto named = id_by_name_.find(session->name());
        named != id_by_name_.end() && named->second == session->id())
        id_by_name_.erase(named);
    session->audit({{"event", "session_deleted"}, {"reason", reason}, {"client", client}});
    session->close(reason);
}

void AgentSessionRegistry::schedule_expiry() {
    const double ttl = services_.config.session_ttl_s;
    if (ttl <= 0)
        return;
    const double interval = std::clamp(ttl / 4, 0.25, 30.0);
    expiry_timer_.expires_after(std::chrono::milliseconds(static_cast<long long>(interval * 1000)));
    expiry_timer_.async_wait([this](const boost::system::error_code& error) {
        if (error)
            return;
        expire_idle();
        schedule_expiry();
    });
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

}  // namespace cellblock::gateway::agent
