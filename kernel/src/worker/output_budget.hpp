// The per-execute output limit, which keeps the end of a long output as well as its beginning: the end
// of a log is where the error is. Text is published as it arrives until half the limit is used; after
// that each stream keeps only its last bytes (a quarter of the limit each), published when the request
// ends after a marker that says how much was left out. Rich outputs (displays, results) count against the
// same limit and are dropped whole once they would not fit.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace cellblock::kernel {

enum class OutputStream { stdout_stream = 0, stderr_stream = 1 };

class OutputBudget {
  public:
    explicit OutputBudget(std::uint64_t limit_bytes);  // 0 = unlimited

    // The part of `text` (valid UTF-8) to publish now; the rest is held as the stream's tail.
    std::string admit_text(OutputStream stream, std::string text);
    // Whether a rich output of `bytes` may be published now (counted if so).
    bool admit_rich(std::size_t bytes);
    // At the end of the request: the stream's held tail, preceded by a marker if bytes were left out.
    std::string take_tail(OutputStream stream);

    bool truncated() const noexcept;  // something was or is being left out
    std::uint64_t limit_bytes() const noexcept { return limit_; }
    std::uint64_t dropped_rich() const noexcept { return dropped_rich_; }

  private:
    struct Tail {
        bool holding = false;  // once text is held, later text of the stream is held too (keeps order)
        std::string text;
        std::uint64_t omitted_bytes = 0;
    };
    std::uint64_t held_bytes() const noexcept;

    std::uint64_t limit_;
    std::uint64_t live_limit_;
    std::uint64_t tail_limit_;
    std::uint64_t published_ = 0;
    std::uint64_t dropped_rich_ = 0;
    bool text_omitted_ = false;
    std::array<Tail, 2> tails_;
};

// The output limit of an execute whose client asked for `requested` bytes: more than the kernel's own
// limit is granted (the agent API saves whole outputs), up to max(own, 256 MiB) so the kernel's tail
// buffers stay bounded; 0 asks for that ceiling. A kernel without a limit (own == 0) stays without one.
std::uint64_t effective_output_limit(std::optional<std::uint64_t> requested,
                                     std::uint64_t own_limit) noexcept;

// Longest suffix of `text` (valid UTF-8) that is at most `max_bytes` long and starts on a code point.
std::string_view utf8_suffix(std::string_view text, std::size_t max_bytes) noexcept;

}  // namespace cellblock::kernel
