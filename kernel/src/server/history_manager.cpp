#include "server/history_manager.hpp"

#include <fnmatch.h>

#include <algorithm>
#include <unordered_set>

namespace cellblock::kernel {

void HistoryManager::record(int line, std::string input, std::optional<std::string> output) {
    std::lock_guard lock(mutex_);
    entries_.push_back({line, std::move(input), std::move(output)});
}

nl::json HistoryManager::to_json(const Entry& entry, bool output) const {
    if (!output) {
        return nl::json::array({session_number, entry.line, entry.input});
    }
    nl::json out = entry.output ? nl::json(*entry.output) : nl::json(nullptr);
    return nl::json::array({session_number, entry.line, nl::json::array({entry.input, out})});
}

nl::json HistoryManager::reply(nl::json history) {
    return {{"status", "ok"}, {"history", std::move(history)}};
}

nl::json HistoryManager::get_tail_impl(int n, bool /*raw*/, bool output) const {
    std::lock_guard lock(mutex_);
    nl::json history = nl::json::array();
    const std::size_t count = n <= 0 ? 0 : std::min(entries_.size(), static_cast<std::size_t>(n));
    for (auto it = entries_.end() - static_cast<std::ptrdiff_t>(count); it != entries_.end(); ++it) {
        history.push_back(to_json(*it, output));
    }
    return reply(std::move(history));
}

nl::json HistoryManager::get_range_impl(int session, int start, int stop, bool /*raw*/, bool output) const {
    std::lock_guard lock(mutex_);
    nl::json history = nl::json::array();
    // IPython numbering: 0 is the current session, negative numbers are earlier sessions (there are none).
    if (session != 0 && session != session_number) {
        return reply(std::move(history));
    }
    for (const auto& entry : entries_) {
        // stop is exclusive, as in IPython's HistoryManager.get_range; stop <= 0 means "to the end".
        if (entry.line >= start && (stop <= 0 || entry.line < stop)) {
            history.push_back(to_json(entry, output));
        }
    }
    return reply(std::move(history));
}

nl::json HistoryManager::search_impl(const std::string& pattern, bool /*raw*/, bool output, int n,
                                     bool unique) const {
    std::lock_guard lock(mutex_);
    // Newest first, so "unique" keeps the latest occurrence and n keeps the latest matches.
    std::vector<const Entry*> matches;
    std::unordered_set<std::string> seen;
    for (auto it = entries_.rbegin(); it != entries_.rend(); ++it) {
        if (::fnmatch(pattern.c_str(), it->input.c_str(), 0) != 0) {
            continue;
        }
        if (unique && !seen.insert(it->input).second) {
            continue;
        }
        matches.push_back(&*it);
        if (n > 0 && matches.size() == static_cast<std::size_t>(n)) {
            break;
        }
    }
    nl::json history = nl::json::array();
    for (auto it = matches.rbegin(); it != matches.rend(); ++it) {
        history.push_back(to_json(**it, output));
    }
    return reply(std::move(history));
}

}  // namespace cellblock::kernel
