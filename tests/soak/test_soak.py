"""Soak with faults (issue 13): many agent sessions and Jupyter WebSocket clients on one gateway at once, some of
their executes hit by a SIGKILL of the confined worker or by the client going away mid-execute.

What must hold, checked from the client side and from the host:
- every execute gets exactly one answer: its output complete (each execute prints tokens unique to the run, the
  session and the execute), or an error naming the cause (`WorkerDied: killed by signal 9` after a kill; for a
  dropped NDJSON stream the gateway interrupts the code and records a `KeyboardInterrupt` in the session's notebook
  and audit trail; a dropped WebSocket client that reconnects with its session_id gets the rest, replayed);
- nothing is lost, duplicated or crosses sessions: a session's notebook holds each of its executes once, in order,
  with exactly its own output; a WebSocket watching an agent session's kernel sees only that session's tokens;
- after every session is deleted the gateway's RSS and open descriptors are back at the baseline (tolerances
  below), no kernel or worker process of the run is left, and the gateway served throughout.

Sizes come from the environment (ctest runs the small default; tests/soak/README.md reports a big run):
CELLBLOCK_SOAK_SESSIONS, CELLBLOCK_SOAK_EXECUTES, CELLBLOCK_SOAK_WS_CLIENTS, CELLBLOCK_SOAK_CONCURRENCY,
CELLBLOCK_SOAK_FAULT_RATE (per execute, for each of kill and drop), CELLBLOCK_SOAK_CHAOS_INTERVAL (mean seconds
between random worker kills), CELLBLOCK_SOAK_SEED, CELLBLOCK_SOAK_REPORT (a
JSON file that receives the figures).
"""
import concurrent.futures
import importlib.util
import json
import os
import random
import re
import secrets
import signal
import sqlite3
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import cellblock_zygote
import requests
import websocket

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "gateway"))
from gateway_harness import KernelSocket  # noqa: E402
from host_processes import (below_kernel, descendants, kernel_tree, wait_for, wait_until_gone,  # noqa: E402
                            with_cmdline)

# The agent suite's gateway harness (tests/agent/conftest.py), under a name that cannot clash with other conftests.
_spec = importlib.util.spec_from_file_location("agent_conftest", HERE.parent / "agent" / "conftest.py")
agent_conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(agent_conftest)
AgentGateway = agent_conftest.AgentGateway

SESSIONS = int(os.environ.get("CELLBLOCK_SOAK_SESSIONS", "20"))
EXECUTES = int(os.environ.get("CELLBLOCK_SOAK_EXECUTES", "10"))
WS_CLIENTS = int(os.environ.get("CELLBLOCK_SOAK_WS_CLIENTS", str(max(2, SESSIONS // 5))))
CONCURRENCY = int(os.environ.get("CELLBLOCK_SOAK_CONCURRENCY", "6"))
FAULT_RATE = float(os.environ.get("CELLBLOCK_SOAK_FAULT_RATE", "0.06"))
SEED = int(os.environ.get("CELLBLOCK_SOAK_SEED", str(secrets.randbits(32))))
CHAOS_INTERVAL_S = float(os.environ.get("CELLBLOCK_SOAK_CHAOS_INTERVAL", "5"))
REPORT = os.environ.get("CELLBLOCK_SOAK_REPORT")
PROGRESS = bool(os.environ.get("CELLBLOCK_SOAK_PROGRESS"))  # a line per 10 clients, and failures as they happen
WARM_POOL = 2

# Generous bounds for a loaded 2-core machine: they say "did not hang", not "was fast".
ANSWER_TIMEOUT_S = 300
GONE_TIMEOUT_S = 120
# After the run the gateway must be back at its baseline. Descriptors: exact but for a few that belong to no
# session (a log file reopened, the store's WAL). RSS: the heap may keep some freed pages (glibc's malloc does not
# give every page back), so a margin that is small against what a leak of per-session state over hundreds of
# sessions would add. Both measured after a warm-up round, so lazily allocated state is in the baseline.
FD_TOLERANCE = 4
RSS_TOLERANCE_KIB = 8 * 1024

RUN = secrets.token_hex(3)
TOKEN = re.compile(rf"soak{RUN}-[aw]\d+-\d+")


def token_of(kind: str, client: int, index: int) -> str:
    return f"soak{RUN}-{kind}{client}-{index}"


def complete_code(token: str) -> str:
    return f"print('{token}:a', flush=True)\nprint('{token}:b')\n'{token}:r'"


def long_code(token: str) -> str:
    """Prints its first token, then runs long enough to be killed or abandoned mid-execute."""
    return f"print('{token}:a', flush=True)\nimport time\ntime.sleep(120)\nprint('{token}:b')"


def gated_code(token: str) -> str:
    """Prints its first token, then waits for a file the test writes into the workspace once the client is away."""
    return (f"print('{token}:a', flush=True)\nimport os, time\nfor _ in range(6000):\n"
            f"    if os.path.exists('gate-{token}'):\n        break\n    time.sleep(0.02)\nprint('{token}:b')")


@dataclass
class Figures:
    agent_executes: int = 0
    ws_executes: int = 0
    worker_kills: int = 0
    ndjson_drops: int = 0
    ws_drops: int = 0
    observed_sessions: int = 0
    random_kills: int = 0
    chaos_hits: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, **counts):
        with self.lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)


@dataclass
class Execute:
    code: str
    mode: str  # call, stream (complete), kill (worker SIGKILLed mid-execute), drop (NDJSON client goes away)
    token: str
    # The previous execute's worker died, or its client went away (the kernel kills a worker that has not stopped
    # within the interrupt grace, kernel/src/worker/conversation.cpp, which a loaded machine can make it miss):
    # this one may carry the kernel's note on stderr.
    after_kill: bool
    chaos: int = 0  # random kills of this session's worker between the previous answer and this one
    previous_chaos: int = 0
    worker_died: bool = False
    stdout: str = ""


class ChaosTarget:
    """One live agent session for the random killer. Its lock orders kills against the session's own reading of
    them: a kill counts in the window of the first answer read after it."""

    def __init__(self, kernel_id: str):
        self.kernel_id = kernel_id
        self.lock = threading.Lock()
        self.pending = 0
        self.kills = 0

    def kill(self, soak, planned: bool) -> bool:
        with self.lock:
            workers = [p for p in soak.kernel_processes(self.kernel_id) if p.is_worker]
            if not workers:
                # Only a random kill that came first may have taken the worker a planned kill wants.
                assert not planned or self.pending, f"no confined worker below kernel {self.kernel_id}"
                return False
            for worker in workers:
                os.kill(worker.pid, signal.SIGKILL)
            if not planned:
                self.pending += 1
                self.kills += 1
            return True

    def take_window(self) -> int:
        with self.lock:
            taken, self.pending = self.pending, 0
            return taken


class Soak:
    def __init__(self, server: AgentGateway, runtime_dir: Path):
        self.server = server
        self.runtime_dir = runtime_dir
        self.figures = Figures()
        self.kernel_ids = set()
        self.kernel_ids_lock = threading.Lock()
        self.targets = {}
        self.targets_lock = threading.Lock()
        self.targets_changed = threading.Condition(self.targets_lock)  # the chaos thread waits for a live session
        self.stop_chaos = threading.Event()
        self.ws_base = server.url.replace("http", "ws", 1)
        self.token = server.token

    # ---------------------------------------------------------------------------------------------- host side

    def kernel_processes(self, kernel_id: str = "") -> list:
        return kernel_tree(self.runtime_dir, kernel_id)

    def chaos(self, interval_s: float) -> None:
        """SIGKILLs the worker of a random live agent session, whatever it is doing: the first as soon as a session
        is live (a run at the ctest size lasts a few seconds and must still see one), then one every interval."""
        rng = random.Random(SEED)
        while True:
            with self.targets_changed:
                self.targets_changed.wait_for(lambda: self.targets or self.stop_chaos.is_set())
                targets = list(self.targets.values())
            if self.stop_chaos.is_set():
                return
            killed = rng.choice(targets).kill(self, planned=False)
            if killed:
                self.figures.add(random_kills=1)
            # A session between workers has none to kill: another draw shortly.
            if self.stop_chaos.wait(rng.uniform(0.5, 1.5) * interval_s if killed else 0.05):
                return

    def stop(self) -> None:
        with self.targets_changed:
            self.stop_chaos.set()
            self.targets_changed.notify_all()

    def kill_worker(self, kernel_id: str) -> None:
        workers = [p for p in self.kernel_processes(kernel_id) if p.is_worker]
        assert workers, f"no confined worker below kernel {kernel_id}: {self.kernel_processes(kernel_id)}"
        for worker in workers:
            os.kill(worker.pid, signal.SIGKILL)

    def remember(self, kernel_id: str) -> None:
        with self.kernel_ids_lock:
            self.kernel_ids.add(kernel_id)

    def http(self) -> requests.Session:
        session = requests.Session()
        session.headers["Authorization"] = f"token {self.token}"
        return session

    # ---------------------------------------------------------------------------------------------- agent sessions

    def plan(self, rng: random.Random) -> str:
        draw = rng.random()
        if draw < FAULT_RATE:
            return "kill"
        if draw < 2 * FAULT_RATE:
            return "drop"
        return "stream" if rng.random() < 0.5 else "call"

    def agent_session(self, index: int) -> None:
        rng = random.Random(SEED * 1_000_003 + index)
        http = self.http()
        base = f"{self.server.url}/agent/v1/sessions/soak-{index}"
        created = http.post(f"{self.server.url}/agent/v1/sessions", json={"name": f"soak-{index}"},
                            timeout=ANSWER_TIMEOUT_S)
        assert created.status_code == 201, f"session {index}: create {created.status_code} {created.text}"
        kernel_id = created.json()["kernel_id"]
        self.remember(kernel_id)
        target = ChaosTarget(kernel_id)
        observer = Observer(self, kernel_id, f"soak{RUN}-a{index}-") if index % 3 == 0 else None
        executed = []  # Execute per request, in order
        with self.targets_changed:
            self.targets[index] = target
            self.targets_changed.notify_all()
        try:
            for position in range(EXECUTES):
                mode = self.plan(rng)
                token = token_of("a", index, position)
                code = long_code(token) if mode in ("kill", "drop") else complete_code(token)
                previous = executed[-1] if executed else None
                run = Execute(code, mode, token,
                              after_kill=bool(previous) and (previous.worker_died or previous.mode == "drop"),
                              previous_chaos=previous.chaos if previous else 0)
                executed.append(run)
                if mode == "call":
                    answer = http.post(f"{base}/execute", json={"code": code}, timeout=ANSWER_TIMEOUT_S)
                    assert answer.status_code == 200, f"{token}: {answer.status_code} {answer.text}"
                    answer = answer.json()
                else:
                    answer = self.streamed_execute(http, base, target, run)
                run.chaos = target.take_window()
                if answer is not None:
                    check_answer(run, answer)
                self.figures.add(agent_executes=1, worker_kills=mode == "kill", ndjson_drops=mode == "drop",
                                 chaos_hits=run.worker_died and mode != "kill")
            self.check_notebook_and_audit(http, base, executed, target)
        finally:
            with self.targets_lock:
                self.targets.pop(index, None)
            deleted = http.delete(base, timeout=ANSWER_TIMEOUT_S)
            http.close()
            if observer:
                observer.finish()
        assert deleted.status_code == 204, f"session {index}: delete {deleted.status_code} {deleted.text}"
        unexplained = sum(run.worker_died for run in executed if run.mode != "kill")
        assert unexplained <= target.kills, \
            f"session {index}: {unexplained} WorkerDied answers but only {target.kills} random kills"
        if observer:
            observer.check([run.token for run in executed if run.stdout.startswith(f"{run.token}:a\n")])
            self.figures.add(observed_sessions=1)

    def streamed_execute(self, http, base, target, run):
        """The NDJSON answer's end event, or None for an execute whose client went away on purpose."""
        token = run.token
        response = http.post(f"{base}/execute", json={"code": run.code}, headers={"Accept": "application/x-ndjson"},
                             stream=True, timeout=ANSWER_TIMEOUT_S)
        assert response.status_code == 200, f"{token}: {response.status_code} {response.text}"
        deadline = time.monotonic() + ANSWER_TIMEOUT_S
        events = []
        stdout = ""
        for line in response.iter_lines():
            assert time.monotonic() < deadline, f"{token}: no end event within {ANSWER_TIMEOUT_S} s: {events}"
            event = json.loads(line)
            if event["type"] == "keepalive":
                continue
            assert not events or events[-1]["type"] != "end", f"{token}: an event after the end: {event}"
            events.append(event)
            if event["type"] == "stdout":
                stdout += event["text"]
                if run.mode in ("kill", "drop") and stdout == f"{token}:a\n":
                    if run.mode == "drop":
                        response.close()  # the client goes away mid-execute
                        return None
                    target.kill(self, planned=True)
        types = [event["type"] for event in events]
        assert types.count("start") == 1 and types[0] == "start", f"{token}: {types}"
        assert types.count("end") == 1 and types[-1] == "end", f"{token}: exactly one answer expected: {types}"
        end = events[-1]
        assert end["stdout"] == stdout, f"{token}: streamed {stdout!r} but the answer says {end['stdout']!r}"
        return end

    def check_notebook_and_audit(self, http, base, executed, target):
        def notebook_cells():
            notebook = http.get(f"{base}/notebook", timeout=ANSWER_TIMEOUT_S)
            assert notebook.status_code == 200, notebook.text
            return notebook.json()["cells"]

        # An execute whose client went away last is still being interrupted: wait for its cell (or a hang).
        deadline = time.monotonic() + ANSWER_TIMEOUT_S
        cells = notebook_cells()
        while len(cells) < len(executed) and time.monotonic() < deadline:
            time.sleep(0.2)
            cells = notebook_cells()
        # Random kills after the last answer the session read: they may have hit that last execute if its client
        # went away (it was still being interrupted).
        tail_chaos = target.take_window()
        sources = [cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"]) for cell in cells]
        assert sources == [run.code for run in executed], \
            f"{base}: the notebook does not hold each execute once, in order: {sources}"
        for position, (cell, run) in enumerate(zip(cells, executed)):
            stdout, others, ename = cell_outputs(cell)
            token = run.token
            where = f"{token} ({run.mode}) in the notebook"
            foreign = [t for t in TOKEN.findall(json.dumps(cell["outputs"])) if t != token]
            assert not foreign, f"{where}: output of other executes: {foreign}"
            if run.worker_died:  # known from its answer
                assert ename in ("WorkerDied", "WorkerUnavailable") and stdout == run.stdout, \
                    f"{where}: {cell['outputs']}"
            elif run.mode == "drop":
                later_chaos = executed[position + 1].chaos if position + 1 < len(executed) else tail_chaos
                if ename == "WorkerDied" and (run.chaos or later_chaos):
                    run.worker_died = True  # a random kill took the worker while it was being interrupted
                else:
                    assert ename == "KeyboardInterrupt", f"{where}: {cell['outputs']}"
                assert stdout == f"{token}:a\n", f"{where}: stdout {stdout!r}"
            else:
                assert stdout == f"{token}:a\n{token}:b\n", f"{where}: stdout {stdout!r}"
                assert ename is None and f"'{token}:r'" in others, f"{where}: {cell['outputs']}"
            run.stdout = stdout
        audit = http.get(f"{base}/audit", params={"event": "execute"}, timeout=ANSWER_TIMEOUT_S)
        assert audit.status_code == 200, audit.text
        entries = audit.json()["entries"]
        assert [entry["code"] for entry in entries] == [run.code for run in executed], \
            f"{base}: the audit trail does not hold each execute once, in order"
        for entry, run in zip(entries, executed):
            complete = run.mode in ("call", "stream") and not run.worker_died
            assert entry["status"] == ("ok" if complete else "error"), f"{run.token}: {entry}"

    # ---------------------------------------------------------------------------------------------- WebSocket clients

    def ws_client(self, index: int) -> None:
        rng = random.Random(SEED * 1_000_003 + 500_000 + index)
        http = self.http()
        created = http.post(f"{self.server.url}/api/kernels", json={}, timeout=ANSWER_TIMEOUT_S)
        assert created.status_code == 201, f"ws client {index}: {created.status_code} {created.text}"
        kernel_id = created.json()["id"]
        self.remember(kernel_id)
        session_id = f"soak-ws-{index}-{secrets.token_hex(4)}"
        v1 = index % 2 == 1  # half speak the v1 binary protocol, half the legacy JSON one
        client = KernelSocket(self, kernel_id, session_id=session_id, v1=v1, timeout=ANSWER_TIMEOUT_S)
        try:
            ready = client.wait_ready(timeout=ANSWER_TIMEOUT_S)
            own = {ready["parent_header"]["msg_id"]}
            modes = [self.plan(rng) for _ in range(EXECUTES)]
            modes = ["call" if mode == "stream" else mode for mode in modes]
            forced = "drop" if index % 2 == 0 else "kill"  # every WebSocket client meets at least one fault
            if forced not in modes:
                modes[EXECUTES // 2] = forced
            for position, mode in enumerate(modes):
                token = token_of("w", index, position)
                code = {"kill": long_code, "drop": gated_code, "call": complete_code}[mode](token)
                msg_id = client.send("execute_request", {"code": code, "silent": False, "store_history": True,
                                                         "user_expressions": {}, "allow_stdin": False})
                own.add(msg_id)
                messages = []
                if mode != "call":
                    messages = collect(client, own, msg_id, token, until_first_output=True)
                    if mode == "kill":
                        self.kill_worker(kernel_id)
                    else:
                        client = self.reconnect_after_gate(http, client, kernel_id, session_id, v1, token)
                messages += collect(client, own, msg_id, token)
                check_ws_execute(token, mode, messages)
                self.figures.add(ws_executes=1, worker_kills=mode == "kill", ws_drops=mode == "drop")
        finally:
            client.close()
            deleted = http.delete(f"{self.server.url}/api/kernels/{kernel_id}", timeout=ANSWER_TIMEOUT_S)
            http.close()
        assert deleted.status_code == 204, f"ws client {index}: delete {deleted.status_code} {deleted.text}"

    def reconnect_after_gate(self, http, client, kernel_id, session_id, v1, token):
        """The client goes away mid-execute; the cell finishes while it is away (the test opens the cell's gate
        only then, and waits for the kernel to go idle); the client comes back with its session_id."""
        client.close()
        url = f"{self.server.url}/api/kernels/{kernel_id}"
        wait_for(lambda: http.get(url, timeout=60).json()["connections"] == 0, timeout=GONE_TIMEOUT_S,
                 what=f"{token}: the dropped WebSocket to be gone")
        gate = self.server.state_dir / "workspaces" / kernel_id / f"gate-{token}"
        assert gate.parent.is_dir(), f"{token}: no workspace at {gate.parent}"
        gate.write_text("open")
        wait_for(lambda: http.get(url, timeout=60).json()["execution_state"] == "idle", timeout=GONE_TIMEOUT_S,
                 what=f"{token}: the cell to finish while the client is away")
        return KernelSocket(self, kernel_id, session_id=session_id, v1=v1, timeout=ANSWER_TIMEOUT_S)


class Observer:
    """A Jupyter client (legacy WebSocket) watching an agent session's kernel: every stream text it sees."""

    def __init__(self, soak: Soak, kernel_id: str, prefix: str):
        self.prefix = prefix
        self.texts = []
        self.error = None
        self.socket = KernelSocket(soak, kernel_id, session_id=f"soak-observer-{secrets.token_hex(4)}",
                                   timeout=ANSWER_TIMEOUT_S)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        try:
            while True:
                message = self.socket.recv(timeout=ANSWER_TIMEOUT_S)
                if message.get("msg_type") == "stream":
                    self.texts.append(message["content"]["text"])
        except (ConnectionError, OSError, websocket.WebSocketException, TimeoutError) as ended:
            self.error = ended

    def finish(self):
        """The session was deleted: its kernel is shut down, which ends the watching connection. The watcher then
        closes its socket, as a browser does (one that keeps it open after the close handshake keeps the deleted
        kernel's files on disk for a while: tests/soak/README.md)."""
        self.thread.join(GONE_TIMEOUT_S)
        alive = self.thread.is_alive()
        self.socket.ws.shutdown()  # the close handshake is done (or the thread is stuck): just close the socket
        if alive:
            self.thread.join(10)
            raise AssertionError(f"the watcher of {self.prefix} was not disconnected when its session was deleted")

    def check(self, tokens):
        seen = TOKEN.findall("".join(self.texts))
        foreign = [t for t in seen if not t.startswith(self.prefix)]
        assert not foreign, f"a watcher of {self.prefix} saw other sessions' output: {foreign[:5]}"
        missing = [t for t in tokens if f"{t}:a\n" not in "".join(self.texts)]
        assert not missing, f"a watcher of {self.prefix} missed output of {missing[:5]}"


def collect(client, own, msg_id, token, until_first_output=False):
    """The messages answering msg_id until its reply and idle status arrived (or its first output); any message
    answering a request this client never sent, or carrying another execute's token, fails."""
    messages = []
    deadline = time.monotonic() + ANSWER_TIMEOUT_S
    while True:
        left = deadline - time.monotonic()
        assert left > 0, f"{token}: no answer within {ANSWER_TIMEOUT_S} s: {[m['msg_type'] for m in messages]}"
        message = client.recv(timeout=left)
        parent = (message.get("parent_header") or {}).get("msg_id")
        if parent not in own and message["msg_type"] != "status":
            raise AssertionError(f"{token}: a message answering a request this client never sent: {message}")
        if parent != msg_id:
            continue
        foreign = [t for t in TOKEN.findall(json.dumps(message.get("content"))) if t != token]
        assert not foreign, f"{token}: another execute's output: {message}"
        messages.append(message)
        if until_first_output and stream_text(messages) == f"{token}:a\n":
            return messages
        types = [m["msg_type"] for m in messages]
        idle = any(m["msg_type"] == "status" and m["content"]["execution_state"] == "idle" for m in messages)
        if "execute_reply" in types and idle:
            return messages


def stream_text(messages, name="stdout"):
    return "".join(m["content"]["text"] for m in messages
                   if m["msg_type"] == "stream" and m["content"]["name"] == name)


def check_ws_execute(token, mode, messages):
    ids = [m["header"]["msg_id"] for m in messages]
    assert len(ids) == len(set(ids)), f"{token} ({mode}): a message arrived twice: {[m['msg_type'] for m in messages]}"
    replies = [m for m in messages if m["msg_type"] == "execute_reply"]
    assert len(replies) == 1, f"{token} ({mode}): {len(replies)} execute_replies"
    stdout = stream_text(messages)
    reply = replies[0]["content"]
    if mode == "kill":
        assert reply["status"] == "error" and reply["ename"] == "WorkerDied", f"{token}: {reply}"
        assert "killed by signal 9" in reply["evalue"], f"{token}: {reply}"
        assert stdout == f"{token}:a\n", f"{token}: stdout {stdout!r}"
        return
    assert reply["status"] == "ok", f"{token} ({mode}): {reply}"
    assert stdout == f"{token}:a\n{token}:b\n", f"{token} ({mode}): stdout {stdout!r}"
    if mode == "call":
        results = [m["content"]["data"]["text/plain"] for m in messages if m["msg_type"] == "execute_result"]
        assert results == [f"'{token}:r'"], f"{token}: results {results}"


RESTART_NOTE = "[cellblock] The Python worker was restarted"


def check_answer(run: Execute, answer: dict) -> None:
    """One agent answer: complete, or WorkerDied where a kill explains it."""
    token = run.token
    may_be_hit = run.chaos > 0 or run.previous_chaos > 0
    expected = f"{token}:a\n{token}:b\n"
    assert not TOKEN.findall(answer["stderr"]), f"{token}: stderr {answer['stderr']!r}"
    # The first execute after a dead worker carries the kernel's note that the state is gone; nothing else writes
    # to stderr.
    for line in answer["stderr"].splitlines():
        assert line.startswith(RESTART_NOTE) and (run.after_kill or may_be_hit), f"{token}: stderr {line!r}"
    error = answer.get("error") or {}
    if error.get("ename") == "WorkerUnavailable" and may_be_hit:
        # A random kill hit the worker while it started for this execute: the kernel says so.
        assert "ended during start-up (killed by signal 9" in error["evalue"], f"{token}: {error}"
        assert answer["status"] == "error" and answer["stdout"] == "", f"{token}: {answer}"
        run.worker_died = True
        return
    if error.get("ename") == "WorkerDied":
        assert run.mode == "kill" or may_be_hit, f"{token}: WorkerDied without a kill: {answer}"
        assert "killed by signal 9" in error["evalue"], f"{token}: {error}"
        assert answer["status"] == "error" and answer["state_lost"] is True, f"{token}: {answer}"
        if run.mode == "kill" and not may_be_hit:
            assert answer["stdout"] == f"{token}:a\n", f"{token}: stdout {answer['stdout']!r}"
        else:  # a random kill: whatever the code printed before it (a print is two writes), nothing else
            assert expected.startswith(answer["stdout"]), f"{token}: stdout {answer['stdout']!r}"
        run.worker_died = True
        run.stdout = answer["stdout"]
        return
    assert run.mode != "kill", f"{token}: the worker was killed mid-execute, but the answer is {answer}"
    assert answer["status"] == "ok" and not error, f"{token}: {answer}"
    assert answer["stdout"] == expected, f"{token}: stdout {answer['stdout']!r}"
    assert answer["result"]["text/plain"] == f"'{token}:r'", f"{token}: result {answer['result']}"


def cell_outputs(cell):
    stdout, others, ename = "", [], None
    for output in cell["outputs"]:
        if output["output_type"] == "stream":
            text = output["text"] if isinstance(output["text"], str) else "".join(output["text"])
            if output["name"] == "stdout":
                stdout += text
            else:
                others.append(text)
        elif output["output_type"] == "error":
            ename = output["ename"]
        else:
            plain = output.get("data", {}).get("text/plain", "")
            others.append(plain if isinstance(plain, str) else "".join(plain))
    return stdout, others, ename


# -------------------------------------------------------------------------------------------------- the gateway


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def kernel_roots(soak: Soak) -> list:
    """The gateway's kernel processes (not their forked helpers, which share the command line)."""
    matching = with_cmdline(f"{soak.runtime_dir}/kernel-")
    pids = {p.pid for p in matching}
    return [p for p in matching if p.ppid not in pids]


def kernel_files(soak: Soak) -> dict:
    """Kernel ids that have a connection file in the runtime directory / a workspace in the state directory."""
    runtime = {path.name[len("kernel-"):-len(".json")] for path in soak.runtime_dir.glob("kernel-*.json")}
    workspaces = soak.server.state_dir / "workspaces"
    return {"runtime": runtime, "workspaces": {path.name for path in workspaces.iterdir()}}


def leftover_report(soak: Soak) -> str:
    """The kernels whose files are left, with what the gateway logged about each (for the diagnosis)."""
    found = kernel_files(soak)
    warm = warm_files(soak)["runtime"] if soak.server.process.poll() is None else set()
    lines = soak.server.log_path.read_text(errors="replace").splitlines()
    report = []
    for kernel_id in sorted((found["runtime"] | found["workspaces"]) - warm):
        logged = [line for line in lines if kernel_id in line][-15:]
        report.append(f"kernel {kernel_id} (connection file: {kernel_id in found['runtime']}, workspace: "
                      f"{kernel_id in found['workspaces']}); gateway log:\n  " + "\n  ".join(logged))
    return "\n".join(report)


def warm_files(soak: Soak) -> dict:
    ids = set()
    for kernel in kernel_roots(soak):
        found = re.search(r"kernel-([0-9a-f-]{36})\.json", kernel.cmdline)
        assert found, f"no connection file on the command line of {kernel}"
        ids.add(found.group(1))
    return {"runtime": ids, "workspaces": ids}


def pool_report(soak: Soak) -> str:
    """What the host shows of the gateway's kernels (for the diagnosis of a pool that does not settle): each kernel
    process, the pids it holds pidfds of, and everything below_kernel finds, with parent, owner and cgroup."""

    def describe(process) -> str:
        try:
            uid = next(line.split()[1] for line in Path(f"/proc/{process.pid}/status").read_text().splitlines()
                       if line.startswith("Uid:"))
            cgroup = sorted({line.split(":", 2)[-1] for line in Path(f"/proc/{process.pid}/cgroup").read_text()
                             .splitlines()} - {"/"})
        except (OSError, StopIteration):
            uid, cgroup = "?", "?"
        return f"{process} ppid {process.ppid} uid {uid} worker {process.is_worker} cgroup {cgroup}"

    lines = []
    for kernel in with_cmdline(f"{soak.runtime_dir}/kernel-"):
        lines.append(f"kernel {describe(kernel)} pidfds {cellblock_zygote.pidfd_targets(kernel.pid)}")
        lines.extend(f"  below: {describe(p)}" for p in below_kernel(kernel.pid))
    for service in with_cmdline("--template-service"):
        if service.ppid == soak.server.process.pid:
            lines.extend(f"template service {service.pid}: {describe(p)}" for p in descendants(service.pid))
    return "\n" + "\n".join(lines)


def settled(soak: Soak) -> dict:
    """Waits for the warm pool to be full again (each kernel with its worker started, so no start-up pipes are
    open) and the gateway's descriptor count to stay put for 3 s."""

    def pool_ready():
        roots = kernel_roots(soak)
        return len(roots) == WARM_POOL and all(any(p.is_worker for p in below_kernel(root.pid)) for root in roots)

    try:
        wait_for(pool_ready, timeout=GONE_TIMEOUT_S,
                 what=f"exactly the {WARM_POOL} warm-pool kernels to be running, each with its worker")
    except AssertionError as timed_out:
        raise AssertionError(f"{timed_out}: {pool_report(soak)}") from None
    pid = soak.server.process.pid
    readings = []
    for _ in range(200):
        readings = (readings + [open_fds(pid)])[-6:]
        if len(readings) == 6 and len(set(readings)) == 1:
            break
        time.sleep(0.5)
    return {"rss_kib": rss_kib(pid), "fds": open_fds(pid), "kernels": len(kernel_roots(soak))}


def run_tasks(soak: Soak, sessions: int, ws_clients: int) -> list:
    failures = []
    with concurrent.futures.ThreadPoolExecutor(CONCURRENCY) as pool:
        tasks = {}
        ws_every = max(1, sessions // max(1, ws_clients))
        ws_index = 0
        for index in range(sessions):
            tasks[pool.submit(soak.agent_session, index)] = f"agent session {index}"
            if index % ws_every == 0 and ws_index < ws_clients:
                tasks[pool.submit(soak.ws_client, ws_index)] = f"WebSocket client {ws_index}"
                ws_index += 1
        while ws_index < ws_clients:
            tasks[pool.submit(soak.ws_client, ws_index)] = f"WebSocket client {ws_index}"
            ws_index += 1
        started = time.monotonic()
        for done, future in enumerate(concurrent.futures.as_completed(tasks), 1):
            try:
                future.result()
            except Exception:  # noqa: BLE001  every task's failure is reported, not only the first
                failures.append(f"{tasks[future]}: {traceback.format_exc(limit=4)}")
                if PROGRESS:
                    print(failures[-1], file=sys.stderr, flush=True)
            if PROGRESS and done % 10 == 0:
                figures = {k: v for k, v in vars(soak.figures).items() if k != "lock"}
                print(f"soak progress: {done}/{len(tasks)} clients after {time.monotonic() - started:.0f} s, "
                      f"{len(failures)} failed, {figures}", file=sys.stderr, flush=True)
    return failures


def test_soak_every_execute_answered_once_nothing_crosses_and_the_gateway_returns_to_baseline(tmp_path):
    reason = agent_conftest._absent_reason()
    assert reason is None, reason
    runtime_dir = tmp_path / "runtime"
    server = AgentGateway(tmp_path / "state", tmp_path / "gateway.log", "--runtime-dir", str(runtime_dir),
                          "--warm-pool", str(WARM_POOL), "--max-kernels", str(2 * CONCURRENCY + 16),
                          "--agent-max-sessions", str(2 * CONCURRENCY + 16), "--agent-keepalive", "0.5",
                          "--agent-interrupt-grace", "2", "--log-level", "info")
    soak = Soak(server, runtime_dir)
    try:
        # Warm-up: the same paths once, so what the gateway allocates lazily (and keeps) is part of the baseline.
        failures = run_tasks(soak, 2, 2)
        assert not failures, "warm-up failed:\n" + "\n".join(failures) + f"\n{server.log_tail()}"
        baseline = settled(soak)
        soak.figures = Figures()
        started = time.monotonic()
        chaos = threading.Thread(target=soak.chaos, args=(CHAOS_INTERVAL_S,), daemon=True)
        chaos.start()
        try:
            failures = run_tasks(soak, SESSIONS, WS_CLIENTS)
        finally:
            soak.stop()
            chaos.join()
        duration_s = time.monotonic() - started
        if REPORT:
            Path(REPORT).write_text(json.dumps({"seed": SEED, "duration_s": duration_s, "failures": failures,
                                                **{k: v for k, v in vars(soak.figures).items() if k != "lock"}},
                                               indent=2) + "\n")
        server.assert_alive()
        assert not failures, f"{len(failures)} of {SESSIONS + WS_CLIENTS} clients failed (seed {SEED}):\n" + \
            "\n".join(failures[:10]) + f"\n{server.log_tail()}"
        figures = soak.figures
        # Positive control: the faults really happened (at the ctest size, some thousands of runs would be needed
        # to see none of either kind; the seed is in the failure message for a rerun).
        assert figures.worker_kills > 0 and figures.random_kills > 0, vars(figures)
        assert figures.ndjson_drops > 0 and figures.ws_drops > 0, vars(figures)
        assert figures.agent_executes == SESSIONS * EXECUTES and figures.ws_executes == WS_CLIENTS * EXECUTES

        assert server.request("GET", "/agent/v1/sessions").json()["sessions"] == []
        assert server.request("GET", "/api/kernels").json() == []
        left = wait_until_gone([p for kernel_id in soak.kernel_ids for p in soak.kernel_processes(kernel_id)],
                               GONE_TIMEOUT_S)
        assert not left, f"processes of deleted sessions still running: {[str(p) for p in left]}"
        server.http.close()
        after = settled(soak)
        # A deleted kernel's connection file, sockets, log and workspace (the user's files) go with it.
        try:
            wait_for(lambda: kernel_files(soak) == warm_files(soak), timeout=GONE_TIMEOUT_S,
                     what="only the warm-pool kernels' files to be left")
        except AssertionError as timed_out:
            raise AssertionError(f"{timed_out}: {leftover_report(soak)}") from None
        for _ in range(60):  # closing connections and shutting kernels down ends in the io thread, soon after
            if after["fds"] <= baseline["fds"] + FD_TOLERANCE and \
                    after["rss_kib"] <= baseline["rss_kib"] + RSS_TOLERANCE_KIB:
                break
            time.sleep(1)
            after = settled(soak)
        summary = {"seed": SEED, "sessions": SESSIONS, "executes_per_session": EXECUTES,
                   "ws_clients": WS_CLIENTS, "concurrency": CONCURRENCY, "fault_rate": FAULT_RATE,
                   "duration_s": round(duration_s, 1), "baseline": baseline, "after": after,
                   **{k: v for k, v in vars(figures).items() if k != "lock"},
                   "kernels_used": len(soak.kernel_ids)}
        print("soak:", json.dumps(summary))
        if REPORT:
            Path(REPORT).write_text(json.dumps(summary, indent=2) + "\n")
        assert after["fds"] <= baseline["fds"] + FD_TOLERANCE, f"descriptors leaked: {summary}"
        assert after["rss_kib"] <= baseline["rss_kib"] + RSS_TOLERANCE_KIB, f"memory not returned: {summary}"
        server.assert_alive()
    finally:
        server.stop()
    # The gateway stopped its warm-pool kernels; nothing of the run is left on the host.
    left = wait_until_gone(soak.kernel_processes(), GONE_TIMEOUT_S)
    assert not left, f"processes left after the gateway stopped: {[str(p) for p in left]}"
    assert kernel_files(soak) == {"runtime": set(), "workspaces": set()}, \
        f"files of kernels left after the gateway stopped: {leftover_report(soak)}"
    # Stopped and forgotten (gateway/README.md): the store remembers no kernel, the warm pool's included.
    store = sqlite3.connect(f"file:{server.state_dir / 'store.sqlite3'}?mode=ro", uri=True)
    try:
        remembered = [row[0] for row in store.execute("SELECT id FROM kernels")]
    finally:
        store.close()
    assert remembered == [], f"the store still records kernels the gateway stopped: {remembered}"
