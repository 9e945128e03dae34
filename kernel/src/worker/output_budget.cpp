#include "worker/output_budget.hpp"

#include <algorithm>

#include "common/utf8_decoder.hpp"

namespace cellblock::kernel {

std::string_view utf8_suffix(std::string_view text, std::size_t max_bytes) noexcept {
    if (text.size() <= max_bytes) {
        return text;
    }
    std::size_t start = text.size() - max_bytes;
    while (start < text.size() && (static_cast<unsigned char>(text[start]) & 0xC0) == 0x80) {
        ++start;
    }
    return text.substr(start);
}

std::uint64_t effective_output_limit(std::optional<std::uint64_t> requested,
                                     std::uint64_t own_limit) noexcept {
    constexpr std::uint64_t ceiling = 256u << 20;
    if (!requested || own_limit == 0) {
        return own_limit;
    }
    const std::uint64_t most = std::max(own_limit, ceiling);
    return *requested == 0 ? most : std::min(*requested, most);
}

OutputBudget::OutputBudget(std::uint64_t limit_bytes)
    : limit_(limit_bytes), live_limit_(limit_bytes - limit_bytes / 2), tail_limit_(limit_bytes / 4) {}

std::uint64_t OutputBudget::held_bytes() const noexcept {
    return tails_[0].text.size() + tails_[1].text.size();
}

std::string OutputBudget::admit_text(OutputStream stream, std::string text) {
    if (limit_ == 0 || text.empty()) {
        return text;
    }
    Tail& tail = tails_[static_cast<int>(stream)];
    std::string live;
    if (!tail.holding) {
        const std::uint64_t room = published_ < live_limit_ ? live_limit_ - published_ : 0;
        if (text.size() <= room) {
            published_ += text.size();
            return text;
        }
        live = std::string(utf8_prefix(text, static_cast<std::size_t>(room)));
        published_ += live.size();
        text.erase(0, live.size());
        tail.holding = true;
    }
    tail.text += text;
    if (tail.text.size() > tail_limit_) {
        const std::string_view kept = utf8_suffix(tail.text, static_cast<std::size_t>(tail_limit_));
        tail.omitted_bytes += tail.text.size() - kept.size();
        tail.text.erase(0, tail.text.size() - kept.size());
    }
    return live;
}

bool OutputBudget::admit_rich(std::size_t bytes) {
    if (limit_ == 0) {
        return true;
    }
    if (published_ + held_bytes() + bytes > limit_) {
        ++dropped_rich_;
        return false;
    }
    published_ += bytes;
    return true;
}

std::string OutputBudget::take_tail(OutputStream stream) {
    Tail& tail = tails_[static_cast<int>(stream)];
    std::string out;
    if (tail.omitted_bytes > 0) {
        text_omitted_ = true;
        out = "\n[cellblock] Output truncated: " + std::to_string(tail.omitted_bytes) +
              " bytes of this stream were left out here (the output limit is " + std::to_string(limit_) +
              " bytes per execute; the first and the last bytes are kept).\n";
    }
    out += tail.text;
    published_ += tail.text.size();
    tail = Tail{};
    return out;
}

bool OutputBudget::truncated() const noexcept {
    return text_omitted_ || dropped_rich_ > 0 || tails_[0].omitted_bytes > 0 || tails_[1].omitted_bytes > 0;
}

}  // namespace cellblock::kernel
