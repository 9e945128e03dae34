"""Sessions outlive the gateway: kernels re-adopted after kill -9 or SIGTERM, output produced while no
gateway ran delivered afterwards, orphaned kernels stopping themselves, lost kernels reported, and a state directory
that refuses a second gateway or a corrupt store. Real gateways, real signals, real kernels; every check is made from
the host (/proc, the filesystem), not only from what the gateway says."""
import json
import os
import signal
import sqlite3
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest
import requests
import websocket

from conftest import GATEWAY_BINARY, KERNELSPEC, AgentGateway
from test_live_view import EventReader

# Prints 30 lines over 3 s; `progress` in the workspace says how far it got (a host-side view of a running cell).
PRINT_30_LINES = ("import time\nfor i in range(30):\n    print(f'line {i}', flush=True)\n"
                  "    open('progress', 'w').write(str(i))\n    time.sleep(0.1)\n'done'")


# ---------------------------------------------------------------------------------------------- host-side views

def process_start(pid: int):
    """Start time (clock ticks since boot) of `pid`, or None when it is gone or a zombie."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return None if fields[0] == "Z" else int(fields[19])


def kernel_pids(state_dir: Path) -> dict:
    """pid -> start time of every cellblock-kernel whose connection file lies in `state_dir`."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(b"cellblock-kernel" in part for part in argv[:2]) and any(str(state_dir).encode() in a for a in argv):
            start = process_start(int(entry.name))
            if start is not None:
                found[int(entry.name)] = start
    return found


def process_tree(root: int) -> dict:
    """pid -> start time of `root` and every process below it (workers run under their kernel)."""
    children = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue
        ppid = int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))
        children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = {}, [root]
    while todo:
        pid = todo.pop()
        start = process_start(pid)
        if start is not None:
            tree[pid] = start
            todo.extend(children.get(pid, []))
    return tree


def recorded_kernels(state_dir: Path) -> dict:
    """pid -> start time of every kernel the gateway's store records (the store writer commits a kernel's record
    just after its spawn, so for a moment a kernel runs that no gateway would find after a crash)."""
    with sqlite3.connect(f"file:{state_dir / 'store.sqlite3'}?mode=ro", uri=True) as store:
        return dict(store.execute("SELECT pid, start_ticks FROM kernels").fetchall())


def kernels_all_recorded(state_dir: Path) -> dict:
    """Every kernel of `state_dir` once the store records each of them (the warm pool's refill too), else {}."""
    running = kernel_pids(state_dir)
    recorded = recorded_kernels(state_dir)
    return running if running and all(recorded.get(pid) == start for pid, start in running.items()) else {}


def still_alive(processes: dict) -> dict:
    return {pid: start for pid, start in processes.items() if process_start(pid) == start}


def wait_until(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def kill_9(gateway: AgentGateway):
    gateway.process.kill()
    gateway.process.wait()
    gateway.http.close()


def result_text(answer: dict) -> str:
    return (answer.get("result") or {}).get("text/plain", "")


# ---------------------------------------------------------------------------------------------- a WebSocket client

class Channels:
    """The Kernel Gateway /channels WebSocket (legacy JSON messages) with a chosen session_id."""

    def __init__(self, gateway: AgentGateway, kernel_id: str, session_id: str):
        self.session_id = session_id
        url = gateway.url.replace("http", "ws", 1) + f"/api/kernels/{kernel_id}/channels?session_id={session_id}"
        self.socket = websocket.create_connection(url, header=[f"Authorization: token {gateway.token}"], timeout=60)

    def send(self, msg_type: str, content: dict, channel: str = "shell") -> str:
        msg_id = uuid.uuid4().hex
        header = {"msg_id": msg_id, "msg_type": msg_type, "username": "test", "session": self.session_id,
                  "date": time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime()), "version": "5.3"}
        self.socket.send(json.dumps({"header": header, "parent_header": {}, "metadata": {}, "content": content,
                                     "channel": channel, "buffers": []}))
        return msg_id

    def execute(self, code: str) -> str:
        return self.send("execute_request", {"code": code, "silent": False, "store_history": True,
                                             "user_expressions": {}, "allow_stdin": False, "stop_on_error": True})

    def collect(self, msg_id: str, timeout_s: float = 60, stop_on_connection_loss: bool = False,
                until_type: str = "execute_reply") -> list:
        """Messages answering `msg_id` until one of type `until_type` (or, if asked, until the connection drops)."""
        seen, deadline = [], time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.socket.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                message = json.loads(self.socket.recv())
            except websocket.WebSocketTimeoutException:
                break
            except (websocket.WebSocketConnectionClosedException, ConnectionError, OSError):
                if stop_on_connection_loss:
                    return seen
                raise
            if message.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            seen.append(message)
            if message["msg_type"] == until_type:
                return seen
        raise AssertionError(f"no execute_reply for {msg_id} within {timeout_s} s; got {[m['msg_type'] for m in seen]}")

    def close(self):
        self.socket.close()


def stream_text(messages: list) -> str:
    return "".join(m["content"]["text"] for m in messages if m["msg_type"] == "stream")


# ---------------------------------------------------------------------------------------------- tests

def test_kill_9_while_idle_keeps_kernel_ids_variables_and_files(tmp_path):
    state = tmp_path / "state"
    first = AgentGateway(state, tmp_path / "first.log", keep_kernels=True)
    try:
        first.create_session("keeper")
        assert first.execute("keeper", "x = 42\nopen('note.txt', 'w').write('kept')")["status"] == "ok"
        plain = first.request("POST", "/api/kernels", json={}).json()
        channels = Channels(first, plain["id"], "notebook-1")
        assert channels.collect(channels.execute("y = 7"))[-1]["content"]["status"] == "ok"
        channels.close()
        ids_before = {k["id"] for k in first.request("GET", "/api/kernels").json()}
        # Idle means settled: the warm pool (1 kernel) refilled after its two hand-outs, and every kernel in
        # the store, before the kill.
        pids_before = wait_until(lambda: len(kernels_all_recorded(state)) >= 3 and kernels_all_recorded(state), 30,
                                 "the session's, the plain and the pool's kernel, each recorded in the store")
    finally:
        kill_9(first)
    # From the host: the kernels did not die with their gateway.
    assert still_alive(pids_before) == pids_before

    second = AgentGateway(state, tmp_path / "second.log")
    try:
        ids_after = {k["id"] for k in second.request("GET", "/api/kernels").json()}
        assert ids_before <= ids_after, (ids_before, ids_after)
        answer = second.execute("keeper", "(x, open('note.txt').read())")
        assert answer["status"] == "ok", answer
        assert result_text(answer) == "(42, 'kept')"
        assert answer["state_lost"] is False
        channels = Channels(second, plain["id"], "notebook-1")
        reply = channels.collect(channels.execute("y * 6"))
        assert [m["content"]["data"]["text/plain"] for m in reply if m["msg_type"] == "execute_result"] == ["42"]
        channels.close()
        # Still the very same processes, not replacements that happen to work.
        assert still_alive(pids_before) == pids_before
        events = [e["event"] for e in second.request("GET", "/agent/v1/sessions/keeper/audit").json()["entries"]]
        assert "session_reloaded" in events and "kernel_readopted" in events
    finally:
        assert second.stop() == 0, second.log_tail()
    # The second gateway stopped its kernels (--shutdown-kernels-on-exit): nothing is left behind.
    wait_until(lambda: not still_alive(pids_before), 30, "the kernels to stop with the second gateway")


def test_output_printed_while_no_gateway_ran_completes_the_cell(tmp_path):
    state = tmp_path / "state"
    first = AgentGateway(state, tmp_path / "first.log", keep_kernels=True)
    outcome = {}

    def run():
        try:
            outcome["response"] = first.request("POST", "/agent/v1/sessions/printer/execute",
                                                json={"code": PRINT_30_LINES})
        except requests.RequestException as error:
            outcome["error"] = error

    try:
        progress = state / "workspaces" / first.create_session("printer")["kernel_id"] / "progress"
        caller = threading.Thread(target=run)
        caller.start()
        # The kill lands mid-cell: some lines printed, most to go.
        wait_until(lambda: progress.exists() and progress.read_text() not in ("", "0", "1"), 30,
                   "the cell to print its first lines")
    finally:
        kill_9(first)
    caller.join(timeout=30)
    assert "error" in outcome, "the killed gateway answered the execute"

    second = AgentGateway(state, tmp_path / "second.log")
    try:
        def finished_cell():
            cells = second.request("GET", "/agent/v1/sessions/printer/notebook").json()["cells"]
            return cells[-1] if cells and cells[-1]["source"] == PRINT_30_LINES else None

        cell = wait_until(finished_cell, 60, "the interrupted cell to be completed from the kernel's record")
        text = "".join("".join(o["text"]) if isinstance(o["text"], list) else o["text"]
                       for o in cell["outputs"] if o["output_type"] == "stream")
        assert text == "".join(f"line {i}\n" for i in range(30)), text
        results = [o for o in cell["outputs"] if o["output_type"] == "execute_result"]
        assert results and results[0]["data"]["text/plain"] == "'done'"
        executes = second.request("GET", "/agent/v1/sessions/printer/audit?event=execute").json()["entries"]
        assert [e["status"] for e in executes] == ["ok"], executes
        assert executes[0]["outputs"]["stdout"]["bytes"] == len(text)
        # The session goes on, on the same kernel.
        assert second.execute("printer", "i")["state_lost"] is False
    finally:
        second.stop()


def test_websocket_client_reconnecting_after_sigterm_gets_what_it_missed(tmp_path):
    state = tmp_path / "state"
    first = AgentGateway(state, tmp_path / "first.log", keep_kernels=True)
    kernel = first.request("POST", "/api/kernels", json={}).json()
    channels = Channels(first, kernel["id"], "watcher")
    # Five ticks, then the cell waits for a gate the test opens only once the first gateway is gone: the other 15
    # are printed while no gateway runs, however long its stop takes.
    gate = state / "workspaces" / kernel["id"] / "gate"
    msg_id = channels.execute("import os, time\nfor i in range(20):\n    print(f'tick {i}', flush=True)\n"
                              "    while i == 4 and not os.path.exists('gate'):\n        time.sleep(0.02)")
    before = channels.collect(msg_id, until_type="stream")  # the cell is under way
    assert first.stop() == 0, first.log_tail()  # SIGTERM: an upgrade; the kernel keeps running
    before += channels.collect(msg_id, stop_on_connection_loss=True)
    assert gate.parent.is_dir(), gate.parent
    gate.write_text("")
    second = AgentGateway(state, tmp_path / "second.log")
    try:
        channels = Channels(second, kernel["id"], "watcher")
        after = channels.collect(msg_id)
        assert after[-1]["msg_type"] == "execute_reply" and after[-1]["content"]["status"] == "ok"
        assert len(stream_text(before).splitlines()) <= 5, "lines printed behind the gate reached the first gateway"
        # Every line exactly once, in order, across the restart.
        assert stream_text(before) + stream_text(after) == "".join(f"tick {i}\n" for i in range(20))
        channels.close()
    finally:
        second.stop()


def test_a_reply_arriving_during_re_adoption_still_follows_its_output(tmp_path):
    """A re-adopting gateway holds the kernel's live output until the kernel's record has reached the clients. A
    reply that arrives meanwhile must be held with it, or a client that stops reading at execute_reply loses the
    output. ipykernel keeps no record, so the gateway waits 5 s for one: a wide, certain window."""
    specs = tmp_path / "specs"
    (specs / "plain-ipykernel").mkdir(parents=True)
    (specs / "plain-ipykernel" / "kernel.json").write_text(json.dumps({
        "argv": ["/usr/bin/python3", "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "ipykernel, which keeps no record", "language": "python"}))
    state = tmp_path / "state"
    first = AgentGateway(state, tmp_path / "first.log", "--kernelspec-dir", str(specs), keep_kernels=True)
    response = first.request("POST", "/api/kernels", json={"name": "plain-ipykernel"})
    assert response.status_code == 201, f"{response.status_code} {response.text}"
    kernel_id = response.json()["id"]
    assert first.stop() == 0, first.log_tail()  # SIGTERM: the kernel keeps running
    second = AgentGateway(state, tmp_path / "second.log", "--kernelspec-dir", str(specs))
    try:
        channels = Channels(second, kernel_id, "watcher")
        msg_id = channels.execute("print('printed before the reply'); 6*7")
        types = [message["msg_type"] for message in channels.collect(msg_id)]
        assert "stream" in types and "execute_result" in types, f"the reply overtook its output: {types}"
        # The window was the one meant: the gateway waited for a record (and ipykernel answers `6*7` at once).
        wait_until(lambda: "kernel_keeps_no_record" in second.log_path.read_text(), 10, "the record wait to end")
        channels.close()
    finally:
        second.stop()


def test_orphaned_kernel_stops_itself_and_removes_its_workspace(tmp_path):
    state = tmp_path / "state"
    first = AgentGateway(state, tmp_path / "first.log", "--orphan-timeout", "3", keep_kernels=True)
    try:
        first.create_session("orphan")
        assert first.execute("orphan", "open('left.txt', 'w').write('x')")["status"] == "ok"
        kernel_id = first.request("GET", "/agent/v1/sessions/orphan").json()["kernel_id"]
        workspace = state / "workspaces" / kernel_id
        assert (workspace / "left.txt").exists()
        processes = {}
        for pid in kernel_pids(state):
            processes.update(process_tree(pid))
        assert len(processes) >= 2, processes  # kernels and their workers
    finally:
        kill_9(first)
    # From the host: every kernel and worker process ends, and the workspace is removed.
    wait_until(lambda: not still_alive(processes), 60, "orphaned kernels and workers to stop")
    wait_until(lambda: not workspace.exists(), 10, "the orphaned kernel's workspace to be removed")

    second = AgentGateway(state, tmp_path / "second.log")
    try:
        answer = second.execute("orphan", "import os\nos.path.exists('left.txt')")
        assert answer["status"] == "ok" and answer["state_lost"] is True
        assert result_text(answer) == "False"
        assert "lease" in answer["notice"], answer["notice"]
    finally:
        second.stop()


def test_a_kernel_its_gateway_died_before_recording_is_stopped_by_the_next_gateway(tmp_path):
    state = tmp_path / "state"
    first = AgentGateway(state, tmp_path / "first.log", "--warm-pool", "0", keep_kernels=True)
    try:
        kernel_id = first.request("POST", "/api/kernels", json={}).json()["id"]
        running = wait_until(lambda: kernels_all_recorded(state), 30, "the kernel to be recorded")
        processes = {}
        for pid in running:
            processes.update(process_tree(pid))
        assert len(processes) >= 2, processes  # the kernel and its worker
    finally:
        kill_9(first)
    # The window this recreates: the store writer commits a kernel's record just after its spawn, so a gateway
    # killed in between leaves a running kernel that no record names.
    with sqlite3.connect(state / "store.sqlite3") as store:
        store.execute("DELETE FROM kernels WHERE id = ?", (kernel_id,))
    connection_files = list(state.rglob(f"kernel-{kernel_id}.json"))
    assert connection_files, "the kernel's connection file is not in the state directory"
    workspace = state / "workspaces" / kernel_id
    assert workspace.exists()

    second = AgentGateway(state, tmp_path / "second.log")
    try:
        # From the host: the kernel and its worker end now, not after the 10-minute orphan lease.
        wait_until(lambda: not still_alive(processes), 20, "the unrecorded kernel and its worker to stop")
        assert not any(path.exists() for path in connection_files)
        wait_until(lambda: not workspace.exists(), 10, "the unrecorded kernel's workspace to be removed")
        assert second.request("GET", f"/api/kernels/{kernel_id}").status_code == 404
    finally:
        second.stop()


def test_kernels_killed_behind_the_gateways_back_are_reported_lost(tmp_path):
    state = tmp_path / "state"
    first = AgentGateway(state, tmp_path / "first.log", keep_kernels=True)
    try:
        first.create_session("stale")
        assert first.execute("stale", "x = 1")["status"] == "ok"
    finally:
        kill_9(first)
    # As after a reboot: the kernels are gone, the store still lists them.
    for pid in kernel_pids(state):
        os.killpg(pid, signal.SIGKILL)
    wait_until(lambda: not kernel_pids(state), 30, "the kernels to die")

    second = AgentGateway(state, tmp_path / "second.log")
    try:
        answer = second.execute("stale", "'x' in dir()")
        assert answer["status"] == "ok" and answer["state_lost"] is True
        assert result_text(answer) == "False"
        assert "no gateway was running" in answer["notice"], answer["notice"]
        events = second.request("GET", "/agent/v1/sessions/stale/audit?event=kernel_lost").json()["entries"]
        assert len(events) == 1 and "no gateway was running" in events[0]["cause"]
        assert second.execute("stale", "x = 2\nx")["state_lost"] is False
    finally:
        second.stop()


def gateway_command(state: Path) -> list:
    return [str(GATEWAY_BINARY), "--ip", "127.0.0.1", "--port", "0", "--token", "t", "--state-dir", str(state),
            "--kernelspec-dir", str(KERNELSPEC.parent.parent), "--warm-pool", "0"]


def test_second_gateway_on_the_same_state_directory_refuses_to_start(tmp_path):
    state = tmp_path / "state"
    first = AgentGateway(state, tmp_path / "first.log")
    try:
        refused = subprocess.run(gateway_command(state), capture_output=True, text=True, timeout=30)
        assert refused.returncode != 0
        assert "another cellblock-gateway" in refused.stderr and str(first.process.pid) in refused.stderr
        first.assert_alive()
        first.create_session("still-served")
    finally:
        first.stop()


def test_corrupt_store_is_refused_and_left_untouched(tmp_path):
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    garbage = b"not a database: " + os.urandom(4000)
    (state / "store.sqlite3").write_bytes(garbage)
    refused = subprocess.run(gateway_command(state), capture_output=True, text=True, timeout=30)
    assert refused.returncode != 0
    assert "not an SQLite database" in refused.stderr, refused.stderr
    assert (state / "store.sqlite3").read_bytes() == garbage
    assert not (state / "store.sqlite3-wal").exists()


def test_a_client_reconnecting_after_re_adoption_gets_what_the_kernel_printed_before_it_came_back(tmp_path):
    """The race the test above can fall into on a loaded machine, made certain: the kernel prints only after the new
    gateway has its record (kernel_adopted in its log) and before the client comes back; that output went to the
    sessions attached then, and must also reach the one that reconnects."""
    state = tmp_path / "state"
    first = AgentGateway(state, tmp_path / "first.log", keep_kernels=True)
    kernel = first.request("POST", "/api/kernels", json={}).json()
    channels = Channels(first, kernel["id"], "late-watcher")
    workspace = state / "workspaces" / kernel["id"]
    msg_id = channels.execute("import os, time\nprint('before', flush=True)\n"
                              "while not os.path.exists('gate'):\n    time.sleep(0.02)\n"
                              "for i in range(10):\n    print(f'after {i}', flush=True)\n"
                              "open('printed', 'w').close()")
    assert stream_text(channels.collect(msg_id, until_type="stream")) == "before\n"
    assert first.stop() == 0, first.log_tail()
    channels.collect(msg_id, stop_on_connection_loss=True)
    second = AgentGateway(state, tmp_path / "second.log", "--log-level", "info")
    try:
        wait_until(lambda: "kernel_adopted" in (tmp_path / "second.log").read_text(), 60,
                   "the new gateway to adopt the kernel")
        (workspace / "gate").write_text("")
        wait_until(lambda: (workspace / "printed").exists(), 60, "the cell to print its ten lines")
        channels = Channels(second, kernel["id"], "late-watcher")
        after = channels.collect(msg_id)
        assert stream_text(after) == "".join(f"after {i}\n" for i in range(10)), stream_text(after)
        channels.close()
    finally:
        second.stop()


def test_a_live_page_resuming_after_a_gateway_restart_starts_over_from_the_record(tmp_path):
    state = tmp_path / "state"
    first = AgentGateway(state, tmp_path / "first.log", keep_kernels=True)
    try:
        first.create_session("watched")
        assert first.execute("watched", "print('before the restart')")["status"] == "ok"
        page = EventReader(first, "watched")
        seen = page.until(lambda event: event["type"] == "end")
        page.close()
    finally:
        kill_9(first)
    last_seen = seen[-1][0]

    second = AgentGateway(state, tmp_path / "second.log")
    try:
        # The page's EventSource comes back with the last id it applied, an id of the gateway before.
        page = EventReader(second, "watched", last_event_id=last_seen)
        resync_id, resync = page.next()
        assert resync["type"] == "resync" and resync_id > last_seen, "a page drops ids it has passed"
        recorded = page.next()[1]
        assert recorded["type"] == "recorded" and "before the restart" in "".join(recorded["source"])
        assert second.execute("watched", "print('after the restart')")["status"] == "ok"
        rest = page.until(lambda event: event["type"] == "end")
        assert [event["type"] for _, event in rest] == ["cell", "stdout", "end"]
        assert rest[1][1]["text"] == "after the restart\n"
        ids = [resync_id] + [event_id for event_id, _ in rest]
        assert ids == sorted(set(ids)), "ids grow and never repeat"
        page.close()
    finally:
        assert second.stop() == 0, second.log_tail()
