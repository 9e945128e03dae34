// cellblock: run code in an agent session of a cellblock-gateway from the shell.
//   cellblock exec --session S 'print(1)'     (stdout/stderr stream as they happen; exit status 1 on
//   error/timeout) cellblock upload --session S FILE [DEST]  (into the session's workspace, the code's cwd)
//   cellblock notebook --session S > s.ipynb  (the session's history as a notebook)
//   cellblock approvals S / cellblock approve S ID allow_once|allow_session|deny  (held network requests)
//   cellblock tenants add|list|show|quota|token|revoke|remove  (the operator's, tenants_command.hpp)
// Sessions are named; `exec` and `upload` create a missing one. --url/--token or
// CELLBLOCK_URL/CELLBLOCK_TOKEN.
#include <CLI/CLI.hpp>
#include <fstream>
#include <iostream>
#include <iterator>
#include <sstream>

#include "agent_client.hpp"
#include "tenants_command.hpp"

using namespace cellblock::cli;
using nlohmann::json;

namespace {

std::string session_path(const std::string& session) {
    return "/agent/v1/sessions/" + encode_path_segment(session);
}

void create_session(AgentClient& client, const std::string& name) {
    const auto response =
        client.request(http::verb::post, "/agent/v1/sessions", json({{"name", name}}).dump());
    if (response.status == 409)
        return;  // created meanwhile by someone else
    AgentClient::check(response, "cannot create session '" + name + "'");
    std::cerr << "cellblock: created session '" << name << "'\n";
}

std::string read_code(const std::string& argument) {
    if (argument != "-")
        return argument;
    return std::string(std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>());
}

int run_exec(AgentClient& client, const std::string& session, const std::string& code,
             std::optional<double> timeout_s) {
    json body = {{"code", code}};
    if (timeout_s)
        body["timeout_s"] = *timeout_s;
    json end;
    bool stdout_cut = false, stderr_cut = false;  // the gateway stopped streaming a long output
    auto on_line = [&](const std::string& line) {
        const json event = json::parse(line, nullptr, false);
        if (!event.is_object())
            return;
        const std::string type = event.value("type", "");
        if (type == "stdout")
            std::cout << event.value("text", "") << std::flush;
        else if (type == "stderr")
            std::cerr << event.value("text", "") << std::flush;
        else if (type == "notice")
            (event.value("text", "").find("stdout") != std::string::npos ? stdout_cut : stderr_cut) = true;
        else if (type == "approval" && event.value("state", "") == "pending")
            std::cerr << "cellblock: network request to " << event.value("host", "") << ":"
                      << event.value("port", 0) << " is held for approval (id " << event.value("id", "")
                      << "): cellblock approve " << session << " " << event.value("id", "")
                      << " allow_once|allow_session|deny\n"
                      << std::flush;
        else if (type == "end")
            end = event;
    };
    // The final answer holds head + "[cellblock: N bytes omitted ...]" + tail: print from the marker on.
    auto print_rest = [&end](const char* field, std::ostream& out) {
        const std::string text = end.value(field, "");
        const auto marker = text.find("\n[cellblock: ");
        if (marker != std::string::npos)
            out << text.substr(marker) << (text.ends_with('\n') ? "" : "\n");
    };
    std::string error_body;
    int status = client.stream_lines(session_path(session) + "/execute", body, on_line, error_body);
    if (status == 404) {
        const json parsed = json::parse(error_body, nullptr, false);
        if (parsed.is_object() && parsed.value("reason", "") == "unknown_session") {
            create_session(client, session);
            error_body.clear();
            status = client.stream_lines(session_path(session) + "/execute", body, on_line, error_body);
        }
    }
    AgentClient::check({status, error_body, ""}, "exec in session '" + session + "' failed");
    if (!end.is_object())
        throw ClientError("the gateway ended the stream without a final answer");
    if (stdout_cut)
        print_rest("stdout", std::cout);
    if (stderr_cut)
        print_rest("stderr", std::cerr);
    if (end.contains("result") && end["result"].is_object()) {
        std::string text = end["result"].value("text/plain", "");
        std::cout << text << (text.ends_with('\n') ? "" : "\n");
    }
    const int displays = static_cast<int>(end.value("displays", json::array()).size());
    if (displays > 0)
        std::cerr << "cellblock: " << displays << " display output(s) (e.g. plots) not shown; "
                  << "see `cellblock notebook`\n";
    if (end.contains("error") && end["error"].is_object())
        std::cerr << end["error"].value("traceback", "") << "\n";
    if (end.contains("saved"))
        std::cerr << "cellblock: full output saved in the workspace: " << end["saved"].dump() << "\n";
    if (end.contains("notice"))
        std::cerr << "cellblock: " << end["notice"].get<std::string>() << "\n";
    const std::string outcome = end.value("status", "error");
    if (outcome == "timeout")
        std::cerr << "cellblock: timed out\n";
    return outcome == "ok" ? 0 : 1;
}

int run_upload(AgentClient& client, const std::string& session, const std::string& file,
               std::string destination) {
    std::ifstream input(file, std::ios::binary);
    if (!input)
        throw ClientError("cannot read " + file + ": " + std::strerror(errno));
    const std::string bytes((std::istreambuf_iterator<char>(input)), std::istreambuf_iterator<char>());
    if (destination.empty())
        destination = std::filesystem::path(file).filename().string();
    std::string encoded;
    std::stringstream parts(destination);
    for (std::string part; std::getline(parts, part, '/');) {
        if (part.empty())
            continue;
        encoded += "/" + encode_path_segment(part);
    }
    const std::string path = session_path(session) + "/files" + encoded;
    auto response = client.request(http::verb::put, path, bytes, "application/octet-stream");
    if (response.status == 404 && response.body.find("unknown_session") != std::string::npos) {
        create_session(client, session);
        response = client.request(http::verb::put, path, bytes, "application/octet-stream");
    }
    AgentClient::check(response, "upload of " + file + " failed");
    std::cerr << "cellblock: uploaded " << file << " to " << destination << " (" << bytes.size()
              << " bytes)\n";
    return 0;
}

int run_notebook(AgentClient& client, const std::string& session, bool skip_errors) {
    const auto response = client.request(
        http::verb::get, session_path(session) + "/notebook" + (skip_errors ? "?errors=skip" : ""));
    AgentClient::check(response, "cannot export session '" + session + "'");
    std::cout << response.body << "\n";
    return 0;
}

int run_sessions(AgentClient& client) {
    const auto response = client.request(http::verb::get, "/agent/v1/sessions");
    AgentClient::check(response, "cannot list sessions");
    const json parsed = json::parse(response.body, nullptr, false);
    for (const json& session : parsed.value("sessions", json::array()))
        std::cout << session.value("name", "") << "\t" << session.value("id", "") << "\t"
                  << session.value("state", "") << "\t" << session.value("cells", 0) << " cells\n";
    return 0;
}

int run_approvals(AgentClient& client, const std::string& session) {
    const auto response = client.request(http::verb::get, session_path(session) + "/approvals");
    AgentClient::check(response, "cannot list the approvals of session '" + session + "'");
    const json parsed = json::parse(response.body, nullptr, false);
    for (const json& approval : parsed.value("approvals", json::array())) {
        const auto text = [&approval](const char* key) {
            return approval.contains(key) && approval[key].is_string() ? approval[key].get<std::string>()
                                                                       : std::string("-");
        };
        std::cout << text("id") << "\t" << text("host") << ":" << approval.value("port", 0) << "\t"
                  << text("method") << "\t" << text("state") << "\t" << text("decision") << "\t"
                  << text("decided_by") << "\t" << text("requested") << "\n";
    }
    return 0;
}

int run_approve(AgentClient& client, const std::string& session, const std::string& approval_id,
                const std::string& decision) {
    const auto response = client.request(
        http::verb::post, session_path(session) + "/approvals/" + encode_path_segment(approval_id),
        json({{"decision", decision}}).dump());
    AgentClient::check(response, "cannot decide approval " + approval_id);
    const json approval = json::parse(response.body, nullptr, false);
    std::cerr << "cellblock: " << approval.value("host", "") << ":" << approval.value("port", 0) << " "
              << decision << "\n";
    return 0;
}

std::string environment(const char* name, const std::string& fallback) {
    const char* value = std::getenv(name);
    return value && *value ? value : fallback;
}

}  // namespace

int main(int argc, char** argv) {
    CLI::App app{"cellblock: run Python in a cellblock-gateway agent session"};
    app.require_subcommand(1);
    std::string url = environment("CELLBLOCK_URL", "http://127.0.0.1:8888");
    std::string token = environment("CELLBLOCK_TOKEN", "");
    app.add_option("--url", url, "gateway URL (env CELLBLOCK_URL; default http://127.0.0.1:8888)");
    std::string token_argument, token_file;
    auto* token_option = app.add_option("--token", token_argument,
                                        "gateway token (env CELLBLOCK_TOKEN; on the command line any local "
                                        "user reads it: prefer --token-file or the environment)");
    app.add_option("--token-file", token_file, "read the gateway token from this file")
        ->check(CLI::ExistingFile)
        ->excludes(token_option);
    app.set_version_flag("--version", "cellblock " CELLBLOCK_VERSION);

    std::string session, code, file, destination;
    std::optional<double> timeout_s;
    bool skip_errors = false;
    auto* exec =
        app.add_subcommand("exec", "run code in a session (created if missing) and print what it produced");
    exec->add_option("--session,-s", session, "session name or id")->required();
    exec->add_option("--timeout", timeout_s, "interrupt after this many seconds")->check(CLI::PositiveNumber);
    exec->add_option("code", code, "Python source, or - to read it from stdin")->required();
    auto* upload = app.add_subcommand("upload", "copy a local file into the session's workspace");
    upload->add_option("--session,-s", session, "session name or id")->required();
    upload->add_option("file", file, "local file")->required()->check(CLI::ExistingFile);
    upload->add_option("dest", destination, "path in the workspace (default: the file's name)");
    auto* notebook = app.add_subcommand("notebook", "print the session's history as a .ipynb notebook");
    notebook->add_option("--session,-s", session, "session name or id")->required();
    notebook->add_flag("--skip-errors", skip_errors, "leave out cells that failed or timed out");
    auto* sessions = app.add_subcommand("sessions", "list the gateway's agent sessions");
    std::string approval_id, decision;
    auto* approvals = app.add_subcommand(
        "approvals",
        "list a session's network requests held for approval (id, host:port, method, state, decision, "
        "decided by, requested)");
    approvals->add_option("session", session, "session name or id")->required();
    auto* approve = app.add_subcommand("approve", "answer a held network request");
    approve->add_option("session", session, "session name or id")->required();
    approve->add_option("id", approval_id, "the approval's id (cellblock approvals SESSION)")->required();
    approve->add_option("decision", decision, "allow_once, allow_session or deny")
        ->required()
        ->check(CLI::IsMember({"allow_once", "allow_session", "deny"}));
    TenantsCommand tenants(app);
    CLI11_PARSE(app, argc, argv);
    if (*token_option) {
        std::cerr << "cellblock: warning: --token on the command line is readable by every local user "
                     "(/proc/PID/cmdline); use --token-file or CELLBLOCK_TOKEN\n";
        token = token_argument;
    }
    if (!token_file.empty()) {
        std::ifstream input(token_file);
        std::getline(input, token);
        if (!token.empty() && token.back() == '\r')
            token.pop_back();
    }

    try {
        AgentClient client(GatewayAddress::parse(url), token);
        if (*exec)
            return run_exec(client, session, read_code(code), timeout_s);
        if (*upload)
            return run_upload(client, session, file, destination);
        if (*notebook)
            return run_notebook(client, session, skip_errors);
        if (*sessions)
            return run_sessions(client);
        if (*approvals)
            return run_approvals(client, session);
        if (*approve)
            return run_approve(client, session, approval_id, decision);
        if (tenants.chosen())
            return tenants.run(client);
    } catch (const ClientError& error) {
        std::cerr << "cellblock: " << error.what() << "\n";
        return 2;
    } catch (const std::exception& error) {
        std::cerr << "cellblock: unexpected error: " << error.what() << "\n";
        return 2;
    }
    return 0;
}
