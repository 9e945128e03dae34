#include "cellblock/gateway/jupyter/session_manager.hpp"

#include "cellblock/gateway/common/crypto.hpp"

namespace cellblock::gateway {

using nlohmann::json;

json JupyterSessionRecord::to_json() const {
    return {{"id", id},     {"path", path},           {"name", name},
            {"type", type}, {"kernel_id", kernel_id}, {"tenant", tenant}};
}

std::optional<JupyterSessionRecord> JupyterSessionRecord::from_json(const json& stored) {
    if (!stored.is_object() || !stored.contains("id") || !stored["id"].is_string())
        return std::nullopt;
    return JupyterSessionRecord{stored.value("id", ""),        stored.value("path", ""),
                                stored.value("name", ""),      stored.value("type", ""),
                                stored.value("kernel_id", ""), stored.value("tenant", "")};
}

JupyterSessionRecord& JupyterSessionManager::create(std::string path, std::string name, std::string type,
                                                    std::string kernel_id, std::string tenant) {
    JupyterSessionRecord record{new_uuid(),      std::move(path),      std::move(name),
                                std::move(type), std::move(kernel_id), std::move(tenant)};
    auto [it, inserted] = sessions_.emplace(record.id, record);
    save(it->second);
    return it->second;
}

JupyterSessionRecord* JupyterSessionManager::find(const std::string& id) {
    auto found = sessions_.find(id);
    return found == sessions_.end() ? nullptr : &found->second;
}

JupyterSessionRecord* JupyterSessionManager::find_by_path(const std::string& path,
                                                          const std::string& tenant) {
    for (auto& [id, record] : sessions_)
        if (record.path == path && record.tenant == tenant)
            return &record;
    return nullptr;
}

void JupyterSessionManager::save(const JupyterSessionRecord& record) {
    writer_.submit([id = record.id, model = record.to_json()](SessionStore& store) {
        store.put_jupyter_session(id, model);
    });
}

void JupyterSessionManager::forget(const std::string& id) {
    writer_.submit([id](SessionStore& store) { store.remove_jupyter_session(id); });
}

bool JupyterSessionManager::remove(const std::string& id) {
    // `id` may be the erased record's own member (remove(record->id)): keep a copy past the erase.
    const std::string removed = id;  // NOLINT(performance-unnecessary-copy-initialization): see above
    if (sessions_.erase(removed) == 0)
        return false;
    forget(removed);
    return true;
}

}  // namespace cellblock::gateway
