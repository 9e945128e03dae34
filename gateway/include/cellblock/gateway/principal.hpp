#pragma once
// Who a request is from, resolved once from its token (TokenAuthenticator, auth.hpp): the operator (the
// gateway's own --token, or no auth at all) or one token of a tenant with its role.
#include <string>

namespace cellblock::gateway {

struct Principal {
    enum class Role { operator_, agent, approver };
    Role role = Role::operator_;
    std::string tenant;    // empty for the operator
    std::string token_id;  // the tenant token's id (never the token); empty for the operator

    bool is_operator() const { return role == Role::operator_; }
};

// "operator", "agent", "approver".
inline const char* role_name(Principal::Role role) {
    switch (role) {
        case Principal::Role::agent:
            return "agent";
        case Principal::Role::approver:
            return "approver";
        case Principal::Role::operator_:
            break;
    }
    return "operator";
}

}  // namespace cellblock::gateway
