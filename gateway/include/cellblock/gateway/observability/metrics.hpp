#pragma once
// Prometheus metrics of the gateway: tiny counter, gauge and histogram types, a registry that
// renders them in the text exposition format 0.0.4, and GatewayMetrics, the one place where the gateway's
// series are named. Everything runs on the io_context thread (no atomics, no locks). Gauges that describe
// current state (kernels and agent sessions by state, the warm pool) are not mirrored: their owners register
// a sampler that the registry calls at scrape time, so the figures cannot drift from the truth.
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace cellblock::gateway {

class Counter {
  public:
    // Throws std::invalid_argument for a negative amount: a counter only goes up.
    void increment(double amount = 1);
    double value() const { return value_; }

  private:
    double value_ = 0;
};

class Gauge {
  public:
    void set(double value) { value_ = value; }
    void add(double amount) { value_ += amount; }
    double value() const { return value_; }

  private:
    double value_ = 0;
};

class Histogram {
  public:
    // `upper_bounds`: finite, strictly increasing (std::invalid_argument otherwise); +Inf is implicit.
    explicit Histogram(std::vector<double> upper_bounds);
    void observe(double value);
    const std::vector<double>& upper_bounds() const { return upper_bounds_; }
    // Observations <= upper_bounds()[i] (cumulative, as exposed), one entry per bound.
    std::vector<std::uint64_t> cumulative_counts() const;
    std::uint64_t count() const { return count_; }
    double sum() const { return sum_; }

  private:
    std::vector<double> upper_bounds_;
    std::vector<std::uint64_t> bucket_counts_;  // per bucket, not cumulative
    std::uint64_t count_ = 0;
    double sum_ = 0;
};

// The series of one metric that differ by the value of a single label (e.g. outcome="ok").
template <class Metric>
class LabeledFamily {
  public:
    explicit LabeledFamily(std::string label_name) : label_name_(std::move(label_name)) {}
    // The series for `label_value`, created (at zero) on first use.
    Metric& with(const std::string& label_value) { return series_[label_value]; }
    const std::string& label_name() const { return label_name_; }
    const std::map<std::string, Metric>& series() const { return series_; }

  private:
    std::string label_name_;
    std::map<std::string, Metric> series_;
};

using CounterFamily = LabeledFamily<Counter>;

// One sample of a gauge computed at scrape time: label value and value.
using GaugeSample = std::pair<std::string, double>;

class MetricsRegistry {
  public:
    MetricsRegistry();
    ~MetricsRegistry();
    MetricsRegistry(const MetricsRegistry&) = delete;
    MetricsRegistry& operator=(const MetricsRegistry&) = delete;

    // Names must match [a-zA-Z_:][a-zA-Z0-9_:]* and be unique, label names [a-zA-Z_][a-zA-Z0-9_]* (not
    // starting with "__"); std::invalid_argument otherwise. The returned references live as long as the
    // registry. Metrics are rendered in the order they were added.
    Counter& counter(std::string name, std::string help);
    CounterFamily& counter_family(std::string name, std::string help, const std::string& label_name);
    Gauge& gauge(std::string name, std::string help);
    Histogram& histogram(std::string name, std::string help, std::vector<double> upper_bounds);

    struct Entry;
    // A gauge whose samples its owner computes when /metrics is scraped. It is rendered while the returned
    // handle lives (destroy it before whatever the sampler reads; either may outlive the other safely).
    class SamplerHandle {
      public:
        SamplerHandle() = default;
        SamplerHandle(SamplerHandle&&) noexcept = default;
        SamplerHandle& operator=(SamplerHandle&& other) noexcept;
        ~SamplerHandle();

      private:
        friend class MetricsRegistry;
        explicit SamplerHandle(std::weak_ptr<Entry> entry) : entry_(std::move(entry)) {}
        void release();
        std::weak_ptr<Entry> entry_;
    };
    // Without a label (`label_name` empty) the sampler returns one sample whose label value is ignored.
    [[nodiscard]] SamplerHandle sampled_gauge(std::string name, std::string help, std::string label_name,
                                              std::function<std::vector<GaugeSample>()> sampler);

    // The text exposition format 0.0.4: # HELP and # TYPE lines, then the samples of each metric.
    std::string render() const;
    static constexpr std::string_view content_type = "text/plain; version=0.0.4; charset=utf-8";

  private:
    Entry& add(std::string name, std::string help, std::string label_name);
    std::vector<std::shared_ptr<Entry>> entries_;
};

// Shortest text that reads back as `value` (Go's ParseFloat accepts it), +Inf, -Inf or NaN.
std::string format_metric_value(double value);
// Label values escape backslash, double quote and newline; HELP text escapes backslash and newline.
std::string escape_label_value(std::string_view value);

// The gateway's own series (names, help texts, label values, buckets): gateway/README.md lists them.
// Owned by main(), handed to whoever counts through GatewayServices / AgentSessionServices / the HTTP server.
class GatewayMetrics {
  public:
    GatewayMetrics();

    MetricsRegistry registry;

    // Agent executes by how they ended (agent::execute_outcome) and how long those that reached a kernel
    // took.
    CounterFamily& agent_executes;
    CounterFamily& tenant_executes;  // by tenant (the operator's own executes are not in it)
    Histogram& agent_execute_duration;
    // A request the warm pool could serve that found a kernel there (hit) or none (miss: a cold start).
    Counter& warm_pool_hits;
    Counter& warm_pool_misses;
    // Kernel processes and sandboxed workers that could not be started, by cause.
    CounterFamily& launch_failures;
    Gauge& websocket_open;
    Counter& websocket_accepted;
    // Payload bytes written to clients: WebSocket messages and streamed (chunked) HTTP bodies.
    CounterFamily& streamed_bytes;

    // Label values; each is present from the start (at 0) so rates and alerts work before the first event.
    static constexpr std::string_view outcome_ok = "ok", outcome_error = "error", outcome_timeout = "timeout",
                                      outcome_interrupted = "interrupted",
                                      outcome_kernel_died = "kernel_died",
                                      outcome_worker_died = "worker_died",
                                      outcome_sandbox_unavailable = "sandbox_unavailable",
                                      outcome_kernel_unavailable = "kernel_unavailable",
                                      outcome_session_closed = "session_closed",
                                      outcome_abandoned = "abandoned";
    static constexpr std::string_view cause_spawn_failed = "spawn_failed",
                                      cause_exited_during_start = "exited_during_start",
                                      cause_start_timeout = "start_timeout",
                                      cause_workspace_failed = "workspace_failed",
                                      cause_sandbox_unavailable = "sandbox_unavailable";
    static constexpr std::string_view transport_websocket = "websocket",
                                      transport_http_stream = "http_stream";

    void count_launch_failure(std::string_view cause) {
        launch_failures.with(std::string(cause)).increment();
    }
    void count_streamed(std::string_view transport, std::size_t bytes) {
        streamed_bytes.with(std::string(transport)).increment(static_cast<double>(bytes));
    }
};

}  // namespace cellblock::gateway
