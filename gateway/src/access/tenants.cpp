#include "cellblock/gateway/access/tenants.hpp"

#include <algorithm>
#include <boost/asio/post.hpp>
#include <chrono>
#include <set>

#include "cellblock/gateway/common/crypto.hpp"
#include "cellblock/gateway/common/time_format.hpp"

namespace cellblock::gateway {

using nlohmann::json;

namespace {

TenantRequestError malformed(std::string reason, const std::string& message, std::string field) {
    return {TenantRequestError::Kind::malformed, std::move(reason), message, std::move(field)};
}

std::string now_iso8601() {
    return format_iso8601_utc(std::chrono::system_clock::now());
}

// A quota field: absent or null = no limit, else a non-negative integer.
std::optional<std::int64_t> quota_field(const json& quota, const char* name) {
    auto found = quota.find(name);
    if (found == quota.end() || found->is_null())
        return std::nullopt;
    if (!found->is_number_integer() || found->get<std::int64_t>() < 0)
        throw malformed("bad_quota", std::string("quota.") + name + " must be a non-negative integer or null",
                        std::string("quota.") + name);
    return found->get<std::int64_t>();
}

std::string role_of(const json& request) {
    auto found = request.find("role");
    if (found == request.end() || found->is_null())
        return "agent";
    if (!found->is_string() || (*found != "agent" && *found != "approver"))
        throw malformed("bad_role", "role must be \"agent\" or \"approver\"", "role");
    return found->get<std::string>();
}

}  // namespace

bool valid_tenant_name(std::string_view name) {
    if (name.empty() || name.size() > 64)
        return false;
    for (char c : name)
        if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-'))
            return false;
    return true;
}

json TenantQuota::to_json() const {
    auto field = [](const std::optional<std::int64_t>& value) {
        return value ? json(*value) : json(nullptr);
    };
    return {{"sessions", field(sessions)}, {"memory_mb", field(memory_mb)}, {"executes", field(executes)}};
}

TenantQuota TenantQuota::parse(const json& quota) {
    if (quota.is_null())
        return {};
    if (!quota.is_object())
        throw malformed("bad_quota", "quota must be an object", "quota");
    for (const auto& [key, value] : quota.items())
        if (key != "sessions" && key != "memory_mb" && key != "executes")
            throw malformed("bad_quota", "quota has no field " + key + " (sessions, memory_mb, executes)",
                            "quota." + key);
    return {quota_field(quota, "sessions"), quota_field(quota, "memory_mb"), quota_field(quota, "executes")};
}

json Tenant::to_json() const {
    return {{"name", name}, {"quota", quota.to_json()}, {"self_approve", self_approve}, {"created", created}};
}

void TenantDirectory::load() {
    SessionStore& store = writer_.store();
    apply(store.tenants(), store.tenant_tokens());
}

void TenantDirectory::apply(const std::vector<json>& tenants, std::vector<TenantToken> tokens) {
    tenants_.clear();
    tokens_by_digest_.clear();
    for (const json& record : tenants) {
        Tenant tenant;
        tenant.name = record.value("name", std::string());
        try {
            tenant.quota = TenantQuota::parse(record.value("quota", json(nullptr)));
        } catch (const TenantRequestError&) {
            tenant.quota = {};  // only gateways write quotas, checked; an unreadable one is no limit
        }
        tenant.self_approve = record.value("self_approve", false);
        tenant.created = record.value("created", std::string());
        if (valid_tenant_name(tenant.name))
            tenants_[tenant.name] = std::move(tenant);
    }
    for (TenantToken& token : tokens)
        if (tenants_.contains(token.tenant))
            tokens_by_digest_[token.digest] = std::move(token);
    close_revoked();
}

void TenantDirectory::watch_revocation(const std::string& token_id, std::weak_ptr<void> target,
                                       std::function<void()> close) {
    std::erase_if(watches_, [](const RevocationWatch& watch) { return watch.target.expired(); });
    watches_.push_back({token_id, std::move(target), std::move(close)});
}

void TenantDirectory::close_revoked() {
    std::set<std::string> live;
    for (const auto& [digest, token] : tokens_by_digest_)
        live.insert(token.id);
    std::vector<std::function<void()>> closing;
    std::erase_if(watches_, [&](RevocationWatch& watch) {
        if (watch.target.expired())
            return true;
        if (live.contains(watch.token_id))
            return false;
        closing.push_back(std::move(watch.close));
        return true;
    });
    for (auto& close : closing)  // after the erase: a close may register or end other watches
        close();
}

void TenantDirectory::follow_shared_store(boost::asio::io_context& io) {
    if (!writer_.store().shared())
        return;
    refresh_timer_.emplace(io);
    refresh_timer_->start(std::chrono::seconds(1), [this, &io] { refresh(io); });
}

void TenantDirectory::refresh(boost::asio::io_context& io) {
    if (refresh_pending_)
        return;  // a slow store: one read at a time
    refresh_pending_ = true;
    writer_.submit(
        [this, &io, generation = generation_, alive = std::weak_ptr<int>(alive_)](SessionStore& store) {
            std::optional<std::pair<std::vector<json>, std::vector<TenantToken>>> read;
            try {
                read.emplace(store.tenants(), store.tenant_tokens());
            } catch (...) {
                boost::asio::post(io, [this, alive] {
                    if (!alive.expired())
                        refresh_pending_ = false;
                });
                throw;  // logged by the writer; the next round reads again
            }
            boost::asio::post(io, [this, generation, alive, read = std::move(*read)]() mutable {
                if (alive.expired())
                    return;
                refresh_pending_ = false;
                if (generation == generation_)  // else a change made here meanwhile: the next round has it
                    apply(read.first, std::move(read.second));
            });
        });
}

std::optional<Principal> TenantDirectory::resolve(std::string_view token) const {
    if (tokens_by_digest_.empty())
        return std::nullopt;
    auto found = tokens_by_digest_.find(secret_.token_digest(token));
    if (found == tokens_by_digest_.end())
        return std::nullopt;
    const TenantToken& record = found->second;
    const auto tenant = tenants_.find(record.tenant);
    if (tenant == tenants_.end())
        return std::nullopt;
    return Principal{record.role == "approver" ? Principal::Role::approver : Principal::Role::agent,
                     record.tenant, record.id, tenant->second.self_approve};
}

namespace {
constexpr std::string_view viewer_prefix = "cbv_";
}

std::string TenantDirectory::issue_viewer(const std::string& session, const std::string& tenant,
                                          std::int64_t expires, const std::string& issuer) const {
    std::string body = session + "." + tenant + "." + std::to_string(expires);
    if (!issuer.empty())
        body += "." + issuer;
    return std::string(viewer_prefix) + body + "." + secret_.token_digest("viewer:" + body);
}

std::optional<Principal> TenantDirectory::resolve_viewer(std::string_view token) const {
    if (!token.starts_with(viewer_prefix))
        return std::nullopt;
    token.remove_prefix(viewer_prefix.size());
    const auto signature_at = token.rfind('.');
    if (signature_at == std::string_view::npos)
        return std::nullopt;
    const std::string body(token.substr(0, signature_at));
    if (!constant_time_equals(token.substr(signature_at + 1), secret_.token_digest("viewer:" + body)))
        return std::nullopt;
    // Signed by a gateway: the fields (none holds a dot) are as it wrote them.
    std::vector<std::string> fields;
    for (std::size_t at = 0;;) {
        const auto dot = body.find('.', at);
        fields.push_back(body.substr(at, dot == std::string::npos ? std::string::npos : dot - at));
        if (dot == std::string::npos)
            break;
        at = dot + 1;
    }
    if (fields.size() != 3 && fields.size() != 4)
        return std::nullopt;
    const std::string& tenant = fields[1];
    const std::int64_t expires = std::stoll(fields[2]);
    const auto now =
        std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch())
            .count();
    if (now >= expires || (!tenant.empty() && !tenants_.contains(tenant)))
        return std::nullopt;
    Principal viewer;
    viewer.role = Principal::Role::viewer;
    viewer.tenant = tenant;
    viewer.session = fields[0];
    viewer.expires = expires;
    if (fields.size() == 4) {
        const bool issuer_live = std::any_of(tokens_by_digest_.begin(), tokens_by_digest_.end(),
                                             [&](const auto& entry) { return entry.second.id == fields[3]; });
        if (!issuer_live)
            return std::nullopt;
        viewer.token_id = fields[3];
    }
    return viewer;
}

TenantDirectory::IssuedToken TenantDirectory::make_token(const std::string& tenant, const std::string& role) {
    IssuedToken issued;
    issued.token = "cbt_" + random_hex(32);
    issued.record = {random_hex(8), tenant, role, secret_.token_digest(issued.token), now_iso8601()};
    tokens_by_digest_[issued.record.digest] = issued.record;
    ++generation_;
    writer_.submit([record = issued.record](SessionStore& store) { store.put_tenant_token(record); });
    return issued;
}

std::pair<Tenant, TenantDirectory::IssuedToken> TenantDirectory::add(const json& request) {
    auto name = request.find("name");
    if (name == request.end() || !name->is_string())
        throw malformed("bad_name", "name is required: 1-64 of a-z, 0-9 and -", "name");
    if (!valid_tenant_name(name->get<std::string>()))
        throw malformed("bad_name", "name must be 1-64 of a-z, 0-9 and -", "name");
    Tenant tenant;
    tenant.name = name->get<std::string>();
    tenant.quota = TenantQuota::parse(request.value("quota", json(nullptr)));
    auto self_approve = request.find("self_approve");
    if (self_approve != request.end() && !self_approve->is_null()) {
        if (!self_approve->is_boolean())
            throw malformed("bad_self_approve", "self_approve must be true or false", "self_approve");
        tenant.self_approve = self_approve->get<bool>();
    }
    if (tenants_.contains(tenant.name))
        throw TenantRequestError(TenantRequestError::Kind::exists, "tenant_exists",
                                 "a tenant named " + tenant.name + " exists", "name");
    tenant.created = now_iso8601();
    tenants_[tenant.name] = tenant;
    ++generation_;
    writer_.submit([record = tenant.to_json()](SessionStore& store) { store.put_tenant(record); });
    return {tenant, make_token(tenant.name, "agent")};
}

std::vector<Tenant> TenantDirectory::list() const {
    std::vector<Tenant> all;
    for (const auto& [name, tenant] : tenants_)
        all.push_back(tenant);
    return all;
}

Tenant& TenantDirectory::require(const std::string& name) {
    auto found = tenants_.find(name);
    if (found == tenants_.end())
        throw TenantRequestError(TenantRequestError::Kind::not_found, "unknown_tenant",
                                 "no tenant named " + name);
    return found->second;
}

const Tenant& TenantDirectory::get(const std::string& name) const {
    auto found = tenants_.find(name);
    if (found == tenants_.end())
        throw TenantRequestError(TenantRequestError::Kind::not_found, "unknown_tenant",
                                 "no tenant named " + name);
    return found->second;
}

const Tenant& TenantDirectory::set_quota(const std::string& name, const json& request) {
    Tenant& tenant = require(name);
    auto quota = request.find("quota");
    if (quota == request.end())
        throw malformed("bad_quota", "quota is required", "quota");
    tenant.quota = TenantQuota::parse(*quota);
    ++generation_;
    writer_.submit([record = tenant.to_json()](SessionStore& store) { store.put_tenant(record); });
    return tenant;
}

TenantDirectory::IssuedToken TenantDirectory::issue_token(const std::string& name, const json& request) {
    require(name);
    return make_token(name, role_of(request));
}

void TenantDirectory::revoke_token(const std::string& name, const std::string& token_id) {
    require(name);
    for (auto it = tokens_by_digest_.begin(); it != tokens_by_digest_.end(); ++it) {
        if (it->second.tenant == name && it->second.id == token_id) {
            tokens_by_digest_.erase(it);
            ++generation_;
            writer_.submit([token_id](SessionStore& store) { store.remove_tenant_token(token_id); });
            close_revoked();
            return;
        }
    }
    throw TenantRequestError(TenantRequestError::Kind::not_found, "unknown_token",
                             "tenant " + name + " has no token " + token_id);
}

void TenantDirectory::remove(const std::string& name) {
    require(name);
    std::erase_if(tokens_by_digest_, [&name](const auto& entry) { return entry.second.tenant == name; });
    tenants_.erase(name);
    ++generation_;
    writer_.submit([name](SessionStore& store) { store.remove_tenant(name); });
    close_revoked();
}

std::vector<TenantToken> TenantDirectory::tokens_of(const std::string& name) const {
    std::vector<TenantToken> found;
    for (const auto& [digest, token] : tokens_by_digest_)
        if (token.tenant == name)
            found.push_back(token);
    std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) { return a.created < b.created; });
    return found;
}

}  // namespace cellblock::gateway
