// Replayed messages: a signature seen before is refused (xeus 2.4.1 keeps no replay history).
#pragma once

#include <cstddef>
#include <deque>
#include <string>
#include <string_view>
#include <unordered_set>

namespace cellblock::kernel {

// Remembers the last `capacity` signatures; a message whose signature was already seen is a replay.
class ReplayFilter {
  public:
    explicit ReplayFilter(std::size_t capacity) : capacity_(capacity) {}
    // True the first time a signature is offered, false for a replay.
    bool first_time(std::string_view signature);

  private:
    std::size_t capacity_;
    std::deque<std::string> order_;
    std::unordered_set<std::string> seen_;
};

}  // namespace cellblock::kernel
