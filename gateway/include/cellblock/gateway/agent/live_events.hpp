#pragma once
// What a live page of an agent session shows (GET /agent/v1/sessions/{id}/events): the session's cells as a
// numbered list of events, each with an id that only grows. A cell appears when it starts, its output as the
// kernel publishes it, its outcome when it ends. A reader that connects gets everything from an id on (all of
// it, or after the Last-Event-ID it saw) and then each new event as it is added; all on the io thread.
//
// Ids outlive the process: a log's ids start past its `generation` (the wall clock in microseconds when it
// was made, below 2^53 so a page's JavaScript holds it exactly), so a log made after a gateway restart hands
// out ids above any its predecessor did (unless more than one event per microsecond of its life). A reader
// that resumes with an id this log did not hand out (from before the restart) first gets a "resync" event,
// whose id is the generation itself, and then the whole log: the page starts over from the session's record
// instead of skipping or repeating events.
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace cellblock::gateway::agent {

class LiveLog {
  public:
    // `text_cap`: stdout and stderr of one cell are relayed up to this many bytes each; the end event has
    // their head and tail and the saved file (like the agent API's answer).
    explicit LiveLog(std::size_t text_cap, std::uint64_t generation = clock_generation())
        : text_cap_(text_cap), generation_(generation), next_id_(generation + 1) {}
    // Microseconds since the epoch now: the generation of a log made now.
    static std::uint64_t clock_generation();
    // Cells of the history (reloaded from the store): one "recorded" event each.
    void seed(const std::vector<nlohmann::json>& cells);
    void cell_started(const std::string& code);
    // An execute's event (stdout, stderr, result, display, error, approval) for the running cell.
    void cell_event(const nlohmann::json& event);
    // The execute's answer (status, duration_ms, stdout/stderr head and tail, error, saved, notice,
    // state_lost).
    void cell_finished(nlohmann::json answer);
    void reset();

    // A reader: gets (id, JSON text) of each event in order; `closed` when the log goes (session deleted).
    struct Reader {
        std::function<void(std::uint64_t id, const std::string& data)> on_event;
        std::function<void()> closed;
    };
    // Replays every event after `after_id` at once, then each new one; returns a key for `unsubscribe`. An
    // `after_id` of 0 is a new reader; one this log did not hand out is a reader from an earlier log (above).
    std::uint64_t subscribe(std::uint64_t after_id, Reader reader);
    void unsubscribe(std::uint64_t key) { readers_.erase(key); }
    std::uint64_t last_id() const { return next_id_ - 1; }
    ~LiveLog();
    LiveLog(const LiveLog&) = delete;
    LiveLog& operator=(const LiveLog&) = delete;

  private:
    void add(nlohmann::json event);

    struct Event {
        std::uint64_t id;
        std::string data;
    };
    std::size_t text_cap_;
    std::uint64_t generation_;
    std::deque<Event> events_;
    std::uint64_t next_id_;
    std::int64_t cell_ = -1;  // the number of the newest cell (0-based), -1 before the first
    bool running_ = false;
    std::size_t stdout_sent_ = 0, stderr_sent_ = 0;
    std::map<std::uint64_t, Reader> readers_;
    std::uint64_t next_reader_ = 1;
};

}  // namespace cellblock::gateway::agent
