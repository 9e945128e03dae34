#!/usr/bin/env python3
"""The agent API's one-call execute vs the same work over the Kernel Gateway WebSocket path of the same gateway.

    /usr/bin/python3 tests/bench/bench_agent.py [--quick] [--executes N]

One installed cellblock-gateway (warm pool 1, a temporary agent state directory), one agent session and one
kernel started through POST /api/kernels, both confined cellblock kernels:
- one-call execute: POST /agent/v1/sessions/{id}/execute {"code": "1+1"} over one keep-alive HTTP connection,
  request sent -> complete JSON answer read (execute_reply and IOPub idle both seen by the gateway, audit queued);
- NDJSON: the same request with Accept: application/x-ndjson, request sent -> "end" line read (what streaming adds);
- KG WebSocket: execute_request on /api/kernels/{id}/channels (legacy JSON protocol, as notebooks and agent
  frameworks speak it), sent -> IOPub status idle for it; the client parses every message, as real clients do;
- first output: code that prints, then works for 300 ms: when the client first sees the printed line, streamed
  (NDJSON stdout event) vs one-call (the answer).
Target: one-call `1+1` <= 2 ms median.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import secrets
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import websocket

import benchlib
from benchlib import Row, Stats, markdown_table, progress


class Gateway:
    def __init__(self, prefix: Path, state_dir: Path, log_path: Path):
        self.port = benchlib.free_port()
        self.token = secrets.token_hex(16)
        env = {k: v for k, v in os.environ.items() if not k.startswith("KG_")}
        env["JUPYTER_PATH"] = str(prefix / "share" / "jupyter")
        self.log = open(log_path, "wb")
        self.log_path = log_path
        self.process = subprocess.Popen(
            [str(prefix / "bin" / "cellblock-gateway"), "--ip", "127.0.0.1", "--port", str(self.port), "--token",
             self.token, "--kernelspec-dir", str(prefix / "share" / "jupyter" / "kernels"), "--state-dir",
             str(state_dir), "--shutdown-kernels-on-exit", "--warm-pool", "1"],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        deadline = time.monotonic() + 60
        ready = re.compile(rf"is available at http://127\.0\.0\.1:{self.port}\b")
        while not ready.search(log_path.read_text(errors="replace")):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"gateway did not start:\n{log_path.read_text(errors='replace')[-2000:]}")
            time.sleep(0.05)
        self.connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)

    def call(self, method: str, path: str, body=None, accept="application/json") -> tuple[int, bytes]:
        payload = json.dumps(body).encode() if body is not None else None
        headers = {"Authorization": f"token {self.token}", "Accept": accept}
        if payload is not None:
            headers["Content-Type"] = "application/json"
        self.connection.request(method, path, body=payload, headers=headers)
        response = self.connection.getresponse()
        return response.status, response.read()

    def stream(self, path: str, body: dict):
        """Sends an NDJSON execute; yields (seconds since sent, event) per line until the end event."""
        started = time.perf_counter()
        self.connection.request("POST", path, body=json.dumps(body).encode(),
                                headers={"Authorization": f"token {self.token}", "Accept": "application/x-ndjson",
                                         "Content-Type": "application/json"})
        response = self.connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"streamed execute: HTTP {response.status} {response.read()[:200]!r}")
        while True:
            line = response.readline()
            if not line:
                break
            event = json.loads(line)
            yield time.perf_counter() - started, event
            if event["type"] == "end":
                response.read()  # the terminating chunk, so the connection is reusable
                break

    def stop(self) -> None:
        self.connection.close()
        benchlib.stop_process(self.process)
        self.log.close()


def kg_websocket_round_trip(gateway: Gateway, kernel_id: str):
    ws = websocket.create_connection(
        f"ws://127.0.0.1:{gateway.port}/api/kernels/{kernel_id}/channels?session_id={uuid.uuid4().hex}",
        header=[f"Authorization: token {gateway.token}"], timeout=120, enable_multithread=False)
    ws.sock.setsockopt(__import__("socket").IPPROTO_TCP, __import__("socket").TCP_NODELAY, 1)
    session = uuid.uuid4().hex

    def run() -> None:
        msg_id = uuid.uuid4().hex
        ws.send(json.dumps({
            "header": {"msg_id": msg_id, "msg_type": "execute_request", "username": "bench", "session": session,
                       "date": "", "version": "5.3"},
            "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
            "content": {"code": "1+1", "silent": False, "store_history": True, "user_expressions": {},
                        "allow_stdin": False, "stop_on_error": True}}))
        result = None
        while True:
            message = json.loads(ws.recv())
            if message.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            if message["msg_type"] == "execute_result":
                result = message["content"]["data"]["text/plain"]
            if message["msg_type"] == "status" and message["content"]["execution_state"] == "idle":
                break
        if result != "2":
            raise RuntimeError(f"KG WebSocket execute returned {result!r}")

    return ws, run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="short smoke run")
    parser.add_argument("--executes", type=int, default=0, help="executes per measure (default 400, quick 30)")
    args = parser.parse_args()
    executes = args.executes or (30 if args.quick else 400)
    prefix = benchlib.cellblock_prefix()
    if not (prefix / "bin" / "cellblock-gateway").exists():
        print(f"cellblock-gateway is not installed under {prefix} (set CELLBLOCK_PREFIX)", file=sys.stderr)
        return 1

    with tempfile.TemporaryDirectory(prefix="bench-agent-") as scratch:
        gateway = Gateway(prefix, Path(scratch) / "state", Path(scratch) / "gateway.log")
        ws = None
        try:
            status, body = gateway.call("POST", "/agent/v1/sessions", {"name": "bench"})
            if status != 201:
                raise RuntimeError(f"create session: {status} {body[:200]!r}")
            execute_path = "/agent/v1/sessions/bench/execute"

            def one_call() -> None:
                status, body = gateway.call("POST", execute_path, {"code": "1+1"})
                if status != 200 or json.loads(body)["result"]["text/plain"] != "2":
                    raise RuntimeError(f"one-call execute: {status} {body[:200]!r}")

            def streamed() -> None:
                events = list(gateway.stream(execute_path, {"code": "1+1"}))
                if events[-1][1]["result"]["text/plain"] != "2":
                    raise RuntimeError(f"streamed execute: {events[-1]}")

            progress(f"agent: one-call execute x{executes}")
            one_call_stats = benchlib.measure(one_call, executes, warmup=5)
            progress(f"agent: NDJSON execute x{executes}")
            streamed_stats = benchlib.measure(streamed, executes, warmup=5)

            status, body = gateway.call("POST", "/api/kernels", {"name": "cellblock-python"})
            if status != 201:
                raise RuntimeError(f"POST /api/kernels: {status} {body[:200]!r}")
            ws, kg_run = kg_websocket_round_trip(gateway, json.loads(body)["id"])
            progress(f"KG WebSocket: execute x{executes}")
            kg_stats = benchlib.measure(kg_run, executes, warmup=5)

            slow_code = "import time\nprint('started', flush=True)\ntime.sleep(0.3)"
            first_streamed, first_one_call = [], []
            for _ in range(5 if args.quick else 20):
                for seconds, event in gateway.stream(execute_path, {"code": slow_code}):
                    if event["type"] == "stdout":
                        first_streamed.append(seconds * 1000)
                started = time.perf_counter()
                gateway.call("POST", execute_path, {"code": slow_code})
                first_one_call.append((time.perf_counter() - started) * 1000)
        finally:
            if ws is not None:
                ws.close()
            gateway.stop()

    rows = [
        Row("execute `1+1`, one call (HTTP keep-alive)", one_call_stats, {"KG WebSocket, same gateway": kg_stats},
            target="≤ 2 ms", note="request → full JSON answer vs execute_request → IOPub idle"),
        Row("execute `1+1`, NDJSON streamed", streamed_stats, {"KG WebSocket, same gateway": kg_stats},
            note=f"streaming adds {streamed_stats.median - one_call_stats.median:+.2f} ms median over one call"),
        Row("first printed line visible (print, then 0.3 s of work)", Stats(first_streamed),
            {"one call (answer at the end)": Stats(first_one_call)}, note="what streaming buys"),
    ]
    print(markdown_table("Agent API vs the Kernel Gateway WebSocket path (same gateway, same kernel type)", rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
