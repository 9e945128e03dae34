// The body of a POST to /mcp as the gateway handles it (gateway/src/agent/mcp_protocol.cpp McpProtocol):
// JSON-RPC 2.0, one message or a batch, with tools that check their arguments with the agent operations' own
// parsers (AgentOperations::parse_execute_arguments, parse_decision) and answer at once or later.
//
// Input: one mode byte (bit 0: tools answer later, in the reverse order of their calls; bit 1: a tool that
// accepts its arguments throws instead of answering), then the body.
// Invariants: nothing escapes; the answer comes once, after every tool has answered; 400 only for a body that
// is not JSON or an empty batch; 202 exactly when nothing in the body asks for an answer; otherwise 200 with
// one answer per request, in the body's order, each carrying its request's id; every answer is JSON-RPC 2.0
// (jsonrpc "2.0", exactly one of result and error, an integer code and a string message) and serialises as
// valid UTF-8.
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "cellblock/gateway/agent/mcp_protocol.hpp"
#include "fuzz_support.hpp"

using namespace cellblock::gateway::agent;
using cellblock::fuzz::require;
using nlohmann::json;

namespace {

// A message the protocol must answer, and with which id; nullopt when it needs no answer.
std::optional<json> expected_answer_id(const json& message) {
    if (message.is_object()) {
        const bool request_shape = message.contains("jsonrpc") && message["jsonrpc"] == "2.0" &&
                                   message.contains("method") && message["method"].is_string();
        if (request_shape)
            return message.contains("id") ? std::optional<json>(message["id"]) : std::nullopt;
        if (message.contains("result") || message.contains("error"))
            return std::nullopt;
        return message.contains("id") ? message["id"] : json();
    }
    return json();
}

void check_answer(const json& answer, const json& id) {
    require(answer.is_object(), "an answer is an object");
    require(answer.contains("jsonrpc") && answer["jsonrpc"] == "2.0", "an answer says jsonrpc 2.0");
    require(answer.contains("id") && answer["id"] == id, "an answer carries its request's id");
    require(answer.contains("result") != answer.contains("error"), "an answer has a result or an error");
    if (answer.contains("error")) {
        const json& error = answer["error"];
        require(error.is_object() && error.contains("code") && error["code"].is_number_integer(),
                "an error has an integer code");
        require(error.contains("message") && error["message"].is_string(), "an error has a message");
    }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    if (size < 1)
        return 0;
    const bool later = (data[0] & 1) != 0;
    const bool throw_after_checks = (data[0] & 2) != 0;
    const std::string_view body = cellblock::fuzz::as_text(data + 1, size - 1);

    std::vector<std::function<void()>> pending;
    const McpProtocol protocol(
        json::array({{{"name", "run_python"}}}), [&](const std::string& tool, const json& arguments,
                                                     const Caller&, const json& id, const McpReply& reply) {
            require(arguments.is_object(), "a tool gets its arguments as an object");
            if (tool == "run_python")
                AgentOperations::parse_execute_arguments(arguments);
            else if (tool == "decide_approval")
                AgentOperations::parse_decision(arguments);
            else
                throw OperationError(OperationErrorKind::malformed, "unknown_tool", "unknown tool: " + tool);
            if (throw_after_checks)
                throw std::runtime_error("the tool failed");
            auto answer = [reply, id] { reply(mcp_result(id, mcp_tool_text("done", false))); };
            if (later)
                pending.push_back(std::move(answer));
            else
                answer();
        });

    int answers = 0;
    McpHttpAnswer answered;
    protocol.handle_body(body, Caller{"fuzz", "mcp"}, [&](McpHttpAnswer answer) {
        ++answers;
        answered = std::move(answer);
    });
    require(answers == 0 || pending.empty(), "the answer waits for every tool");
    while (!pending.empty()) {
        auto next = std::move(pending.back());
        pending.pop_back();
        next();
    }
    require(answers == 1, "a body is answered exactly once");

    const json message = json::parse(body, nullptr, false);
    if (message.is_discarded() || (message.is_array() && message.empty())) {
        require(answered.status == 400 && answered.body.has_value(), "a body that is not JSON is a 400");
        check_answer(*answered.body, nullptr);
        return 0;
    }
    std::vector<json> expected;
    for (const json& member : message.is_array() ? message : json::array({message}))
        if (auto id = expected_answer_id(member))
            expected.push_back(*id);
    if (expected.empty()) {
        require(answered.status == 202 && !answered.body, "nothing to answer is a 202 without a body");
        return 0;
    }
    require(answered.status == 200 && answered.body.has_value(), "requests are answered with a 200");
    const json& answer = *answered.body;
    if (message.is_array()) {
        require(answer.is_array() && answer.size() == expected.size(), "a batch has one answer per request");
        for (std::size_t i = 0; i < expected.size(); ++i)
            check_answer(answer[i], expected[i]);
    } else {
        check_answer(answer, expected.front());
    }
    try {
        static_cast<void>(answer.dump());  // strict: throws on invalid UTF-8
    } catch (const json::exception&) {
        cellblock::fuzz::invariant_failed("an answer is valid UTF-8");
    }
    return 0;
}
