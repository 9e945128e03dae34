#pragma once
// Token authentication (?token=, "Authorization: token X", "Authorization: Bearer X", compared in constant
// time; the live page's cookie on its own GET paths) and the CORS / origin policy, shared by REST and
// WebSocket upgrades.
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "cellblock/gateway/access/principal.hpp"
#include "cellblock/gateway/common/config.hpp"
#include "cellblock/gateway/http/router.hpp"

namespace cellblock::gateway {

class TenantDirectory;

// The one place a request's token becomes its Principal (every transport: REST, WebSocket upgrades, NDJSON,
// MCP): the gateway's own token is the operator, a tenant's token (looked up in `tenants`) that tenant's.
class TokenAuthenticator {
  public:
    explicit TokenAuthenticator(std::string token, TenantDirectory* tenants = nullptr)
        : token_(std::move(token)), tenants_(tenants) {}
    bool enabled() const { return !token_.empty(); }
    // Who the request is from: the operator when auth is off or it carries the gateway's token (query
    // ?token= or the Authorization header), a tenant for a tenant's live token; nullopt otherwise.
    std::optional<Principal> authenticate(const HttpRequest& request,
                                          const std::map<std::string, std::string>& query) const;
    bool authorized(const HttpRequest& request, const std::map<std::string, std::string>& query) const {
        return authenticate(request, query).has_value();
    }
    // Closes what `principal`'s token holds open (`close`, while `target` lives) once the token is revoked
    // (TenantDirectory::watch_revocation); nothing for the operator.
    void close_on_revocation(const Principal& principal, std::weak_ptr<void> target,
                             std::function<void()> close) const;
    // A viewer token of one agent session (TenantDirectory::issue_viewer); empty when the gateway has no
    // tenants directory (nothing could resolve it).
    std::string issue_viewer(const std::string& session, const std::string& tenant, std::int64_t expires,
                             const std::string& issuer = {}) const;
    // The answer to a request without a valid token: 401 JSON, or for a GET of a live page (.../view) a
    // short HTML page that says to open it once with ?token=.
    HttpResponse refusal(const HttpRequest& request) const;

    // The live page's cookie (gateway/src/agent/README.md, "The live page"): `cellblock_view` with the value
    // HMAC-SHA256(key = the gateway's token, "view:" + scope), where the scope is the cookie's Path: a
    // session's "<base>/agent/v1/sessions/{id}" or the list's "<base>/agent/v1/view". It stands for the
    // operator, only on GET requests of the page's own paths inside its scope (the page, its static files,
    // its events; the list's data and its links to the sessions' pages), never for the API. Tenants' tokens
    // are stored hashed, so no cookie derives from them: a tenant's page cookie is a viewer token instead (of
    // the session, or of the tenant's list; principal.hpp), accepted on that scope alone.
    static constexpr std::string_view view_cookie_name = "cellblock_view";
    std::string view_cookie(std::string_view scope) const;
    // The scope a view cookie must be derived for to be accepted on a GET of `path` (the raw path, without
    // the query); nullopt for a path that no cookie opens.
    static std::optional<std::string_view> view_cookie_scope(std::string_view path);

  private:
    std::string token_;
    TenantDirectory* tenants_;
};

class CorsPolicy {
  public:
    explicit CorsPolicy(const GatewayConfig& config);
    // Adds the configured Access-Control-* headers (only the non-empty ones).
    void apply(HttpResponse& response) const;
    // Kernel Gateway's check_origin: no Origin, allow_origin "*" or equal, or same host as the Host header.
    bool origin_allowed(const HttpRequest& request) const;

  private:
    std::string allow_origin_, allow_credentials_, allow_headers_, allow_methods_, expose_headers_, max_age_;
};

}  // namespace cellblock::gateway
