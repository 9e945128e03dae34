// The gateway's configuration file and environment: a number lands in its field exactly or is refused with
// the key's name. Before, a port of 70000 became 4464, a byte cap of -1 became no cap at all, and a count of
// 1e10 converted out of int's range (undefined behaviour).
#include "cellblock/gateway/common/config.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

using namespace cellblock::gateway;
using nlohmann::json;

namespace {

// The message of the error merging `text` raises; empty when it is accepted.
std::string file_error(const std::string& text) {
    GatewayConfig config;
    try {
        config.merge_json(json::parse(text));
    } catch (const std::invalid_argument& error) {
        return error.what();
    }
    return "";
}

std::string environment_error(const std::map<std::string, std::string>& variables, GatewayConfig& config) {
    try {
        config.merge_environment([&](const std::string& name) -> std::optional<std::string> {
            auto found = variables.find(name);
            return found == variables.end() ? std::nullopt : std::optional<std::string>(found->second);
        });
    } catch (const std::invalid_argument& error) {
        return error.what();
    }
    return "";
}

}  // namespace

TEST(GatewayConfigFile, NumbersLandInTheirFieldsExactly) {
    GatewayConfig config;
    config.merge_json(json::parse(
        R"({"port": 9999, "max_body_bytes": 1048576, "max_kernels": -1, "cull_interval": 2.5, "warm_pool": 0,
            "list_kernels": false, "header_timeout": 3})"));
    EXPECT_EQ(config.port, 9999);
    EXPECT_EQ(config.max_body_bytes, 1048576u);
    EXPECT_EQ(config.max_kernels, -1);
    EXPECT_DOUBLE_EQ(config.cull_interval, 2.5);
    EXPECT_EQ(config.warm_pool, 0);
    EXPECT_FALSE(config.list_kernels);
    EXPECT_DOUBLE_EQ(config.header_timeout, 3);
}

TEST(GatewayConfigFile, NumbersPastTheirFieldAreRefusedNotTruncatedOrWrapped) {
    const std::map<std::string, std::string> refused = {
        {R"({"port": 70000})", "'port': 70000 is out of range (0 to 65535)"},
        {R"({"port": -1})", "'port': -1 is out of range"},
        {R"({"port": 8888.5})", "'port': must be a whole number"},
        {R"({"max_body_bytes": -1})", "'max_body_bytes': -1 is out of range"},
        {R"({"fd_reserve": -5})", "'fd_reserve': -5 is out of range"},
        {R"({"warm_pool": 10000000000})", "'warm_pool': 10000000000 is out of range"},
        {R"({"max_kernels": 1e10})", "'max_kernels': must be a whole number"},
        {R"({"slurm_mem_mb": "4096"})", "'slurm_mem_mb': must be a whole number"},
        {R"({"cull_interval": "300"})", "'cull_interval': must be a number"},
        {R"({"list_kernels": 1})", "'list_kernels': must be true or false"},
    };
    for (const auto& [text, expected] : refused) {
        SCOPED_TRACE(text);
        EXPECT_NE(file_error(text).find(expected), std::string::npos) << file_error(text);
    }
}

TEST(GatewayConfigEnvironment, NumbersFollowTheFilesRule) {
    GatewayConfig config;
    EXPECT_EQ(environment_error({{"KG_PORT", "9000"}, {"KG_WS_PING_INTERVAL_SECS", "2.5"}}, config), "");
    EXPECT_EQ(config.port, 9000);
    EXPECT_DOUBLE_EQ(config.ws_ping_interval, 2.5);
    GatewayConfig other;
    EXPECT_NE(environment_error({{"KG_PORT", "70000"}}, other).find("KG_PORT: 70000 is out of range"),
              std::string::npos);
    EXPECT_NE(environment_error({{"KG_PORT", "8888.5"}}, other).find("KG_PORT: must be a whole number"),
              std::string::npos);
    EXPECT_NE(
        environment_error({{"KG_MAX_KERNELS", "lots"}}, other).find("KG_MAX_KERNELS: expected a number"),
        std::string::npos);
    EXPECT_NE(environment_error({{"CELLBLOCK_GATEWAY_FD_RESERVE", "-1"}}, other).find("out of range"),
              std::string::npos);
    EXPECT_EQ(other.port, 8888) << "a refused value must leave the field as it was";
}

// Every duration's timer counts milliseconds in 64 bits: 1e300 seconds overflowed it (undefined behaviour),
// and a negative time makes no sense. The gateway refuses to start, naming the setting, whichever way it was
// given.
TEST(GatewayConfigDurations, ANegativeOrAstronomicalNumberOfSecondsIsRefusedByName) {
    EXPECT_NO_THROW(GatewayConfig{}.check_durations());
    GatewayConfig longest;
    longest.merge_json(nlohmann::json::parse(R"({"orphan_timeout": 1.5e9, "cull_interval": 0})"));
    EXPECT_NO_THROW(longest.check_durations());
    GatewayConfig instant;
    instant.merge_json(nlohmann::json::parse(R"({"header_timeout": 0})"));
    EXPECT_THROW(instant.check_durations(), std::invalid_argument);
    for (const char* key : {"kernel_launch_timeout", "cull_idle_timeout", "cull_interval", "ws_ping_interval",
                            "offline_session_ttl", "header_timeout", "orphan_timeout", "slurm_poll_interval",
                            "network.approval_timeout"}) {
        for (double seconds : {1e300, 1.6e9, -1.0}) {
            SCOPED_TRACE(std::string(key) + " = " + std::to_string(seconds));
            GatewayConfig config;
            const std::string name = key;
            config.merge_json(name.starts_with("network.")
                                  ? nlohmann::json{{"network", {{name.substr(8), seconds}}}}
                                  : nlohmann::json{{key, seconds}});
            try {
                config.check_durations();
                ADD_FAILURE() << "accepted";
            } catch (const std::invalid_argument& error) {
                EXPECT_EQ(std::string(error.what()).rfind(std::string(key) + ": ", 0), 0) << error.what();
                EXPECT_NE(std::string(error.what()).find("from 0 to 1.5e9"), std::string::npos)
                    << error.what();
            }
        }
    }
}

// --print-config and the logs show the store without its password, in every form libpq takes one.
TEST(GatewayConfigStore, PasswordsAreMaskedInUriAndKeywordForms) {
    const std::map<std::string, std::string> masked = {
        {"postgresql://alice:s3cret@db.example/cellblock", "postgresql://alice:***@db.example/cellblock"},
        {"host=db user=alice password=s3cret dbname=cellblock",
         "host=db user=alice password=*** dbname=cellblock"},
        {"host=db password = 's3 cr\\'et' dbname=x", "host=db password = *** dbname=x"},
        {"postgresql://db/cellblock?user=alice&password=s3cret&sslmode=require",
         "postgresql://db/cellblock?user=alice&password=***&sslmode=require"},
        {"host=db PASSWORD=s3cret", "host=db PASSWORD=***"},
        {"postgresql://alice@db/cellblock", "postgresql://alice@db/cellblock"}};
    for (const auto& [store, expected] : masked) {
        EXPECT_EQ(masked_store(store), expected);
        EXPECT_EQ(masked_store(store).find("s3"), std::string::npos) << store;
    }
    GatewayConfig config;
    config.store = "host=db password=s3cret";
    EXPECT_EQ(config.to_json()["store"], "host=db password=***");
}

// The table every merge, --print-config, the command line and docs/configuration.md are made from
// (gateway_settings() in settings_table.cpp): one name means one setting, and the file takes back every value
// the table says a setting has, at its key ("network.allow" inside "network").
TEST(GatewaySettings, NamesAreUniqueAndTheFileTakesEveryDefault) {
    std::map<std::string, int> names;
    for (const Setting& setting : gateway_settings()) {
        for (std::string_view name : {setting.key, setting.env, setting.flag, setting.file_flag}) {
            if (!name.empty()) {
                EXPECT_EQ(++names[std::string(name)], 1) << name;
            }
        }
        EXPECT_FALSE(setting.help.empty()) << setting.key;
        std::string path = "/" + std::string(setting.key);
        std::replace(path.begin(), path.end(), '.', '/');
        json file;
        file[json::json_pointer(path)] = setting.value_of(GatewayConfig{});
        GatewayConfig config;
        EXPECT_NO_THROW(config.merge_json(file)) << file.dump();
    }
}

// The agent API's settings are in the table too (a field of GatewayConfig::agent): the file's "agent" object
// holds them, --print-config shows them, approvals_mcp is written off or on, and a file value gets its flag's
// check. Their variables are read by their flags (main.cpp), not by merge_environment.
TEST(GatewaySettings, AgentSettingsTakeTheirFileKeysAndChecks) {
    GatewayConfig config;
    config.merge_json(json::parse(
        R"({"agent": {"max_sessions": 2, "max_limits": {"timeout_s": 60}, "approvals_mcp": "on"}})"));
    EXPECT_EQ(config.agent.max_sessions, 2u);
    EXPECT_DOUBLE_EQ(config.agent.max_limits.timeout_s, 60);
    EXPECT_TRUE(config.agent.approvals_mcp);
    EXPECT_EQ(config.to_json()["agent"]["approvals_mcp"], "on");
    EXPECT_EQ(config.to_json()["agent"]["max_limits"]["timeout_s"], 60.0);
    EXPECT_NO_THROW(config.check_every_source());
    EXPECT_EQ(file_error(R"({"agent": {"approvals_mcp": true}})"),
              "config key 'agent.approvals_mcp': must be one of off,on, got 'true'");
    EXPECT_EQ(file_error(R"({"agent": {"max_session": 2}})"),
              "unknown gateway config key 'agent.max_session'");
    config.merge_json(json::parse(R"({"agent": {"keepalive_s": 0}})"));
    EXPECT_THROW(config.check_every_source(), std::invalid_argument);
    GatewayConfig environment;
    EXPECT_EQ(environment_error({{"CELLBLOCK_AGENT_MAX_SESSIONS", "x"}}, environment), "");
    EXPECT_EQ(environment.agent.max_sessions, GatewayConfig{}.agent.max_sessions);
}

// What the table's rules keep from before it: an empty KG_AUTH_TOKEN means no authentication, a token in the
// file that is not a string is ignored, and the network allowlist splits at commas only (':' is IPv6's).
TEST(GatewaySettings, TokenAndListRulesStay) {
    GatewayConfig config;
    EXPECT_EQ(environment_error({{"KG_AUTH_TOKEN", ""},
                                 {"KG_ENV_WHITELIST", "A:B, C"},
                                 {"CELLBLOCK_GATEWAY_NETWORK_ALLOW", "pypi.org, ::1"}},
                                config),
              "");
    EXPECT_EQ(config.token, std::optional<std::string>(""));
    EXPECT_EQ(config.env_whitelist, (std::vector<std::string>{"A", "B", "C"}));
    EXPECT_EQ(config.network_allow, (std::vector<std::string>{"pypi.org", "::1"}));
    GatewayConfig file;
    file.merge_json(json::parse(R"({"token": 5, "network": {"default": null, "ports": [8443]}})"));
    EXPECT_FALSE(file.token.has_value());
    EXPECT_EQ(file.network_ports, std::vector<int>{8443});
    EXPECT_EQ(file_error(R"({"network": {"ports": ["x"]}})").rfind("config key 'network.ports': ", 0), 0u);
    EXPECT_EQ(file_error(R"({"slurm": {}})"), "unknown gateway config key 'slurm'");
}
