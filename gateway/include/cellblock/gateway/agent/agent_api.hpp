#pragma once
// The agent API: /agent/v1/sessions (create, list, get, delete, execute with optional NDJSON streaming,
// files, notebook, audit, reset) and the MCP endpoint /mcp, over the same kernels, auth and HTTP server as
// the Kernel Gateway API.
#include <memory>

#include "cellblock/gateway/agent/agent_config.hpp"
#include "cellblock/gateway/agent/agent_operations.hpp"
#include "cellblock/gateway/agent/session_registry.hpp"
#include "cellblock/gateway/http/rest_handlers.hpp"

namespace cellblock::gateway::agent {

class AgentService {
  public:
    AgentService(GatewayServices& gateway, const AgentConfig& config);
    ~AgentService();
    // Adds the /agent/v1/... and /mcp routes.
    void register_routes(Router& router);
    // After KernelManager::start(): reloads the recorded sessions with their re-adopted kernels.
    void start();

    AgentSessionRegistry& sessions() { return registry_; }
    // What the REST resources and the MCP tools call: every rule of the agent API is there.
    AgentOperations& operations() { return operations_; }
    AgentSessionServices& services() { return session_services_; }
    GatewayServices& gateway() { return gateway_; }
    const AgentConfig& config() const { return config_; }

    // Finds a session `principal` sees by id or name, or throws HttpError 404 {"reason": "unknown_session"}.
    std::shared_ptr<AgentSession> require_session(const Principal& principal,
                                                  const std::string& id_or_name) const;

    // Deletes every session of `tenant` held here (its tenant was removed), each audited as deleted.
    void end_sessions_of(const std::string& tenant);
    // What `tenant` holds here (its quotas count it; tenant_quotas.hpp).
    TenantHoldings tenant_holdings(const std::string& tenant) const;

  private:
    GatewayServices& gateway_;
    const AgentConfig& config_;
    AgentSessionServices session_services_;
    AgentSessionRegistry registry_;
    AgentOperations operations_;
};

// The HTTP status of a refusal of the agent operations.
http::status http_status(OperationErrorKind kind);

// Registers POST /mcp (Model Context Protocol, Streamable HTTP transport answering with application/json).
void register_mcp_endpoint(Router& router, AgentService& service);

// The {path...} capture of a files route (already decoded by the router, which refuses encoded '/' and
// NUL) as a workspace-relative path: empty components collapse; throws HttpError 400 "bad_path" for an
// empty path, "." or ".." components and NUL bytes.
std::string workspace_relative_path(const std::string& decoded_path);

}  // namespace cellblock::gateway::agent
