#include "cellblock/gateway/jupyter/kernelspec_registry.hpp"

#include <fstream>

namespace cellblock::gateway {

using nlohmann::json;
namespace fs = std::filesystem;

std::vector<std::string> KernelSpec::argv() const {
    std::vector<std::string> args;
    if (spec.contains("argv") && spec["argv"].is_array())
        for (const auto& item : spec["argv"])
            if (item.is_string())
                args.push_back(item.get<std::string>());
    return args;
}

KernelSpecRegistry::KernelSpecRegistry(std::vector<std::string> directories,
                                       std::map<std::string, std::string> aliases, std::string default_name)
    : directories_(std::move(directories)),
      aliases_(std::move(aliases)),
      default_name_(std::move(default_name)) {
    refresh();
}

void KernelSpecRegistry::refresh() {
    std::map<std::string, KernelSpec> found;
    for (const std::string& directory : directories_) {
        std::error_code error;
        for (const auto& entry : fs::directory_iterator(directory, error)) {
            const fs::path kernel_json = entry.path() / "kernel.json";
            std::ifstream input(kernel_json);
            if (!input)
                continue;
            json spec = json::parse(input, nullptr, false);
            if (!spec.is_object() || !spec.contains("argv"))
                continue;
            const std::string name = entry.path().filename().string();
            if (found.contains(name))
                continue;  // earlier directories win, as in jupyter_client
            found[name] = KernelSpec{name, entry.path(), std::move(spec)};
        }
    }
    on_disk_ = std::move(found);
}

std::optional<std::string> KernelSpecRegistry::resolve(const std::string& name, int depth) const {
    if (depth > 4)
        return std::nullopt;  // alias cycles end here
    if (auto alias = aliases_.find(name); alias != aliases_.end())
        if (auto target = resolve(alias->second, depth + 1))
            return target;
    if (on_disk_.contains(name))
        return name;
    return std::nullopt;
}

std::optional<KernelSpec> KernelSpecRegistry::find(const std::string& requested) const {
    auto resolved_name = resolve(requested, 0);
    if (!resolved_name)
        return std::nullopt;
    const std::string& name = *resolved_name;
    auto spec = on_disk_.find(name);
    if (spec == on_disk_.end())
        return std::nullopt;
    KernelSpec resolved = spec->second;
    // Clients see the name they asked for when it is the default or a listed alias (python3), the on-disk
    // name otherwise; "python" reports as "python3" as jupyter_client does.
    resolved.name = (requested == "python") ? std::string("python3") : requested;
    return resolved;
}

std::vector<std::string> KernelSpecRegistry::listed_names() const {
    std::vector<std::string> names;
    for (const auto& [name, spec] : on_disk_)
        names.push_back(name);
    // The default name is always listed when it resolves (AutoGen requires "python3" in the listing).
    if (std::find(names.begin(), names.end(), default_name_) == names.end() && find(default_name_))
        names.push_back(default_name_);
    return names;
}

json KernelSpecRegistry::spec_model(const KernelSpec& spec, const std::string& base_url) const {
    json resources = json::object();
    for (const char* file : {"logo-64x64.png", "logo-32x32.png", "logo-svg.svg", "kernel.js", "kernel.css"}) {
        std::error_code error;
        if (fs::exists(spec.directory / file, error)) {
            std::string key = file;
            key = key.substr(0, key.rfind('.'));
            if (key == "kernel")
                key = file;
            resources[key] = base_url + "kernelspecs/" + spec.name + "/" + file;
        }
    }
    return {{"name", spec.name}, {"spec", spec.spec}, {"resources", resources}};
}

json KernelSpecRegistry::list_model(const std::string& base_url) const {
    json specs = json::object();
    for (const std::string& name : listed_names())
        if (auto spec = find(name))
            specs[name] = spec_model(*spec, base_url);
    std::string default_name = default_name_;
    if (!find(default_name) && !on_disk_.empty())
        default_name = on_disk_.begin()->first;
    return {{"default", default_name}, {"kernelspecs", specs}};
}

std::optional<fs::path> KernelSpecRegistry::resource_path(const std::string& name,
                                                          const std::string& file) const {
    auto spec = find(name);
    if (!spec || file.empty() || file.find('/') != std::string::npos || file == "." || file == "..")
        return std::nullopt;
    fs::path candidate = spec->directory / file;
    std::error_code error;
    if (!fs::is_regular_file(candidate, error))
        return std::nullopt;
    return candidate;
}

}  // namespace cellblock::gateway
