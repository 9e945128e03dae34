// Policy: the confinement profile, loaded from JSON. Parsing is strict: an unknown key or a value of the
// wrong type is an error naming the key, because a typo in a security policy must never be ignored.
#include <cctype>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "cellblock/sandbox/sandbox.hpp"

namespace cellblock::sandbox {
namespace {

using nlohmann::json;

[[noreturn]] void fail(const std::string& where, const std::string& what) {
    throw SandboxError("policy: " + where + ": " + what);
}

void reject_unknown_keys(const json& object, const std::string& where, const std::set<std::string>& known) {
    if (!object.is_object()) {
        fail(where.empty() ? "top level" : where, "must be an object");
    }
    for (const auto& [key, value] : object.items()) {
        if (!known.contains(key)) {
            fail(where.empty() ? key : where + "." + key, "unknown key");
        }
    }
}

std::string join(const std::string& where, const std::string& key) {
    return where.empty() ? key : where + "." + key;
}

// A size as a non-negative integer of bytes or a string with a binary suffix: "512M", "2G", "64K".
std::uint64_t parse_size(const json& value, const std::string& where) {
    if (value.is_number_unsigned()) {
        return value.get<std::uint64_t>();
    }
    if (value.is_number_integer()) {
        fail(where, "must not be negative");
    }
    if (!value.is_string()) {
        fail(where, "must be a byte count or a string like \"512M\"");
    }
    const auto text = value.get<std::string>();
    std::size_t digits = 0;
    while (digits < text.size() && std::isdigit(static_cast<unsigned char>(text[digits])) != 0) {
        ++digits;
    }
    if (digits == 0 || digits > 15) {
        fail(where, "'" + text + "' is not a size");
    }
    std::uint64_t number = std::stoull(text.substr(0, digits));
    const std::string suffix = text.substr(digits);
    std::uint64_t unit = 1;
    if (suffix.empty() || suffix == "B") {
        unit = 1;
    } else if (suffix == "K" || suffix == "KiB") {
        unit = 1ULL << 10;
    } else if (suffix == "M" || suffix == "MiB") {
        unit = 1ULL << 20;
    } else if (suffix == "G" || suffix == "GiB") {
        unit = 1ULL << 30;
    } else {
        fail(where, "'" + text + "' has an unknown unit (use K, M or G)");
    }
    // 15 digits times a GiB passes 2^64: wrapped, "999999999999999G" would be a tiny limit.
    if (number > std::numeric_limits<std::uint64_t>::max() / unit) {
        fail(where, "'" + text + "' is too large");
    }
    return number * unit;
}

std::uint64_t parse_count(const json& value, const std::string& where) {
    if (!value.is_number_unsigned()) {
        fail(where, "must be a non-negative integer");
    }
    return value.get<std::uint64_t>();
}

// A host uid (or a count of them): truncated to uid_t, 4294968296 would silently become uid 1000.
uid_t parse_uid(const json& value, const std::string& where) {
    const auto number = parse_count(value, where);
    if (number > 0xFFFFFFFEULL) {
        fail(where, "is past the largest valid uid (4294967294)");
    }
    return static_cast<uid_t>(number);
}

// Seconds or cores as a non-negative number, bounded so that converting it to the kernel's integer units
// (milliseconds, cgroup quota microseconds) cannot overflow.
double parse_bounded_number(const json& value, const std::string& where, double largest) {
    if (!value.is_number() || value.get<double>() < 0) {
        fail(where, "must be a non-negative number");
    }
    if (value.get<double>() > largest) {
        fail(where, "must be at most " + std::to_string(static_cast<std::uint64_t>(largest)));
    }
    return value.get<double>();
}

bool parse_bool(const json& value, const std::string& where) {
    if (!value.is_boolean()) {
        fail(where, "must be true or false");
    }
    return value.get<bool>();
}

std::string parse_string(const json& value, const std::string& where) {
    if (!value.is_string()) {
        fail(where, "must be a string");
    }
    return value.get<std::string>();
}

std::string parse_absolute_path(const json& value, const std::string& where) {
    auto path = parse_string(value, where);
    if (path.empty() || path.front() != '/') {
        fail(where, "'" + path + "' must be an absolute path");
    }
    if (path.find("/../") != std::string::npos || path.ends_with("/..")) {
        fail(where, "'" + path + "' must not contain '..'");
    }
    return path;
}

ResourceLimits parse_limits(const json& object, const std::string& where, ResourceLimits limits) {
    reject_unknown_keys(object, where,
                        {"memory", "pids", "cpu_cores", "open_files", "processes", "file_size", "cpu_seconds",
                         "wall_clock_seconds", "output"});
    for (const auto& [key, value] : object.items()) {
        const auto at = join(where, key);
        if (key == "memory") {
            limits.memory_bytes = parse_size(value, at);
        } else if (key == "pids") {
            limits.pids = parse_count(value, at);
        } else if (key == "cpu_cores") {
            limits.cpu_cores = parse_bounded_number(value, at, 1 << 20);
        } else if (key == "open_files") {
            limits.open_files = parse_count(value, at);
            if (limits.open_files < 16) {
                fail(at, "must be at least 16 (an interpreter needs a few)");
            }
        } else if (key == "processes") {
            limits.processes = parse_count(value, at);
        } else if (key == "file_size") {
            limits.file_size_bytes = parse_size(value, at);
        } else if (key == "cpu_seconds") {
            limits.cpu_seconds = parse_count(value, at);
        } else if (key == "wall_clock_seconds") {
            const double seconds = parse_bounded_number(value, at, 1e12);  // 31,000 years
            limits.wall_clock = std::chrono::milliseconds(static_cast<std::int64_t>(seconds * 1000));
        } else if (key == "output") {
            limits.output_bytes = parse_size(value, at);
        }
    }
    return limits;
}

MountSpec parse_mount(const json& object, const std::string& where) {
    if (!object.is_object()) {
        fail(where, "must be an object");
    }
    if (!object.contains("type")) {
        fail(where, "missing \"type\" (bind, tmpfs, proc, dev, file or symlink)");
    }
    if (!object.contains("target")) {
        fail(where, "missing \"target\"");
    }
    MountSpec mount;
    const auto type = parse_string(object.at("type"), join(where, "type"));
    std::set<std::string> known{"type", "target"};
    if (type == "bind") {
        mount.kind = MountSpec::Kind::bind;
        known.insert({"source", "writable", "optional"});
        if (!object.contains("source")) {
            fail(where, "a bind needs \"source\"");
        }
    } else if (type == "tmpfs") {
        mount.kind = MountSpec::Kind::tmpfs;
        known.insert({"size", "writable"});
    } else if (type == "proc") {
        mount.kind = MountSpec::Kind::proc;
    } else if (type == "dev") {
        mount.kind = MountSpec::Kind::dev;
        known.insert({"size"});
    } else if (type == "file") {
        mount.kind = MountSpec::Kind::file;
        known.insert({"content"});
    } else if (type == "symlink") {
        mount.kind = MountSpec::Kind::symlink;
        known.insert({"source"});
        if (!object.contains("source")) {
            fail(where, "a symlink needs \"source\" (the link text)");
        }
    } else {
        fail(join(where, "type"), "'" + type + "' is not one of bind, tmpfs, proc, dev, file, symlink");
    }
    reject_unknown_keys(object, where, known);
    mount.target = parse_absolute_path(object.at("target"), join(where, "target"));
    if (mount.target == "/") {
        fail(join(where, "target"), "the root is built by the launcher");
    }
    if (object.contains("source")) {
        mount.source = mount.kind == MountSpec::Kind::bind
                           ? parse_absolute_path(object.at("source"), join(where, "source"))
                           : parse_string(object.at("source"), join(where, "source"));
    }
    if (object.contains("writable")) {
        mount.writable = parse_bool(object.at("writable"), join(where, "writable"));
    }
    if (object.contains("optional")) {
        mount.optional = parse_bool(object.at("optional"), join(where, "optional"));
    }
    if (object.contains("size")) {
        mount.size_bytes = parse_size(object.at("size"), join(where, "size"));
    }
    if (object.contains("content")) {
        mount.content = parse_string(object.at("content"), join(where, "content"));
    }
    if (mount.kind == MountSpec::Kind::tmpfs && !object.contains("writable")) {
        mount.writable = true;
    }
    return mount;
}

}  // namespace

Policy Policy::from_json(const json& root) {
    reject_unknown_keys(
        root, "",
        {"uid_range", "inside_uid", "hostname", "workspace_target", "mounts", "environment", "limits",
         "seccomp", "network_loopback", "allow_weaker_confinement", "state_dir", "comment"});
    Policy policy;
    for (const auto& [key, value] : root.items()) {
        if (key == "uid_range") {
            reject_unknown_keys(value, key, {"first", "count"});
            if (value.contains("first")) {
                policy.uid_first = parse_uid(value.at("first"), "uid_range.first");
            }
            if (value.contains("count")) {
                policy.uid_count = parse_uid(value.at("count"), "uid_range.count");
            }
        } else if (key == "inside_uid") {
            const auto uid = parse_count(value, key);
            if (uid == 0 || uid > 65533) {
                fail(key, "must be between 1 and 65533 (the program never runs as root)");
            }
            policy.inside_uid = static_cast<uid_t>(uid);
        } else if (key == "hostname") {
            policy.hostname = parse_string(value, key);
            if (policy.hostname.empty() || policy.hostname.size() > 64) {
                fail(key, "must be 1 to 64 characters");
            }
        } else if (key == "workspace_target") {
            policy.workspace_target = parse_absolute_path(value, key);
        } else if (key == "mounts") {
            if (!value.is_array()) {
                fail(key, "must be an array");
            }
            for (std::size_t i = 0; i < value.size(); ++i) {
                policy.mounts.push_back(parse_mount(value[i], "mounts[" + std::to_string(i) + "]"));
            }
        } else if (key == "environment") {
            if (!value.is_array()) {
                fail(key, "must be an array of \"NAME=value\" strings");
            }
            for (std::size_t i = 0; i < value.size(); ++i) {
                const auto at = "environment[" + std::to_string(i) + "]";
                auto entry = parse_string(value[i], at);
                const auto equals = entry.find('=');
                if (equals == 0 || equals == std::string::npos) {
                    fail(at, "'" + entry + "' is not NAME=value");
                }
                policy.environment.push_back(std::move(entry));
            }
        } else if (key == "limits") {
            policy.limits = parse_limits(value, key, policy.limits);
        } else if (key == "seccomp") {
            policy.seccomp = parse_bool(value, key);
        } else if (key == "network_loopback") {
            policy.network_loopback = parse_bool(value, key);
        } else if (key == "allow_weaker_confinement") {
            policy.allow_weaker_confinement = parse_bool(value, key);
        } else if (key == "state_dir") {
            policy.state_dir = parse_absolute_path(value, key);
        } else if (key == "comment") {
            // Free text for people reading the file.
        }
    }
    if (policy.uid_first == 0) {
        fail("uid_range.first", "must not be 0 (host root is never handed out)");
    }
    if (policy.uid_count == 0) {
        fail("uid_range.count", "must be at least 1");
    }
    if (static_cast<std::uint64_t>(policy.uid_first) + policy.uid_count > 0xFFFFFFFEULL) {
        fail("uid_range", "extends past the largest valid uid");
    }
    return policy;
}

Policy Policy::load(const std::filesystem::path& file) {
    std::ifstream stream(file);
    if (!stream) {
        throw SandboxError("policy: cannot open " + file.string());
    }
    json document;
    try {
        document = json::parse(stream);
    } catch (const json::exception& error) {
        // Not only parse_error: a number past double's range is an out_of_range.
        throw SandboxError("policy: " + file.string() + " is not valid JSON: " + error.what());
    }
    try {
        return from_json(document);
    } catch (const SandboxError& error) {
        throw SandboxError(std::string(error.what()) + " (in " + file.string() + ")");
    }
}

}  // namespace cellblock::sandbox
