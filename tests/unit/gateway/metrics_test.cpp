// The metrics registry and its Prometheus text exposition (format 0.0.4), as a scraper reads it.
#include "cellblock/gateway/observability/metrics.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <regex>
#include <sstream>

using namespace cellblock::gateway;

namespace {

// The sample lines of `metric` (name or name{labels}) in `text`, "name{labels} value" → value text.
std::string sample(const std::string& text, const std::string& series) {
    std::istringstream lines(text);
    for (std::string line; std::getline(lines, line);)
        if (line.starts_with(series + " "))
            return line.substr(series.size() + 1);
    return "<missing " + series + ">";
}

}  // namespace

TEST(Metrics, CounterIsRenderedWithHelpAndTypeAndOnlyGoesUp) {
    MetricsRegistry registry;
    Counter& requests = registry.counter("demo_requests_total", "Requests seen.");
    requests.increment();
    requests.increment(2);
    EXPECT_THROW(requests.increment(-1), std::invalid_argument);
    EXPECT_EQ(registry.render(),
              "# HELP demo_requests_total Requests seen.\n"
              "# TYPE demo_requests_total counter\n"
              "demo_requests_total 3\n");
}

TEST(Metrics, LabeledSeriesAreSortedAndEscaped) {
    MetricsRegistry registry;
    CounterFamily& outcomes =
        registry.counter_family("demo_total", "Help with a \\ and a\nnewline.", "outcome");
    outcomes.with("ok").increment(5);
    outcomes.with("error").increment();
    outcomes.with("say \"hi\"\\\n").increment();
    const std::string text = registry.render();
    EXPECT_NE(text.find("# HELP demo_total Help with a \\\\ and a\\nnewline.\n"), std::string::npos) << text;
    const auto error_at = text.find("demo_total{outcome=\"error\"} 1\n");
    const auto ok_at = text.find("demo_total{outcome=\"ok\"} 5\n");
    ASSERT_NE(error_at, std::string::npos) << text;
    ASSERT_NE(ok_at, std::string::npos) << text;
    EXPECT_LT(error_at, ok_at);
    EXPECT_NE(text.find("demo_total{outcome=\"say \\\"hi\\\"\\\\\\n\"} 1\n"), std::string::npos) << text;
}

TEST(Metrics, HistogramBucketsAreCumulativeAndInclusive) {
    MetricsRegistry registry;
    Histogram& latency = registry.histogram("demo_seconds", "Latency.", {0.1, 1, 2.5});
    for (double value : {0.05, 0.1, 0.5, 3.0, 100.0})
        latency.observe(value);
    const std::string text = registry.render();
    EXPECT_NE(text.find("# TYPE demo_seconds histogram\n"), std::string::npos);
    EXPECT_EQ(sample(text, "demo_seconds_bucket{le=\"0.1\"}"), "2");  // le is "less than or equal"
    EXPECT_EQ(sample(text, "demo_seconds_bucket{le=\"1\"}"), "3");
    EXPECT_EQ(sample(text, "demo_seconds_bucket{le=\"2.5\"}"), "3");
    EXPECT_EQ(sample(text, "demo_seconds_bucket{le=\"+Inf\"}"), "5");
    EXPECT_EQ(sample(text, "demo_seconds_count"), "5");
    EXPECT_EQ(sample(text, "demo_seconds_sum"), format_metric_value(0.05 + 0.1 + 0.5 + 3.0 + 100.0));
    EXPECT_THROW(Histogram({1, 1}), std::invalid_argument);
    EXPECT_THROW(Histogram({2, 1}), std::invalid_argument);
    EXPECT_THROW(Histogram({1, std::numeric_limits<double>::infinity()}), std::invalid_argument);
}

TEST(Metrics, SampledGaugeIsComputedAtScrapeTimeWhileItsHandleLives) {
    MetricsRegistry registry;
    int busy = 1;
    {
        auto handle = registry.sampled_gauge("demo_kernels", "Kernels by state.", "state", [&busy] {
            return std::vector<GaugeSample>{{"idle", 2}, {"busy", static_cast<double>(busy)}};
        });
        EXPECT_EQ(sample(registry.render(), "demo_kernels{state=\"busy\"}"), "1");
        busy = 4;
        const std::string text = registry.render();
        EXPECT_EQ(sample(text, "demo_kernels{state=\"busy\"}"), "4");
        EXPECT_EQ(sample(text, "demo_kernels{state=\"idle\"}"), "2");
        EXPECT_NE(text.find("# TYPE demo_kernels gauge\n"), std::string::npos);
    }
    EXPECT_EQ(registry.render().find("demo_kernels"), std::string::npos) << "its owner is gone";

    auto unlabeled = registry.sampled_gauge("demo_target", "Target.", {}, [] {
        return std::vector<GaugeSample>{{{}, 3}};
    });
    EXPECT_EQ(sample(registry.render(), "demo_target"), "3");
}

TEST(Metrics, AHandleMayOutliveItsRegistry) {
    MetricsRegistry::SamplerHandle handle;
    {
        MetricsRegistry registry;
        handle = registry.sampled_gauge("demo_gauge", "Gauge.", "state", [] {
            return std::vector<GaugeSample>{{"a", 1}};
        });
    }
    SUCCEED();  // destroying `handle` now touches nothing that is gone (ASan would say otherwise)
}

TEST(Metrics, InvalidOrDuplicateNamesAreRefused) {
    MetricsRegistry registry;
    registry.counter("demo_total", "x");
    EXPECT_THROW(registry.counter("demo_total", "again"), std::invalid_argument);
    EXPECT_THROW(registry.counter("9starts_with_digit", "x"), std::invalid_argument);
    EXPECT_THROW(registry.gauge("has-dash", "x"), std::invalid_argument);
    EXPECT_THROW(registry.counter_family("demo_family_total", "x", "__reserved"), std::invalid_argument);
    EXPECT_THROW(registry.counter_family("demo_family_total", "x", "a:colon"), std::invalid_argument);
    EXPECT_NO_THROW(registry.gauge("namespace:demo_gauge", "colons are allowed in metric names"));
}

TEST(Metrics, ValuesUseTheShortestExactTextAndPrometheusSpecialValues) {
    EXPECT_EQ(format_metric_value(0), "0");
    EXPECT_EQ(format_metric_value(42), "42");
    EXPECT_EQ(format_metric_value(0.005), "0.005");
    EXPECT_EQ(format_metric_value(1e21), "1e+21");
    EXPECT_EQ(format_metric_value(std::numeric_limits<double>::infinity()), "+Inf");
    EXPECT_EQ(format_metric_value(-std::numeric_limits<double>::infinity()), "-Inf");
    EXPECT_EQ(format_metric_value(std::nan("")), "NaN");
    EXPECT_EQ(std::stod(format_metric_value(0.1 + 0.2)), 0.1 + 0.2);
}

// Every line of the gateway's exposition is a comment of the two kinds or a well-formed sample, every series
// it promises (README) exists before the first event, and each metric has exactly one HELP and TYPE.
TEST(Metrics, GatewaySeriesAreWellFormedAndPresentFromTheStart) {
    GatewayMetrics metrics;
    const std::string text = metrics.registry.render();
    const std::regex comment(R"(# (HELP|TYPE) [a-zA-Z_:][a-zA-Z0-9_:]* .+)");
    const std::regex sample_line(
        R"([a-zA-Z_:][a-zA-Z0-9_:]*(\{[a-zA-Z_][a-zA-Z0-9_]*="([^"\\\n]|\\.)*"\})? ([-+]?[0-9.e+]+|\+Inf|-Inf|NaN))");
    std::istringstream lines(text);
    int types = 0;
    for (std::string line; std::getline(lines, line);) {
        EXPECT_TRUE(std::regex_match(line, comment) || std::regex_match(line, sample_line)) << line;
        types += line.starts_with("# TYPE ");
    }
    EXPECT_EQ(types, 9);  // cellblock_tenant_executes_total among them, empty until a tenant runs code
    for (const char* outcome : {"ok", "error", "timeout", "interrupted", "kernel_died", "worker_died",
                                "sandbox_unavailable", "kernel_unavailable", "session_closed", "abandoned"})
        EXPECT_EQ(sample(text, std::string("cellblock_agent_executes_total{outcome=\"") + outcome + "\"}"),
                  "0");
    for (const char* cause :
         {"spawn_failed", "exited_during_start", "start_timeout", "workspace_failed", "sandbox_unavailable"})
        EXPECT_EQ(sample(text, std::string("cellblock_launch_failures_total{cause=\"") + cause + "\"}"), "0");
    EXPECT_EQ(sample(text, "cellblock_streamed_bytes_total{transport=\"websocket\"}"), "0");
    EXPECT_EQ(sample(text, "cellblock_agent_execute_duration_seconds_bucket{le=\"300\"}"), "0");
    EXPECT_EQ(sample(text, "cellblock_websocket_connections_open"), "0");
}
