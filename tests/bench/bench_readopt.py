#!/usr/bin/env python3
"""Sessions outliving the gateway: how long a restarted gateway takes to serve every live session again.

- re-adoption: N agent sessions with state; `kill -9` the gateway; time from starting a new gateway on the same state
  directory to every session answering `1+1` (and still holding its variable). Target ≤ 1 s for 100 sessions.
- the alternative: what a gateway that cannot re-adopt costs (Jupyter Server and Kernel Gateway stop or lose their
  kernels on restart): a new gateway creating N fresh sessions until each answers `1+1` — and their state is gone.
- store cost per execute: the writes an execute makes (in-flight record, cell, audit entry, in-flight removal), each
  committed and fsync'd in SQLite (WAL, synchronous=FULL, as SqliteStore), against the JSONL appends + fdatasync
  it replaced (cell + audit line). Both run off the request path in the gateway (one writer thread).
"""
import argparse
import concurrent.futures
import json
import os
import re
import secrets
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

import benchlib
from benchlib import Row, Stats, markdown_table, progress


class Gateway:
    def __init__(self, prefix: Path, state_dir: Path, log_path: Path, port: int, token: str, keep_kernels: bool):
        env = {k: v for k, v in os.environ.items() if not k.startswith("KG_")}
        env["JUPYTER_PATH"] = str(prefix / "share" / "jupyter")
        self.url = f"http://127.0.0.1:{port}"
        # One log per start: a ready line from an earlier gateway must not count as this one's.
        log_path = log_path.with_name(f"{log_path.stem}-{time.monotonic_ns()}.log")
        self.log_path = log_path
        self.started = time.perf_counter()
        self.process = subprocess.Popen(
            [str(prefix / "bin" / "cellblock-gateway"), "--ip", "127.0.0.1", "--port", str(port), "--token", token,
             "--kernelspec-dir", str(prefix / "share" / "jupyter" / "kernels"), "--state-dir", str(state_dir),
             "--warm-pool", "0", *([] if keep_kernels else ["--shutdown-kernels-on-exit"])],
            stdout=open(log_path, "ab"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
            start_new_session=True)
        self.http = requests.Session()
        self.http.headers["Authorization"] = f"token {token}"
        ready = re.compile(rf"is available at http://127\.0\.0\.1:{port}\b")
        deadline = time.monotonic() + 120
        while not ready.search(log_path.read_text(errors="replace")):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"gateway did not start:\n{log_path.read_text(errors='replace')[-2000:]}")
            time.sleep(0.01)

    def execute(self, session: str, code: str) -> dict:
        response = self.http.post(f"{self.url}/agent/v1/sessions/{session}/execute", json={"code": code}, timeout=300)
        response.raise_for_status()
        return response.json()

    def kill_9(self):
        self.process.kill()
        self.process.wait()

    def stop(self):
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=120)


def all_answer(gateway: Gateway, sessions: list[str], check_state: bool) -> float:
    """Seconds from the gateway's start until every session answered `1+1` (and, if asked, kept `x`)."""
    def one(name: str):
        answer = gateway.execute(name, "1+1" if not check_state else "x + 1 - x + 1")
        if answer["status"] != "ok" or answer["result"]["text/plain"] != "2":
            raise RuntimeError(f"{name}: {answer}")
        if check_state and answer["state_lost"]:
            raise RuntimeError(f"{name} lost its state: {answer}")
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(one, sessions))
    return time.perf_counter() - gateway.started


def readoption(prefix: Path, sessions: int, rounds: int) -> tuple[Stats, Stats, Stats]:
    readopt, recreate, first_line = [], [], []
    with tempfile.TemporaryDirectory(prefix="bench-readopt-") as scratch:
        state, port, token = Path(scratch) / "state", benchlib.free_port(), secrets.token_hex(16)
        names = [f"s{i}" for i in range(sessions)]
        gateway = Gateway(prefix, state, Path(scratch) / "gateway.log", port, token, keep_kernels=True)
        try:
            progress(f"readopt: creating {sessions} sessions")

            def create(name: str):
                r = gateway.http.post(f"{gateway.url}/agent/v1/sessions", json={"name": name}, timeout=300)
                r.raise_for_status()
                gateway.execute(name, "x = 41")
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                list(pool.map(create, names))
            for round_ in range(rounds):
                gateway.kill_9()
                progress(f"readopt: round {round_ + 1}/{rounds}: kill -9, restart, {sessions} sessions answer")
                gateway = Gateway(prefix, state, Path(scratch) / "gateway.log", port, token, keep_kernels=True)
                first_line.append((time.perf_counter() - gateway.started) * 1000)
                readopt.append(all_answer(gateway, names, check_state=True) * 1000)
        finally:
            gateway.process.terminate()
            gateway.process.wait(timeout=120)
        # The alternative: no re-adoption. Kernels are stopped; a new gateway serves the sessions on new kernels.
        gateway = Gateway(prefix, state, Path(scratch) / "gateway.log", port, token, keep_kernels=False)
        gateway.stop()
        for round_ in range(rounds):
            progress(f"readopt: round {round_ + 1}/{rounds}: restart without live kernels, {sessions} new kernels")
            gateway = Gateway(prefix, state, Path(scratch) / "gateway.log", port, token, keep_kernels=False)
            try:
                recreate.append(all_answer(gateway, names, check_state=False) * 1000)
            finally:
                gateway.stop()
    return Stats(readopt), Stats(recreate), Stats(first_line)


AUDIT_ENTRY = {"time": "2026-12-01T10:00:00.000000Z", "session": "0" * 36, "event": "execute", "client": "127.0.0.1",
               "via": "http", "code": "1+1", "code_sha256": "a" * 64, "status": "ok", "execution_count": 1,
               "duration_ms": 1.2, "outputs": {"stdout": None, "stderr": None, "result": {"bytes": 14}},
               "truncated": False, "state_lost": False}
CELL = {"cell_type": "code", "id": "0123456789abcdef", "metadata": {}, "source": "1+1", "execution_count": 1,
        "outputs": [{"output_type": "execute_result", "data": {"text/plain": "2"}, "metadata": {}, "execution_count": 1}]}


def store_cost(writes: int) -> tuple[Stats, Stats, Stats]:
    with tempfile.TemporaryDirectory(prefix="bench-store-") as scratch:
        database = sqlite3.connect(Path(scratch) / "store.sqlite3", isolation_level=None)
        database.execute("PRAGMA journal_mode=WAL")
        database.execute("PRAGMA synchronous=FULL")
        database.execute("CREATE TABLE cells (seq INTEGER PRIMARY KEY AUTOINCREMENT, session TEXT, cell TEXT)")
        database.execute("CREATE TABLE audit (seq INTEGER PRIMARY KEY AUTOINCREMENT, session TEXT, time TEXT, "
                         "event TEXT, entry TEXT)")
        database.execute("CREATE TABLE inflight_executes (session TEXT, msg_id TEXT, request TEXT, "
                         "PRIMARY KEY (session, msg_id))")
        audit, cell = json.dumps(AUDIT_ENTRY), json.dumps(CELL)

        def sqlite_execute():
            msg_id = secrets.token_hex(16)
            database.execute("INSERT INTO inflight_executes VALUES (?, ?, ?)", ("s", msg_id, '{"code": "1+1"}'))
            database.execute("INSERT INTO cells (session, cell) VALUES (?, ?)", ("s", cell))
            database.execute("DELETE FROM inflight_executes WHERE session = ? AND msg_id = ?", ("s", msg_id))
            database.execute("INSERT INTO audit (session, time, event, entry) VALUES (?, ?, ?, ?)",
                             ("s", AUDIT_ENTRY["time"], "execute", audit))

        def sqlite_execute_batched():
            # What the gateway's StoreWriter does with writes queued together: one transaction, one fsync.
            database.execute("BEGIN IMMEDIATE")
            sqlite_execute()
            database.execute("COMMIT")

        def jsonl_execute():
            for name, line in (("cells.jsonl", cell), ("audit.jsonl", audit)):
                fd = os.open(Path(scratch) / name, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
                try:
                    os.write(fd, (line + "\n").encode())
                    os.fdatasync(fd)
                finally:
                    os.close(fd)
        progress(f"store: {writes} executes' writes, SQLite and JSONL")
        return (benchlib.measure(sqlite_execute, writes, warmup=5),
                benchlib.measure(sqlite_execute_batched, writes, warmup=5),
                benchlib.measure(jsonl_execute, writes, warmup=5))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="short smoke run")
    parser.add_argument("--sessions", type=int, default=0, help="live sessions (default 100, quick 4)")
    args = parser.parse_args()
    prefix = benchlib.cellblock_prefix()
    if not (prefix / "bin" / "cellblock-gateway").exists():
        print(f"cellblock-gateway is not installed under {prefix} (set CELLBLOCK_PREFIX)", file=sys.stderr)
        return 1
    sessions = args.sessions or (4 if args.quick else 100)
    rounds = 1 if args.quick else 3
    readopt, recreate, first_line = readoption(prefix, sessions, rounds)
    sqlite_cost, sqlite_batched, jsonl_cost = store_cost(50 if args.quick else 500)
    print(markdown_table(f"Gateway restart with {sessions} live agent sessions", [
        Row(f"kill -9, restart → all {sessions} sessions answer (state kept)", readopt,
            {"restart without re-adoption (new kernels, state lost)": recreate}, target="≤ 1000 ms for 100",
            note="from starting the new gateway; Jupyter Server / Kernel Gateway cannot re-adopt at all"),
        Row("restart → ready line", first_line, note="store opened, kernels re-attached in the background"),
    ]))
    print(markdown_table("Store writes per execute (committed, fsync'd)", [
        Row("SQLite (WAL, synchronous=FULL): in-flight, cell, in-flight removal, audit; a commit each",
            sqlite_cost, {"JSONL + fdatasync (the writer it replaced): cell, audit": jsonl_cost},
            note="off the request path: one writer thread in the gateway"),
        Row("the same four writes in one transaction (the writer's group commit)", sqlite_batched,
            {"JSONL + fdatasync (the writer it replaced): cell, audit": jsonl_cost},
            note="what a burst of executes costs per execute"),
    ]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
