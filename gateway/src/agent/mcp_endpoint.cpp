// Model Context Protocol over the Streamable HTTP transport: JSON-RPC 2.0 requests POSTed to /mcp, each
// answered with one application/json body (no server-initiated messages, so no SSE stream is needed; GET
// answers 405 as the transport allows). Tools run Python in named agent sessions, created on demand.
#include <openssl/evp.h>

#include "cellblock/gateway/agent/agent_api.hpp"
#include "cellblock/gateway/agent/output_shield.hpp"
#include "cellblock/gateway/crypto.hpp"
#include "cellblock/sandbox/sandbox.hpp"

namespace cellblock::gateway::agent {

using nlohmann::json;

namespace {

constexpr std::string_view latest_protocol = "2025-06-18";
constexpr std::string_view known_protocols[] = {"2025-11-25", "2025-06-18", "2025-03-26", "2024-11-05"};
constexpr std::size_t max_read_bytes = 1u << 20;  // read_file returns at most this much inline

// JSON-RPC error codes.
constexpr int parse_error = -32700, invalid_request = -32600, method_not_found = -32601,
              invalid_params = -32602;

class ToolError : public std::runtime_error {
  public:
    using std::runtime_error::runtime_error;
};
class ParamsError : public std::runtime_error {
  public:
    using std::runtime_error::runtime_error;
};

json rpc_result(const json& id, json result) {
    return {{"jsonrpc", "2.0"}, {"id", id}, {"result", std::move(result)}};
}
json rpc_error(const json& id, int code, const std::string& message) {
    return {{"jsonrpc", "2.0"}, {"id", id}, {"error", {{"code", code}, {"message", message}}}};
}

json text_content(const std::string& text) {
    return {{"type", "text"}, {"text", text}};
}
json tool_text(const std::string& text, bool is_error) {
    return {{"content", json::array({text_content(text)})}, {"isError", is_error}};
}

std::string decode_base64_argument(const std::string& text) {
    auto decoded = base64_decode(text);
    if (!decoded)
        throw ParamsError("content_base64 is not valid base64");
    return *decoded;
}

const json& tool_definitions() {
    static const json tools = json::array({
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
              {{"type", "number"}, {"description", "interrupt the code after this many seconds"}}}}},
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
        {{"name", "reset_session"},
         {"title", "Reset a session"},
         {"description",
          "Restart the session's Python interpreter: variables and imports are cleared, files stay."},
         {"inputSchema",
          {{"type", "object"},
           {"properties", {{"session", {{"type", "string"}, {"description", "session name"}}}}}}}},
    });
    return tools;
}

std::string string_argument(const json& arguments, const char* name, bool required,
                            const std::string& fallback = {}) {
    if (!arguments.contains(name) || arguments[name].is_null()) {
        if (required)
            throw ParamsError(std::string("missing argument \"") + name + "\"");
        return fallback;
    }
    if (!arguments[name].is_string())
        throw ParamsError(std::string("argument \"") + name + "\" must be a string");
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
    explicit McpResource(AgentService& service) : service_(service) {}
    std::string allowed_methods() const override { return "POST, OPTIONS"; }

    void get(RequestContext&, Responder respond) override {
        HttpResponse response =
            json_error(http::status::method_not_allowed,
                       "this MCP server sends no server-initiated messages (no SSE stream)");
        response.set(http::field::allow, allowed_methods());
        respond(std::move(response));
    }

    void post(RequestContext& context, Responder respond) override {
        const json body = json::parse(context.request.body(), nullptr, false);
        if (body.is_discarded()) {
            return respond(json_response(http::status::bad_request,
                                         rpc_error(nullptr, parse_error, "Parse error: body is not JSON")));
        }
        const std::string client = context.client_address;
        if (!body.is_array()) {
            return handle(body, client, [respond](std::optional<json> reply) {
                if (!reply)
                    return respond(empty_response(http::status::accepted));
                respond(json_response(http::status::ok, *reply));
            });
        }
        if (body.empty())
            return respond(
                json_response(http::status::bad_request, rpc_error(nullptr, invalid_request, "empty batch")));
        // A batch: answer once every member is done, in order, leaving out notifications.
        struct Batch {
            std::vector<std::optional<json>> replies;
            std::size_t left;
        };
        auto batch =
            std::make_shared<Batch>(Batch{std::vector<std::optional<json>>(body.size()), body.size()});
        for (std::size_t i = 0; i < body.size(); ++i) {
            handle(body[i], client, [batch, i, respond](std::optional<json> reply) {
                batch->replies[i] = std::move(reply);
                if (--batch->left > 0)
                    return;
                json replies = json::array();
                for (auto& item : batch->replies)
                    if (item)
                        replies.push_back(std::move(*item));
                if (replies.empty())
                    return respond(empty_response(http::status::accepted));
                respond(json_response(http::status::ok, replies));
            });
        }
    }

  private:
    using Reply = std::function<void(std::optional<json>)>;

    void handle(const json& message, const std::string& client, Reply reply) {
        if (!message.is_object() || message.value("jsonrpc", "") != "2.0" || !message.contains("method") ||
            !message["method"].is_string()) {
            // Responses from the client (to server requests we never send) are accepted and ignored.
            if (message.is_object() && (message.contains("result") || message.contains("error")))
                return reply(std::nullopt);
            return reply(rpc_error(message.is_object() ? message.value("id", json()) : json(),
                                   invalid_request, "Invalid Request"));
        }
        const std::string method = message["method"].get<std::string>();
        const bool notification = !message.contains("id");
        const json id = notification ? json() : message["id"];
        const json params = message.value("params", json::object());
        if (notification)
            return reply(std::nullopt);  // notifications/initialized, cancelled, ...

        if (method == "initialize") {
            std::string version(latest_protocol);
            const std::string requested = params.is_object() ? params.value("protocolVersion", "") : "";
            for (std::string_view known : known_protocols)
                if (requested == known)
                    version = requested;
            return reply(rpc_result(id, {{"protocolVersion", version},
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
            return reply(rpc_result(id, json::object()));
        if (method == "tools/list")
            return reply(rpc_result(id, {{"tools", tool_definitions()}}));
        if (method == "tools/call") {
            if (!params.is_object() || !params.contains("name") || !params["name"].is_string())
                return reply(rpc_error(id, invalid_params, "tools/call needs params.name"));
            const json arguments = params.value("arguments", json::object());
            if (!arguments.is_object())
                return reply(rpc_error(id, invalid_params, "params.arguments must be an object"));
            try {
                call_tool(params["name"].get<std::string>(), arguments, client,
                          [id, reply](json result) { reply(rpc_result(id, std::move(result))); });
            } catch (const ParamsError& error) {
                reply(rpc_error(id, invalid_params, error.what()));
            } catch (const std::exception& error) {
                reply(rpc_result(id, tool_text(error.what(), true)));
            }
            return;
        }
        reply(rpc_error(id, method_not_found, "Method not found: " + method));
    }

    // Finds the named session or creates it with the default limits.
    void with_session(const std::string& name, const std::string& client,
                      std::function<void(std::shared_ptr<AgentSession>)> use,
                      std::function<void(json)> done) {
        if (auto session = service_.sessions().find(name))
            return use(session);
        service_.sessions().create(
            name, service_.config().default_limits, client,
            [this, name, use, done](std::shared_ptr<AgentSession> session, std::optional<HttpError> error) {
                // Two calls for a new name at once: the second finds the session the first is creating.
                if (error && error->status() == http::status::conflict)
                    session = service_.sessions().find(name);
                if (!session) {
                    return done(tool_text(
                        std::string("cannot create the session: ") + (error ? error->what() : "gone"), true));
                }
                session->ensure_kernel([session, use, done](std::optional<std::string> failure) {
                    if (failure)
                        return done(tool_text("the session has no kernel: " + *failure, true));
                    use(session);
                });
            });
    }

    void with_files(const std::string& name, const std::string& client,
                    std::function<json(sandbox::Workspace&)> action, std::function<void(json)> done) {
        with_session(
            name, client,
            [action, done](std::shared_ptr<AgentSession> session) {
                session->touch();
                session->ensure_kernel([session, action, done](std::optional<std::string> error) {
                    if (error || !session->workspace())
                        return done(tool_text("the session has no kernel: " + error.value_or("?"), true));
                    try {
                        sandbox::Workspace workspace(*session->workspace());
                        done(action(workspace));
                    } catch (const std::exception& failure) {
                        done(tool_text(failure.what(), true));
                    }
                });
            },
            done);
    }

    void call_tool(const std::string& tool, const json& arguments, const std::string& client,
                   std::function<void(json)> done) {
        const std::string name = string_argument(arguments, "session", false, "default");
        if (tool == "run_python") {
            ExecuteRequest request;
            request.code = string_argument(arguments, "code", true);
            request.client_address = client;
            request.client_kind = "mcp";
            if (arguments.contains("timeout_s") && !arguments["timeout_s"].is_null()) {
                if (!arguments["timeout_s"].is_number() || arguments["timeout_s"].get<double>() <= 0)
                    throw ParamsError("timeout_s must be a positive number");
                request.timeout_s = arguments["timeout_s"].get<double>();
            }
            return with_session(
                name, client,
                [request, done](std::shared_ptr<AgentSession> session) mutable {
                    request.timeout_s = std::min(
                        request.timeout_s > 0 ? request.timeout_s : session->record().limits.timeout_s,
                        session->record().limits.timeout_s);
                    ExecuteHandlers handlers;
                    handlers.on_done = [done](json answer) { done(execute_content(answer)); };
                    session->execute(std::move(request), std::move(handlers));
                },
                done);
        }
        if (tool == "list_files") {
            return with_files(
                name, client,
                [](sandbox::Workspace& workspace) {
                    json files = json::array();
                    std::string text;
                    for (const auto& entry : workspace.list()) {
                        if (entry.is_directory)
                            continue;
                        files.push_back({{"path", entry.path}, {"size", entry.size}});
                        text += entry.path + "\t" + std::to_string(entry.size) + " bytes\n";
                    }
                    if (text.empty())
                        text = "(the workspace is empty)\n";
                    json result = tool_text(text, false);
                    result["structuredContent"] = {{"files", files}};
                    return result;
                },
                done);
        }
        if (tool == "upload_file") {
            const std::string path =
                string_argument(arguments, "path", true);  // the Workspace refuses escapes
            std::string bytes;
            if (arguments.contains("content_base64") && !arguments["content_base64"].is_null())
                bytes = decode_base64_argument(string_argument(arguments, "content_base64", true));
            else
                bytes = string_argument(arguments, "content", true);
            const std::uint64_t cap = service_.config().max_file_bytes;
            auto shared_bytes = std::make_shared<std::string>(std::move(bytes));
            return with_files(
                name, client,
                [path, shared_bytes, cap](sandbox::Workspace& workspace) {
                    workspace.write_file(path, *shared_bytes, cap);
                    return tool_text(
                        "wrote " + path + " (" + std::to_string(shared_bytes->size()) + " bytes)", false);
                },
                done);
        }
        if (tool == "read_file") {
            const std::string path =
                string_argument(arguments, "path", true);  // the Workspace refuses escapes
            const std::uint64_t cap = service_.config().max_file_bytes;
            return with_files(
                name, client,
                [path, cap](sandbox::Workspace& workspace) {
                    const std::string bytes = workspace.read_file(path, cap);
                    if (is_valid_utf8(bytes)) {
                        return tool_text(shield_text(bytes, max_read_bytes, path).text, false);
                    }
                    if (bytes.size() > max_read_bytes)
                        return tool_text(
                            path + " is a binary file of " + std::to_string(bytes.size()) +
                                " bytes, too large to return inline; process it with run_python instead",
                            true);
                    json result = {{"content", json::array({{{"type", "resource"},
                                                             {"resource",
                                                              {{"uri", "file:///workspace/" + path},
                                                               {"mimeType", "application/octet-stream"},
                                                               {"blob", base64_encode(bytes)}}}}})},
                                   {"isError", false}};
                    return result;
                },
                done);
        }
        if (tool == "reset_session") {
            return with_session(
                name, client,
                [client, done](std::shared_ptr<AgentSession> session) {
                    session->reset(client, [done](std::optional<std::string> error) {
                        if (error)
                            return done(tool_text("reset failed: " + *error, true));
                        done(tool_text(
                            "the session's interpreter was restarted; files in its workspace are kept",
                            false));
                    });
                },
                done);
        }
        throw ParamsError("unknown tool: " + tool);
    }

    AgentService& service_;
};

}  // namespace

void register_mcp_endpoint(Router& router, AgentService& service) {
    router.add("/mcp", std::make_shared<McpResource>(service));
}

}  // namespace cellblock::gateway::agent
