"""Tenants: the operator's admin API (/agent/v1/tenants), a tenant's token refused (403 operator_only) on the routes
that are not isolated per tenant, revocation taking effect on the next request, and a restarted gateway keeping
tenants, quotas and tokens (tokens stored as keyed digests only). What a tenant sees and may do on the isolated
routes is tests/agent/test_tenant_isolation.py."""
import json
import os
import signal
import subprocess
import time

import pytest
import requests
import websocket

from conftest import CLI_BINARY, AgentGateway


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tenants")
    server = AgentGateway(directory / "state", directory / "gateway.log")
    try:
        yield server
    finally:
        server.stop()


def as_token(gateway, token, method, path, **kwargs):
    return requests.request(method, gateway.url + path, headers={"Authorization": f"token {token}"}, timeout=60,
                            **kwargs)


def add_tenant(gateway, name, **body):
    answer = gateway.request("POST", "/agent/v1/tenants", json={"name": name, **body})
    assert answer.status_code == 201, answer.text
    return answer.json()


def test_the_operator_adds_lists_shows_and_changes_a_tenant(gateway):
    created = add_tenant(gateway, "alice", quota={"sessions": 10, "memory_mb": 8192, "executes": 4})
    assert created["name"] == "alice"
    assert created["quota"] == {"sessions": 10, "memory_mb": 8192, "executes": 4}
    assert created["self_approve"] is False
    assert created["token"].startswith("cbt_") and created["token_id"]

    listed = gateway.request("GET", "/agent/v1/tenants").json()["tenants"]
    alice = next(tenant for tenant in listed if tenant["name"] == "alice")
    assert created["token"] not in json.dumps(listed) and "token" not in alice

    shown = gateway.request("GET", "/agent/v1/tenants/alice").json()
    assert shown["usage"] == {"sessions": 0, "memory_mb": 0, "executes": 0}
    assert [token["id"] for token in shown["tokens"]] == [created["token_id"]]
    assert created["token"] not in json.dumps(shown)

    # A missing quota field is no limit, 0 allows none.
    changed = gateway.request("PATCH", "/agent/v1/tenants/alice", json={"quota": {"sessions": 0}})
    assert changed.status_code == 200, changed.text
    assert changed.json()["quota"] == {"sessions": 0, "memory_mb": None, "executes": None}


@pytest.mark.parametrize("body, field", [
    ({"name": "Alice"}, "name"),
    ({"name": "a" * 65}, "name"),
    ({}, "name"),
    ({"name": "bad-quota", "quota": {"sessions": -1}}, "quota.sessions"),
    ({"name": "bad-quota", "quota": {"sessions": 1.5}}, "quota.sessions"),
    ({"name": "bad-quota", "quota": {"gpus": 1}}, "quota.gpus"),
    ({"name": "bad-quota", "quota": [1]}, "quota"),
    ({"name": "bad-flag", "self_approve": "yes"}, "self_approve"),
])
def test_a_bad_field_is_named_in_a_400(gateway, body, field):
    answer = gateway.request("POST", "/agent/v1/tenants", json=body)
    assert answer.status_code == 400, answer.text
    assert answer.json()["field"] == field and answer.json()["reason"] and answer.json()["message"]
    gateway.assert_alive()


def test_a_second_tenant_of_a_name_is_409_and_unknown_tenants_are_404(gateway):
    add_tenant(gateway, "twice")
    again = gateway.request("POST", "/agent/v1/tenants", json={"name": "twice"})
    assert again.status_code == 409 and again.json()["reason"] == "tenant_exists", again.text
    for method, path, body in [("GET", "/agent/v1/tenants/nobody", None),
                               ("PATCH", "/agent/v1/tenants/nobody", {"quota": {}}),
                               ("DELETE", "/agent/v1/tenants/nobody", None),
                               ("POST", "/agent/v1/tenants/nobody/tokens", {"role": "agent"}),
                               ("DELETE", "/agent/v1/tenants/nobody/tokens/0123", None)]:
        answer = gateway.request(method, path, json=body)
        assert answer.status_code == 404 and answer.json()["reason"] == "unknown_tenant", (method, path, answer.text)


def test_a_tenant_token_is_refused_where_nothing_is_isolated_per_tenant(gateway):
    token = add_tenant(gateway, "carol")["token"]
    assert as_token(gateway, "cbt_" + "0" * 64, "GET", "/agent/v1/sessions").status_code == 401
    for method, path in [("POST", "/agent/v1/tenants"), ("GET", "/agent/v1/tenants"), ("GET", "/metrics"),
                         ("GET", "/api/status")]:
        answer = as_token(gateway, token, method, path, json={"name": "mallory"})
        assert answer.status_code == 403, (method, path, answer.text)
        assert answer.json()["reason"] == "operator_only", (method, path, answer.text)
    # The query form and the WebSocket upgrade resolve the same principal: the tenant's own (empty) world.
    assert requests.get(f"{gateway.url}/api/status?token={token}", timeout=30).status_code == 403
    assert requests.get(f"{gateway.url}/api/kernels?token={token}", timeout=30).json() == []
    with pytest.raises(websocket.WebSocketBadStatusException) as refused:
        websocket.create_connection(
            f"ws://127.0.0.1:{gateway.port}/api/kernels/00000000-0000-0000-0000-000000000000/channels",
            header=[f"Authorization: token {token}"], timeout=30)
    assert refused.value.status_code == 404
    assert "mallory" not in [t["name"] for t in gateway.request("GET", "/agent/v1/tenants").json()["tenants"]]


def test_tokens_are_issued_by_role_and_a_revoked_or_deleted_one_is_401_on_its_next_request(gateway):
    first = add_tenant(gateway, "dave")
    issued = gateway.request("POST", "/agent/v1/tenants/dave/tokens", json={"role": "approver"})
    assert issued.status_code == 201, issued.text
    approver = issued.json()
    assert approver["role"] == "approver" and approver["token"].startswith("cbt_") and approver["id"]
    bad_role = gateway.request("POST", "/agent/v1/tenants/dave/tokens", json={"role": "viewer"})
    assert bad_role.status_code == 400 and bad_role.json()["field"] == "role", bad_role.text
    # Another tenant's token id is not this tenant's.
    other = add_tenant(gateway, "erin")
    assert gateway.request("DELETE", f"/agent/v1/tenants/dave/tokens/{other['token_id']}").status_code == 404

    assert as_token(gateway, approver["token"], "GET", "/agent/v1/sessions").status_code == 200
    assert gateway.request("DELETE", f"/agent/v1/tenants/dave/tokens/{approver['id']}").status_code == 204
    assert as_token(gateway, approver["token"], "GET", "/agent/v1/sessions").status_code == 401
    assert as_token(gateway, first["token"], "GET", "/agent/v1/sessions").status_code == 200

    assert gateway.request("DELETE", "/agent/v1/tenants/dave").status_code == 204
    assert as_token(gateway, first["token"], "GET", "/agent/v1/sessions").status_code == 401
    assert gateway.request("GET", "/agent/v1/tenants/dave").status_code == 404
    assert as_token(gateway, other["token"], "GET", "/agent/v1/sessions").status_code == 200


def test_a_restarted_gateway_keeps_tenants_quotas_and_tokens_and_stores_only_digests(tmp_path):
    state = tmp_path / "state"
    first = AgentGateway(state, tmp_path / "first.log")
    try:
        kept = first.request("POST", "/agent/v1/tenants",
                             json={"name": "frank", "quota": {"executes": 2}, "self_approve": True}).json()
        revoked = first.request("POST", "/agent/v1/tenants/frank/tokens", json={"role": "agent"}).json()
        assert first.request("DELETE", f"/agent/v1/tenants/frank/tokens/{revoked['id']}").status_code == 204
    finally:
        first.stop(sig=signal.SIGTERM)
    stored = b"".join(path.read_bytes() for path in state.rglob("store*") if path.is_file())
    assert b"frank" in stored
    assert kept["token"].encode() not in stored and kept["token"][4:].encode() not in stored

    second = AgentGateway(state, tmp_path / "second.log")
    try:
        shown = second.request("GET", "/agent/v1/tenants/frank").json()
        assert shown["quota"] == {"sessions": None, "memory_mb": None, "executes": 2}
        assert shown["self_approve"] is True
        assert [token["id"] for token in shown["tokens"]] == [kept["token_id"]]
        assert as_token(second, kept["token"], "GET", "/agent/v1/sessions").status_code == 200
        assert as_token(second, revoked["token"], "GET", "/agent/v1/sessions").status_code == 401
    finally:
        second.stop()


def status_becomes(gateway, token, expected, within_s=5.0):
    """The status a token's next request gets once it is `expected`, or the last one seen after `within_s`."""
    deadline = time.monotonic() + within_s
    while True:
        status = as_token(gateway, token, "GET", "/agent/v1/sessions").status_code
        if status == expected or time.monotonic() > deadline:
            return status
        time.sleep(0.05)


def test_two_gateways_on_one_postgresql_store_agree_on_tenants_and_revocations(tmp_path):
    from test_shared_store import Postgres  # the shared store's fixture: a PostgreSQL of the test's own
    postgres = Postgres()
    gateways = []
    try:
        for name in ("a", "b"):
            gateways.append(AgentGateway(tmp_path / f"state-{name}", tmp_path / f"{name}.log", "--store",
                                         postgres.url, "--store-key-file", str(postgres.key_file), "--warm-pool", "0"))
        a, b = gateways
        added = a.request("POST", "/agent/v1/tenants", json={"name": "grace"})
        assert added.status_code == 201, added.text
        token = added.json()["token"]
        assert status_becomes(b, token, 200) == 200, "the other gateway never accepted the new token"
        assert b.request("GET", "/agent/v1/tenants/grace").json()["tokens"][0]["id"] == added.json()["token_id"]
        assert a.request("DELETE", f"/agent/v1/tenants/grace/tokens/{added.json()['token_id']}").status_code == 204
        # Revoked through A, refused by B within about a second (its directory follows the store).
        started = time.monotonic()
        assert status_becomes(b, token, 401) == 401, "the other gateway still accepts a revoked token"
        assert time.monotonic() - started < 3
    finally:
        for gateway in gateways:
            gateway.stop()
        postgres.stop()


def cellblock(gateway, *arguments, token=None):
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "CELLBLOCK_URL": gateway.url,
           "CELLBLOCK_TOKEN": token or gateway.token}
    return subprocess.run([str(CLI_BINARY), *arguments], capture_output=True, text=True, timeout=60, env=env)


def test_the_cli_adds_shows_changes_hands_out_revokes_and_removes(gateway):
    added = cellblock(gateway, "tenants", "add", "heidi", "--sessions", "3", "--self-approve")
    assert added.returncode == 0, added.stderr
    token = added.stdout.strip()
    assert token.startswith("cbt_") and token not in added.stderr
    assert "sessions 3, memory_mb -, executes -" in added.stderr
    assert as_token(gateway, token, "GET", "/agent/v1/sessions").status_code == 200

    listed = cellblock(gateway, "tenants", "list")
    assert "heidi\tsessions 3, memory_mb -, executes -\tself_approve" in listed.stdout.splitlines(), listed.stdout
    changed = cellblock(gateway, "tenants", "quota", "heidi", "--executes", "0")
    assert changed.returncode == 0 and "sessions -, memory_mb -, executes 0" in changed.stderr, changed.stderr

    approver = cellblock(gateway, "tenants", "token", "heidi", "--role", "approver")
    assert approver.returncode == 0, approver.stderr
    shown = json.loads(cellblock(gateway, "tenants", "show", "heidi").stdout)
    assert shown["quota"] == {"sessions": None, "memory_mb": None, "executes": 0}
    roles = {token_info["role"]: token_info["id"] for token_info in shown["tokens"]}
    assert set(roles) == {"agent", "approver"}

    revoked = cellblock(gateway, "tenants", "revoke", "heidi", roles["approver"])
    assert revoked.returncode == 0, revoked.stderr
    assert as_token(gateway, approver.stdout.strip(), "GET", "/agent/v1/sessions").status_code == 401

    # A tenant's own token cannot manage tenants; errors are one line and exit status 2.
    refused = cellblock(gateway, "tenants", "list", token=token)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert cellblock(gateway, "tenants", "show", "nobody").returncode == 2

    assert cellblock(gateway, "tenants", "remove", "heidi").returncode == 0
    assert as_token(gateway, token, "GET", "/agent/v1/sessions").status_code == 401
