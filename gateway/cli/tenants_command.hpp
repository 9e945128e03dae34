#pragma once
// `cellblock tenants add|list|show|quota|token|revoke|remove`: the operator's admin API (/agent/v1/tenants)
// from the shell. A token handed out is printed alone on stdout (for `T=$(cellblock tenants add alice)`).
#include <CLI/CLI.hpp>
#include <cstdint>
#include <optional>
#include <string>

#include "agent_client.hpp"

namespace cellblock::cli {

class TenantsCommand {
  public:
    // Adds `tenants` and its subcommands to `app`.
    explicit TenantsCommand(CLI::App& app);
    bool chosen() const { return static_cast<bool>(*command_); }
    // After parsing, when chosen(): runs the subcommand; answers the exit status. Throws ClientError.
    int run(AgentClient& client) const;

  private:
    nlohmann::json quota() const;
    CLI::App* command_;
    CLI::App *add_, *list_, *show_, *quota_, *token_, *revoke_, *remove_;
    std::string name_, role_ = "agent", token_id_;
    std::optional<std::int64_t> sessions_, memory_mb_, executes_;
    bool self_approve_ = false;
};

}  // namespace cellblock::cli
