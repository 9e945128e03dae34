#include "cellblock/gateway/agent/live_events.hpp"

#include <chrono>

#include "cellblock/gateway/agent/output_shield.hpp"

namespace cellblock::gateway::agent {

using nlohmann::json;

std::uint64_t LiveLog::clock_generation() {
    const auto now = std::chrono::system_clock::now().time_since_epoch();
    return static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::microseconds>(now).count());
}

LiveLog::~LiveLog() {
    auto readers = std::move(readers_);
    for (auto& [key, reader] : readers)
        if (reader.closed)
            reader.closed();
}

void LiveLog::seed(const std::vector<json>& cells) {
    for (const json& cell : cells) {
        ++cell_;
        add({{"type", "recorded"},
             {"source", cell.value("source", json(""))},
             {"outputs", cell.value("outputs", json::array())},
             {"execution_count", cell.value("execution_count", json(nullptr))},
             {"metadata", cell.value("metadata", json::object())}});
    }
}

void LiveLog::cell_started(const std::string& code) {
    ++cell_;
    running_ = true;
    stdout_sent_ = stderr_sent_ = 0;
    add({{"type", "cell"}, {"code", code}});
}

void LiveLog::cell_event(const json& event) {
    if (!running_ && event.value("type", "") != "approval")
        return;
    const std::string type = event.value("type", "");
    if (type != "stdout" && type != "stderr")
        return add(event);
    // A cell printing megabytes would flood every page; past the cap the end event's head and tail stand in.
    std::size_t& sent = type == "stdout" ? stdout_sent_ : stderr_sent_;
    if (sent >= text_cap_)
        return;
    const std::string& text = event["text"].get_ref<const std::string&>();
    if (sent + text.size() <= text_cap_) {
        sent += text.size();
        return add(event);
    }
    const std::string_view part = utf8_head(text, text_cap_ - sent);
    sent = text_cap_;
    if (!part.empty())
        add({{"type", type}, {"text", part}});
    add({{"type", "notice"},
         {"text", "further " + type + " is not relayed live (more than " + std::to_string(text_cap_) +
                      " bytes); the cell's end shows its head and tail"}});
}

void LiveLog::cell_finished(json answer) {
    if (!running_)
        return;
    running_ = false;
    answer.erase("session");
    answer["type"] = "end";
    answer["relayed_whole"] = stdout_sent_ < text_cap_ && stderr_sent_ < text_cap_;
    add(std::move(answer));
}

void LiveLog::reset() {
    // Whoever resumes from before the reset needs only the reset itself: the page starts over from it.
    events_.clear();
    cell_ = -1;
    running_ = false;
    add({{"type", "reset"}});
}

void LiveLog::add(json event) {
    event["cell"] = cell_;
    Event added{next_id_++, event.dump(-1, ' ', false, json::error_handler_t::replace)};
    std::vector<std::uint64_t> keys;
    for (const auto& entry : readers_)
        keys.push_back(entry.first);
    for (const std::uint64_t key : keys) {
        const auto found = readers_.find(key);
        if (found != readers_.end())
            found->second.on_event(added.id, added.data);
    }
    events_.push_back(std::move(added));
}

std::uint64_t LiveLog::subscribe(std::uint64_t after_id, Reader reader) {
    if (after_id != 0 && (after_id < generation_ || after_id > last_id())) {
        // Resumed from another log's id: nothing of this one has been seen.
        reader.on_event(generation_, R"({"type":"resync","cell":-1})");
        after_id = generation_;
    }
    for (const Event& event : events_)
        if (event.id > after_id)
            reader.on_event(event.id, event.data);
    const std::uint64_t key = next_reader_++;
    readers_.emplace(key, std::move(reader));
    return key;
}

}  // namespace cellblock::gateway::agent
