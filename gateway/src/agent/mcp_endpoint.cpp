// Model Context Protocol over the Streamable HTTP transport: JSON-RPC 2.0 requests POSTed to /mcp, each
// answered with one application/json body (no server-initiated messages, so no SSE stream is needed; GET
// answers 405 as the transport allows). Tools run Python in named agent sessions, created on demand.
#include <openssl/evp.h>

#include <algorithm>

#include "cellblock/gateway/agent/agent_api.hpp"
#include "cellblock/gateway/agent/mcp_protocol.hpp"
#include "cellblock/gateway/agent/output_shield.hpp"
#include "cellblock/gateway/common/crypto.hpp"
#include "cellblock/sandbox/sandbox.hpp"

namespace cellblock::gateway::agent {

using nlohmann::json;

namespace {

constexpr std::size_t max_read_bytes = 1u << 20;  // read_file returns at most this much inline

using SessionPtr = std::shared_ptr<AgentSession>;
using Reply = McpReply;

json text_content(const std::string& text) {
    return {{"type", "text"}, {"text", text}};
}

// The callback of an operation answering `Value`: `render` turns the value into the tool's result.
template <class Value, class Render>
AgentOperations::Then<Value> rendered(const json& id, Reply reply, Render render) {
    return [id, reply = std::move(reply), render = std::move(render)](Outcome<Value> outcome) {
        if (!outcome.ok())
            return reply(mcp_tool_refusal(id, outcome.error()));
        reply(mcp_result(id, render(outcome.value())));
    };
}

std::string decode_base64_argument(const std::string& text) {
    auto decoded = base64_decode(text);
    if (!decoded)
        throw OperationError(OperationErrorKind::malformed, "bad_base64",
                             "content_base64 is not valid base64");
    return *decoded;
}

// decide_approval only with --approvals-mcp on: by default the agent's own MCP client, which reads text
// the sandboxed code wrote, cannot approve that code's network requests.
json tool_definitions(bool with_decide_approval) {
    json tools = json::array({
        {{"name", "run_python"},
         {"title", "Run Python"},
         {"description",
          "Run Python code in a persistent, sandboxed session (created on first use; variables, imports and "
          "files "
          "persist between calls). Returns stdout, stderr, the value of the last expression, displayed "
          "images and "
          "errors. The working directory is the session's workspace (see list_files/upload_file/read_file)."},
         {"inputSchema",
          {{"type", "object"},
           {"properties",
            {{"session", {{"type", "string"}, {"description", "session name (default: \"default\")"}}},
             {"code", {{"type", "string"}, {"description", "Python source to run"}}},
             {"timeout_s",
              {{"type", "number"}, {"description", "interrupt the code after this many seconds"}}},
             {"network",
              {{"type", "object"},
               {"description",
                "network policy of a session created by this call, e.g. {\"allow\": [\"pypi.org\", "
                "\"*.pythonhosted.org\"], \"ask\": true}: hosts reachable through the proxy (within the "
                "gateway's ceiling); with ask, other hosts are held for an approval. Default: no network"},
               {"properties",
                {{"allow", {{"type", "array"}, {"items", {{"type", "string"}}}}},
                 {"ask", {{"type", "boolean"}}}}}}}}},
           {"required", json::array({"code"})}}}},
        {{"name", "list_files"},
         {"title", "List workspace files"},
         {"description",
          "List the files in a session's workspace (the code's working directory) with their sizes."},
         {"inputSchema",
          {{"type", "object"},
           {"properties", {{"session", {{"type", "string"}, {"description", "session name"}}}}}}}},
        {{"name", "upload_file"},
         {"title", "Upload a file"},
         {"description",
          "Write a file into a session's workspace, as text (content) or bytes (content_base64)."},
         {"inputSchema",
          {{"type", "object"},
           {"properties",
            {{"session", {{"type", "string"}, {"description", "session name"}}},
             {"path", {{"type", "string"}, {"description", "path relative to the workspace"}}},
             {"content", {{"type", "string"}, {"description", "text content (UTF-8)"}}},
             {"content_base64", {{"type", "string"}, {"description", "binary content, base64"}}}}},
           {"required", json::array({"path"})}}}},
        {{"name", "read_file"},
         {"title", "Read a file"},
         {"description", "Read a file from a session's workspace (text, or base64 for binary files)."},
         {"inputSchema",
          {{"type", "object"},
           {"properties",
            {{"session", {{"type", "string"}, {"description", "session name"}}},
             {"path", {{"type", "string"}, {"description", "path relative to the workspace"}}}}},
           {"required", json::array({"path"})}}}},
        {{"name", "list_approvals"},
         {"title", "List network approvals"},
         {"description",
          "List the network requests a session's code made to hosts outside its allowlist (with ask), "
          "pending "
          "and decided."},
         {"inputSchema",
          {{"type", "object"},
           {"properties", {{"session", {{"type", "string"}, {"description", "session name"}}}}}}}},
        {{"name", "decide_approval"},
         {"title", "Decide a network approval"},
         {"description", "Answer a pending network approval: allow_once, allow_session or deny."},
         {"inputSchema",
          {{"type", "object"},
           {"properties",
            {{"session", {{"type", "string"}, {"description", "session name"}}},
             {"id", {{"type", "string"}, {"description", "the approval's id"}}},
             {"decision",
              {{"type", "string"}, {"enum", json::array({"allow_once", "allow_session", "deny"})}}}}},
           {"required", json::array({"id", "decision"})}}}},
        {{"name", "reset_session"},
         {"title", "Reset a session"},
         {"description",
          "Restart the session's Python interpreter: variables and imports are cleared, files stay."},
         {"inputSchema",
          {{"type", "object"},
           {"properties", {{"session", {{"type", "string"}, {"description", "session name"}}}}}}}},
    });
    if (!with_decide_approval)
        tools.erase(std::remove_if(tools.begin(), tools.end(),
                                   [](const json& tool) { return tool["name"] == "decide_approval"; }),
                    tools.end());
    return tools;
}

std::string string_argument(const json& arguments, const char* name, bool required,
                            const std::string& fallback = {}) {
    if (!arguments.contains(name) || arguments[name].is_null()) {
        if (required)
            throw OperationError(OperationErrorKind::malformed, "missing_argument",
                                 std::string("missing argument \"") + name + "\"");
        return fallback;
    }
    if (!arguments[name].is_string())
        throw OperationError(OperationErrorKind::malformed, "bad_type",
                             std::string("argument \"") + name + "\" must be a string");
    return arguments[name].get<std::string>();
}

// The answer of an execute as MCP content: one text block (stdout, stderr, result, error) plus PNG images.
json execute_content(const json& answer) {
    std::string text;
    auto section = [&text](const std::string& title, const std::string& body) {
        if (body.empty())
            return;
        if (!text.empty())
            text += "\n";
        text += "[" + title + "]\n" + body;
        if (!body.ends_with('\n'))
            text += "\n";
    };
    section("stdout", answer.value("stdout", ""));
    section("stderr", answer.value("stderr", ""));
    if (answer.contains("result") && answer["result"].is_object())
        section("result", answer["result"].value("text/plain", ""));
    if (answer.contains("error") && answer["error"].is_object())
        section("error", answer["error"].value("traceback", ""));
    if (answer.contains("notice"))
        section("notice", answer["notice"].get<std::string>());
    if (answer.contains("saved"))
        section("saved", answer["saved"].dump());
    if (text.empty())
        text = "(no output)\n";
    text = "[status] " + answer.value("status", "") + "\n" + text;
    json content = json::array({text_content(text)});
    for (const json& display : answer.value("displays", json::array())) {
        if (display.contains("image/png") && display["image/png"].is_string())
            content.push_back({{"type", "image"}, {"data", display["image/png"]}, {"mimeType", "image/png"}});
    }
    json structured = answer;
    structured.erase("displays");
    return {{"content", content},
            {"isError", answer.value("status", "") != "ok"},
            {"structuredContent", structured}};
}

class McpResource : public RestResource {
  public:
    explicit McpResource(AgentService& service)
        : operations_(service.operations()),
          approvals_mcp_(service.config().approvals_mcp),
          protocol_(
              tool_definitions(approvals_mcp_),
              [this](const std::string& tool, const json& arguments, const Caller& caller, const json& id,
                     const Reply& reply) { call_tool(tool, arguments, caller, id, reply); }) {}
    std::string allowed_methods() const override { return "POST, OPTIONS"; }
    // Each tool is checked against the caller's role (role_allows below); the endpoint itself any may reach.
    bool serves_tenants() const override { return true; }
    Principal::Action action(http::verb) const override { return Principal::Action::read; }

    void get(RequestContext&, Responder respond) override {
        HttpResponse response =
            json_error(http::status::method_not_allowed,
                       "this MCP server sends no server-initiated messages (no SSE stream)");
        response.set(http::field::allow, allowed_methods());
        respond(std::move(response));
    }

    void post(RequestContext& context, Responder respond) override {
        protocol_.handle_body(
            context.request.body(), Caller{context.client_address, "mcp", context.principal},
            [respond](McpHttpAnswer answer) {
                if (!answer.body)
                    return respond(empty_response(static_cast<http::status>(answer.status)));
                respond(json_response(static_cast<http::status>(answer.status), *answer.body));
            });
    }

  private:
    // What a tool does, for the role check (principal.hpp): listing reads, deciding decides, the rest runs.
    static void check_role(const std::string& tool, const Principal& principal) {
        const Principal::Action action =
            tool == "list_approvals" || tool == "list_files" || tool == "read_file" ? Principal::Action::read
            : tool == "decide_approval" ? Principal::Action::decide
                                        : Principal::Action::run;
        if (!principal.may(action))
            throw OperationError(
                OperationErrorKind::refused, "role_forbidden",
                std::string("a token of role ") + role_name(principal.role) + " may not call " + tool);
    }

    // Runs `use` on the named session (created on first use of a name); a refusal, there or thrown by
    // `use`, is the tool's answer.
    void on_session(const std::string& name, const Caller& caller, const json& id, const Reply& reply,
                    std::function<void(const SessionPtr&)> use, const json& network = nullptr) {
        operations_.session_or_create(
            name, caller,
            [id, reply, use = std::move(use)](Outcome<SessionPtr> outcome) {
                if (!outcome.ok())
                    return reply(mcp_tool_refusal(id, outcome.error()));
                try {
                    use(outcome.value());
                } catch (const OperationError& error) {
                    reply(mcp_tool_refusal(id, error));
                }
            },
            network);
    }

    // Arguments are checked before the session is looked up or created, so a malformed call creates nothing.
    void call_tool(const std::string& tool, const json& arguments, const Caller& caller, const json& id,
                   const Reply& reply) {
        const std::string name = string_argument(arguments, "session", false, "default");
        check_role(tool, caller.principal);
        if (tool == "run_python") {
            const ExecuteArguments parsed = AgentOperations::parse_execute_arguments(arguments);
            return on_session(
                name, caller, id, reply,
                [this, parsed, caller, id, reply](const SessionPtr& session) {
                    ExecuteHandlers handlers;
                    handlers.on_done = [id, reply](const json& answer) {
                        reply(mcp_result(id, execute_content(answer)));
                    };
                    operations_.execute(session, parsed, caller, std::move(handlers));
                },
                arguments.value("network", json(nullptr)));
        }
        if (tool == "list_approvals") {
            return on_session(name, caller, id, reply, [this, id, reply](const SessionPtr& session) {
                const json approvals = operations_.approvals(session);
                std::string text;
                for (const json& approval : approvals)
                    text += approval.value("id", "") + "\t" + approval.value("host", "") + ":" +
                            std::to_string(approval.value("port", 0)) + "\t" +
                            (approval["decision"].is_string() ? approval["decision"].get<std::string>()
                                                              : std::string("pending")) +
                            "\n";
                if (text.empty())
                    text = "(no approvals)\n";
                json result = mcp_tool_text(text, false);
                result["structuredContent"] = {{"approvals", approvals}};
                reply(mcp_result(id, result));
            });
        }
        if (tool == "decide_approval" && !approvals_mcp_)
            throw OperationError(
                OperationErrorKind::refused, "approvals_not_allowed",
                "this gateway does not take approval decisions over MCP (--approvals-mcp off): "
                "a person decides with `cellblock approve` or POST .../approvals/{id}");
        if (tool == "decide_approval") {
            const std::string approval_id = string_argument(arguments, "id", true);
            const std::string decision = AgentOperations::parse_decision(arguments);
            return on_session(
                name, caller, id, reply,
                [this, approval_id, decision, caller, id, reply](const SessionPtr& session) {
                    operations_.decide_approval(
                        session, approval_id, decision, caller,
                        rendered<json>(id, reply, [](const json& approval) {
                            json result = mcp_tool_text(
                                "approval " + approval.value("id", "") + " (" + approval.value("host", "") +
                                    "): " +
                                    (approval.contains("decision") && approval["decision"].is_string()
                                         ? approval["decision"].get<std::string>()
                                         : std::string("pending")),
                                false);
                            result["structuredContent"] = approval;
                            return result;
                        }));
                });
        }
        if (tool == "list_files") {
            return on_session(name, caller, id, reply, [this, id, reply](const SessionPtr& session) {
                operations_.list_files(
                    session, rendered<std::vector<WorkspaceFile>>(
                                 id, reply, [](const std::vector<WorkspaceFile>& found) {
                                     json files = json::array();
                                     std::string text;
                                     for (const WorkspaceFile& file : found) {
                                         files.push_back({{"path", file.path}, {"size", file.size}});
                                         text += file.path + "\t" + std::to_string(file.size) + " bytes\n";
                                     }
                                     if (text.empty())
                                         text = "(the workspace is empty)\n";
                                     json result = mcp_tool_text(text, false);
                                     result["structuredContent"] = {{"files", files}};
                                     return result;
                                 }));
            });
        }
        if (tool == "upload_file") {
            const std::string path = workspace_path(string_argument(arguments, "path", true));
            std::string bytes;
            if (arguments.contains("content_base64") && !arguments["content_base64"].is_null())
                bytes = decode_base64_argument(string_argument(arguments, "content_base64", true));
            else
                bytes = string_argument(arguments, "content", true);
            const std::size_t size = bytes.size();
            auto shared_bytes = std::make_shared<std::string>(std::move(bytes));
            return on_session(name, caller, id, reply,
                              [this, path, shared_bytes, size, caller, id, reply](const SessionPtr& session) {
                                  operations_.write_file(
                                      session, path, *shared_bytes, caller,
                                      rendered<std::string>(id, reply, [size](const std::string& relative) {
                                          return mcp_tool_text(
                                              "wrote " + relative + " (" + std::to_string(size) + " bytes)",
                                              false);
                                      }));
                              });
        }
        if (tool == "read_file") {
            const std::string path = workspace_path(string_argument(arguments, "path", true));
            return on_session(name, caller, id, reply, [this, path, id, reply](const SessionPtr& session) {
                operations_.read_file(
                    session, path, rendered<std::string>(id, reply, [path](const std::string& bytes) {
                        if (is_valid_utf8(bytes))
                            return mcp_tool_text(shield_text(bytes, max_read_bytes, path).text, false);
                        if (bytes.size() > max_read_bytes)
                            return mcp_tool_text(
                                path + " is a binary file of " + std::to_string(bytes.size()) +
                                    " bytes, too large to return inline; process it with run_python instead",
                                true);
                        return json{{"content", json::array({{{"type", "resource"},
                                                              {"resource",
                                                               {{"uri", "file:///workspace/" + path},
                                                                {"mimeType", "application/octet-stream"},
                                                                {"blob", base64_encode(bytes)}}}}})},
                                    {"isError", false}};
                    }));
            });
        }
        if (tool == "reset_session") {
            return on_session(name, caller, id, reply, [this, caller, id, reply](const SessionPtr& session) {
                operations_.reset(
                    session, caller, rendered<SessionPtr>(id, reply, [](const SessionPtr&) {
                        return mcp_tool_text(
                            "the session's interpreter was restarted; files in its workspace are kept",
                            false);
                    }));
            });
        }
        throw OperationError(OperationErrorKind::malformed, "unknown_tool", "unknown tool: " + tool);
    }

    AgentOperations& operations_;
    bool approvals_mcp_;
    McpProtocol protocol_;
};

}  // namespace

void register_mcp_endpoint(Router& router, AgentService& service) {
    router.add("/mcp", std::make_shared<McpResource>(service));
}

}  // namespace cellblock::gateway::agent
