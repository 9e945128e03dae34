#pragma once
// The tenants' admin API, the operator's only: /agent/v1/tenants (create, list), /agent/v1/tenants/{tenant}
// (show, change the quota, remove), /agent/v1/tenants/{tenant}/tokens (issue) and .../tokens/{token}
// (revoke). Documented in share/cellblock/openapi/agent-v1.json.
#include <functional>
#include <string>

#include "cellblock/gateway/access/tenants.hpp"
#include "cellblock/gateway/http/rest_handlers.hpp"

namespace cellblock::gateway {

// Ends what a removed tenant ran beyond its kernels (the agent layer's sessions); the tenant API shuts down
// the tenant's kernels itself.
using TenantSessionsEnd = std::function<void(const std::string& tenant)>;

// DELETE /agent/v1/tenants/{tenant} revokes its tokens, deletes its agent sessions (`end_sessions`) and shuts
// down its kernels, so that a tenant added again under the same name starts with nothing.
void register_tenant_api(Router& router, GatewayServices& services, TenantDirectory& tenants,
                         TenantSessionsEnd end_sessions);

}  // namespace cellblock::gateway
