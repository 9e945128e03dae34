"""REST (/agent/v1) and MCP (/mcp) are two translations of one set of agent operations
(gateway/src/agent/agent_operations.cpp): the same request gets the same answer through both. MCP is driven by the
official TypeScript SDK client (mcp_client/mcp_calls.mjs), REST by plain HTTP."""
import hashlib
import json
import os
import subprocess
import threading
import time
import uuid

import pytest

from test_agent_clients import MCP_CLIENT_DIR, mcp_client, tool_text  # noqa: F401 (mcp_client is a fixture)


def mcp_calls(gateway, node, *calls):
    """Runs the tool calls in order through the SDK client; each answer is {"result": ...} or {"error": ...}."""
    env = dict(os.environ, GATEWAY_URL=gateway.url, GATEWAY_TOKEN=gateway.token)
    done = subprocess.run([node, "mcp_calls.mjs", json.dumps(list(calls))], cwd=MCP_CLIENT_DIR, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{done.stderr}\n--- gateway ---\n{gateway.log_tail()}"
    answers = json.loads(done.stdout)
    assert len(answers) == len(calls)
    return answers


def tool_refusal(answer):
    """The {"reason", "message", ...} of an MCP tool error (a refusal the model reads)."""
    assert "result" in answer, answer
    assert answer["result"]["isError"] is True, answer
    return answer["result"]["structuredContent"]


def run_python(session, code, **extra):
    return {"name": "run_python", "arguments": {"session": session, "code": code, **extra}}


def test_timeout_above_the_session_limit_is_refused_alike(gateway, mcp_client):
    # Generous limit: a first execute on a loaded machine can take seconds (a timeout would restart the kernel).
    gateway.create_session("parity-short", limits={"timeout_s": 60})
    marker = "ran = globals().get('ran', 0) + 1"
    rest = gateway.request("POST", "/agent/v1/sessions/parity-short/execute", json={"code": marker, "timeout_s": 61})
    assert rest.status_code == 400, rest.text
    [mcp] = mcp_calls(gateway, mcp_client, run_python("parity-short", marker, timeout_s=61))
    refusal = tool_refusal(mcp)
    assert rest.json()["reason"] == refusal["reason"] == "bad_limit"
    assert rest.json()["message"] == refusal["message"] and "timeout_s" in refusal["message"]
    assert rest.json()["limit"] == refusal["limit"] == "timeout_s"
    # Refused, not clamped: the code ran through neither.
    unchanged = gateway.execute("parity-short", "globals().get('ran', 0)")
    assert unchanged["status"] == "ok" and unchanged["result"]["text/plain"] == "0", unchanged
    # Within the limit both run it.
    assert gateway.execute("parity-short", marker, timeout_s=60)["status"] == "ok"
    [mcp_ok] = mcp_calls(gateway, mcp_client, run_python("parity-short", marker, timeout_s=60))
    assert mcp_ok["result"]["isError"] is False, mcp_ok
    assert gateway.execute("parity-short", "ran")["result"]["text/plain"] == "2"


def test_malformed_execute_is_refused_alike(gateway, mcp_client):
    gateway.create_session("parity-malformed")
    for arguments, reason in (({}, "missing_code"), ({"code": "1", "timeout_s": "soon"}, "bad_type"),
                              ({"code": "1", "timeout_s": -1}, "bad_type")):
        rest = gateway.request("POST", "/agent/v1/sessions/parity-malformed/execute", json=arguments)
        assert rest.status_code == 400 and rest.json()["reason"] == reason, rest.text
        [mcp] = mcp_calls(gateway, mcp_client,
                          {"name": "run_python", "arguments": {"session": "parity-malformed", **arguments}})
        # A malformed call is a JSON-RPC invalid-params error on MCP, with the same reason and message.
        assert mcp["error"]["code"] == -32602, mcp
        assert mcp["error"]["data"]["reason"] == reason
        assert mcp["error"]["data"]["message"] == rest.json()["message"]


def test_a_full_queue_is_refused_alike(gateway, mcp_client):
    name = "parity-busy"
    gateway.create_session(name)
    url = f"/agent/v1/sessions/{name}/execute"
    answers, lock = [], threading.Lock()

    def execute(code):
        response = gateway.request("POST", url, json={"code": code})
        with lock:
            answers.append(response)

    # One execute runs (blocked until the session is deleted), then the queue behind it fills to its cap of 64.
    workers = [threading.Thread(target=execute, args=("import time\ntime.sleep(600)",))]
    workers[0].start()
    deadline = time.monotonic() + 120
    while gateway.request("GET", f"/agent/v1/sessions/{name}").json()["state"] != "busy":
        assert time.monotonic() < deadline, gateway.log_tail()
        time.sleep(0.2)
    workers += [threading.Thread(target=execute, args=(f"queued = {i}",)) for i in range(64)]
    for worker in workers[1:]:
        worker.start()
    while gateway.request("GET", f"/agent/v1/sessions/{name}").json()["queued"] < 64:
        assert time.monotonic() < deadline, gateway.log_tail()
        time.sleep(0.2)
    try:
        rest = gateway.request("POST", url, json={"code": "'one too many'"})
        assert rest.status_code == 429, rest.text
        # Refused at once; generous bound so that an execute queued by mistake shows as a timeout, not a hang.
        [mcp] = mcp_calls(gateway, mcp_client, {**run_python(name, "'one too many'"), "timeout_s": 60})
        refusal = tool_refusal(mcp)
        assert rest.json()["reason"] == refusal["reason"] == "session_busy"
        assert rest.json()["message"] == refusal["message"]
        assert gateway.request("GET", f"/agent/v1/sessions/{name}").json()["queued"] == 64  # nothing was added
    finally:
        gateway.request("DELETE", f"/agent/v1/sessions/{name}")
        for worker in workers:
            worker.join(timeout=120)
    # Every accepted execute got its one answer: deleted while running or queued, none ran to completion.
    assert len(answers) == 65, [answer.status_code for answer in answers]
    assert all(answer.status_code in (200, 410) for answer in answers)
    assert not [answer for answer in answers if answer.status_code == 200 and answer.json()["status"] == "ok"]


def test_file_writes_are_audited_alike(gateway, mcp_client):
    name = "parity-files"
    gateway.create_session(name)
    rest = gateway.request("PUT", f"/agent/v1/sessions/{name}/files/from-rest.txt", data=b"rest bytes")
    assert rest.status_code == 201, rest.text
    [mcp] = mcp_calls(gateway, mcp_client, {"name": "upload_file",
                                            "arguments": {"session": name, "path": "from-mcp.txt",
                                                          "content": "mcp bytes"}})
    assert mcp["result"]["isError"] is False, mcp
    entries = gateway.request("GET", f"/agent/v1/sessions/{name}/audit", params={"event": "file_put"}).json()
    by_path = {entry["path"]: entry for entry in entries["entries"]}
    assert set(by_path) == {"from-rest.txt", "from-mcp.txt"}, entries
    for path, content, via in (("from-rest.txt", b"rest bytes", "http"), ("from-mcp.txt", b"mcp bytes", "mcp")):
        entry = by_path[path]
        assert entry["bytes"] == len(content) and entry["sha256"] == hashlib.sha256(content).hexdigest()
        assert entry["via"] == via and entry["client"]
    # Both wrote into the same workspace, each readable through the other.
    assert gateway.request("GET", f"/agent/v1/sessions/{name}/files/from-mcp.txt").content == b"mcp bytes"
    [read] = mcp_calls(gateway, mcp_client, {"name": "read_file", "arguments": {"session": name,
                                                                              "path": "from-rest.txt"}})
    assert tool_text(read["result"]) == "rest bytes"


def test_an_unknown_session_is_the_same_error(gateway, mcp_client):
    deleted = gateway.create_session("parity-deleted")["id"]
    assert gateway.request("DELETE", f"/agent/v1/sessions/{deleted}").status_code == 204
    for session in (str(uuid.uuid4()), deleted):
        rest_execute = gateway.request("POST", f"/agent/v1/sessions/{session}/execute", json={"code": "1"})
        rest_read = gateway.request("GET", f"/agent/v1/sessions/{session}/files/a.txt")
        for rest in (rest_execute, rest_read):
            assert rest.status_code == 404 and rest.json()["reason"] == "unknown_session", rest.text
        answers = mcp_calls(gateway, mcp_client, run_python(session, "1"),
                            {"name": "read_file", "arguments": {"session": session, "path": "a.txt"}},
                            {"name": "list_files", "arguments": {"session": session}})
        for answer in answers:
            refusal = tool_refusal(answer)
            assert refusal["reason"] == "unknown_session"
            assert refusal["message"] == rest_execute.json()["message"]
    # An MCP call never brought a session of that id into being.
    ids = {entry["id"] for entry in gateway.request("GET", "/agent/v1/sessions").json()["sessions"]}
    assert deleted not in ids
