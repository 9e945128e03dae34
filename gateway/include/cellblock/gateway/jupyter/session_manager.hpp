#pragma once
// /api/sessions bookkeeping in Jupyter Server's shape: a session names a path and owns a kernel. Every change
// is written to the store, so sessions survive a gateway restart together with their kernels.
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "cellblock/gateway/store/store_writer.hpp"

namespace cellblock::gateway {

struct JupyterSessionRecord {
    std::string id, path, name, type, kernel_id;
    std::string tenant;  // whose session it is (principal.hpp); empty = the operator's
    nlohmann::json to_json() const;
    static std::optional<JupyterSessionRecord> from_json(const nlohmann::json& stored);
};

class JupyterSessionManager {
  public:
    explicit JupyterSessionManager(StoreWriter& writer) : writer_(writer) {}
    // Reloads the stored sessions whose kernel exists (the others are forgotten, in the store too).
    template <typename KernelExists>
    void load(KernelExists&& kernel_exists) {
        for (const nlohmann::json& stored : writer_.store().jupyter_sessions()) {
            auto record = JupyterSessionRecord::from_json(stored);
            if (record && kernel_exists(record->kernel_id))
                sessions_.emplace(record->id, *record);
            else if (record)
                forget(record->id);
        }
    }
    // On a store shared with other gateways: takes in the sessions they created (whose kernel exists) and
    // drops those they deleted, so /api/sessions answers the same through every gateway. `stored_sessions`
    // is what the store's jupyter_sessions() answered (read off the io thread).
    template <typename KernelExists>
    void refresh(const std::vector<nlohmann::json>& stored_sessions, KernelExists&& kernel_exists) {
        std::map<std::string, JupyterSessionRecord> stored;
        for (const nlohmann::json& entry : stored_sessions)
            if (auto record = JupyterSessionRecord::from_json(entry))
                stored.emplace(record->id, *record);
        std::erase_if(sessions_, [&stored](const auto& held) { return !stored.contains(held.first); });
        for (auto& [id, record] : stored)
            if (!sessions_.contains(id) && kernel_exists(record.kernel_id))
                sessions_.emplace(id, std::move(record));
    }
    JupyterSessionRecord& create(std::string path, std::string name, std::string type, std::string kernel_id,
                                 std::string tenant);
    JupyterSessionRecord* find(const std::string& id);
    // Paths are per tenant: two tenants' notebooks of one path are two sessions.
    JupyterSessionRecord* find_by_path(const std::string& path, const std::string& tenant);
    // Writes `record` (changed in place by a PATCH) to the store.
    void save(const JupyterSessionRecord& record);
    bool remove(const std::string& id);
    // Sessions whose kernel is gone (deleted or culled through /api/kernels) are forgotten.
    template <typename KernelExists>
    void prune(KernelExists&& kernel_exists) {
        for (auto it = sessions_.begin(); it != sessions_.end();) {
            if (kernel_exists(it->second.kernel_id)) {
                ++it;
                continue;
            }
            forget(it->first);
            it = sessions_.erase(it);
        }
    }
    const std::map<std::string, JupyterSessionRecord>& all() const { return sessions_; }

  private:
    void forget(const std::string& id);
    StoreWriter& writer_;
    std::map<std::string, JupyterSessionRecord> sessions_;
};

}  // namespace cellblock::gateway
