#include "cellblock/gateway/agent/mcp_protocol.hpp"

#include <memory>
#include <utility>
#include <vector>

namespace cellblock::gateway::agent {

using nlohmann::json;

namespace {
constexpr std::string_view latest_protocol = "2025-06-18";
constexpr std::string_view known_protocols[] = {"2025-11-25", "2025-06-18", "2025-03-26", "2024-11-05"};
}  // namespace

json mcp_result(const json& id, json result) {
    return {{"jsonrpc", "2.0"}, {"id", id}, {"result", std::move(result)}};
}

json mcp_error(const json& id, int code, const std::string& message) {
    return {{"jsonrpc", "2.0"}, {"id", id}, {"error", {{"code", code}, {"message", message}}}};
}

json mcp_tool_text(const std::string& text, bool is_error) {
    return {{"content", json::array({{{"type", "text"}, {"text", text}}})}, {"isError", is_error}};
}

json mcp_tool_refusal(const json& id, const OperationError& error) {
    if (error.kind() == OperationErrorKind::malformed) {
        json reply = mcp_error(id, mcp_invalid_params, error.what());
        reply["error"]["data"] = error.to_json();
        return reply;
    }
    json result = mcp_tool_text(std::string(error.what()) + " (" + error.reason() + ")", true);
    result["structuredContent"] = error.to_json();
    return mcp_result(id, std::move(result));
}

McpProtocol::McpProtocol(json tools, CallTool call_tool)
    : tools_(std::move(tools)), call_tool_(std::move(call_tool)) {}

void McpProtocol::handle_body(std::string_view body, const Caller& caller,
                              std::function<void(McpHttpAnswer)> done) const {
    const json message = json::parse(body, nullptr, false);
    if (message.is_discarded())
        return done({400, mcp_error(nullptr, mcp_parse_error, "Parse error: body is not JSON")});
    if (!message.is_array()) {
        return handle(message, caller, [done = std::move(done)](std::optional<json> reply) {
            if (!reply)
                return done({202, std::nullopt});
            done({200, std::move(*reply)});
        });
    }
    if (message.empty())
        return done({400, mcp_error(nullptr, mcp_invalid_request, "empty batch")});
    // A batch: answered once every member is, in its order, leaving out what needs no answer.
    struct Batch {
        std::vector<std::optional<json>> replies;
        std::size_t left;
        std::function<void(McpHttpAnswer)> done;
    };
    auto batch = std::make_shared<Batch>(
        Batch{std::vector<std::optional<json>>(message.size()), message.size(), std::move(done)});
    for (std::size_t i = 0; i < message.size(); ++i) {
        handle(message[i], caller, [batch, i](std::optional<json> reply) {
            batch->replies[i] = std::move(reply);
            if (--batch->left > 0)
                return;
            json replies = json::array();
            for (auto& item : batch->replies)
                if (item)
                    replies.push_back(std::move(*item));
            if (replies.empty())
                return batch->done({202, std::nullopt});
            batch->done({200, std::move(replies)});
        });
    }
}

void McpProtocol::handle(const json& message, const Caller& caller, const McpReply& reply) const {
    // Every field is checked for its type before it is read: a member of the wrong type is an Invalid Request
    // of its own, never an exception that loses the whole body's answers.
    if (!message.is_object() || !message.contains("jsonrpc") || message["jsonrpc"] != "2.0" ||
        !message.contains("method") || !message["method"].is_string()) {
        // Responses from the client (to server requests we never send) are accepted and ignored.
        if (message.is_object() && (message.contains("result") || message.contains("error")))
            return reply(std::nullopt);
        return reply(mcp_error(message.is_object() ? message.value("id", json()) : json(),
                               mcp_invalid_request, "Invalid Request"));
    }
    if (!message.contains("id"))
        return reply(std::nullopt);  // a notification: notifications/initialized, cancelled, ...
    const std::string method = message["method"].get<std::string>();
    const json& id = message["id"];
    const json params = message.value("params", json::object());

    if (method == "initialize") {
        std::string version(latest_protocol);
        const std::string requested =
            params.is_object() && params.contains("protocolVersion") && params["protocolVersion"].is_string()
                ? params["protocolVersion"].get<std::string>()
                : std::string();
        for (std::string_view known : known_protocols)
            if (requested == known)
                version = requested;
        return reply(mcp_result(id, {{"protocolVersion", version},
                                     {"capabilities", {{"tools", {{"listChanged", false}}}}},
                                     {"serverInfo",
                                      {{"name", "cellblock"},
                                       {"title", "cellblock sandboxed Python"},
                                       {"version", CELLBLOCK_GATEWAY_VERSION}}},
                                     {"instructions",
                                      "Run Python with run_python; sessions keep state between calls "
                                      "and share a workspace directory with the file tools."}}));
    }
    if (method == "ping")
        return reply(mcp_result(id, json::object()));
    if (method == "tools/list")
        return reply(mcp_result(id, {{"tools", tools_}}));
    if (method == "tools/call") {
        if (!params.is_object() || !params.contains("name") || !params["name"].is_string())
            return reply(mcp_error(id, mcp_invalid_params, "tools/call needs params.name"));
        const json arguments = params.value("arguments", json::object());
        if (!arguments.is_object())
            return reply(mcp_error(id, mcp_invalid_params, "params.arguments must be an object"));
        try {
            call_tool_(params["name"].get<std::string>(), arguments, caller, id, reply);
        } catch (const OperationError& error) {
            reply(mcp_tool_refusal(id, error));
        } catch (const std::exception& error) {
            reply(mcp_result(id, mcp_tool_text(error.what(), true)));
        }
        return;
    }
    reply(mcp_error(id, mcp_method_not_found, "Method not found: " + method));
}

}  // namespace cellblock::gateway::agent
