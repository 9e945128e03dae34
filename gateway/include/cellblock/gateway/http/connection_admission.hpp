#pragma once
// Which TCP connections the gateway keeps before they have authenticated, and when it accepts at all: the one
// owner of the rules that stop a crowd of idle, tokenless connections from starving authenticated clients and
// kernel starts of file descriptors ("Exhaustion before authentication").
//
//   - At construction the soft RLIMIT_NOFILE is raised to the hard limit (as nginx and Envoy do).
//   - A connection is "pending" from accept until its first request carries a valid token (or, with auth
//     off, until its first request's headers arrive). Pending connections are capped globally and per client
//     address. Over a cap the OLDEST pending connection (of that address, for the per-address cap) is closed
//     to make room, never the new one: every local agent shares 127.0.0.1 with a flood from this host, and a
//     client that sends its headers promptly must still be read. Closures are logged once per interval, not
//     per connection.
//   - Accepting pauses while fewer than `fd_reserve` descriptors are free, so a kernel start (ZMQ sockets,
//     pipes, pidfds) always finds some, and resumes when they come back.
#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>

#include "cellblock/gateway/common/config.hpp"
#include "cellblock/gateway/observability/log.hpp"

namespace cellblock::gateway {

class ConnectionAdmission {
  private:
    struct PendingCounts {
        struct Entry {
            std::string address;
            std::function<void()> close;  // closes the connection (set by it once it exists)
        };
        std::map<std::uint64_t, Entry> by_age;  // oldest first: ids grow with each accept
        std::unordered_map<std::string, std::size_t> by_address;
        std::uint64_t next_id = 0;
        std::size_t total() const { return by_age.size(); }
        std::uint64_t add(const std::string& address);
        void release(std::uint64_t id);
        // Closes the oldest pending connection (from `address` when given); false when none can be closed.
        bool close_oldest(const std::optional<std::string>& address);
    };

  public:
    // Holds one pending connection's place under the caps until it authenticates or closes.
    class PendingSlot {
      public:
        PendingSlot(std::shared_ptr<PendingCounts> counts, std::uint64_t id)
            : counts_(std::move(counts)), id_(id) {}
        PendingSlot(PendingSlot&&) noexcept = default;
        PendingSlot& operator=(PendingSlot&& other) noexcept {
            if (this != &other) {
                release();
                counts_ = std::move(other.counts_);
                id_ = other.id_;
            }
            return *this;
        }
        PendingSlot(const PendingSlot&) = delete;
        PendingSlot& operator=(const PendingSlot&) = delete;
        ~PendingSlot() { release(); }
        // The connection authenticated: it no longer counts against the caps.
        void release() {
            if (auto counts = std::exchange(counts_, nullptr))
                counts->release(id_);
        }
        // How the admission closes this connection to make room for a newer one (called on the io thread).
        void on_close_request(std::function<void()> close) {
            if (!counts_)
                return;
            if (auto found = counts_->by_age.find(id_); found != counts_->by_age.end())
                found->second.close = std::move(close);
        }

      private:
        std::shared_ptr<PendingCounts> counts_;
        std::uint64_t id_ = 0;
    };

    ConnectionAdmission(boost::asio::io_context& io, const Logger& logger, const GatewayConfig& config);

    // A newly accepted connection from `address`: its slot, after closing the oldest pending connection when
    // a cap is reached; nullopt only when none could be closed (then close this one now).
    std::optional<PendingSlot> admit(const std::string& address);
    // False while fewer than the reserve of descriptors are free: do not accept now, ask again shortly.
    bool may_accept();

    std::size_t max_pending() const { return max_pending_; }
    std::size_t max_pending_per_address() const { return max_pending_per_address_; }
    std::size_t file_limit() const { return file_limit_; }

  private:
    void note_refusal(bool per_address, const std::string& address);
    void report_refusals();
    std::size_t free_descriptors();

    const Logger& logger_;
    std::size_t file_limit_ = 0;  // soft RLIMIT_NOFILE after raising it
    std::size_t fd_reserve_ = 0;
    std::size_t max_pending_ = 0;
    std::size_t max_pending_per_address_ = 0;
    std::shared_ptr<PendingCounts> pending_ = std::make_shared<PendingCounts>();

    // Refusals since the last log line: the first is reported at once, later ones at the end of the interval
    // (one line per interval, whatever the number of connections).
    static constexpr std::chrono::seconds refusal_log_interval{10};
    std::optional<std::chrono::steady_clock::time_point> last_refusal_log_;
    boost::asio::steady_timer refusal_report_timer_;
    bool refusal_report_due_ = false;
    std::size_t refused_global_ = 0, refused_per_address_ = 0;
    std::string last_refused_address_;

    // Counting /proc/self/fd costs one entry per open descriptor, so a count is reused while it is recent and
    // far from the reserve (connections admitted since are subtracted).
    std::optional<std::chrono::steady_clock::time_point> counted_at_;
    std::size_t free_at_count_ = 0;
    std::size_t admitted_since_count_ = 0;
    bool paused_ = false;
    bool count_unavailable_logged_ = false;
};

}  // namespace cellblock::gateway
