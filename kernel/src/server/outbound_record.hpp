// A bounded record of what the kernel sent to its clients (IOPub, shell and stdin, after the fixups: exactly
// what clients got), so that a gateway that was down while a cell ran can fetch what it missed
// (cellblock_replay_request, answered by the kernel server). Oldest messages are dropped first when a bound
// is reached, and the drops are counted so the gateway can show a gap instead of hiding it.
//
// Single owner: only the kernel server's I/O thread touches it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "cellblock/contract/base64.hpp"

namespace cellblock::kernel {

struct RecordLimits {
    std::size_t max_bytes = std::size_t{8} << 20;
    std::size_t max_messages = 10000;

    bool enabled() const noexcept { return max_bytes > 0 && max_messages > 0; }

    // From CELLBLOCK_RECORD_BYTES and CELLBLOCK_RECORD_MESSAGES (null = unset = default; 0 disables).
    // Throws std::invalid_argument naming the variable for anything but a non-negative integer.
    static RecordLimits from_environment(const char* bytes, const char* messages);
};

// One outgoing message, its parts as the JSON texts that went on the wire.
struct RecordedMessage {
    std::string channel;  // "iopub", "shell" or "stdin"
    std::string header;
    std::string parent_header;
    std::string metadata;
    std::string content;
    std::vector<std::string> buffers;  // raw bytes

    std::size_t bytes() const noexcept;
};

class OutboundRecord {
  public:
    explicit OutboundRecord(RecordLimits limits) : limits_(limits) {}

    // Records `message`, whose header has `msg_id` (the sender knows it: reading it back from the header
    // text cost a JSON parse per message), then drops the oldest messages until both bounds hold again; a
    // single message larger than the byte bound is therefore dropped at once.
    void add(std::string msg_id, RecordedMessage message);

    // The content of a cellblock_replay_reply: every recorded message after the one whose msg_id is
    // `after` (found: true), or every recorded message when `after` is empty (found: true) or not in the
    // record (found: false: dropped, or never sent).
    nlohmann::json replay(const std::optional<std::string>& after) const;

    bool enabled() const noexcept { return limits_.enabled(); }
    std::size_t size() const noexcept { return entries_.size(); }
    std::size_t bytes() const noexcept { return bytes_; }
    std::uint64_t dropped() const noexcept { return dropped_; }

  private:
    struct Entry {
        std::string msg_id;
        RecordedMessage message;
    };
    RecordLimits limits_;
    std::deque<Entry> entries_;
    std::size_t bytes_ = 0;
    std::uint64_t dropped_ = 0;
};

// Standard base64, as Jupyter carries binary buffers in JSON: the contract's
// (contract/include/cellblock/contract/base64.hpp).
using contract::base64_encode;

}  // namespace cellblock::kernel
