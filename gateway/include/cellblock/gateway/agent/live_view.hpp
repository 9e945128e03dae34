#pragma once
// The live page of agent sessions: GET /agent/v1/sessions/{session}/events (server-sent events of the
// session's LiveLog), GET /agent/v1/sessions/{session}/view and GET /agent/v1/view (static pages installed
// under share/cellblock/view/).
#include "cellblock/gateway/agent/agent_api.hpp"

namespace cellblock::gateway::agent {

void register_live_view(Router& router, AgentService& service);

}  // namespace cellblock::gateway::agent
