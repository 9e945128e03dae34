#include "tenants_command.hpp"

#include <iostream>

namespace cellblock::cli {

using nlohmann::json;

namespace {

std::string tenant_path(const std::string& name) {
    return "/agent/v1/tenants/" + encode_path_segment(name);
}

std::string limit_text(const json& quota, const char* key) {
    return quota.contains(key) && quota[key].is_number_integer()
               ? std::to_string(quota[key].get<std::int64_t>())
               : std::string("-");
}

// "sessions 10, memory_mb -, executes 4" ("-": no limit).
std::string quota_text(const json& quota) {
    return "sessions " + limit_text(quota, "sessions") + ", memory_mb " + limit_text(quota, "memory_mb") +
           ", executes " + limit_text(quota, "executes");
}

json answer_of(const AgentClient::Response& response) {
    return json::parse(response.body, nullptr, false);
}

void add_quota_options(CLI::App* command, std::optional<std::int64_t>& sessions,
                       std::optional<std::int64_t>& memory_mb, std::optional<std::int64_t>& executes) {
    command->add_option("--sessions", sessions, "sessions alive at once (0 = none; not given = no limit)")
        ->check(CLI::NonNegativeNumber);
    command->add_option("--memory-mb", memory_mb, "sum of the sessions' memory limits in MiB")
        ->check(CLI::NonNegativeNumber);
    command->add_option("--executes", executes, "executes running at once")->check(CLI::NonNegativeNumber);
}

}  // namespace

TenantsCommand::TenantsCommand(CLI::App& app)
    : command_(app.add_subcommand("tenants", "manage tenants and their tokens (the operator's token only)")) {
    command_->require_subcommand(1);
    add_ = command_->add_subcommand("add", "add a tenant; prints its first (agent) token, shown only once");
    add_->add_option("name", name_, "1-64 of a-z, 0-9 and -")->required();
    add_quota_options(add_, sessions_, memory_mb_, executes_);
    add_->add_flag("--self-approve", self_approve_, "its agent tokens may decide its network approvals");
    list_ = command_->add_subcommand("list", "list tenants with their quotas");
    show_ = command_->add_subcommand("show", "a tenant as JSON: quota, token ids and roles, usage");
    show_->add_option("name", name_, "tenant")->required();
    quota_ = command_->add_subcommand("quota", "replace a tenant's quota (a limit not given becomes none)");
    quota_->add_option("name", name_, "tenant")->required();
    add_quota_options(quota_, sessions_, memory_mb_, executes_);
    token_ = command_->add_subcommand("token", "hand out another token of a tenant; prints it");
    token_->add_option("name", name_, "tenant")->required();
    token_->add_option("--role", role_, "agent (default) or approver")
        ->check(CLI::IsMember({"agent", "approver"}));
    revoke_ = command_->add_subcommand("revoke", "revoke one token (its next request is refused)");
    revoke_->add_option("name", name_, "tenant")->required();
    revoke_->add_option("id", token_id_, "the token's id (cellblock tenants show NAME)")->required();
    remove_ = command_->add_subcommand("remove", "remove a tenant and revoke all its tokens");
    remove_->add_option("name", name_, "tenant")->required();
}

json TenantsCommand::quota() const {
    auto field = [](const std::optional<std::int64_t>& value) {
        return value ? json(*value) : json(nullptr);
    };
    return {{"sessions", field(sessions_)}, {"memory_mb", field(memory_mb_)}, {"executes", field(executes_)}};
}

int TenantsCommand::run(AgentClient& client) const {
    if (*add_) {
        const auto response = client.request(
            http::verb::post, "/agent/v1/tenants",
            json({{"name", name_}, {"quota", quota()}, {"self_approve", self_approve_}}).dump());
        AgentClient::check(response, "cannot add tenant '" + name_ + "'");
        const json tenant = answer_of(response);
        std::cerr << "cellblock: tenant " << name_ << " added (" << quota_text(tenant.value("quota", json()))
                  << "); its agent token " << tenant.value("token_id", "") << " is shown only now:\n";
        std::cout << tenant.value("token", "") << "\n";
    } else if (*list_) {
        const auto response = client.request(http::verb::get, "/agent/v1/tenants");
        AgentClient::check(response, "cannot list tenants");
        for (const json& tenant : answer_of(response).value("tenants", json::array()))
            std::cout << tenant.value("name", "") << "\t" << quota_text(tenant.value("quota", json()))
                      << (tenant.value("self_approve", false) ? "\tself_approve" : "") << "\n";
    } else if (*show_) {
        const auto response = client.request(http::verb::get, tenant_path(name_));
        AgentClient::check(response, "cannot show tenant '" + name_ + "'");
        std::cout << answer_of(response).dump(2) << "\n";
    } else if (*quota_) {
        const auto response =
            client.request(http::verb::patch, tenant_path(name_), json({{"quota", quota()}}).dump());
        AgentClient::check(response, "cannot change the quota of tenant '" + name_ + "'");
        std::cerr << "cellblock: " << name_ << ": " << quota_text(answer_of(response).value("quota", json()))
                  << "\n";
    } else if (*token_) {
        const auto response =
            client.request(http::verb::post, tenant_path(name_) + "/tokens", json({{"role", role_}}).dump());
        AgentClient::check(response, "cannot hand out a token of tenant '" + name_ + "'");
        const json token = answer_of(response);
        std::cerr << "cellblock: " << role_ << " token " << token.value("id", "") << " of " << name_
                  << ", shown only now:\n";
        std::cout << token.value("token", "") << "\n";
    } else if (*revoke_) {
        const auto response = client.request(
            http::verb::delete_, tenant_path(name_) + "/tokens/" + encode_path_segment(token_id_));
        AgentClient::check(response, "cannot revoke token " + token_id_ + " of tenant '" + name_ + "'");
        std::cerr << "cellblock: token " << token_id_ << " of " << name_ << " revoked\n";
    } else if (*remove_) {
        const auto response = client.request(http::verb::delete_, tenant_path(name_));
        AgentClient::check(response, "cannot remove tenant '" + name_ + "'");
        std::cerr << "cellblock: tenant " << name_ << " removed, its tokens revoked\n";
    }
    return 0;
}

}  // namespace cellblock::cli
