#pragma once
// Kernelspecs found on disk (<dir>/<name>/kernel.json), the names they are exposed under (aliases such as
// python3 → cellblock-python) and the KernelSpecModel JSON that Jupyter clients expect.
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

namespace cellblock::gateway {

struct KernelSpec {
    std::string name;                 // the name clients use (after alias resolution, e.g. "python3")
    std::filesystem::path directory;  // where kernel.json and the logos live
    nlohmann::json spec;              // kernel.json contents
    std::vector<std::string> argv() const;
    std::string interrupt_mode() const { return spec.value("interrupt_mode", "signal"); }
};

class KernelSpecRegistry {
  public:
    KernelSpecRegistry(std::vector<std::string> directories, std::map<std::string, std::string> aliases,
                       std::string default_name);

    // Rescans the directories (cheap; called on listing so newly installed specs appear).
    void refresh();
    // Resolves aliases; nullopt when no such kernelspec exists.
    std::optional<KernelSpec> find(const std::string& name) const;
    const std::string& default_name() const { return default_name_; }
    // {"default": ..., "kernelspecs": {name: model}} with resource URLs under base_url.
    nlohmann::json list_model(const std::string& base_url) const;
    nlohmann::json spec_model(const KernelSpec& spec, const std::string& base_url) const;
    // A file inside the kernelspec directory (logo, kernel.js); nullopt for anything outside it.
    std::optional<std::filesystem::path> resource_path(const std::string& name,
                                                       const std::string& file) const;

  private:
    std::vector<std::string> directories_;
    std::map<std::string, std::string> aliases_;
    std::string default_name_;
    std::map<std::string, KernelSpec> on_disk_;  // keyed by directory name
    std::vector<std::string> listed_names() const;
    // Alias resolution: an alias whose target resolves wins over a directory of the same name.
    std::optional<std::string> resolve(const std::string& name, int depth) const;
};

}  // namespace cellblock::gateway
