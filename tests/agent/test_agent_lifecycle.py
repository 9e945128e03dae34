"""Agent sessions across gateway restarts (audit trail and history survive), the idle TTL and the retention of
deleted sessions in the store."""
import hashlib
import sqlite3
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


def store_rows(state_dir, session_id: str) -> dict:
    """How many rows the gateway's store holds for `session_id`, per table, read on the host (read-only)."""
    with sqlite3.connect(f"file:{state_dir / 'store.sqlite3'}?mode=ro", uri=True) as store:
        rows = {"agent_sessions": store.execute("SELECT count(*) FROM agent_sessions WHERE id = ?",
                                                (session_id,)).fetchone()[0]}
        for table in ("cells", "audit", "inflight_executes"):
            rows[table] = store.execute(f"SELECT count(*) FROM {table} WHERE session = ?", (session_id,)).fetchone()[0]
    return rows


def test_a_deleted_session_leaves_the_store_after_the_retention_and_the_others_stay(tmp_path):
    state = tmp_path / "state"
    gateway = AgentGateway(state, tmp_path / "gateway.log", "--agent-deleted-retention", "5")
    try:
        gone = gateway.create_session("gone")
        kept = gateway.create_session("kept")
        for name in ("gone", "kept"):
            assert gateway.execute(name, f"print('{name}')\n6 * 7")["status"] == "ok"
        assert gateway.request("DELETE", "/agent/v1/sessions/gone").status_code in (200, 204)
        # Kept through the retention: the record (marked deleted, with its time), the cell and the audit trail.
        rows = store_rows(state, gone["id"])
        assert rows["agent_sessions"] == 1 and rows["cells"] == 1 and rows["audit"] >= 3, rows
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and store_rows(state, gone["id"])["agent_sessions"]:
            time.sleep(0.25)
        assert store_rows(state, gone["id"]) == {"agent_sessions": 0, "cells": 0, "audit": 0,
                                                 "inflight_executes": 0}
        # The live session is untouched: its notebook, its audit trail, its kernel's state.
        rows = store_rows(state, kept["id"])
        assert rows["agent_sessions"] == 1 and rows["cells"] == 1, rows
        events = [e["event"] for e in gateway.request("GET", "/agent/v1/sessions/kept/audit").json()["entries"]]
        assert events[:2] == ["session_created", "execute"]
        notebook = nbformat.reads(gateway.request("GET", "/agent/v1/sessions/kept/notebook").text, as_version=4)
        assert [cell.source for cell in notebook.cells] == ["print('kept')\n6 * 7"]
        assert gateway.execute("kept", "7 * 6")["result"]["text/plain"] == "42"
        gateway.assert_alive()
    finally:
        gateway.stop()
