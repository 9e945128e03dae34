"""The agent API's two client surfaces besides raw HTTP: the `cellblock` CLI and the MCP endpoint driven by the
official TypeScript SDK client (@modelcontextprotocol/sdk, StreamableHTTPClientTransport)."""
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import nbformat
import pytest

from conftest import CLI_BINARY, AgentGateway

MCP_CLIENT_DIR = Path(__file__).resolve().parent / "mcp_client"


def cli(gateway, *arguments, stdin=None, url=None):
    env = dict(os.environ, CELLBLOCK_URL=url or gateway.url, CELLBLOCK_TOKEN=gateway.token)
    return subprocess.run([str(CLI_BINARY), *arguments], input=stdin, capture_output=True, text=True, env=env,
                          timeout=180)


def test_cli_exec_upload_notebook(gateway, tmp_path):
    data = tmp_path / "sales.csv"
    data.write_text("product,units\napple,3\npear,5\napple,4\n")
    upload = cli(gateway, "upload", "--session", "cli", str(data), "input/sales.csv")
    assert upload.returncode == 0, upload.stderr
    assert "input/sales.csv" in upload.stderr
    run = cli(gateway, "exec", "--session", "cli",
              "import pandas as pd\nprint(pd.read_csv('input/sales.csv').groupby('product').units.sum().to_dict())\n6*7")
    assert run.returncode == 0, run.stderr
    assert run.stdout == "{'apple': 7, 'pear': 5}\n42\n"
    from_stdin = cli(gateway, "exec", "--session", "cli", "-", stdin="print('from stdin')")
    assert from_stdin.returncode == 0 and from_stdin.stdout == "from stdin\n"
    failed = cli(gateway, "exec", "--session", "cli", "1/0")
    assert failed.returncode == 1
    assert "ZeroDivisionError" in failed.stderr and "\x1b" not in failed.stderr
    timed_out = cli(gateway, "exec", "--session", "cli", "--timeout", "1", "import time; time.sleep(60)")
    assert timed_out.returncode == 1 and "timed out" in timed_out.stderr
    notebook = cli(gateway, "notebook", "--session", "cli")
    assert notebook.returncode == 0, notebook.stderr
    parsed = nbformat.reads(notebook.stdout, as_version=4)
    nbformat.validate(parsed)
    assert any("6*7" in cell.source for cell in parsed.cells)


def test_cli_errors_are_readable(gateway):
    wrong_token = subprocess.run([str(CLI_BINARY), "--url", gateway.url, "--token", "wrong", "exec", "--session", "x",
                                  "1"], capture_output=True, text=True, timeout=60)
    assert wrong_token.returncode == 2
    assert "token" in wrong_token.stderr and "401" in wrong_token.stderr
    unreachable = cli(gateway, "exec", "--session", "x", "1", url="http://127.0.0.1:1")
    assert unreachable.returncode == 2
    assert "cannot connect" in unreachable.stderr and "CELLBLOCK_URL" in unreachable.stderr
    missing = cli(gateway, "notebook", "--session", "never-created")
    assert missing.returncode == 2 and "never-created" in missing.stderr


TOKEN_ON_ARGV_WARNING = "warning: --token on the command line is readable by every local user"


def test_cli_reads_its_token_from_a_file_and_warns_when_it_is_on_the_command_line(gateway, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("CELLBLOCK_TOKEN", "CELLBLOCK_URL")}
    token_file = tmp_path / "token"
    with os.fdopen(os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as out:
        out.write(gateway.token + "\n")
    with_file = [str(CLI_BINARY), "--url", gateway.url, "--token-file", str(token_file)]
    # A run long enough to read its command line from /proc, as any local user could: the token is not there.
    running = subprocess.Popen([*with_file, "exec", "--session", "token-file", "import time; time.sleep(2); 6*7"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 10
        while not (cmdline := Path(f"/proc/{running.pid}/cmdline").read_bytes()).startswith(bytes(CLI_BINARY)):
            assert time.monotonic() < deadline and running.poll() is None, cmdline
            time.sleep(0.01)
        stdout, stderr = running.communicate(timeout=120)
    finally:
        running.kill()
    assert str(token_file).encode() in cmdline and gateway.token.encode() not in cmdline, cmdline
    assert running.returncode == 0 and stdout == "42\n", stderr
    assert "warning" not in stderr, stderr
    listed = subprocess.run([*with_file, "sessions"], capture_output=True, text=True, env=env, timeout=60)
    assert listed.returncode == 0 and listed.stderr == "", listed.stderr
    assert any(line.split("\t")[0] == "token-file" for line in listed.stdout.splitlines()), listed.stdout
    # The file is what authenticates: a wrong token in it is refused.
    wrong_file = tmp_path / "wrong-token"
    with os.fdopen(os.open(wrong_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as out:
        out.write("wrong\n")
    refused = subprocess.run([str(CLI_BINARY), "--url", gateway.url, "--token-file", str(wrong_file), "sessions"],
                             capture_output=True, text=True, env=env, timeout=60)
    assert refused.returncode == 2 and "401" in refused.stderr, refused.stderr
    # The same command with the token on argv works, and says on stderr that the token is exposed.
    on_argv = subprocess.run([str(CLI_BINARY), "--url", gateway.url, "--token", gateway.token, "sessions"],
                             capture_output=True, text=True, env=env, timeout=60)
    assert on_argv.returncode == 0 and on_argv.stdout == listed.stdout, on_argv.stderr
    assert TOKEN_ON_ARGV_WARNING in on_argv.stderr and "--token-file" in on_argv.stderr, on_argv.stderr


@pytest.fixture(scope="module")
def mcp_client():
    node, npm = shutil.which("node"), shutil.which("npm")
    if not node or not npm:
        pytest.fail("node and npm are required (share/scripts/install-deps.sh --with-test-tools installs them)")
    if not (MCP_CLIENT_DIR / "node_modules" / "@modelcontextprotocol" / "sdk").is_dir():
        result = subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"], cwd=MCP_CLIENT_DIR,
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, f"npm ci failed:\n{result.stdout}\n{result.stderr}"
    return node


def tool_text(result):
    return "".join(block["text"] for block in result["content"] if block["type"] == "text")


def test_mcp_sdk_client_runs_python_and_uses_files(gateway, mcp_client):
    env = dict(os.environ, GATEWAY_URL=gateway.url, GATEWAY_TOKEN=gateway.token, MCP_SESSION="mcp-analysis")
    result = subprocess.run([mcp_client, "mcp_session.mjs"], cwd=MCP_CLIENT_DIR, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, f"{result.stderr}\n--- gateway ---\n{gateway.log_tail()}"
    report = json.loads(result.stdout)
    assert report["server"]["name"] == "cellblock"
    assert {"run_python", "list_files", "upload_file", "read_file", "reset_session"} <= set(report["tools"])
    assert report["upload"]["isError"] is False
    assert "data/sales.csv" in tool_text(report["list"])
    run = report["run"]
    assert run["isError"] is False
    assert "apple,7" in tool_text(run) and "pear,5" in tool_text(run) and "42" in tool_text(run)
    assert run["structuredContent"]["result"]["text/plain"] == "42"
    assert report["state"]["structuredContent"]["result"]["text/plain"] == "5"  # state persists between calls
    assert report["error"]["isError"] is True and "ZeroDivisionError" in tool_text(report["error"])
    assert tool_text(report["read"]).startswith("product,units")
    assert report["escape"]["isError"] is True and "root:" not in tool_text(report["escape"])
    assert report["reset"]["isError"] is False
    assert report["after_reset"]["structuredContent"]["result"]["text/plain"] == "False"
    # The MCP session is an ordinary agent session, visible over HTTP.
    assert gateway.request("GET", "/agent/v1/sessions/mcp-analysis").status_code == 200


def test_mcp_json_rpc_edges_over_plain_http(gateway):
    def rpc(payload, **kwargs):
        return gateway.request("POST", "/mcp", json=payload,
                               headers={"Accept": "application/json, text/event-stream"}, **kwargs)

    init = rpc({"jsonrpc": "2.0", "id": 1, "method": "initialize",
                "params": {"protocolVersion": "2025-03-26", "capabilities": {}, "clientInfo": {"name": "t", "version": "0"}}})
    assert init.status_code == 200 and init.headers["Content-Type"] == "application/json"
    assert init.json()["result"]["protocolVersion"] == "2025-03-26"
    assert init.json()["result"]["capabilities"]["tools"] is not None
    assert rpc({"jsonrpc": "2.0", "method": "notifications/initialized"}).status_code == 202
    unknown = rpc({"jsonrpc": "2.0", "id": "x", "method": "resources/list"}).json()
    assert unknown["id"] == "x" and unknown["error"]["code"] == -32601
    missing_code = rpc({"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                        "params": {"name": "run_python", "arguments": {"session": "rpc"}}}).json()
    assert missing_code["error"]["code"] == -32602 and "code" in missing_code["error"]["message"]
    parse = gateway.request("POST", "/mcp", data=b"{oops")
    assert parse.status_code == 400 and parse.json()["error"]["code"] == -32700
    batch = rpc([{"jsonrpc": "2.0", "id": 3, "method": "ping"},
                 {"jsonrpc": "2.0", "method": "notifications/initialized"},
                 {"jsonrpc": "2.0", "id": 4, "method": "tools/call",
                  "params": {"name": "run_python", "arguments": {"session": "rpc", "code": "print('batched')"}}}]).json()
    assert [reply["id"] for reply in batch] == [3, 4]
    assert batch[1]["result"]["isError"] is False and "batched" in batch[1]["result"]["content"][0]["text"]
    # Members of the wrong JSON type (found by tests/fuzz/mcp_jsonrpc.cpp; they were a 500 that lost the whole
    # batch): an Invalid Request, or the protocol's default, and the rest of the batch is answered.
    wrong_types = rpc([{"jsonrpc": 2, "id": 5, "method": "ping"},
                       {"jsonrpc": None, "id": 6},
                       {"jsonrpc": "2.0", "id": 7, "method": "initialize", "params": {"protocolVersion": 5}},
                       {"jsonrpc": "2.0", "id": 8, "method": "ping"}])
    assert wrong_types.status_code == 200, wrong_types.text
    assert [(reply["id"], reply.get("error", {}).get("code")) for reply in wrong_types.json()] == [
        (5, -32600), (6, -32600), (7, None), (8, None)]
    assert wrong_types.json()[2]["result"]["protocolVersion"] == "2025-06-18"
    assert gateway.request("GET", "/mcp").status_code == 405


def test_rest_reset_clears_state_and_history_but_keeps_files(gateway):
    gateway.create_session("resettable")
    gateway.request("PUT", "/agent/v1/sessions/resettable/files/keep.txt", data=b"kept")
    gateway.execute("resettable", "value = 1")
    reset = gateway.request("POST", "/agent/v1/sessions/resettable/reset")
    assert reset.status_code == 200, reset.text
    assert reset.json()["cells"] == 0
    after = gateway.execute("resettable", "('value' in globals(), open('keep.txt').read())")
    assert after["result"]["text/plain"] == "(False, 'kept')"
    events = [e["event"] for e in gateway.request("GET", "/agent/v1/sessions/resettable/audit").json()["entries"]]
    assert "reset" in events


def test_mcp_clients_cannot_decide_approvals_unless_the_operator_allows_it(gateway, tmp_path):
    """The agent's own MCP client reads what its sandboxed code wrote (an approval's host, its output): by default it
    is not offered decide_approval and a call is refused, so prompt-injected text cannot approve its own request."""
    def rpc(server, payload):
        return server.request("POST", "/mcp", json=payload, headers={"Accept": "application/json"}).json()

    listed = rpc(gateway, {"jsonrpc": "2.0", "id": 1, "method": "tools/list"})["result"]["tools"]
    assert "decide_approval" not in {tool["name"] for tool in listed}
    assert "list_approvals" in {tool["name"] for tool in listed}
    called = rpc(gateway, {"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                           "params": {"name": "decide_approval",
                                      "arguments": {"session": "mcp-approver", "id": "x", "decision": "allow_session"}}})
    assert "approvals_not_allowed" in json.dumps(called), called
    # Control: the operator's --approvals-mcp on offers it (and then the call reaches the session's approvals).
    allowing = AgentGateway(tmp_path / "state", tmp_path / "gateway.log", "--approvals-mcp", "on")
    try:
        listed = rpc(allowing, {"jsonrpc": "2.0", "id": 1, "method": "tools/list"})["result"]["tools"]
        assert "decide_approval" in {tool["name"] for tool in listed}
        called = rpc(allowing, {"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                                "params": {"name": "decide_approval",
                                           "arguments": {"session": "mcp-approver", "id": "x", "decision": "deny"}}})
        assert "approvals_not_allowed" not in json.dumps(called), called
    finally:
        allowing.stop()
