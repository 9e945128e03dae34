#pragma once
// Tenants and their tokens: the gateway's copy of the store's tenants and tenant_tokens tables, resolving a
// presented token to its Principal without a store read (the io_context thread never waits for the store).
// Changes are applied here at once and written through the StoreWriter; a token is kept only as its keyed
// digest (StoreSecret::token_digest), so the plaintext exists only in the one answer that hands it out.
#include <boost/asio/io_context.hpp>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "cellblock/gateway/access/principal.hpp"
#include "cellblock/gateway/common/repeating_timer.hpp"
#include "cellblock/gateway/store/store_sealing.hpp"
#include "cellblock/gateway/store/store_writer.hpp"

namespace cellblock::gateway {

// Limits of one tenant; a missing one is no limit, 0 allows none.
struct TenantQuota {
    std::optional<std::int64_t> sessions, memory_mb, executes;
    nlohmann::json to_json() const;
    // Reads {"sessions"?, "memory_mb"?, "executes"?} (non-negative integers or null); throws
    // TenantRequestError naming the field.
    static TenantQuota parse(const nlohmann::json& quota);
};

struct Tenant {
    std::string name;
    TenantQuota quota;
    bool self_approve = false;       // its agent tokens may decide its approvals
    std::string created;             // ISO 8601
    nlohmann::json to_json() const;  // {name, quota, self_approve, created}
};

// A refusal of the directory: `reason` is the stable word ("bad_name", "tenant_exists", "unknown_tenant",
// ...), `field` the request's field at fault (empty when none).
class TenantRequestError : public std::runtime_error {
  public:
    enum class Kind { malformed, exists, not_found };
    TenantRequestError(Kind kind, std::string reason, const std::string& message, std::string field = {})
        : std::runtime_error(message), kind_(kind), reason_(std::move(reason)), field_(std::move(field)) {}
    Kind kind() const { return kind_; }
    const std::string& reason() const { return reason_; }
    const std::string& field() const { return field_; }

  private:
    Kind kind_;
    std::string reason_, field_;
};

// True for tenant names: 1-64 of [a-z0-9-].
bool valid_tenant_name(std::string_view name);

class TenantDirectory {
  public:
    TenantDirectory(StoreWriter& writer, StoreSecret secret) : writer_(writer), secret_(secret) {}

    // Reads every tenant and token from the store (gateway start-up, before serving).
    void load();
    // On a store other gateways share: reads it again every second (on the StoreWriter's thread), so that a
    // tenant or token added, revoked or removed through another gateway counts here within about a second.
    void follow_shared_store(boost::asio::io_context& io);
    // The tenant principal of `token`; nullopt when it is no tenant's live token.
    std::optional<Principal> resolve(std::string_view token) const;

    // Viewer tokens (POST /agent/v1/sessions/{id}/share): "cbv_<session>.<tenant>.<expires>.<signature>", the
    // signature a keyed digest of the rest under the store secret, so nothing is stored, every gateway on the
    // store accepts them and none outlives its expiry (Unix seconds). A viewer of a session whose tenant was
    // removed is refused. One issued for a live page a tenant's token opened names that token's id (`issuer`:
    // "cbv_<session>.<tenant>.<expires>.<issuer>.<signature>") and dies with it: it is the principal's
    // token_id, so its open streams close on revocation too.
    std::string issue_viewer(const std::string& session, const std::string& tenant, std::int64_t expires,
                             const std::string& issuer = {}) const;
    // The viewer principal of a live `token` (nullopt: not a viewer token, forged, expired, tenant gone, its
    // issuer revoked).
    std::optional<Principal> resolve_viewer(std::string_view token) const;

    // A token as handed out: shown once, never stored.
    struct IssuedToken {
        TenantToken record;
        std::string token;
    };
    // Reads {"name", "quota"?, "self_approve"?}; creates the tenant with one agent token.
    std::pair<Tenant, IssuedToken> add(const nlohmann::json& request);
    std::vector<Tenant> list() const;
    // Throws TenantRequestError not_found "unknown_tenant".
    const Tenant& get(const std::string& name) const;
    // Replaces the quota with {"quota": {...}} of `request`.
    const Tenant& set_quota(const std::string& name, const nlohmann::json& request);
    // Reads {"role": "agent" | "approver"} (default agent).
    IssuedToken issue_token(const std::string& name, const nlohmann::json& request);
    // Throws not_found "unknown_token" for a token id that is not this tenant's.
    void revoke_token(const std::string& name, const std::string& token_id);
    // The tenant and all its tokens.
    void remove(const std::string& name);
    std::vector<TenantToken> tokens_of(const std::string& name) const;

    // A long-lived use of a tenant's token (a keep-alive connection with its streamed responses, a
    // WebSocket): `close` runs once, when the token is revoked or its tenant removed, here or through another
    // gateway (follow_shared_store), so that revocation ends what is open as well as what comes next.
    // Forgotten when `target` is gone.
    void watch_revocation(const std::string& token_id, std::weak_ptr<void> target,
                          std::function<void()> close);

  private:
    // Runs the watches whose token is no longer live.
    void close_revoked();
    IssuedToken make_token(const std::string& tenant, const std::string& role);
    Tenant& require(const std::string& name);
    void apply(const std::vector<nlohmann::json>& tenants, std::vector<TenantToken> tokens);
    void refresh(boost::asio::io_context& io);

    StoreWriter& writer_;
    StoreSecret secret_;
    std::map<std::string, Tenant> tenants_;
    std::map<std::string, TenantToken> tokens_by_digest_;
    struct RevocationWatch {
        std::string token_id;
        std::weak_ptr<void> target;
        std::function<void()> close;
    };
    std::vector<RevocationWatch> watches_;
    // Counts changes made here: a store read queued before one of them is stale and not applied.
    std::uint64_t generation_ = 0;
    bool refresh_pending_ = false;
    std::shared_ptr<int> alive_ =
        std::make_shared<int>(0);  // read results posted after this is gone are dropped
    std::optional<RepeatingTimer> refresh_timer_;
};

}  // namespace cellblock::gateway
