"""Tenants on the isolated routes, and their quotas: each tenant's tokens see only what that tenant created (agent sessions, Kernel
Gateway kernels, /api/sessions), through REST, the kernel WebSocket, NDJSON and MCP (the official SDK client); another
tenant's id answers exactly what an unknown id answers; roles (agent, approver) limit what a token does; the operator
sees everything with its tenant; and a restarted gateway keeps every owner."""
import json
import threading
import time
import os
import subprocess
import uuid

import pytest
import requests
import websocket

from conftest import AgentGateway
from test_agent_clients import MCP_CLIENT_DIR, mcp_client  # noqa: F401 (mcp_client is a fixture)
from test_durable_sessions import Channels


class Tenant:
    """A tenant's token as a client holds it."""

    def __init__(self, gateway, token):
        self.gateway, self.token = gateway, token
        self.http = requests.Session()
        self.http.headers["Authorization"] = f"token {token}"

    def request(self, method, path, **kwargs):
        kwargs.setdefault("timeout", 120)
        return self.http.request(method, self.gateway.url + path, **kwargs)

    def channels(self, kernel_id):
        return TenantChannels(self, kernel_id)


class TenantChannels(Channels):
    """The kernel's /channels WebSocket (Channels of the durable tests) opened with a tenant's token."""

    def __init__(self, tenant, kernel_id):  # noqa: super().__init__ would use the operator's token
        self.session_id = uuid.uuid4().hex
        url = tenant.gateway.url.replace("http", "ws", 1) + f"/api/kernels/{kernel_id}/channels"
        self.socket = websocket.create_connection(url, header=[f"Authorization: token {tenant.token}"], timeout=60)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """One gateway with tenants alice (agent and approver tokens) and bob, and one agent session "main" each."""
    directory = tmp_path_factory.mktemp("tenant-isolation")
    gateway = AgentGateway(directory / "state", directory / "gateway.log", keep_kernels=False)
    try:
        tokens = {}
        for name in ("alice", "bob"):
            added = gateway.request("POST", "/agent/v1/tenants", json={"name": name})
            assert added.status_code == 201, added.text
            tokens[name] = added.json()["token"]
        approver = gateway.request("POST", "/agent/v1/tenants/alice/tokens", json={"role": "approver"})
        assert approver.status_code == 201, approver.text
        alice, bob = Tenant(gateway, tokens["alice"]), Tenant(gateway, tokens["bob"])
        sessions = {}
        for who, client in (("alice", alice), ("bob", bob)):
            created = client.request("POST", "/agent/v1/sessions", json={"name": "main"})
            assert created.status_code == 201, created.text
            sessions[who] = created.json()
        ran = alice.request("POST", f"/agent/v1/sessions/{sessions['alice']['id']}/execute",
                            json={"code": "secret = 'alice-only'"})
        assert ran.status_code == 200 and ran.json()["status"] == "ok", ran.text
        yield {"gateway": gateway, "alice": alice, "bob": bob, "sessions": sessions,
               "approver": Tenant(gateway, approver.json()["token"])}
    finally:
        gateway.stop()


def unknown_answer(client, method, path_template, **kwargs):
    """What `client` gets for an id of nothing at all, to compare another tenant's id with."""
    return client.request(method, path_template.format(id=str(uuid.uuid4())), **kwargs)


def same_as_unknown(answer, unknown, other_id):
    """Another tenant's id answers as an unknown one: the same status and body, but for the id itself."""
    assert answer.status_code == unknown.status_code == 404, (answer.text, unknown.text)
    mine = json.loads(answer.text.replace(other_id, "ID"))
    theirs = unknown.json()
    for key in ("reason",):
        assert mine.get(key) == theirs.get(key), (mine, theirs)
    assert set(mine) == set(theirs), (mine, theirs)


def test_each_tenant_lists_only_its_own_sessions_and_names_are_per_tenant(world):
    alice, bob, sessions = world["alice"], world["bob"], world["sessions"]
    assert [s["id"] for s in alice.request("GET", "/agent/v1/sessions").json()["sessions"]] == [sessions["alice"]["id"]]
    assert [s["id"] for s in bob.request("GET", "/agent/v1/sessions").json()["sessions"]] == [sessions["bob"]["id"]]
    # Both are called "main": a name resolves within its tenant.
    assert alice.request("GET", "/agent/v1/sessions/main").json()["id"] == sessions["alice"]["id"]
    assert bob.request("GET", "/agent/v1/sessions/main").json()["id"] == sessions["bob"]["id"]
    # The operator sees both, each with its tenant.
    listed = world["gateway"].request("GET", "/agent/v1/sessions").json()["sessions"]
    owners = {s["id"]: s.get("tenant") for s in listed}
    assert owners[sessions["alice"]["id"]] == "alice" and owners[sessions["bob"]["id"]] == "bob"


@pytest.mark.parametrize("method,path,body", [
    ("GET", "/agent/v1/sessions/{id}", None),
    ("DELETE", "/agent/v1/sessions/{id}", None),
    ("POST", "/agent/v1/sessions/{id}/execute", {"code": "print(secret)"}),
    ("POST", "/agent/v1/sessions/{id}/reset", None),
    ("GET", "/agent/v1/sessions/{id}/files", None),
    ("PUT", "/agent/v1/sessions/{id}/files/planted.txt", None),
    ("GET", "/agent/v1/sessions/{id}/notebook", None),
    ("GET", "/agent/v1/sessions/{id}/audit", None),
    ("GET", "/agent/v1/sessions/{id}/approvals", None),
])
def test_another_tenants_session_answers_like_an_unknown_id(world, method, path, body):
    bob, alice_id = world["bob"], world["sessions"]["alice"]["id"]
    kwargs = {"json": body} if body is not None else {}
    answer = bob.request(method, path.format(id=alice_id), **kwargs)
    same_as_unknown(answer, unknown_answer(bob, method, path, **kwargs), alice_id)
    # Nothing happened to alice's session: still there, its state intact, no file planted.
    alice = world["alice"]
    still = alice.request("POST", f"/agent/v1/sessions/{alice_id}/execute", json={"code": "print(secret)"})
    assert still.status_code == 200 and still.json()["stdout"] == "alice-only\n", still.text
    files = alice.request("GET", f"/agent/v1/sessions/{alice_id}/files").json()
    assert "planted.txt" not in json.dumps(files)


def test_the_events_stream_of_another_tenants_session_is_404(world):
    bob, alice_id = world["bob"], world["sessions"]["alice"]["id"]
    answer = bob.request("GET", f"/agent/v1/sessions/{alice_id}/events",
                         headers={"Accept": "text/event-stream"}, stream=True)
    assert answer.status_code == 404, answer.text
    answer.close()


def test_ndjson_execute_in_another_tenants_session_is_404_and_runs_nothing(world):
    bob, alice_id = world["bob"], world["sessions"]["alice"]["id"]
    answer = bob.request("POST", f"/agent/v1/sessions/{alice_id}/execute",
                         json={"code": "secret = 'bob was here'"}, headers={"Accept": "application/x-ndjson"})
    assert answer.status_code == 404, answer.text
    check = world["alice"].request("POST", f"/agent/v1/sessions/{alice_id}/execute", json={"code": "print(secret)"})
    assert check.json()["stdout"] == "alice-only\n"


def test_kernels_started_by_a_tenant_are_its_own_over_rest_and_websocket(world):
    alice, bob, gateway = world["alice"], world["bob"], world["gateway"]
    started = alice.request("POST", "/api/kernels", json={})
    assert started.status_code == 201, started.text
    kernel = started.json()
    assert kernel["tenant"] == "alice"
    try:
        assert kernel["id"] in [k["id"] for k in alice.request("GET", "/api/kernels").json()]
        assert kernel["id"] not in [k["id"] for k in bob.request("GET", "/api/kernels").json()]
        assert {k["id"]: k.get("tenant") for k in gateway.request("GET", "/api/kernels").json()}[kernel["id"]] == "alice"
        for method, suffix in (("GET", ""), ("POST", "/interrupt"), ("POST", "/restart"), ("DELETE", "")):
            answer = bob.request(method, f"/api/kernels/{kernel['id']}{suffix}")
            unknown = unknown_answer(bob, method, "/api/kernels/{id}" + suffix)
            assert answer.status_code == unknown.status_code == 404, (method, suffix, answer.text)
        # The agent session's kernel is alice's too.
        agent_kernel = world["sessions"]["alice"]["kernel_id"]
        assert bob.request("GET", f"/api/kernels/{agent_kernel}").status_code == 404
        # The WebSocket: bob is refused as for no kernel at all; alice executes.
        for kernel_id in (kernel["id"], agent_kernel):
            with pytest.raises(websocket.WebSocketBadStatusException) as refused:
                bob.channels(kernel_id)
            assert refused.value.status_code == 404
        channels = alice.channels(agent_kernel)
        try:
            replies = channels.collect(channels.execute("print(secret)"))
            printed = [m["content"]["text"] for m in replies if m["msg_type"] == "stream"]
            assert printed == ["alice-only\n"]
        finally:
            channels.socket.close()
    finally:
        assert alice.request("DELETE", f"/api/kernels/{kernel['id']}").status_code == 204


def test_jupyter_sessions_are_per_tenant(world):
    alice, bob = world["alice"], world["bob"]
    # (A session of its own kernel: deleting a Jupyter session shuts its kernel down.)
    mine = alice.request("POST", "/api/sessions", json={"path": "shared.ipynb", "type": "notebook", "kernel": {}})
    assert mine.status_code == 201, mine.text
    session = mine.json()
    assert session["kernel"]["tenant"] == "alice"
    assert bob.request("GET", f"/api/kernels/{session['kernel']['id']}").status_code == 404
    try:
        assert session["id"] in [s["id"] for s in alice.request("GET", "/api/sessions").json()]
        assert session["id"] not in [s["id"] for s in bob.request("GET", "/api/sessions").json()]
        for method, body in (("GET", None), ("PATCH", {"name": "taken"}), ("DELETE", None)):
            answer = bob.request(method, f"/api/sessions/{session['id']}", json=body)
            assert answer.status_code == 404, (method, answer.text)
        # Bob cannot wrap alice's kernel in a session of his, and the same path is his own session.
        stolen = bob.request("POST", "/api/sessions", json={"path": "x.ipynb", "type": "notebook",
                                                             "kernel": {"id": session["kernel"]["id"]}})
        assert stolen.status_code == 404, stolen.text
        assert alice.request("GET", f"/api/sessions/{session['id']}").json()["name"] != "taken"
    finally:
        assert alice.request("DELETE", f"/api/sessions/{session['id']}").status_code == 204


def test_an_approver_reads_and_decides_but_runs_nothing(world):
    approver, alice_id = world["approver"], world["sessions"]["alice"]["id"]
    assert [s["id"] for s in approver.request("GET", "/agent/v1/sessions").json()["sessions"]] == [alice_id]
    assert approver.request("GET", f"/agent/v1/sessions/{alice_id}/notebook").status_code == 200
    for method, path, body in (("POST", f"/agent/v1/sessions/{alice_id}/execute", {"code": "secret = 1"}),
                               ("POST", "/agent/v1/sessions", {"name": "approvers-own"}),
                               ("DELETE", f"/agent/v1/sessions/{alice_id}", None),
                               ("POST", "/api/kernels", {})):
        answer = approver.request(method, path, json=body)
        assert answer.status_code == 403 and answer.json()["reason"] == "role_forbidden", (method, path, answer.text)
    # On the kernel's WebSocket it watches: what it sends is refused (test_a_viewer_link_watches_...).
    watching = approver.channels(world["sessions"]["alice"]["kernel_id"])
    assert "sends it nothing" in refusal_of(watching, watching.execute("secret = 1"))
    watching.close()
    # An approval that does not exist is the approver's to ask about (404 unknown_approval, not 403).
    decided = approver.request("POST", f"/agent/v1/sessions/{alice_id}/approvals/nope", json={"decision": "deny"})
    assert decided.status_code == 404 and decided.json()["reason"] == "unknown_approval", decided.text
    # An agent token of a tenant without self_approve may not decide.
    agent = world["alice"].request("POST", f"/agent/v1/sessions/{alice_id}/approvals/nope", json={"decision": "deny"})
    assert agent.status_code == 403 and agent.json()["reason"] == "role_forbidden", agent.text


def mcp_as(token, gateway, node, *calls):
    env = dict(os.environ, GATEWAY_URL=gateway.url, GATEWAY_TOKEN=token)
    done = subprocess.run([node, "mcp_calls.mjs", json.dumps(list(calls))], cwd=MCP_CLIENT_DIR, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{done.stderr}\n--- gateway ---\n{gateway.log_tail()}"
    return json.loads(done.stdout)


def test_mcp_tools_see_only_the_tenants_own_sessions(world, mcp_client):
    gateway, alice_id = world["gateway"], world["sessions"]["alice"]["id"]
    def run(session, code):
        return {"name": "run_python", "arguments": {"session": session, "code": code}}

    # "main" over MCP is each tenant's own session of that name.
    [alice_main] = mcp_as(world["alice"].token, gateway, mcp_client, run("main", "print(secret)"))
    bob_main, bob_by_id = mcp_as(world["bob"].token, gateway, mcp_client, run("main", "print(secret)"),
                                 run(alice_id, "print(secret)"))
    assert alice_main["result"]["structuredContent"]["stdout"] == "alice-only\n", alice_main
    assert "NameError" in json.dumps(bob_main["result"]), bob_main
    assert bob_by_id["result"]["isError"] is True, bob_by_id
    assert bob_by_id["result"]["structuredContent"]["reason"] == "unknown_session", bob_by_id
    refused = mcp_as(world["approver"].token, gateway, mcp_client, run("main", "secret = 0"))[0]
    assert refused["result"]["structuredContent"]["reason"] == "role_forbidden", refused
    # No session "main" appeared for the operator, and bob's MCP call made none in alice's tenant.
    names = [(s["name"], s.get("tenant")) for s in gateway.request("GET", "/agent/v1/sessions").json()["sessions"]]
    assert sorted(names) == [("main", "alice"), ("main", "bob")], names


def test_a_restarted_gateway_keeps_every_owner(tmp_path):
    state = tmp_path / "state"
    first = AgentGateway(state, tmp_path / "first.log", keep_kernels=True)
    try:
        token = first.request("POST", "/agent/v1/tenants", json={"name": "ivan"}).json()["token"]
        ivan = Tenant(first, token)
        session = ivan.request("POST", "/agent/v1/sessions", json={"name": "kept"}).json()
        kernel = ivan.request("POST", "/api/kernels", json={}).json()
        assert ivan.request("POST", f"/agent/v1/sessions/{session['id']}/execute",
                            json={"code": "k = 7"}).json()["status"] == "ok"
    finally:
        first.stop()
    second = AgentGateway(state, tmp_path / "second.log")
    try:
        ivan = Tenant(second, token)
        other = Tenant(second, second.request("POST", "/agent/v1/tenants", json={"name": "judy"}).json()["token"])
        assert [s["id"] for s in ivan.request("GET", "/agent/v1/sessions").json()["sessions"]] == [session["id"]]
        assert ivan.request("GET", "/agent/v1/sessions/kept").json()["tenant"] == "ivan"
        assert kernel["id"] in [k["id"] for k in ivan.request("GET", "/api/kernels").json()]
        assert other.request("GET", f"/agent/v1/sessions/{session['id']}").status_code == 404
        assert other.request("GET", f"/api/kernels/{kernel['id']}").status_code == 404
        assert other.request("GET", "/api/kernels").json() == []
        assert ivan.request("POST", f"/agent/v1/sessions/{session['id']}/execute",
                            json={"code": "k"}).json()["result"]["text/plain"] == "7"
    finally:
        second.stop()


# ---------------------------------------------------------------------------------------------------------- quotas

def quota_refusal(answer, text):
    assert answer.status_code == 429, answer.text
    body = answer.json()
    assert body["reason"] == "quota_exceeded" and text in body["message"], body
    return body


def test_the_sessions_quota_counts_agent_sessions_and_kernels_together_and_touches_nothing_running(world,
                                                                                                   mcp_client):
    gateway = world["gateway"]
    added = gateway.request("POST", "/agent/v1/tenants", json={"name": "kim", "quota": {"sessions": 2}})
    kim = Tenant(gateway, added.json()["token"])
    first = kim.request("POST", "/agent/v1/sessions", json={"name": "one"})
    assert first.status_code == 201, first.text
    kernel = kim.request("POST", "/api/kernels", json={})
    assert kernel.status_code == 201, kernel.text
    quota_refusal(kim.request("POST", "/agent/v1/sessions", json={"name": "three"}), "tenant kim has 2 of 2 sessions")
    quota_refusal(kim.request("POST", "/api/kernels", json={}), "2 of 2 sessions")
    quota_refusal(kim.request("POST", "/api/sessions", json={"path": "n.ipynb", "type": "notebook", "kernel": {}}),
                  "2 of 2 sessions")
    [over_mcp] = mcp_as(kim.token, gateway, mcp_client,
                        {"name": "run_python", "arguments": {"session": "fresh", "code": "1"}})
    assert over_mcp["result"]["isError"] is True
    assert over_mcp["result"]["structuredContent"]["reason"] == "quota_exceeded", over_mcp
    usage = gateway.request("GET", "/agent/v1/tenants/kim").json()["usage"]
    assert usage["sessions"] == 2 and usage["memory_mb"] > 0, usage
    # A quota of 0 allows nothing new; what runs goes on.
    assert gateway.request("PATCH", "/agent/v1/tenants/kim", json={"quota": {"sessions": 0}}).status_code == 200
    ran = kim.request("POST", "/agent/v1/sessions/one/execute", json={"code": "6*7"})
    assert ran.status_code == 200 and ran.json()["result"]["text/plain"] == "42", ran.text
    quota_refusal(kim.request("POST", "/agent/v1/sessions", json={"name": "three"}), "2 of 0 sessions")
    # Raised again and one gone: a new one is admitted. Other tenants never counted.
    assert gateway.request("PATCH", "/agent/v1/tenants/kim", json={"quota": {"sessions": 2}}).status_code == 200
    assert kim.request("DELETE", f"/api/kernels/{kernel.json()['id']}").status_code == 204
    assert kim.request("POST", "/agent/v1/sessions", json={"name": "three"}).status_code == 201
    assert world["alice"].request("POST", "/agent/v1/sessions", json={"name": "extra"}).status_code == 201
    assert names_of(gateway, "kim") == ["one", "three"]


def names_of(gateway, tenant):
    return sorted(s["name"] for s in gateway.request("GET", "/agent/v1/sessions").json()["sessions"]
                  if s.get("tenant") == tenant)


def test_the_memory_quota_sums_the_sessions_memory_limits(world):
    gateway = world["gateway"]
    added = gateway.request("POST", "/agent/v1/tenants", json={"name": "lee", "quota": {"memory_mb": 3000}})
    lee = Tenant(gateway, added.json()["token"])
    assert lee.request("POST", "/agent/v1/sessions", json={"name": "big", "limits": {"memory_mb": 2048}}).status_code == 201
    quota_refusal(lee.request("POST", "/agent/v1/sessions", json={"name": "big2", "limits": {"memory_mb": 2048}}),
                  "tenant lee has 2048 of 3000 MB of memory")
    assert lee.request("POST", "/agent/v1/sessions", json={"name": "small", "limits": {"memory_mb": 512}}).status_code == 201
    assert names_of(gateway, "lee") == ["big", "small"]


def test_the_executes_quota_counts_executes_in_flight(world, tmp_path):
    gateway = world["gateway"]
    added = gateway.request("POST", "/agent/v1/tenants", json={"name": "max", "quota": {"executes": 1}})
    max_ = Tenant(gateway, added.json()["token"])
    session = max_.request("POST", "/agent/v1/sessions", json={"name": "busy"}).json()
    workspace_gate = "gate"
    answers = {}


    def long_execute():
        answers["first"] = max_.request(
            "POST", f"/agent/v1/sessions/{session['id']}/execute",
            json={"code": f"import os, time\nwhile not os.path.exists({workspace_gate!r}):\n    time.sleep(0.02)\n'out'"})

    runner = threading.Thread(target=long_execute)
    runner.start()
    try:
        # The first execute is under way once the session says so.
        deadline = time.monotonic() + 60
        while max_.request("GET", f"/agent/v1/sessions/{session['id']}").json()["state"] != "busy":
            assert time.monotonic() < deadline, "the first execute never started"
        quota_refusal(max_.request("POST", f"/agent/v1/sessions/{session['id']}/execute", json={"code": "1"}),
                      "tenant max has 1 of 1 executes running")
    finally:
        put = max_.request("PUT", f"/agent/v1/sessions/{session['id']}/files/{workspace_gate}", data=b"")
        assert put.status_code in (200, 201), put.text
        runner.join(120)
    assert answers["first"].json()["result"]["text/plain"] == "'out'", answers["first"].text
    assert max_.request("POST", f"/agent/v1/sessions/{session['id']}/execute", json={"code": "1"}).status_code == 200


# ---------------------------------------------------------------------------------------------------- revocation

def test_revoking_a_token_closes_its_open_websocket_and_streams_within_a_second(world):
    gateway = world["gateway"]
    added = gateway.request("POST", "/agent/v1/tenants", json={"name": "nina"}).json()
    nina = Tenant(gateway, added["token"])
    session = nina.request("POST", "/agent/v1/sessions", json={"name": "watched"}).json()
    channels = nina.channels(session["kernel_id"])
    events = nina.request("GET", f"/agent/v1/sessions/{session['id']}/events",
                          headers={"Accept": "text/event-stream"}, stream=True)
    assert events.status_code == 200, events.text
    ended = {}

    def read_until_closed(name, lines):
        try:
            for _ in lines:
                pass
        except requests.exceptions.RequestException:
            pass
        ended[name] = time.monotonic()

    streamed = nina.request("POST", f"/agent/v1/sessions/{session['id']}/execute", stream=True,
                            headers={"Accept": "application/x-ndjson"},
                            json={"code": "import time\nprint('started', flush=True)\ntime.sleep(300)"})
    assert streamed.status_code == 200, streamed.text
    lines = streamed.iter_lines()
    assert any(b"started" in line for line in lines), "the execute never started"
    readers = [threading.Thread(target=read_until_closed, args=("ndjson", lines)),
               threading.Thread(target=read_until_closed, args=("events", events.iter_lines()))]
    for reader in readers:
        reader.start()

    revoked_at = time.monotonic()
    assert gateway.request("DELETE", f"/agent/v1/tenants/nina/tokens/{added['token_id']}").status_code == 204
    channels.socket.settimeout(5)
    with pytest.raises((websocket.WebSocketConnectionClosedException, ConnectionError, OSError)):
        while True:
            channels.socket.recv()
    ended["websocket"] = time.monotonic()
    for reader in readers:
        reader.join(5)
    assert set(ended) == {"websocket", "ndjson", "events"}, ended
    late = {name: round(at - revoked_at, 3) for name, at in ended.items() if at - revoked_at > 1.0}
    assert not late, f"still open more than 1 s after the revocation: {late}"
    assert nina.request("GET", "/agent/v1/sessions").status_code == 401


def watch_until_closed(response):
    """An event set once the streamed `response` ends (the server closed it), read on a thread."""
    closed = threading.Event()

    def read():
        try:
            for _ in response.iter_lines():
                pass
        except requests.exceptions.RequestException:
            pass
        closed.set()

    threading.Thread(target=read, daemon=True).start()
    return closed


def test_a_page_opened_with_a_tenants_token_ends_with_that_token_and_a_viewer_link_does_not(world):
    gateway, alice = world["gateway"], world["alice"]
    alice_id = world["sessions"]["alice"]["id"]
    issued = gateway.request("POST", "/agent/v1/tenants/alice/tokens", json={"role": "agent"}).json()
    opened = requests.get(f"{gateway.url}/agent/v1/sessions/{alice_id}/view?token={issued['token']}",
                          allow_redirects=False, timeout=60)
    jar = {"cellblock_view": page_cookie(opened, f"/agent/v1/sessions/{alice_id}")}
    link = alice.request("POST", f"/agent/v1/sessions/{alice_id}/share", json={}).json()["token"]
    page_events = requests.get(f"{gateway.url}/agent/v1/sessions/{alice_id}/events", cookies=jar, stream=True,
                               headers={"Accept": "text/event-stream"}, timeout=60)
    link_events = requests.get(f"{gateway.url}/agent/v1/sessions/{alice_id}/events", stream=True, timeout=60,
                               headers={"Accept": "text/event-stream", "Authorization": f"token {link}"})
    assert page_events.status_code == 200 and link_events.status_code == 200
    closed = watch_until_closed(page_events)
    assert gateway.request("DELETE", f"/agent/v1/tenants/alice/tokens/{issued['id']}").status_code == 204
    # The page's stream closes and its cookie opens nothing any more.
    assert closed.wait(5), "the page's stream stayed open after its token was revoked"
    assert requests.get(f"{gateway.url}/agent/v1/sessions/{alice_id}/view", cookies=jar,
                        timeout=60).status_code == 401
    # The viewer link (no token behind it) keeps streaming: the next cell's end reaches it.
    marker = f"after-revocation-{os.getpid()}"
    assert alice.request("POST", f"/agent/v1/sessions/{alice_id}/execute",
                         json={"code": f"print('{marker}')"}).json()["status"] == "ok"
    seen = ""
    for line in link_events.iter_lines(decode_unicode=True):
        seen += line
        if marker in line and '"type":"end"' in line:
            break
    assert marker in seen
    link_events.close()


def test_removing_a_tenant_ends_its_sessions_and_kernels_and_a_new_one_of_its_name_starts_empty(world):
    gateway = world["gateway"]
    oscar = Tenant(gateway, gateway.request("POST", "/agent/v1/tenants", json={"name": "oscar"}).json()["token"])
    session = oscar.request("POST", "/agent/v1/sessions", json={"name": "work"}).json()
    kernel = oscar.request("POST", "/api/kernels", json={}).json()
    assert gateway.request("DELETE", "/agent/v1/tenants/oscar").status_code == 204
    listed = gateway.request("GET", "/agent/v1/sessions").json()["sessions"]
    assert session["id"] not in [s["id"] for s in listed]
    kernel_ids = [k["id"] for k in gateway.request("GET", "/api/kernels").json()]
    assert kernel["id"] not in kernel_ids and session["kernel_id"] not in kernel_ids
    audit = gateway.request("GET", f"/agent/v1/sessions/{session['id']}/audit?event=session_deleted")
    assert audit.status_code in (200, 404), audit.text
    again = Tenant(gateway, gateway.request("POST", "/agent/v1/tenants", json={"name": "oscar"}).json()["token"])
    assert again.request("GET", "/agent/v1/sessions").json()["sessions"] == []
    assert again.request("GET", "/api/kernels").json() == []


# --------------------------------------------------------------------------------------------------- viewer links

def test_a_viewer_link_reads_its_one_session_and_nothing_else(world):
    alice, gateway, alice_id = world["alice"], world["gateway"], world["sessions"]["alice"]["id"]
    other = alice.request("POST", "/agent/v1/sessions", json={"name": "not-shared"}).json()
    shared = alice.request("POST", f"/agent/v1/sessions/{alice_id}/share", json={"ttl_s": 600})
    assert shared.status_code == 201, shared.text
    link = shared.json()
    assert link["token"].startswith("cbv_") and link["view"].endswith(f"/agent/v1/sessions/{alice_id}/view")
    viewer = Tenant(gateway, link["token"])
    assert [s["id"] for s in viewer.request("GET", "/agent/v1/sessions").json()["sessions"]] == [alice_id]
    for path in ("", "/notebook", "/audit"):
        assert viewer.request("GET", f"/agent/v1/sessions/{alice_id}{path}").status_code == 200, path
    events = viewer.request("GET", f"/agent/v1/sessions/{alice_id}/events", headers={"Accept": "text/event-stream"},
                            stream=True)
    assert events.status_code == 200
    events.close()
    for method, path in (("POST", f"/agent/v1/sessions/{alice_id}/execute"), ("DELETE", f"/agent/v1/sessions/{alice_id}"),
                         ("POST", f"/agent/v1/sessions/{alice_id}/share"), ("POST", "/agent/v1/sessions")):
        answer = viewer.request(method, path, json={"code": "secret = 0"})
        assert answer.status_code == 403 and answer.json()["reason"] == "role_forbidden", (method, path, answer.text)
    assert viewer.request("GET", f"/agent/v1/sessions/{other['id']}").status_code == 404
    assert viewer.request("GET", "/api/kernels").json() == []
    assert viewer.request("GET", f"/api/kernels/{world['sessions']['alice']['kernel_id']}").status_code == 404
    # Its session's kernel it may watch (below); no other kernel.
    with pytest.raises(websocket.WebSocketBadStatusException) as refused:
        viewer.channels(world["sessions"]["bob"]["kernel_id"])
    assert refused.value.status_code == 404
    # Tampered (another session or a later expiry under the same signature) or malformed: no token at all.
    prefix, rest = link["token"][:4], link["token"][40:]
    for forged in (prefix + other["id"] + rest, link["token"][:-1] + ("0" if link["token"][-1] != "0" else "1"),
                   "cbv_x", "cbv_"):
        assert Tenant(gateway, forged).request("GET", "/agent/v1/sessions").status_code == 401, forged
    assert alice.request("POST", f"/agent/v1/sessions/{alice_id}/share", json={"ttl_s": 0}).json()["reason"] == "bad_ttl"
    # Another tenant cannot share alice's session; the session's end ends the link.
    assert world["bob"].request("POST", f"/agent/v1/sessions/{alice_id}/share", json={}).status_code == 404
    other_link = alice.request("POST", f"/agent/v1/sessions/{other['id']}/share", json={}).json()["token"]
    assert alice.request("DELETE", f"/agent/v1/sessions/{other['id']}").status_code == 204
    assert Tenant(gateway, other_link).request("GET", f"/agent/v1/sessions/{other['id']}").status_code == 404


def refusal_of(channels, msg_id):
    """The gateway's refusal of the message `msg_id` a watcher sent: the stderr stream answering it."""
    stream = channels.collect(msg_id, timeout_s=15, until_type="stream")[-1]
    assert stream["content"]["name"] == "stderr", stream
    return stream["content"]["text"]


def published_text(channels, marker, timeout_s=60):
    """Reads what the kernel publishes until a stream message holds `marker`; its text."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        channels.socket.settimeout(max(0.1, deadline - time.monotonic()))
        message = json.loads(channels.socket.recv())
        if message["msg_type"] == "stream" and marker in message["content"]["text"]:
            return message["content"]["text"]
    raise AssertionError(f"{marker!r} was not published within {timeout_s} s")


def test_a_viewer_link_watches_its_sessions_kernel_read_only(world):
    alice, gateway = world["alice"], world["gateway"]
    alice_id, kernel_id = world["sessions"]["alice"]["id"], world["sessions"]["alice"]["kernel_id"]
    link = alice.request("POST", f"/agent/v1/sessions/{alice_id}/share", json={"ttl_s": 600}).json()["token"]
    viewer = Tenant(gateway, link).channels(kernel_id)
    # It sees the agent's cells as the kernel publishes them, and may ask kernel_info (what a client does first).
    assert alice.request("POST", f"/agent/v1/sessions/{alice_id}/execute",
                         json={"code": "print('watched-output')"}).json()["status"] == "ok"
    assert published_text(viewer, "watched-output") == "watched-output\n"
    info = viewer.collect(viewer.send("kernel_info_request", {}), until_type="kernel_info_reply")[-1]
    assert info["content"]["status"] == "ok"
    # An execute, a stdin reply and a comm message are refused, and the execute ran nowhere.
    assert "'execute_request' refused" in refusal_of(viewer, viewer.execute("stolen = 'by the viewer'"))
    assert "'input_reply' refused" in refusal_of(viewer, viewer.send("input_reply", {"value": "x"}, "stdin"))
    # Not even a kernel_info_request on stdin, which a kernel could take as the answer to a prompt.
    assert "refused" in refusal_of(viewer, viewer.send("kernel_info_request", {"value": "x"}, "stdin"))
    assert "'comm_open' refused" in refusal_of(viewer, viewer.send("comm_open", {"comm_id": "c", "target_name": "t",
                                                                                "data": {}}))
    answer = alice.request("POST", f"/agent/v1/sessions/{alice_id}/execute", json={"code": "'stolen' in dir()"})
    assert answer.json()["result"]["text/plain"] == "False", answer.text
    viewer.close()


def test_a_viewer_links_kernel_watch_and_event_stream_close_when_the_link_expires(world):
    alice, gateway = world["alice"], world["gateway"]
    alice_id, kernel_id = world["sessions"]["alice"]["id"], world["sessions"]["alice"]["kernel_id"]
    link = alice.request("POST", f"/agent/v1/sessions/{alice_id}/share", json={"ttl_s": 2}).json()["token"]
    viewer = Tenant(gateway, link).channels(kernel_id)
    events = Tenant(gateway, link).request("GET", f"/agent/v1/sessions/{alice_id}/events", stream=True,
                                           headers={"Accept": "text/event-stream"})
    assert events.status_code == 200
    stream_ended = watch_until_closed(events)
    started = time.monotonic()
    viewer.socket.settimeout(30)
    with pytest.raises((websocket.WebSocketConnectionClosedException, ConnectionError)):
        while True:  # whatever the kernel publishes meanwhile, until the gateway closes the watch
            if viewer.socket.recv() in ("", b""):
                raise websocket.WebSocketConnectionClosedException("closed")
    assert time.monotonic() - started < 10
    assert stream_ended.wait(10), "the viewer's event stream outlived its link"
    events.close()


def test_a_viewer_link_expires(world):
    alice, alice_id = world["alice"], world["sessions"]["alice"]["id"]
    token = alice.request("POST", f"/agent/v1/sessions/{alice_id}/share", json={"ttl_s": 1}).json()["token"]
    viewer = Tenant(world["gateway"], token)
    deadline = time.monotonic() + 5
    while viewer.request("GET", "/agent/v1/sessions").status_code == 200:  # the link's own clock, not a sleep
        assert time.monotonic() < deadline, "a viewer token of 1 s still works after 5 s"
    assert viewer.request("GET", f"/agent/v1/sessions/{alice_id}").status_code == 401


def test_a_viewer_opens_the_live_page_with_its_link_and_gets_a_cookie_for_that_page_only(world):
    alice, gateway, alice_id = world["alice"], world["gateway"], world["sessions"]["alice"]["id"]
    token = alice.request("POST", f"/agent/v1/sessions/{alice_id}/share", json={}).json()["token"]
    opened = requests.get(f"{gateway.url}/agent/v1/sessions/{alice_id}/view?token={token}", allow_redirects=False,
                          timeout=60)
    assert opened.status_code == 303 and "token" not in opened.headers["Location"], opened.headers
    cookie = opened.headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and f"Path=/agent/v1/sessions/{alice_id}" in cookie
    value = cookie.split(";")[0].split("=", 1)[1]
    jar = {"cellblock_view": value}
    page = requests.get(f"{gateway.url}/agent/v1/sessions/{alice_id}/view", cookies=jar, timeout=60)
    assert page.status_code == 200 and "text/html" in page.headers["Content-Type"]
    events = requests.get(f"{gateway.url}/agent/v1/sessions/{alice_id}/events", cookies=jar, stream=True,
                          headers={"Accept": "text/event-stream"}, timeout=60)
    assert events.status_code == 200
    events.close()
    # The cookie opens nothing else: not the API under the same path, not another session's page.
    assert requests.get(f"{gateway.url}/agent/v1/sessions/{alice_id}/notebook", cookies=jar, timeout=60).status_code == 401
    bob_id = world["sessions"]["bob"]["id"]
    assert requests.get(f"{gateway.url}/agent/v1/sessions/{bob_id}/view", cookies=jar, timeout=60).status_code == 401
    # A stale token in the address beside the valid cookie does not replace the cookie.
    stale = requests.get(f"{gateway.url}/agent/v1/sessions/{alice_id}/view?token=cbv_stale", cookies=jar,
                         allow_redirects=False, timeout=60)
    assert stale.status_code == 303 and "Set-Cookie" not in stale.headers, stale.headers


def page_cookie(answer, path):
    """The cellblock_view cookie of a 303 that opened a page: its value, after checking its attributes."""
    assert answer.status_code == 303 and "token" not in answer.headers["Location"], (answer.status_code, answer.text)
    cookie = answer.headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and f"Path={path}" in cookie, cookie
    return cookie.split(";")[0].split("=", 1)[1]


def test_a_tenants_own_tokens_open_its_pages_and_its_list_shows_only_its_sessions(world):
    gateway, alice, bob = world["gateway"], world["alice"], world["bob"]
    alice_id, bob_id = world["sessions"]["alice"]["id"], world["sessions"]["bob"]["id"]
    for owner in (alice, world["approver"]):  # the agent token and the approver's: both read the session
        opened = requests.get(f"{gateway.url}/agent/v1/sessions/{alice_id}/view?token={owner.token}",
                              allow_redirects=False, timeout=60)
        value = page_cookie(opened, f"/agent/v1/sessions/{alice_id}")
        assert value.startswith("cbv_") and owner.token not in value, "a viewer token, never the tenant's token"
        page = requests.get(f"{gateway.url}/agent/v1/sessions/{alice_id}/view", cookies={"cellblock_view": value},
                            timeout=60)
        assert page.status_code == 200 and "text/html" in page.headers["Content-Type"]
        # The cookie's token reads; it runs nothing.
        ran = Tenant(gateway, value).request("POST", f"/agent/v1/sessions/{alice_id}/execute", json={"code": "1"})
        assert ran.status_code == 403 and ran.json()["reason"] == "role_forbidden"
    # Opened by the session's name, the page moves to its id's path first (where the cookie's scope is the id's).
    by_name = requests.get(f"{gateway.url}/agent/v1/sessions/main/view?token={alice.token}", allow_redirects=False,
                           timeout=60)
    assert by_name.status_code == 303, by_name.text
    assert by_name.headers["Location"] == f"/agent/v1/sessions/{alice_id}/view?token={alice.token}"
    # Another tenant's session page answers like one that does not exist.
    assert requests.get(f"{gateway.url}/agent/v1/sessions/{bob_id}/view?token={alice.token}", allow_redirects=False,
                        timeout=60).status_code == 404

    # The list page: alice's token gets a cookie for the list; its data holds alice's sessions only.
    listed = page_cookie(requests.get(f"{gateway.url}/agent/v1/view?token={alice.token}", allow_redirects=False,
                                      timeout=60), "/agent/v1/view")
    jar = {"cellblock_view": listed}
    data = requests.get(f"{gateway.url}/agent/v1/view/sessions", cookies=jar, timeout=60)
    assert data.status_code == 200, data.text
    ids = {s["id"] for s in data.json()["sessions"]}
    assert alice_id in ids and bob_id not in ids
    assert ids == {s["id"] for s in alice.request("GET", "/agent/v1/sessions").json()["sessions"]}
    # Its links open alice's session pages (with that page's own cookie), not bob's.
    opened = requests.get(f"{gateway.url}/agent/v1/view/open/{alice_id}", cookies=jar, allow_redirects=False,
                          timeout=60)
    session_cookie = page_cookie(opened, f"/agent/v1/sessions/{alice_id}")
    assert requests.get(f"{gateway.url}/agent/v1/sessions/{alice_id}/view",
                        cookies={"cellblock_view": session_cookie}, timeout=60).status_code == 200
    assert requests.get(f"{gateway.url}/agent/v1/view/open/{bob_id}", cookies=jar, allow_redirects=False,
                        timeout=60).status_code == 404
    # The list's cookie opens no session page by itself and no API; bob's list is bob's.
    assert requests.get(f"{gateway.url}/agent/v1/sessions/{alice_id}/view", cookies=jar, timeout=60).status_code == 401
    assert requests.get(f"{gateway.url}/agent/v1/sessions", cookies=jar, timeout=60).status_code == 401
    bobs = {s["id"] for s in bob.request("GET", "/agent/v1/view/sessions").json()["sessions"]}
    assert bob_id in bobs and alice_id not in bobs
    assert bobs == {s["id"] for s in bob.request("GET", "/agent/v1/sessions").json()["sessions"]}
    # A viewer link of one session has no list.
    shared = alice.request("POST", f"/agent/v1/sessions/{alice_id}/share", json={}).json()["token"]
    refused = Tenant(gateway, shared).request("GET", "/agent/v1/view/sessions")
    assert refused.status_code == 403 and refused.json()["reason"] == "role_forbidden"


# ----------------------------------------------------------------------------------------------- audit and metrics

def test_audit_entries_name_the_tenant_and_token_id_and_metrics_count_by_tenant(world):
    gateway, alice, alice_id = world["gateway"], world["alice"], world["sessions"]["alice"]["id"]
    ran = alice.request("POST", f"/agent/v1/sessions/{alice_id}/execute", json={"code": "'audited'"})
    assert ran.status_code == 200, ran.text
    agent_token_id = [t["id"] for t in gateway.request("GET", "/agent/v1/tenants/alice").json()["tokens"]
                      if t["role"] == "agent"][0]
    entries = alice.request("GET", f"/agent/v1/sessions/{alice_id}/audit?event=execute").json()["entries"]
    last = entries[-1]
    assert last["code"] == "'audited'" and last["tenant"] == "alice" and last["token_id"] == agent_token_id, last
    assert alice.token not in json.dumps(entries)
    metrics = gateway.request("GET", "/metrics").text
    sessions = [line for line in metrics.splitlines() if line.startswith('cellblock_tenant_sessions{tenant="alice"}')]
    executes = [line for line in metrics.splitlines()
                if line.startswith('cellblock_tenant_executes_total{tenant="alice"}')]
    assert sessions and float(sessions[0].split()[-1]) >= 1, metrics
    assert executes and float(executes[0].split()[-1]) >= 1, metrics
    assert alice.request("GET", "/metrics").json()["reason"] == "operator_only"


def test_a_sessions_creation_and_reset_name_the_token_that_asked(world):
    gateway, alice = world["gateway"], world["alice"]
    agent_token_id = [t["id"] for t in gateway.request("GET", "/agent/v1/tenants/alice").json()["tokens"]
                      if t["role"] == "agent"][0]
    created = alice.request("POST", "/agent/v1/sessions", json={"name": "audited-lifecycle"})
    assert created.status_code == 201, created.text
    session_id = created.json()["id"]
    try:
        assert alice.request("POST", f"/agent/v1/sessions/{session_id}/reset").status_code == 200
        entries = alice.request("GET", f"/agent/v1/sessions/{session_id}/audit").json()["entries"]
        by_event = {entry["event"]: entry for entry in entries}
        assert by_event["session_created"]["token_id"] == agent_token_id, entries
        assert by_event["reset"]["token_id"] == agent_token_id, entries
        assert alice.token not in json.dumps(entries)
    finally:
        assert alice.request("DELETE", f"/agent/v1/sessions/{session_id}").status_code == 204
