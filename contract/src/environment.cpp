#include "cellblock/contract/environment.hpp"

#include <nlohmann/json.hpp>

namespace cellblock::contract {

namespace {

constexpr int document_version = 1;

bool letter_or_underscore(char c) {
    return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || c == '_';
}

}  // namespace

bool valid_environment_name(std::string_view name) {
    if (name.empty() || !letter_or_underscore(name.front()))
        return false;
    for (char c : name)
        if (!letter_or_underscore(c) && !(c >= '0' && c <= '9'))
            return false;
    return true;
}

bool valid_environment_value(std::string_view value) {
    return value.find('\0') == std::string_view::npos;
}

void check_environment(const Environment& environment) {
    for (const auto& [name, value] : environment) {
        if (!valid_environment_name(name))
            throw InvalidEnvironment("environment variable name " + nlohmann::json(name).dump() +
                                         " is not a name (letters, digits and _, not starting with a digit)",
                                     name);
        if (!valid_environment_value(value))
            throw InvalidEnvironment("the value of environment variable " + name + " holds a NUL byte", name);
    }
}

std::string encode_environment(const Environment& environment) {
    check_environment(environment);
    const nlohmann::json document = {{"version", document_version}, {"environment", environment}};
    // dump() without indentation escapes control characters, and ensure_ascii the rest: one printable line.
    return document.dump(-1, ' ', true);
}

Environment decode_environment(std::string_view document) {
    const nlohmann::json parsed = nlohmann::json::parse(document, nullptr, false);
    const bool versioned = parsed.is_object() && parsed.contains("version") &&
                           parsed["version"].is_number_integer() && parsed["version"] == document_version;
    if (!versioned)
        throw InvalidEnvironment(
            "the launch environment is not a version " + std::to_string(document_version) + " document", {});
    const auto found = parsed.find("environment");
    if (found == parsed.end() || !found->is_object())
        throw InvalidEnvironment("the launch environment has no \"environment\" object", {});
    Environment environment;
    for (const auto& [name, value] : found->items()) {
        if (!value.is_string())
            throw InvalidEnvironment("the value of environment variable " + name + " is not a string", name);
        environment[name] = value.get<std::string>();
    }
    check_environment(environment);
    return environment;
}

}  // namespace cellblock::contract
