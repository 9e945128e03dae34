#pragma once
// Who a request is from, resolved once from its token (TokenAuthenticator, auth.hpp): the operator (the
// gateway's own --token, or no auth at all) or one token of a tenant with its role. The rules of what each
// may see and do are stated here once, and every transport (REST, WebSocket, NDJSON, MCP) asks them:
//
// - What a tenant created (agent sessions, kernels, the Jupyter sessions on them) is that tenant's: only its
//   tokens and the operator see it. To anyone else it does not exist (404, the same as an unknown id).
// - `agent` reads and runs: sessions, kernels, executes, files. `approver` reads and decides approvals, and
//   runs nothing. An agent decides approvals only for a tenant created with "self_approve": true.
// - A `viewer` (a link from POST .../sessions/{id}/share) reads that one session until its token expires or
//   the session ends (and watches its kernel's channels, sending nothing), and sees nothing else. A viewer of
//   no one session is a tenant's list reader: the cookie its agent or approver token gets on the live list
//   page (gateway/src/agent/live_view.cpp); it reads the tenant's sessions and nothing else.
// - The operator sees and does everything; routes that are not isolated per tenant are the operator's alone
//   (RestResource::serves_tenants, router.hpp).
#include <cstdint>
#include <string>
#include <string_view>

namespace cellblock::gateway {

struct Principal {
    enum class Role { operator_, agent, approver, viewer };
    // What a request asks to do with what it names.
    enum class Action { read, run, decide };

    Role role = Role::operator_;
    std::string tenant;         // empty for the operator
    std::string token_id;       // the tenant token's id (never the token); empty for the operator
    bool self_approve = false;  // the tenant's agents may decide its approvals
    std::string session = {};   // a viewer's one session (its id); empty for a tenant's list reader
    std::int64_t expires = 0;   // a viewer's end (seconds since the epoch); 0 = its token does not expire

    bool is_operator() const { return role == Role::operator_; }
    // Whether something owned by `owner` (a tenant's name; empty = the operator's) exists for this principal.
    // A viewer sees no owner's things as such, only its session (sees_session).
    bool sees(std::string_view owner) const {
        return is_operator() || (role != Role::viewer && owner == tenant);
    }
    // Whether the agent session `id` of `owner` exists for this principal.
    bool sees_session(std::string_view owner, std::string_view id) const {
        return sees(owner) || (role == Role::viewer && (id == session || (reads_list() && owner == tenant)));
    }
    // A viewer of its tenant's sessions (the live list page's reader), not of one session.
    bool reads_list() const { return role == Role::viewer && session.empty() && !tenant.empty(); }
    bool may(Action action) const {
        switch (role) {
            case Role::operator_:
                return true;
            case Role::agent:
                return action != Action::decide || self_approve;
            case Role::approver:
                return action != Action::run;
            case Role::viewer:
                return action == Action::read;
        }
        return false;
    }
};

// "operator", "agent", "approver", "viewer".
inline const char* role_name(Principal::Role role) {
    switch (role) {
        case Principal::Role::agent:
            return "agent";
        case Principal::Role::approver:
            return "approver";
        case Principal::Role::viewer:
            return "viewer";
        case Principal::Role::operator_:
            break;
    }
    return "operator";
}

}  // namespace cellblock::gateway
