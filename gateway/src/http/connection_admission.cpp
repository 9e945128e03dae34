#include "cellblock/gateway/http/connection_admission.hpp"

#include <dirent.h>
#include <sys/resource.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>

namespace cellblock::gateway {

namespace {

constexpr std::size_t automatic_pending_ceiling = 4096;

std::size_t as_count(rlim_t value) {
    if (value == RLIM_INFINITY || value > std::numeric_limits<int>::max())
        return std::numeric_limits<int>::max();
    return static_cast<std::size_t>(value);
}

// Raises the soft descriptor limit to the hard one and returns the soft limit in force afterwards.
std::size_t raise_file_limit(const Logger& logger) {
    rlimit limit{};
    if (::getrlimit(RLIMIT_NOFILE, &limit) != 0) {
        logger.warn("file_limit_unknown",
                    {{"error", std::string("getrlimit(RLIMIT_NOFILE): ") + std::strerror(errno)}});
        return 1024;
    }
    const rlim_t before = limit.rlim_cur;
    if (limit.rlim_cur != limit.rlim_max) {
        limit.rlim_cur = limit.rlim_max;
        if (::setrlimit(RLIMIT_NOFILE, &limit) != 0) {
            logger.warn("file_limit_not_raised",
                        {{"soft", as_count(before)},
                         {"hard", as_count(limit.rlim_max)},
                         {"error", std::string("setrlimit(RLIMIT_NOFILE): ") + std::strerror(errno)}});
            return as_count(before);
        }
    }
    logger.info("file_limit", {{"soft", as_count(limit.rlim_cur)},
                               {"hard", as_count(limit.rlim_max)},
                               {"soft_at_start", as_count(before)}});
    return as_count(limit.rlim_cur);
}

std::optional<std::size_t> count_open_descriptors() {
    std::unique_ptr<DIR, int (*)(DIR*)> directory(::opendir("/proc/self/fd"), &::closedir);
    if (!directory)
        return std::nullopt;
    std::size_t entries = 0;
    while (const dirent* entry = ::readdir(directory.get())) {
        if (std::strcmp(entry->d_name, ".") != 0 && std::strcmp(entry->d_name, "..") != 0)
            ++entries;
    }
    return entries > 0 ? entries - 1 : 0;  // the directory's own descriptor is listed too
}

}  // namespace

std::uint64_t ConnectionAdmission::PendingCounts::add(const std::string& address) {
    const std::uint64_t id = next_id++;
    by_age.emplace(id, Entry{address, nullptr});
    ++by_address[address];
    return id;
}

void ConnectionAdmission::PendingCounts::release(std::uint64_t id) {
    auto found = by_age.find(id);
    if (found == by_age.end())
        return;  // closed to make room: counted out already
    auto from = by_address.find(found->second.address);
    if (from != by_address.end() && --from->second == 0)
        by_address.erase(from);
    by_age.erase(found);
}

bool ConnectionAdmission::PendingCounts::close_oldest(const std::optional<std::string>& address) {
    for (auto& [id, entry] : by_age) {
        if (!entry.close || (address && entry.address != *address))
            continue;
        auto close = std::move(entry.close);
        release(id);  // before closing: the connection's own release then finds nothing
        close();
        return true;
    }
    return false;
}

ConnectionAdmission::ConnectionAdmission(boost::asio::io_context& io, const Logger& logger,
                                         const GatewayConfig& config)
    : logger_(logger),
      file_limit_(raise_file_limit(logger)),
      fd_reserve_(config.fd_reserve),
      refusal_report_timer_(io) {
    const std::size_t usable = file_limit_ > fd_reserve_ ? file_limit_ - fd_reserve_ : 0;
    max_pending_ = config.max_unauthenticated_connections > 0
                       ? config.max_unauthenticated_connections
                       : std::max<std::size_t>(1, std::min(automatic_pending_ceiling, usable / 2));
    max_pending_per_address_ = config.max_unauthenticated_per_address > 0
                                   ? std::min(config.max_unauthenticated_per_address, max_pending_)
                                   : max_pending_;
    logger_.info("connection_admission", {{"max_unauthenticated_connections", max_pending_},
                                          {"max_unauthenticated_per_address", max_pending_per_address_},
                                          {"fd_reserve", fd_reserve_},
                                          {"file_limit", file_limit_}});
}

std::optional<ConnectionAdmission::PendingSlot> ConnectionAdmission::admit(const std::string& address) {
    ++admitted_since_count_;
    if (pending_->total() >= max_pending_) {
        note_refusal(false, address);
        if (!pending_->close_oldest(std::nullopt))
            return std::nullopt;
    }
    if (auto from = pending_->by_address.find(address);
        from != pending_->by_address.end() && from->second >= max_pending_per_address_) {
        note_refusal(true, address);
        if (!pending_->close_oldest(address))
            return std::nullopt;
    }
    return PendingSlot(pending_, pending_->add(address));
}

void ConnectionAdmission::note_refusal(bool per_address, const std::string& address) {
    ++(per_address ? refused_per_address_ : refused_global_);
    last_refused_address_ = address;
    const auto now = std::chrono::steady_clock::now();
    if (!last_refusal_log_ || now - *last_refusal_log_ >= refusal_log_interval)
        return report_refusals();
    if (refusal_report_due_)
        return;
    refusal_report_due_ = true;
    refusal_report_timer_.expires_at(*last_refusal_log_ + refusal_log_interval);
    refusal_report_timer_.async_wait([this](const boost::system::error_code& error) {
        if (!error)
            report_refusals();
    });
}

void ConnectionAdmission::report_refusals() {
    refusal_report_due_ = false;
    if (refused_global_ == 0 && refused_per_address_ == 0)
        return;
    last_refusal_log_ = std::chrono::steady_clock::now();
    logger_.warn("unauthenticated_connections_refused",
                 {{"over_global_cap", refused_global_},
                  {"over_address_cap", refused_per_address_},
                  {"last_address", last_refused_address_},
                  {"pending", pending_->total()},
                  {"closed", "the oldest pending connections"},
                  {"max_unauthenticated_connections", max_pending_},
                  {"max_unauthenticated_per_address", max_pending_per_address_},
                  {"next_report_after_s", refusal_log_interval.count()}});
    refused_global_ = refused_per_address_ = 0;
}

std::size_t ConnectionAdmission::free_descriptors() {
    const auto now = std::chrono::steady_clock::now();
    const std::size_t estimate =
        free_at_count_ > admitted_since_count_ ? free_at_count_ - admitted_since_count_ : 0;
    if (counted_at_ && now - *counted_at_ < std::chrono::seconds(1) && estimate > 4 * fd_reserve_)
        return estimate;
    const auto open = count_open_descriptors();
    if (!open) {
        if (!count_unavailable_logged_) {
            logger_.warn("fd_count_unavailable",
                         {{"error", std::string("opendir(/proc/self/fd): ") + std::strerror(errno)},
                          {"effect", "the descriptor reserve is not enforced"}});
            count_unavailable_logged_ = true;
        }
        return std::numeric_limits<std::size_t>::max();
    }
    counted_at_ = now;
    admitted_since_count_ = 0;
    free_at_count_ = file_limit_ > *open ? file_limit_ - *open : 0;
    return free_at_count_;
}

bool ConnectionAdmission::may_accept() {
    if (fd_reserve_ == 0)
        return true;
    const std::size_t free = free_descriptors();
    const bool enough = free > fd_reserve_;
    if (enough == paused_) {
        paused_ = !enough;
        if (paused_)
            logger_.warn("accept_paused", {{"free_descriptors", free},
                                           {"fd_reserve", fd_reserve_},
                                           {"file_limit", file_limit_},
                                           {"pending", pending_->total()}});
        else
            logger_.warn("accept_resumed", {{"free_descriptors", free}, {"fd_reserve", fd_reserve_}});
    }
    return enough;
}

}  // namespace cellblock::gateway
