#pragma once
// /api/sessions bookkeeping in Jupyter Server's shape: a session names a path and owns a kernel.
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

namespace cellblock::gateway {

struct SessionRecord {
    std::string id, path, name, type, kernel_id;
};

class SessionManager {
  public:
    SessionRecord& create(std::string path, std::string name, std::string type, std::string kernel_id);
    SessionRecord* find(const std::string& id);
    SessionRecord* find_by_path(const std::string& path);
    bool remove(const std::string& id);
    // Sessions whose kernel is gone (deleted or culled through /api/kernels) are forgotten.
    template <typename KernelExists>
    void prune(KernelExists&& kernel_exists) {
        for (auto it = sessions_.begin(); it != sessions_.end();)
            it = kernel_exists(it->second.kernel_id) ? std::next(it) : sessions_.erase(it);
    }
    const std::map<std::string, SessionRecord>& all() const { return sessions_; }

  private:
    std::map<std::string, SessionRecord> sessions_;
};

}  // namespace cellblock::gateway
