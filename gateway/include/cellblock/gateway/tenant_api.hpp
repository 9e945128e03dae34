#pragma once
// The tenants' admin API, the operator's only: /agent/v1/tenants (create, list), /agent/v1/tenants/{tenant}
// (show, change the quota, remove), /agent/v1/tenants/{tenant}/tokens (issue) and .../tokens/{token}
// (revoke). Documented in share/cellblock/openapi/agent-v1.json.
#include "cellblock/gateway/rest_handlers.hpp"
#include "cellblock/gateway/tenants.hpp"

namespace cellblock::gateway {

void register_tenant_api(Router& router, GatewayServices& services, TenantDirectory& tenants);

}  // namespace cellblock::gateway
