#pragma once
// Token authentication (?token=, "Authorization: token X", "Authorization: Bearer X", compared in constant
// time) and the CORS / origin policy, shared by REST and WebSocket upgrades.
#include <map>
#include <string>

#include "cellblock/gateway/config.hpp"
#include "cellblock/gateway/router.hpp"

namespace cellblock::gateway {

class TokenAuthenticator {
  public:
    explicit TokenAuthenticator(std::string token) : token_(std::move(token)) {}
    bool enabled() const { return !token_.empty(); }
    // True when auth is off or the request carries the right token in the query or the Authorization header.
    bool authorized(const HttpRequest& request, const std::map<std::string, std::string>& query) const;

  private:
    std::string token_;
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
