// What the settings table (settings_table.cpp) is read by: the config file and environment merges, each
// setting's value as text or JSON, --print-config, the Markdown reference, and the checks after the merge.
#include "cellblock/gateway/common/config.hpp"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <regex>
#include <stdexcept>
#include <type_traits>
#include <utility>
#include <variant>

namespace cellblock::gateway {

using nlohmann::json;

namespace {
// A value into its field exactly, or an error naming `where`: an integer field takes only a whole number
// within its range (a port of 70000 or a byte cap of -1 would otherwise be truncated or wrapped into another,
// valid looking value), a floating-point field a finite number, a flag true or false. One rule for the config
// file and the environment.
template <typename T>
T exact_value(const json& value, const std::string& where) {
    if constexpr (std::is_same_v<T, bool>) {
        if (!value.is_boolean())
            throw std::invalid_argument(where + ": must be true or false");
        return value.get<bool>();
    } else if constexpr (std::is_integral_v<T>) {
        if (!value.is_number_integer())  // nlohmann: true for signed and unsigned integers, not for floats
            throw std::invalid_argument(where + ": must be a whole number, got " + value.dump());
        if (value.is_number_unsigned()) {
            if (const auto number = value.get<std::uint64_t>(); std::in_range<T>(number))
                return static_cast<T>(number);
        } else if (const auto number = value.get<std::int64_t>(); std::in_range<T>(number)) {
            return static_cast<T>(number);
        }
        throw std::invalid_argument(where + ": " + value.dump() + " is out of range (" +
                                    std::to_string(std::numeric_limits<T>::min()) + " to " +
                                    std::to_string(std::numeric_limits<T>::max()) + ")");
    } else if constexpr (std::is_floating_point_v<T>) {
        if (!value.is_number() || !std::isfinite(value.get<double>()))
            throw std::invalid_argument(where + ": must be a number, got " + value.dump());
        return value.get<T>();
    } else {
        try {
            return value.get<T>();
        } catch (const json::exception& error) {
            throw std::invalid_argument(where + ": " + error.what());
        }
    }
}

template <typename T>
void take(const json& source, const char* key, T& field) {
    auto found = source.find(key);
    if (found == source.end() || found->is_null())
        return;
    field = exact_value<T>(*found, std::string("config key '") + key + "'");
}

bool parse_bool(const std::string& name, const std::string& text) {
    if (text == "1" || text == "true" || text == "True" || text == "yes")
        return true;
    if (text == "0" || text == "false" || text == "False" || text == "no" || text.empty())
        return false;
    throw std::invalid_argument(name + ": expected true/false, got '" + text + "'");
}

// An environment variable's number, read as a JSON number so that it meets exact_value's rule.
template <typename T>
T parse_number(const std::string& name, const std::string& text) {
    const json number = json::parse(text, nullptr, false);
    if (number.is_discarded() || !number.is_number())
        throw std::invalid_argument(name + ": expected a number, got '" + text + "'");
    return exact_value<T>(number, name);
}

std::vector<std::string> parse_list(const std::string& text, std::string_view separators) {
    std::vector<std::string> items;
    std::string current;
    for (char c : text) {
        if (separators.find(c) != std::string_view::npos) {
            if (!current.empty())
                items.push_back(current);
            current.clear();
        } else if (c != ' ') {
            current += c;
        }
    }
    if (!current.empty())
        items.push_back(current);
    return items;
}

std::string number_text(double number) {
    return number == std::floor(number) ? std::to_string(static_cast<long long>(number))
                                        : json(number).dump();
}

// What a flag's check asks for, as docs/configuration.md and the file's errors say it.
std::string check_text(const Setting& setting) {
    switch (setting.check) {
        case FlagCheck::range:
        case FlagCheck::unsigned_range:
            return number_text(setting.low) + " to " + number_text(setting.high);
        case FlagCheck::non_negative:
            return ">= 0";
        case FlagCheck::positive:
            return "> 0";
        case FlagCheck::duration:
            return "0 to " + number_text(longest_duration_s);
        case FlagCheck::positive_duration:
            return "> 0, at most " + number_text(longest_duration_s);
        case FlagCheck::none:
            break;
    }
    return "";
}

// A true/false setting with two choices ("off,on") from its text: only a choice, the first meaning false.
bool choice_value(std::string_view choices, const std::string& text, const std::string& where) {
    const auto comma = choices.find(',');
    if (text == choices.substr(0, comma))
        return false;
    if (comma != std::string_view::npos && text == choices.substr(comma + 1))
        return true;
    throw std::invalid_argument(where + ": must be one of " + std::string(choices) + ", got '" + text + "'");
}

}  // namespace

void Setting::set_from_json(GatewayConfig& config, const json& value, const std::string& where) const {
    std::visit(
        [&](auto member) {
            auto& target = field_of(config, member);
            using T = std::remove_cvref_t<decltype(target)>;
            if constexpr (std::is_same_v<T, json>) {
                target = value;  // null included: "no policy"
            } else if constexpr (std::is_same_v<T, std::optional<std::string>>) {
                // The token: only a string sets it; anything else leaves it (nullopt = generated at startup).
                if (value.is_string())
                    target = value.get<std::string>();
            } else if constexpr (std::is_same_v<T, bool>) {
                if (!choices.empty() && !value.is_null())
                    target = choice_value(choices,
                                          value.is_string() ? value.get<std::string>() : value.dump(), where);
                else if (!value.is_null())
                    target = exact_value<T>(value, where);
            } else {
                if (!value.is_null())
                    target = exact_value<T>(value, where);
            }
        },
        field);
}

void Setting::set_from_text(GatewayConfig& config, const std::string& text, const std::string& where) const {
    std::visit(
        [&](auto member) {
            auto& target = field_of(config, member);
            using T = std::remove_cvref_t<decltype(target)>;
            if constexpr (std::is_same_v<T, std::string> || std::is_same_v<T, std::optional<std::string>>) {
                target = text;
            } else if constexpr (std::is_same_v<T, bool>) {
                target = choices.empty() ? parse_bool(where, text) : choice_value(choices, text, where);
            } else if constexpr (std::is_arithmetic_v<T>) {
                target = parse_number<T>(where, text);
            } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
                target = parse_list(text, separators);
            } else {
                // A JSON field (network.default; empty = null), or a list or map written as JSON.
                const json parsed = text.empty() ? json(nullptr) : json::parse(text, nullptr, false);
                if (parsed.is_discarded())
                    throw std::invalid_argument(where + ": not valid JSON");
                set_from_json(config, parsed, where);
            }
        },
        field);
}

json Setting::value_of(const GatewayConfig& config) const {
    return std::visit(
        [&](auto member) -> json {
            const auto& value = field_of(config, member);
            using T = std::remove_cvref_t<decltype(value)>;
            if constexpr (std::is_same_v<T, std::optional<std::string>>) {
                return value ? json(*value) : json(nullptr);
            } else if constexpr (std::is_same_v<T, bool>) {
                if (choices.empty())
                    return value;
                const auto comma = choices.find(',');
                return std::string(value ? choices.substr(comma + 1) : choices.substr(0, comma));
            } else {
                return json(value);
            }
        },
        field);
}

void Setting::check_value(const GatewayConfig& config) const {
    const json value = value_of(config);
    if (check == FlagCheck::none || !value.is_number())
        return;
    const double number = value.get<double>();
    const bool duration = check == FlagCheck::duration || check == FlagCheck::positive_duration;
    const double least = check == FlagCheck::range || check == FlagCheck::unsigned_range ? low : 0;
    const double most = check == FlagCheck::range || check == FlagCheck::unsigned_range ? high
                        : duration                                                      ? longest_duration_s
                                   : std::numeric_limits<double>::infinity();
    const bool above_zero = check == FlagCheck::positive || check == FlagCheck::positive_duration;
    if (number < least || number > most || (above_zero && number <= 0))
        throw std::invalid_argument("config key '" + std::string(key) + "': " + value.dump() + " is not " +
                                    check_text(*this));
}

std::string Setting::default_shown() const {
    if (!default_text.empty())
        return std::string(default_text);
    return value_of(GatewayConfig{}).dump();
}

namespace {
// Whether `key` (a dotted path, "network.allow") names a setting, or a group of them ("network").
bool is_setting(const std::string& key) {
    const auto settings = gateway_settings();
    return std::any_of(settings.begin(), settings.end(), [&](const Setting& s) { return s.key == key; });
}

bool is_group(const std::string& key) {
    const auto settings = gateway_settings();
    return std::any_of(settings.begin(), settings.end(),
                       [&](const Setting& s) { return s.key.starts_with(key + "."); });
}

// Every key of the file is a setting or a group of them; keys starting with _ are comments.
void check_keys(const json& object, const std::string& prefix) {
    for (const auto& [name, value] : object.items()) {
        if (name.starts_with("_"))
            continue;
        const std::string key = prefix + name;
        if (is_setting(key))
            continue;
        if (!is_group(key))
            throw std::invalid_argument("unknown gateway config key '" + key + "'");
        if (value.is_null())
            continue;
        if (!value.is_object())
            throw std::invalid_argument("config key '" + key + "': must be an object");
        check_keys(value, key + ".");
    }
}

// The value at a dotted key, or nullptr when the file does not hold it.
const json* value_at(const json& object, std::string_view key) {
    const json* current = &object;
    for (;;) {
        const auto dot = key.find('.');
        const auto found = current->find(std::string(key.substr(0, dot)));
        if (found == current->end())
            return nullptr;
        if (dot == std::string_view::npos)
            return &*found;
        if (!found->is_object())
            return nullptr;
        current = &*found;
        key.remove_prefix(dot + 1);
    }
}

// Text for a Markdown table cell: no column break, no HTML tag, no emphasis.
std::string cell(std::string_view text) {
    std::string escaped;
    for (char c : text) {
        if (c == '|' || c == '*')
            escaped += '\\';
        if (c == '<')
            escaped += "&lt;";
        else if (c == '>')
            escaped += "&gt;";
        else
            escaped += c;
    }
    return escaped;
}

std::string code(std::string_view text) {
    return text.empty() ? "-" : "`" + std::string(text) + "`";
}

std::string flag_cell(const Setting& setting) {
    if (setting.flag.empty())
        return "-";
    std::string text = code(setting.flag);
    if (std::holds_alternative<std::vector<std::string> GatewayConfig::*>(setting.field))
        text += " (repeatable)";
    if (setting.switch_only)
        text += " (no value)";
    if (setting.check != FlagCheck::none)
        text += " (" + check_text(setting) + ")";
    if (!setting.file_flag.empty())
        text += ", " + code(std::string(setting.file_flag) + " FILE");
    return cell(text);
}
}  // namespace

void GatewayConfig::merge_json(const json& j) {
    if (!j.is_object())
        throw std::invalid_argument("the gateway config must be a JSON object");
    check_keys(j, "");
    for (const Setting& setting : gateway_settings())
        if (const json* value = value_at(j, setting.key))
            setting.set_from_json(*this, *value, "config key '" + std::string(setting.key) + "'");
}

void GatewayConfig::merge_file(const std::string& path) {
    std::ifstream input(path);
    if (!input)
        throw std::invalid_argument("cannot read config file " + path);
    json parsed = json::parse(input, nullptr, false);
    if (parsed.is_discarded())
        throw std::invalid_argument("config file " + path + " is not valid JSON");
    merge_json(parsed);
}

void GatewayConfig::merge_environment(
    const std::function<std::optional<std::string>(const std::string&)>& lookup) {
    for (const Setting& setting : gateway_settings()) {
        if (setting.env.empty() || setting.env_read == EnvRead::by_flag)  // that flag reads it (main.cpp)
            continue;
        const std::string name(setting.env);
        if (auto value = lookup(name))
            setting.set_from_text(*this, *value, name);
    }
}

std::string masked_store(const std::string& store) {
    // postgresql://user:SECRET@host/db, and the keyword form's password=SECRET or password='SE CRET' (also
    // as a URI parameter, ?password=SECRET&...).
    static const std::regex uri_password(R"(://([^:/@]*):[^@/]*@)");
    static const std::regex keyword_password(R"((\bpassword\s*=\s*)('(?:[^'\\]|\\.)*'|[^\s&]*))",
                                             std::regex::icase);
    return std::regex_replace(std::regex_replace(store, uri_password, "://$1:***@"), keyword_password,
                              "$1***");
}

json GatewayConfig::to_json() const {
    json j = json::object();
    for (const Setting& setting : gateway_settings()) {
        if (setting.printed == Printed::never)
            continue;
        json value = setting.value_of(*this);
        if (setting.printed == Printed::masked_store)  // the password (if the URL holds one) is not printed
            value = value.get<std::string>().empty() ? "sqlite" : masked_store(value.get<std::string>());
        std::string path = "/" + std::string(setting.printed_as.empty() ? setting.key : setting.printed_as);
        std::replace(path.begin(), path.end(), '.', '/');
        j[json::json_pointer(path)] = value;
    }
    // The directories really scanned, with the installed default when none is configured.
    j["kernelspec_dirs"] = effective_kernelspec_dirs();
    j["tls"] = !certfile.empty();
    return j;
}

std::string configuration_reference() {
    std::string text;
    std::string_view topic;
    for (const Setting& setting : gateway_settings()) {
        if (setting.topic != topic) {
            topic = setting.topic;
            text += (text.empty() ? "" : "\n") + std::string("## ") + std::string(topic) + "\n\n" +
                    "| Config key | Environment | Command line | Default | Meaning |\n" +
                    "| --- | --- | --- | --- | --- |\n";
        }
        std::string meaning(setting.help);
        if (!setting.choices.empty())
            meaning += "; one of " + std::string(setting.choices);
        text += "| " + code(setting.key) + " | " + code(setting.env) + " | " + flag_cell(setting) + " | " +
                (setting.default_text.empty() ? code(setting.default_shown()) : cell(setting.default_text)) +
                " | " + cell(meaning) + " |\n";
    }
    return text;
}

NetworkSettings GatewayConfig::network_settings() const {
    return checked_settings(network_allow, network_ports, network_approval_timeout, egress_deny);
}

NetworkRequest GatewayConfig::default_network() const {
    NetworkRequest request = parse_network_request(network_default);
    check_within_ceiling(request, network_settings().ceiling);
    return request;
}

void GatewayConfig::check_network() const {
    try {
        network_settings();
        default_network();
    } catch (const NetworkPolicyError& error) {
        throw std::invalid_argument(std::string("network settings: ") + error.what());
    }
    if (!egress_hosts.empty()) {
        std::ifstream hosts(egress_hosts);
        if (!hosts)
            throw std::invalid_argument("--egress-hosts " + egress_hosts + ": cannot read the file");
    }
}

void GatewayConfig::check_zygote_tenant() const {
    // The same rule as the kernel's (kernel_config.cpp): the name becomes part of a socket path.
    constexpr std::size_t longest = 64;
    const bool plain = std::all_of(zygote_tenant.begin(), zygote_tenant.end(), [](char c) {
        return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
               c == '_' || c == '-';
    });
    if (zygote_tenant.size() > longest || !plain || zygote_tenant == "." || zygote_tenant == "..")
        throw std::invalid_argument("zygote_tenant '" + zygote_tenant +
                                    "': a plain name of at most 64 of A-Za-z0-9._- is needed");
}

void GatewayConfig::check_durations() const {
    const std::pair<const char*, double> durations[] = {
        {"kernel_launch_timeout", kernel_launch_timeout},
        {"cull_idle_timeout", cull_idle_timeout},
        {"cull_interval", cull_interval},
        {"ws_ping_interval", ws_ping_interval},
        {"offline_session_ttl", offline_session_ttl},
        {"header_timeout", header_timeout},
        {"orphan_timeout", orphan_timeout},
        {"slurm_poll_interval", slurm_poll_interval},
        {"network.approval_timeout", network_approval_timeout},
    };
    for (const auto& [name, seconds] : durations)
        if (!(seconds >= 0 && seconds <= longest_duration_s))  // NaN fails both
            throw std::invalid_argument(std::string(name) + ": " + json(seconds).dump() +
                                        " is not a number of seconds from 0 to 1.5e9");
    // A connection that must send its headers within 0 s could never be served.
    if (header_timeout == 0)
        throw std::invalid_argument("header_timeout: must be a positive number of seconds");
}

void GatewayConfig::check_every_source() const {
    for (const Setting& setting : gateway_settings())
        if (setting.env_read == EnvRead::by_flag)
            setting.check_value(*this);
}

std::string installed_data_dir() {
    std::error_code error;
    const auto executable = std::filesystem::read_symlink("/proc/self/exe", error);
    if (!error) {
        const auto share = executable.parent_path().parent_path() / "share";
        if (std::filesystem::is_directory(share / "jupyter" / "kernels", error) ||
            std::filesystem::is_directory(share / "cellblock", error))
            return share.string();
    }
    return CELLBLOCK_INSTALL_DATADIR;
}

std::vector<std::string> GatewayConfig::effective_kernelspec_dirs() const {
    if (!kernelspec_dirs.empty())
        return kernelspec_dirs;
    return {installed_data_dir() + "/jupyter/kernels"};
}

}  // namespace cellblock::gateway
