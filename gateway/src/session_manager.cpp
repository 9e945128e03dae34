#include "cellblock/gateway/session_manager.hpp"

#include "cellblock/gateway/crypto.hpp"

namespace cellblock::gateway {

SessionRecord& SessionManager::create(std::string path, std::string name, std::string type,
                                      std::string kernel_id) {
    SessionRecord record{new_uuid(), std::move(path), std::move(name), std::move(type), std::move(kernel_id)};
    auto [it, inserted] = sessions_.emplace(record.id, record);
    return it->second;
}

SessionRecord* SessionManager::find(const std::string& id) {
    auto found = sessions_.find(id);
    return found == sessions_.end() ? nullptr : &found->second;
}

SessionRecord* SessionManager::find_by_path(const std::string& path) {
    for (auto& [id, record] : sessions_)
        if (record.path == path)
            return &record;
    return nullptr;
}

bool SessionManager::remove(const std::string& id) {
    return sessions_.erase(id) > 0;
}

}  // namespace cellblock::gateway
