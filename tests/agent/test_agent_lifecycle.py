"""Agent sessions across gateway restarts (audit trail and history survive) and the idle TTL."""
import hashlib
import time

import nbformat

from conftest import AgentGateway


def test_audit_trail_and_history_survive_a_gateway_restart(tmp_path):
    state = tmp_path / "state"
    first = AgentGateway(state, tmp_path / "first.log")
    try:
        session = first.create_session("durable")
        answer = first.execute("durable", "print('before restart')\n6 * 7")
        assert answer["status"] == "ok"
    finally:
        assert first.stop() == 0, first.log_tail()
    second = AgentGateway(state, tmp_path / "second.log")
    try:
        reloaded = second.request("GET", "/agent/v1/sessions/durable")
        assert reloaded.status_code == 200, reloaded.text
        assert reloaded.json()["id"] == session["id"]
        entries = second.request("GET", "/agent/v1/sessions/durable/audit").json()["entries"]
        executes = [e for e in entries if e["event"] == "execute"]
        assert executes[0]["code"] == "print('before restart')\n6 * 7"
        assert executes[0]["outputs"]["stdout"]["sha256"] == hashlib.sha256(b"before restart\n").hexdigest()
        # A new kernel serves the reloaded session, and the answer says the old state is gone.
        after = second.execute("durable", "'before' in dir()")
        assert after["status"] == "ok" and after["state_lost"] is True
        notebook = nbformat.reads(second.request("GET", "/agent/v1/sessions/durable/notebook").text, as_version=4)
        nbformat.validate(notebook)
        assert [cell.source for cell in notebook.cells][0] == "print('before restart')\n6 * 7"
        events = [e["event"] for e in second.request("GET", "/agent/v1/sessions/durable/audit").json()["entries"]]
        assert events[:2] == ["session_created", "execute"] and "session_reloaded" in events
        assert events.count("execute") == 2
    finally:
        second.stop()


def test_idle_sessions_expire_after_the_ttl(tmp_path):
    gateway = AgentGateway(tmp_path / "state", tmp_path / "gateway.log", "--agent-session-ttl", "2")
    try:
        session = gateway.create_session("ephemeral")
        gateway.execute("ephemeral", "1")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if gateway.request("GET", "/agent/v1/sessions/ephemeral").status_code == 404:
                break
            time.sleep(0.25)
        assert gateway.request("GET", "/agent/v1/sessions/ephemeral").status_code == 404
        while time.monotonic() < deadline:
            if session["kernel_id"] not in [k["id"] for k in gateway.request("GET", "/api/kernels").json()]:
                break
            time.sleep(0.25)
        assert session["kernel_id"] not in [k["id"] for k in gateway.request("GET", "/api/kernels").json()]
        gateway.assert_alive()
    finally:
        gateway.stop()
