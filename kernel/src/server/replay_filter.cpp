#include "server/replay_filter.hpp"

namespace cellblock::kernel {

bool ReplayFilter::first_time(std::string_view signature) {
    std::string key(signature);
    if (seen_.contains(key)) {
        return false;
    }
    seen_.insert(key);
    order_.push_back(std::move(key));
    if (order_.size() > capacity_) {
        seen_.erase(order_.front());
        order_.pop_front();
    }
    return true;
}

}  // namespace cellblock::kernel
