#include "launch/kernel_config.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string_view>

namespace cellblock::kernel {
namespace {

std::filesystem::path resolve(const std::filesystem::path& base, const std::string& value) {
    std::filesystem::path path(value);
    return path.is_absolute() ? path : (base / path).lexically_normal();
}

std::string seconds_rule() {
    return "a number of seconds from 0 to " + nlohmann::json(longest_seconds).dump();
}

// Seconds from the environment: a number from 0 to longest_seconds (from_chars also reads "inf" and "nan").
double parse_seconds(const std::string& name, const std::string& text) {
    double value = 0;
    const auto* first = text.data();
    const auto* last = text.data() + text.size();
    const auto [end, error] = std::from_chars(first, last, value);
    if (error != std::errc{} || end != last || !(value >= 0 && value <= longest_seconds)) {
        throw ConfigError(name + ": expected " + seconds_rule() + ", got '" + text + "'");
    }
    return value;
}

// A count (bytes, MiB) from the environment: a whole number up to `largest`, never a fraction rounded down or
// a value wrapped around.
std::uint64_t parse_count(const std::string& name, const std::string& text, std::uint64_t largest) {
    std::uint64_t value = 0;
    const auto* first = text.data();
    const auto* last = text.data() + text.size();
    const auto [end, error] = std::from_chars(first, last, value);
    if (error != std::errc{} || end != last || value > largest) {
        throw ConfigError(name + ": expected a whole number from 0 to " + std::to_string(largest) +
                          ", got '" + text + "'");
    }
    return value;
}

// The same two rules for the config file's values: nlohmann's converting value() would turn a memory_mb of -1
// into 2^64-1 and 1.5 into 1.
double file_seconds(const nlohmann::json& object, const char* key, double fallback,
                    const std::string& where) {
    if (!object.contains(key)) {
        return fallback;
    }
    const auto& value = object.at(key);
    if (!value.is_number() || !(value.get<double>() >= 0 && value.get<double>() <= longest_seconds)) {
        throw ConfigError(where + "." + key + " must be " + seconds_rule() + ", got " + value.dump());
    }
    return value.get<double>();
}

std::uint64_t file_count(const nlohmann::json& object, const char* key, std::uint64_t fallback,
                         const std::string& where, std::uint64_t smallest, std::uint64_t largest) {
    if (!object.contains(key)) {
        return fallback;
    }
    const auto& value = object.at(key);
    if (!value.is_number_unsigned() || value.get<std::uint64_t>() < smallest ||
        value.get<std::uint64_t>() > largest) {
        throw ConfigError(where + "." + key + " must be a whole number from " + std::to_string(smallest) +
                          " to " + std::to_string(largest) + ", got " + value.dump());
    }
    return value.get<std::uint64_t>();
}

constexpr std::uint64_t any_count = std::numeric_limits<std::uint64_t>::max();

// A tenant names files under the sandbox's state_dir: a plain name only.
void check_tenant(const std::string& where, const std::string& tenant) {
    const bool plain =
        tenant.size() <= longest_tenant_name && std::all_of(tenant.begin(), tenant.end(), [](char c) {
            return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' ||
                   c == '_' || c == '.';
        });
    if (!plain || tenant == "." || tenant == "..") {
        throw ConfigError(where + ": '" + tenant + "' is not a tenant name (at most " +
                          std::to_string(longest_tenant_name) + " of A-Z a-z 0-9 . _ -)");
    }
}

// A dotted Python module name (what the template passes to importlib.import_module): ASCII identifiers
// joined by dots.
void check_module_name(const std::string& name) {
    const auto identifier = [](std::string_view part) {
        const auto letter = [](char c) {
            return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
        };
        return !part.empty() && letter(part.front()) && std::all_of(part.begin(), part.end(), [&](char c) {
            return letter(c) || (c >= '0' && c <= '9');
        });
    };
    bool valid = !name.empty() && name.size() <= 200;
    for (std::size_t start = 0; valid;) {
        const auto dot = name.find('.', start);
        valid =
            identifier(std::string_view(name).substr(start, dot == std::string::npos ? dot : dot - start));
        if (dot == std::string::npos) {
            break;
        }
        start = dot + 1;
    }
    if (!valid) {
        throw ConfigError("worker.zygote_preload: '" + name + "' is not a Python module name");
    }
}

}  // namespace

std::vector<std::string> ZygoteConfig::template_environment() const {
    std::vector<std::string> variables;
    if (preload) {
        std::string joined;
        for (const auto& module : *preload) {
            joined += (joined.empty() ? "" : ",") + module;
        }
        variables.push_back("CELLBLOCK_ZYGOTE_PRELOAD=" + joined);
    }
    if (generation_forks) {
        variables.push_back("CELLBLOCK_ZYGOTE_GENERATION_FORKS=" + std::to_string(*generation_forks));
    }
    if (generation_seconds) {
        std::ostringstream seconds;
        seconds << *generation_seconds;
        variables.push_back("CELLBLOCK_ZYGOTE_GENERATION_SECONDS=" + seconds.str());
    }
    return variables;
}

KernelConfig::EnvironmentLookup KernelConfig::process_environment() {
    return [](const std::string& name) -> std::optional<std::string> {
        const char* value = std::getenv(name.c_str());
        if (value == nullptr || *value == '\0') {
            return std::nullopt;
        }
        return std::string(value);
    };
}

KernelConfig KernelConfig::load(const std::filesystem::path& file, const EnvironmentLookup& environment) {
    std::ifstream input(file);
    if (!input) {
        throw ConfigError("cannot read kernel config " + file.string());
    }
    const auto json = nlohmann::json::parse(input, nullptr, false);
    if (json.is_discarded() || !json.is_object()) {
        throw ConfigError("kernel config " + file.string() + " is not a JSON object");
    }
    const auto base = std::filesystem::absolute(file).parent_path();
    KernelConfig config;
    try {
        const auto& worker = json.at("worker");
        config.python = worker.value("python", std::string("/usr/bin/python3"));
        config.worker_script = resolve(base, worker.at("script").get<std::string>());
        config.worker_start_timeout_s =
            file_seconds(worker, "start_timeout_s", config.worker_start_timeout_s, "worker");
        config.zygote.enabled = worker.value("zygote", true);
        config.zygote.tenant = worker.value("zygote_tenant", std::string());
        config.zygote.library =
            resolve(base, worker.value("zygote_library", std::string(CELLBLOCK_DEFAULT_ZYGOTE_LIBRARY)));
        if (worker.contains("zygote_preload")) {
            config.zygote.preload = worker.at("zygote_preload").get<std::vector<std::string>>();
            std::for_each(config.zygote.preload->begin(), config.zygote.preload->end(), check_module_name);
        }
        if (worker.contains("zygote_generation_forks")) {
            config.zygote.generation_forks =
                static_cast<unsigned>(file_count(worker, "zygote_generation_forks", 0, "worker", 1, 1000000));
        }
        if (worker.contains("zygote_generation_seconds")) {
            config.zygote.generation_seconds = file_seconds(worker, "zygote_generation_seconds", 0, "worker");
            if (*config.zygote.generation_seconds == 0) {
                throw ConfigError("worker.zygote_generation_seconds must be greater than 0");
            }
        }
        config.sandbox_policy = resolve(base, json.at("sandbox_policy").get<std::string>());
        config.workspace_root =
            resolve(base, json.value("workspace_root", std::string("/var/lib/cellblock/workspaces")));
        if (json.contains("limits")) {
            const auto& limits = json.at("limits");
            config.limits.timeout_s = file_seconds(limits, "timeout_s", config.limits.timeout_s, "limits");
            config.limits.interrupt_grace_s =
                file_seconds(limits, "interrupt_grace_s", config.limits.interrupt_grace_s, "limits");
            config.limits.output_bytes =
                file_count(limits, "output_bytes", config.limits.output_bytes, "limits", 0, any_count);
            config.limits.memory_mb =
                file_count(limits, "memory_mb", config.limits.memory_mb, "limits", 0, largest_memory_mb);
        }
    } catch (const nlohmann::json::exception& error) {
        throw ConfigError("kernel config " + file.string() + ": " + error.what());
    }
    if (!(config.worker_start_timeout_s > 0)) {
        throw ConfigError("worker.start_timeout_s must be greater than 0");
    }
    if (!config.python.is_absolute()) {
        throw ConfigError("worker.python must be an absolute path");
    }

    check_tenant("worker.zygote_tenant", config.zygote.tenant);
    if (auto value = environment("CELLBLOCK_ZYGOTE_TENANT")) {
        check_tenant("CELLBLOCK_ZYGOTE_TENANT", *value);
        config.zygote.tenant = *value;
    }
    config.zygote.supervised = environment("CELLBLOCK_ZYGOTE_SUPERVISED") == std::optional<std::string>("1");

    if (auto value = environment("CELLBLOCK_WORKSPACE")) {
        config.workspace = std::filesystem::path(*value);
    }
    if (auto value = environment("CELLBLOCK_TIMEOUT_S")) {
        config.limits.timeout_s = parse_seconds("CELLBLOCK_TIMEOUT_S", *value);
    }
    if (auto value = environment("CELLBLOCK_MEMORY_MB")) {
        config.limits.memory_mb = parse_count("CELLBLOCK_MEMORY_MB", *value, largest_memory_mb);
    }
    if (auto value = environment("CELLBLOCK_INTERRUPT_GRACE_S")) {
        config.limits.interrupt_grace_s = parse_seconds("CELLBLOCK_INTERRUPT_GRACE_S", *value);
    }
    if (auto value = environment("CELLBLOCK_OUTPUT_BYTES")) {
        config.limits.output_bytes = parse_count("CELLBLOCK_OUTPUT_BYTES", *value, any_count);
    }
    if (auto value = environment("CELLBLOCK_NETWORK_POLICY")) {
        try {
            auto policy = nlohmann::json::parse(*value);
            if (!policy.is_object()) {
                throw ConfigError("CELLBLOCK_NETWORK_POLICY must be a JSON object, got " +
                                  std::string(policy.type_name()));
            }
            config.network_policy = std::move(policy);
        } catch (const nlohmann::json::exception& error) {
            // Not only parse_error: a number past double's range is an out_of_range.
            throw ConfigError(std::string("CELLBLOCK_NETWORK_POLICY is not valid JSON: ") + error.what());
        }
    }
    if (auto value = environment("CELLBLOCK_EGRESS_HOSTS")) {
        config.egress_hosts = std::filesystem::path(*value);
    }
    return config;
}

}  // namespace cellblock::kernel
