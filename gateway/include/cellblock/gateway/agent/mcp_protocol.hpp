#pragma once
// The JSON-RPC 2.0 side of MCP's Streamable HTTP transport, without the tools: what a POSTed body holds (one
// message or a batch of requests, notifications and responses), the protocol's own methods (initialize, ping,
// tools/list), the checks of a tools/call, and a tool's refusal as MCP. `mcp_endpoint.cpp` gives it the tools
// and the HTTP side; apart, it can be fuzzed without a gateway behind it (tests/fuzz/mcp_jsonrpc.cpp).
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>

#include "cellblock/gateway/agent/agent_operations.hpp"

namespace cellblock::gateway::agent {

// One JSON-RPC answer, or nothing (the message was a notification or a response of the client's).
using McpReply = std::function<void(std::optional<nlohmann::json>)>;

// What answers one POST: 200 with `body` (an answer, or the answers of a batch in its order), 202 without a
// body (nothing in it asked for an answer), or 400 with a JSON-RPC error (not JSON, an empty batch).
struct McpHttpAnswer {
    unsigned status = 200;
    std::optional<nlohmann::json> body;
};

// JSON-RPC error codes.
inline constexpr int mcp_parse_error = -32700, mcp_invalid_request = -32600, mcp_method_not_found = -32601,
                     mcp_invalid_params = -32602;

class McpProtocol {
  public:
    // Runs one tools/call whose name is a string and whose arguments are an object, and answers through
    // `reply` exactly once, now or later. Thrown instead: an OperationError is answered as
    // `mcp_tool_refusal`, any other exception as a tool error with its text.
    using CallTool =
        std::function<void(const std::string& tool, const nlohmann::json& arguments, const Caller& caller,
                           const nlohmann::json& id, const McpReply& reply)>;

    // `tools`: the array tools/list answers.
    McpProtocol(nlohmann::json tools, CallTool call_tool);

    // Answers the POSTed `body` of `caller` through `done`, once, when the last tool call of it has answered.
    void handle_body(std::string_view body, const Caller& caller,
                     std::function<void(McpHttpAnswer)> done) const;

  private:
    void handle(const nlohmann::json& message, const Caller& caller, const McpReply& reply) const;

    nlohmann::json tools_;
    CallTool call_tool_;
};

nlohmann::json mcp_result(const nlohmann::json& id, nlohmann::json result);
nlohmann::json mcp_error(const nlohmann::json& id, int code, const std::string& message);
// A tool's answer of one text block.
nlohmann::json mcp_tool_text(const std::string& text, bool is_error);
// A refusal of the agent operations as MCP: a malformed call (an argument missing or of the wrong type) is a
// JSON-RPC invalid-params error, as the protocol asks; any other refusal is a tool error the model can read
// and act on. Both carry the same {"reason", "message", ...} as the REST API's error body (in the error's
// `data`, in the result's `structuredContent`).
nlohmann::json mcp_tool_refusal(const nlohmann::json& id, const OperationError& error);

}  // namespace cellblock::gateway::agent
