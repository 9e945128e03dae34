#include "egress/network_approvals.hpp"

#include <cmath>

#include "cellblock/contract/html_text.hpp"
#include "common/logging.hpp"

namespace cellblock::kernel {
namespace {

using contract::html_escaped;

// "120" for whole seconds, "2.5" otherwise.
std::string seconds_text(double seconds) {
    if (seconds == std::floor(seconds) && seconds < 1e15) {
        return std::to_string(static_cast<long long>(seconds));
    }
    nlohmann::json number = seconds;
    return number.dump();
}

std::string display_id(const egress::ApprovalRequest& request) {
    return "cellblock-approval-" + request.id;
}

std::string target(const egress::ApprovalRequest& request) {
    return request.host + ":" + std::to_string(request.port);
}

std::optional<egress::Decision> parse_decision(const std::string& text) {
    if (text == "allow_once") {
        return egress::Decision::allow_once;
    }
    if (text == "allow_session") {
        return egress::Decision::allow_session;
    }
    if (text == "deny") {
        return egress::Decision::deny;
    }
    return std::nullopt;  // "timeout" is the proxy's alone
}

nlohmann::json error_reply(const char* ename, const std::string& evalue) {
    return {
        {"status", "error"}, {"ename", ename}, {"evalue", evalue}, {"traceback", nlohmann::json::array()}};
}

}  // namespace

NetworkApprovals::Connection::~Connection() {
    if (owner_ == nullptr) {
        return;  // moved from
    }
    std::lock_guard lock(owner_->mutex_);
    owner_->publisher_ = nullptr;
}

NetworkApprovals::Connection NetworkApprovals::connect(Publisher publisher) {
    std::lock_guard lock(mutex_);
    publisher_ = std::move(publisher);
    return Connection(*this);
}

void NetworkApprovals::publish(const char* msg_type, nlohmann::json content) {
    if (!publisher_) {
        log_event(LogLevel::warning, "egress_event_dropped", {{"msg_type", msg_type}, {"content", content}});
        return;
    }
    publisher_(msg_type, std::move(content));
}

// The notebook's view of one approval: the same frame while it is held and after it is decided (the
// update replaces the display by its display_id), so only the status phrase and the decision fields differ.
nlohmann::json NetworkApprovals::approval_frame(const egress::ApprovalRequest& request,
                                                const std::string& status, double timeout_s,
                                                const nlohmann::json& decision_fields) {
    const std::string text =
        "cellblock: network request to " + target(request) + " (" + request.method + ")" + status;
    const std::string html = "<div class=\"cellblock-approval\"><b>cellblock</b>: network request to <code>" +
                             html_escaped(target(request)) + "</code> (" + html_escaped(request.method) +
                             ")" + html_escaped(status) + "</div>";
    nlohmann::json approval = {{"id", request.id},
                               {"host", request.host},
                               {"port", request.port},
                               {"method", request.method},
                               {"timeout_s", timeout_s}};
    approval.update(decision_fields);
    return {
        {"data",
         {{"text/plain", text}, {"text/html", html}, {"application/vnd.cellblock.approval+json", approval}}},
        {"metadata", nlohmann::json::object()},
        {"transient", {{"display_id", display_id(request)}}}};
}

nlohmann::json NetworkApprovals::approval_display(const egress::ApprovalRequest& request, double timeout_s) {
    return approval_frame(request,
                          " is held for approval (id " + request.id + "); no decision within " +
                              seconds_text(timeout_s) + " s denies it",
                          timeout_s, nlohmann::json::object());
}

nlohmann::json NetworkApprovals::decision_display(const egress::ApprovalRequest& request,
                                                  egress::Decision decision, const std::string& decided_by,
                                                  double timeout_s) {
    std::string outcome;
    switch (decision) {
        case egress::Decision::allow_once:
            outcome = "allowed once by " + decided_by;
            break;
        case egress::Decision::allow_session:
            outcome = "allowed for this session by " + decided_by;
            break;
        case egress::Decision::deny:
            outcome = "denied by " + decided_by;
            break;
        case egress::Decision::timeout:
            outcome = "denied: no decision within " + seconds_text(timeout_s) + " s";
            break;
    }
    return approval_frame(
        request, ": " + outcome, timeout_s,
        {{"decision", std::string(egress::to_string(decision))}, {"decided_by", decided_by}});
}

void NetworkApprovals::on_approval_requested(const egress::ApprovalRequest& request, double timeout_s) {
    std::lock_guard lock(mutex_);
    auto& pending = pending_[request.id];
    pending.request = request;
    pending.timeout_s = timeout_s;
    log_event(
        LogLevel::info, "egress_approval_requested",
        {{"id", request.id}, {"host", request.host}, {"port", request.port}, {"method", request.method}});
    publish("cellblock_egress", {{"event", "approval_requested"},
                                 {"id", request.id},
                                 {"host", request.host},
                                 {"port", request.port},
                                 {"method", request.method},
                                 {"timeout_s", timeout_s}});
    publish("display_data", approval_display(request, timeout_s));
}

void NetworkApprovals::request(const egress::ApprovalRequest& request,
                               std::function<void(egress::Decision, std::string decided_by)> answer) {
    bool announced = false;
    {
        std::lock_guard lock(mutex_);
        announced = pending_.contains(request.id);
    }
    if (!announced) {
        on_approval_requested(request, 0);  // the proxy announces first; shown anyway, so it can be decided
    }
    std::optional<std::pair<egress::Decision, std::string>> early;
    {
        std::lock_guard lock(mutex_);
        auto& pending = pending_[request.id];
        if (!pending.early) {
            pending.answer = std::move(answer);  // answered when the decision comes
            return;
        }
        early = std::exchange(pending.early, std::nullopt);
    }
    answer(early->first, std::move(early->second));  // decided before the proxy asked: at once, unlocked
}

void NetworkApprovals::on_approval_decided(const egress::ApprovalRequest& request, egress::Decision decision,
                                           const std::string& decided_by) {
    std::lock_guard lock(mutex_);
    double timeout_s = 0;
    if (const auto found = pending_.find(request.id); found != pending_.end()) {
        timeout_s = found->second.timeout_s;
        pending_.erase(found);
    }
    log_event(LogLevel::info, "egress_approval_decided",
              {{"id", request.id},
               {"host", request.host},
               {"decision", std::string(egress::to_string(decision))},
               {"decided_by", decided_by}});
    publish("cellblock_egress", {{"event", "approval_decided"},
                                 {"id", request.id},
                                 {"host", request.host},
                                 {"port", request.port},
                                 {"method", request.method},
                                 {"decision", std::string(egress::to_string(decision))},
                                 {"decided_by", decided_by}});
    publish("update_display_data", decision_display(request, decision, decided_by, timeout_s));
}

// The egress helper died (egress/egress_client.hpp): machines get an event, a notebook a line on stderr.
void NetworkApprovals::on_helper_crashed(const std::string& text) {
    const std::lock_guard lock(mutex_);
    publish("cellblock_egress", {{"event", "helper_crashed"}, {"detail", text}});
    publish("stream", {{"name", "stderr"}, {"text", "cellblock: " + text + "\n"}});
}

void NetworkApprovals::on_connection(const egress::ConnectionRecord& record) {
    nlohmann::json event = {{"event", "connection"},
                            {"host", record.host},
                            {"port", record.port},
                            {"method", record.method},
                            {"bytes_up", record.bytes_up},
                            {"bytes_down", record.bytes_down},
                            {"duration_ms", record.duration_ms},
                            {"allowed", record.allowed},
                            {"rule", record.rule}};
    if (!record.error.empty()) {
        event["error"] = record.error;
    }
    std::lock_guard lock(mutex_);
    publish("cellblock_egress", std::move(event));
}

nlohmann::json NetworkApprovals::decide(const nlohmann::json& content) {
    if (!content.is_object() || !content.contains("id") || !content["id"].is_string() ||
        !content.contains("decision") || !content["decision"].is_string() ||
        (content.contains("decided_by") && !content["decided_by"].is_string())) {
        return error_reply("ValueError",
                           "cellblock_approval_decision_request needs {\"id\": string, \"decision\": "
                           "\"allow_once\" | \"allow_session\" | \"deny\", \"decided_by\": string}");
    }
    const auto id = content["id"].get<std::string>();
    const auto decision = parse_decision(content["decision"].get<std::string>());
    if (!decision) {
        return error_reply("ValueError", "decision must be allow_once, allow_session or deny, not '" +
                                             content["decision"].get<std::string>() + "'");
    }
    std::string decided_by = content.value("decided_by", std::string());
    if (decided_by.empty()) {
        decided_by = "an unnamed client";
    }
    std::function<void(egress::Decision, std::string)> answer;
    {
        std::lock_guard lock(mutex_);
        const auto found = pending_.find(id);
        if (found == pending_.end() || found->second.decided) {
            return error_reply("UnknownApproval", "no approval '" + id +
                                                      "' is pending on this kernel (unknown, already decided "
                                                      "or timed out)");
        }
        found->second.decided = true;
        if (found->second.answer) {
            answer = std::exchange(found->second.answer, nullptr);
        } else {
            found->second.early.emplace(*decision, decided_by);
        }
    }
    log_event(
        LogLevel::info, "egress_approval_decision",
        {{"id", id}, {"decision", std::string(egress::to_string(*decision))}, {"decided_by", decided_by}});
    if (answer) {
        answer(*decision, std::move(decided_by));  // the proxy takes it over on its own thread
    }
    return {{"status", "ok"}};
}

}  // namespace cellblock::kernel
