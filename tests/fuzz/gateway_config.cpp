// The gateway's configuration as an operator writes it (gateway/src/common/config.cpp): a JSON config file
// (GatewayConfig::merge_json) or KG_* / CELLBLOCK_GATEWAY_* environment variables (merge_environment).
//
// Input: a mode byte (even: a config file; odd: environment lines NAME=VALUE), then the file or the lines.
// Invariants: only std::invalid_argument escapes, with a message; an accepted number or flag is exactly what
// the file or the variable says (no truncation, wrap-around or rounding into another value), as the gateway
// reports it in GatewayConfig::to_json; UBSan catches an out-of-range conversion.
#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>

#include "cellblock/gateway/common/config.hpp"
#include "fuzz_support.hpp"

using cellblock::fuzz::require;
using cellblock::gateway::GatewayConfig;
using nlohmann::json;

namespace {

// Variables holding a number, by the to_json key of the field they set.
const std::map<std::string, std::string> numeric_variables = {
    {"KG_PORT", "port"},
    {"KG_MAX_KERNELS", "max_kernels"},
    {"KG_PRESPAWN_COUNT", "warm_pool"},
    {"KG_WS_PING_INTERVAL_SECS", "ws_ping_interval"},
    {"CELLBLOCK_GATEWAY_CULL_IDLE_TIMEOUT", "cull_idle_timeout"},
    {"CELLBLOCK_GATEWAY_CULL_INTERVAL", "cull_interval"},
    {"CELLBLOCK_GATEWAY_HEADER_TIMEOUT", "header_timeout"},
    {"CELLBLOCK_GATEWAY_MAX_UNAUTHENTICATED_CONNECTIONS", "max_unauthenticated_connections"},
    {"CELLBLOCK_GATEWAY_MAX_UNAUTHENTICATED_PER_ADDRESS", "max_unauthenticated_per_address"},
    {"CELLBLOCK_GATEWAY_FD_RESERVE", "fd_reserve"},
    {"CELLBLOCK_GATEWAY_ORPHAN_TIMEOUT", "orphan_timeout"},
};

// Equal as numbers. Not json's operator==, which compares an unsigned with a signed integer after a cast to
// signed: 18446744073709551611 (a wrapped -5) would equal -5.
bool same(const json& reported, const json& given) {
    if (reported.is_boolean() || given.is_boolean())
        return reported == given;
    if (reported.is_number_integer() && given.is_number_integer()) {
        if (reported.is_number_unsigned() != given.is_number_unsigned())
            return !reported.is_number_unsigned()
                       ? reported.get<std::int64_t>() >= 0 &&
                             reported.get<std::uint64_t>() == given.get<std::uint64_t>()
                       : given.get<std::int64_t>() >= 0 &&
                             given.get<std::uint64_t>() == reported.get<std::uint64_t>();
        return reported == given;
    }
    return reported.is_number() && given.is_number() && reported.get<double>() == given.get<double>();
}

void config_file(std::string_view text) {
    const json file = json::parse(text, nullptr, false);
    if (file.is_discarded())
        return;
    GatewayConfig config;
    try {
        config.merge_json(file);
    } catch (const std::invalid_argument& error) {
        require(error.what()[0] != '\0', "a refusal says why");
        return;
    }
    const json reported = config.to_json();
    for (const auto& [key, value] : file.items()) {
        if (!reported.contains(key) || !(value.is_number() || value.is_boolean()))
            continue;
        require(same(reported[key], value), "an accepted number or flag is what the file says");
    }
}

void environment(std::string_view text) {
    const std::map<std::string, std::string> variables = cellblock::fuzz::environment_lines(text);
    GatewayConfig config;
    try {
        config.merge_environment([&](const std::string& name) -> std::optional<std::string> {
            auto found = variables.find(name);
            return found == variables.end() ? std::nullopt : std::optional<std::string>(found->second);
        });
    } catch (const std::invalid_argument& error) {
        require(error.what()[0] != '\0', "a refusal says why");
        return;
    }
    const json reported = config.to_json();
    for (const auto& [name, key] : numeric_variables) {
        auto found = variables.find(name);
        if (found == variables.end())
            continue;
        const json number = json::parse(found->second, nullptr, false);
        require(!number.is_discarded() && number.is_number(), "an accepted variable is a number");
        require(same(reported[key], number), "an accepted variable's number is what it says");
    }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    if (size < 1)
        return 0;
    const std::string_view text = cellblock::fuzz::as_text(data + 1, size - 1);
    if (data[0] % 2 == 0)
        config_file(text);
    else
        environment(text);
    return 0;
}
