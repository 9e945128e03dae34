// Input history with the shapes the protocol specifies: [session, line, input], or
// [session, line, [input, output]] with output=True. xeus 2.4.1's in-memory manager returns strings and
// 4-element entries, and the core stores every input as line 1, so the interpreter records inputs itself
// (with the real execution count) and the core's store_inputs calls are ignored.
#pragma once

#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>
#include <xeus/xhistory_manager.hpp>

namespace cellblock::kernel {

class HistoryManager final : public xeus::xhistory_manager {
  public:
    // The session number reported in entries; 0 in a range request also means "this session".
    static constexpr int session_number = 1;

    // Called by the interpreter after each stored execute. `output` is the text/plain result, if any.
    void record(int line, std::string input, std::optional<std::string> output);

  private:
    struct Entry {
        int line;
        std::string input;
        std::optional<std::string> output;
    };

    void configure_impl() override {}
    void store_inputs_impl(int, int, const std::string&, const std::string&) override {}
    nl::json get_tail_impl(int n, bool raw, bool output) const override;
    nl::json get_range_impl(int session, int start, int stop, bool raw, bool output) const override;
    nl::json search_impl(const std::string& pattern, bool raw, bool output, int n,
                         bool unique) const override;

    nl::json to_json(const Entry& entry, bool output) const;
    static nl::json reply(nl::json history);

    mutable std::mutex mutex_;  // history_request may arrive on control while the shell thread records
    std::vector<Entry> entries_;
};

}  // namespace cellblock::kernel
