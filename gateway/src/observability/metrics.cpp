#include "cellblock/gateway/observability/metrics.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <set>
#include <stdexcept>
#include <variant>

namespace cellblock::gateway {

namespace {

bool valid_name(std::string_view name, bool colon_allowed) {
    if (name.empty())
        return false;
    auto allowed = [colon_allowed](char c, bool first) {
        const bool letter =
            (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || (colon_allowed && c == ':');
        return letter || (!first && c >= '0' && c <= '9');
    };
    for (std::size_t at = 0; at < name.size(); ++at)
        if (!allowed(name[at], at == 0))
            return false;
    return true;
}

std::string escape_help(std::string_view help) {
    std::string escaped;
    for (char c : help) {
        if (c == '\\')
            escaped += "\\\\";
        else if (c == '\n')
            escaped += "\\n";
        else
            escaped.push_back(c);
    }
    return escaped;
}

void append_sample(std::string& out, std::string_view name, std::string_view labels, double value) {
    out += name;
    if (!labels.empty()) {
        out.push_back('{');
        out += labels;
        out.push_back('}');
    }
    out.push_back(' ');
    out += format_metric_value(value);
    out.push_back('\n');
}

std::string label_pair(std::string_view name, std::string_view value) {
    return std::string(name) + "=\"" + escape_label_value(value) + "\"";
}

}  // namespace

void Counter::increment(double amount) {
    if (!(amount >= 0))
        throw std::invalid_argument("a counter cannot decrease (increment by " + std::to_string(amount) +
                                    ")");
    value_ += amount;
}

Histogram::Histogram(std::vector<double> upper_bounds) : upper_bounds_(std::move(upper_bounds)) {
    for (std::size_t at = 0; at < upper_bounds_.size(); ++at) {
        if (!std::isfinite(upper_bounds_[at]))
            throw std::invalid_argument("histogram bounds must be finite (+Inf is implicit)");
        if (at > 0 && !(upper_bounds_[at] > upper_bounds_[at - 1]))
            throw std::invalid_argument("histogram bounds must be strictly increasing");
    }
    bucket_counts_.assign(upper_bounds_.size() + 1, 0);
}

void Histogram::observe(double value) {
    // The first bucket whose upper bound is >= value; the last one (+Inf) takes the rest and NaN.
    const auto bound = std::isnan(value)
                           ? upper_bounds_.end()
                           : std::lower_bound(upper_bounds_.begin(), upper_bounds_.end(), value);
    ++bucket_counts_[static_cast<std::size_t>(bound - upper_bounds_.begin())];
    ++count_;
    sum_ += value;
}

std::vector<std::uint64_t> Histogram::cumulative_counts() const {
    std::vector<std::uint64_t> cumulative;
    std::uint64_t running = 0;
    for (std::size_t at = 0; at < upper_bounds_.size(); ++at) {
        running += bucket_counts_[at];
        cumulative.push_back(running);
    }
    return cumulative;
}

std::string format_metric_value(double value) {
    if (std::isnan(value))
        return "NaN";
    if (std::isinf(value))
        return value > 0 ? "+Inf" : "-Inf";
    char buffer[64];
    const auto result = std::to_chars(buffer, buffer + sizeof buffer, value);
    return std::string(buffer, result.ptr);
}

std::string escape_label_value(std::string_view value) {
    std::string escaped;
    for (char c : value) {
        if (c == '\\')
            escaped += "\\\\";
        else if (c == '"')
            escaped += "\\\"";
        else if (c == '\n')
            escaped += "\\n";
        else
            escaped.push_back(c);
    }
    return escaped;
}

// ------------------------------------------------------------------------------------------------ registry

struct MetricsRegistry::Entry {
    std::string name, help, label_name;
    using Sampler = std::function<std::vector<GaugeSample>()>;
    std::variant<Counter, CounterFamily, Gauge, Histogram, Sampler> metric;
};

MetricsRegistry::MetricsRegistry() = default;
MetricsRegistry::~MetricsRegistry() = default;

MetricsRegistry::Entry& MetricsRegistry::add(std::string name, std::string help, std::string label_name) {
    if (!valid_name(name, true))
        throw std::invalid_argument("invalid metric name '" + name + "'");
    if (!label_name.empty() && (!valid_name(label_name, false) || label_name.starts_with("__")))
        throw std::invalid_argument("invalid label name '" + label_name + "' of " + name);
    for (const auto& entry : entries_)
        if (entry->name == name)
            throw std::invalid_argument("metric " + name + " is registered twice");
    auto entry = std::make_shared<Entry>();
    entry->name = std::move(name);
    entry->help = std::move(help);
    entry->label_name = std::move(label_name);
    entries_.push_back(entry);
    return *entry;
}

Counter& MetricsRegistry::counter(std::string name, std::string help) {
    Entry& entry = add(std::move(name), std::move(help), {});
    return entry.metric.emplace<Counter>();
}

CounterFamily& MetricsRegistry::counter_family(std::string name, std::string help,
                                               const std::string& label_name) {
    if (label_name.empty())
        throw std::invalid_argument("a counter family of " + name + " needs a label name");
    Entry& entry = add(std::move(name), std::move(help), label_name);
    return entry.metric.emplace<CounterFamily>(label_name);
}

Gauge& MetricsRegistry::gauge(std::string name, std::string help) {
    Entry& entry = add(std::move(name), std::move(help), {});
    return entry.metric.emplace<Gauge>();
}

Histogram& MetricsRegistry::histogram(std::string name, std::string help, std::vector<double> upper_bounds) {
    Histogram histogram(std::move(upper_bounds));  // validated before the name is taken
    Entry& entry = add(std::move(name), std::move(help), {});
    return entry.metric.emplace<Histogram>(std::move(histogram));
}

MetricsRegistry::SamplerHandle MetricsRegistry::sampled_gauge(
    std::string name, std::string help, std::string label_name,
    std::function<std::vector<GaugeSample>()> sampler) {
    Entry& entry = add(std::move(name), std::move(help), std::move(label_name));
    entry.metric = std::move(sampler);
    return SamplerHandle(entries_.back());
}

void MetricsRegistry::SamplerHandle::release() {
    if (auto entry = entry_.lock())
        entry->metric = Entry::Sampler();  // rendered no more; the name stays taken
    entry_.reset();
}

MetricsRegistry::SamplerHandle& MetricsRegistry::SamplerHandle::operator=(SamplerHandle&& other) noexcept {
    if (this != &other) {
        release();
        entry_ = std::move(other.entry_);
    }
    return *this;
}

MetricsRegistry::SamplerHandle::~SamplerHandle() {
    release();
}

std::string MetricsRegistry::render() const {
    std::string out;
    for (const auto& entry : entries_) {
        const std::string& name = entry->name;
        auto header = [&](std::string_view type) {
            out += "# HELP " + name + " " + escape_help(entry->help) + "\n";
            out += "# TYPE " + name + " ";
            out += type;
            out.push_back('\n');
        };
        if (const auto* counter = std::get_if<Counter>(&entry->metric)) {
            header("counter");
            append_sample(out, name, {}, counter->value());
        } else if (const auto* family = std::get_if<CounterFamily>(&entry->metric)) {
            header("counter");
            for (const auto& [label_value, series] : family->series())
                append_sample(out, name, label_pair(family->label_name(), label_value), series.value());
        } else if (const auto* gauge = std::get_if<Gauge>(&entry->metric)) {
            header("gauge");
            append_sample(out, name, {}, gauge->value());
        } else if (const auto* histogram = std::get_if<Histogram>(&entry->metric)) {
            header("histogram");
            const auto cumulative = histogram->cumulative_counts();
            for (std::size_t at = 0; at < cumulative.size(); ++at)
                append_sample(out, name + "_bucket",
                              label_pair("le", format_metric_value(histogram->upper_bounds()[at])),
                              static_cast<double>(cumulative[at]));
            append_sample(out, name + "_bucket", label_pair("le", "+Inf"),
                          static_cast<double>(histogram->count()));
            append_sample(out, name + "_sum", {}, histogram->sum());
            append_sample(out, name + "_count", {}, static_cast<double>(histogram->count()));
        } else if (const auto* sampler = std::get_if<Entry::Sampler>(&entry->metric); sampler && *sampler) {
            header("gauge");
            if (entry->label_name.empty()) {
                const auto samples = (*sampler)();
                append_sample(out, name, {}, samples.empty() ? 0.0 : samples.front().second);
                continue;
            }
            std::set<std::string> seen;  // a repeated label value would make the exposition invalid
            for (const auto& [label_value, value] : (*sampler)())
                if (seen.insert(label_value).second)
                    append_sample(out, name, label_pair(entry->label_name, label_value), value);
        }
    }
    return out;
}

// ------------------------------------------------------------------------------------------ gateway series

namespace {
// Agent executes run from milliseconds (print) to the session's time limit (minutes).
const std::vector<double> execute_duration_buckets = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1,
                                                      2.5,   5,    10,    30,   60,  120,  300};
}  // namespace

GatewayMetrics::GatewayMetrics()
    : agent_executes(registry.counter_family(
          "cellblock_agent_executes_total",
          "Agent executes (REST, NDJSON, MCP) by how they ended; see gateway/README.md for each outcome.",
          "outcome")),
      tenant_executes(registry.counter_family("cellblock_tenant_executes_total",
                                              "Agent executes of tenants' sessions, by tenant.", "tenant")),
      agent_execute_duration(registry.histogram("cellblock_agent_execute_duration_seconds",
                                                "Time from sending an agent execute to its kernel until its "
                                                "answer, for executes that reached a kernel.",
                                                execute_duration_buckets)),
      warm_pool_hits(registry.counter("cellblock_warm_pool_hits_total",
                                      "Kernel requests the warm pool could serve that got a pooled kernel.")),
      warm_pool_misses(registry.counter(
          "cellblock_warm_pool_misses_total",
          "Kernel requests the warm pool could serve that found it empty and started a kernel cold.")),
      launch_failures(registry.counter_family(
          "cellblock_launch_failures_total",
          "Kernel processes and sandboxed Python workers that could not be started, by cause.", "cause")),
      websocket_open(
          registry.gauge("cellblock_websocket_connections_open", "WebSocket connections open now.")),
      websocket_accepted(registry.counter("cellblock_websocket_connections_accepted_total",
                                          "WebSocket connections accepted (upgrade completed).")),
      streamed_bytes(registry.counter_family(
          "cellblock_streamed_bytes_total",
          "Payload bytes written to clients: WebSocket messages and streamed (chunked) HTTP bodies.",
          "transport")) {
    for (std::string_view outcome : {outcome_ok, outcome_error, outcome_timeout, outcome_interrupted,
                                     outcome_kernel_died, outcome_worker_died, outcome_sandbox_unavailable,
                                     outcome_kernel_unavailable, outcome_session_closed, outcome_abandoned})
        agent_executes.with(std::string(outcome));
    for (std::string_view cause : {cause_spawn_failed, cause_exited_during_start, cause_start_timeout,
                                   cause_workspace_failed, cause_sandbox_unavailable})
        launch_failures.with(std::string(cause));
    for (std::string_view transport : {transport_websocket, transport_http_stream})
        streamed_bytes.with(std::string(transport));
}

}  // namespace cellblock::gateway
