// The sandbox policy file (sandbox/src/policy.cpp, Policy::from_json), which decides the host uids, mounts
// and limits of every confined process. Parsing is meant to be strict: a wrong key or value is an error
// naming it, never a silently different policy.
//
// Input: the policy file's bytes.
// Invariants: from_json throws nothing but SandboxError; an accepted policy has the uid range, inside uid
// and counts the file says (no truncation to 32 bits), a non-zero uid range within valid uids, absolute mount
// targets without '..', sizes that did not wrap around and core counts the cgroup quota can hold. Seconds too
// large for milliseconds would be a UBSan report (float-cast-overflow).
#include <cstdint>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>

#include "cellblock/sandbox/sandbox.hpp"
#include "fuzz_support.hpp"

using cellblock::fuzz::require;
using cellblock::sandbox::Policy;
using cellblock::sandbox::SandboxError;
using nlohmann::json;

namespace {
// What a size in the file means, computed without overflow; nullopt when it is not representable.
std::optional<long double> intended_size(const json& value) {
    if (value.is_number_unsigned()) {
        return static_cast<long double>(value.get<std::uint64_t>());
    }
    if (!value.is_string()) {
        return std::nullopt;
    }
    const std::string text = value.get<std::string>();
    std::size_t digits = 0;
    long double number = 0;
    while (digits < text.size() && text[digits] >= '0' && text[digits] <= '9') {
        number = number * 10 + (text[digits] - '0');
        ++digits;
    }
    const std::string suffix = text.substr(digits);
    const long double unit = (suffix == "K" || suffix == "KiB")   ? 1024.0L
                             : (suffix == "M" || suffix == "MiB") ? 1048576.0L
                             : (suffix == "G" || suffix == "GiB") ? 1073741824.0L
                                                                  : 1.0L;
    return number * unit;
}

void require_size(const json& object, const char* key, std::uint64_t parsed) {
    if (!object.is_object() || !object.contains(key)) {
        return;
    }
    const auto intended = intended_size(object.at(key));
    require(intended.has_value() && *intended == static_cast<long double>(parsed),
            "an accepted size is not the size the policy file gives");
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    const json document = json::parse(cellblock::fuzz::as_text(data, size), nullptr, false);
    if (document.is_discarded()) {
        return 0;
    }
    Policy policy;
    try {
        policy = Policy::from_json(document);
    } catch (const SandboxError&) {
        return 0;
    }
    require(policy.uid_first != 0 && policy.uid_count != 0, "an accepted policy hands out uid 0 or no uids");
    require(std::uint64_t{policy.uid_first} + policy.uid_count <= 0xFFFFFFFEULL,
            "the uid range passes the last uid");
    if (document.contains("uid_range")) {
        const json& range = document.at("uid_range");
        if (range.contains("first")) {
            require(range.at("first").get<std::uint64_t>() == policy.uid_first,
                    "uid_range.first was truncated to another uid");
        }
        if (range.contains("count")) {
            require(range.at("count").get<std::uint64_t>() == policy.uid_count,
                    "uid_range.count was truncated");
        }
    }
    require(policy.inside_uid != 0, "the confined program would run as root");
    // cgroups.cpp turns cores into a quota of microseconds per 100 ms period with a cast to long.
    require(policy.limits.cpu_cores * 100000 < 9.2e18, "cpu_cores overflows the cgroup quota");
    for (const auto& mount : policy.mounts) {
        require(mount.target.starts_with('/') && mount.target != "/" && !mount.target.ends_with("/..") &&
                    mount.target.find("/../") == std::string::npos,
                "an accepted mount target is relative, the root, or climbs with '..'");
    }
    if (document.contains("limits")) {
        const json& limits = document.at("limits");
        require_size(limits, "memory", policy.limits.memory_bytes);
        require_size(limits, "file_size", policy.limits.file_size_bytes);
        require_size(limits, "output", policy.limits.output_bytes);
    }
    if (document.contains("mounts")) {
        for (std::size_t i = 0; i < policy.mounts.size(); ++i) {
            require_size(document.at("mounts")[i], "size", policy.mounts[i].size_bytes);
        }
    }
    return 0;
}
