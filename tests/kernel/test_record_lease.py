"""Sessions outlive the gateway, kernel side: the outbound record a re-attaching gateway fetches with
cellblock_replay_request, and the orphan lease (CELLBLOCK_LEASE_S) that stops a kernel nobody came back for.

Real kernels, real jupyter_client clients, real processes; the "gateway" is a second client on the control
channel, as the gateway is after a restart."""
import json
import os
import signal
import time

import cellblock_zygote
import pytest
from conftest import control_request
from jupyter_client import BlockingKernelClient

LEASE_EXPIRED_STATUS = 3  # kernel/src/launch/main.cpp lease_expired_exit_status
PRINT_30_LINES = "import time\nfor i in range(30):\n    print(f'line {i}', flush=True)\n    time.sleep(0.05)\n"
EXPECTED_30_LINES = "".join(f"line {i}\n" for i in range(30))


def _descendants(pid: int) -> set:
    """Everything below the kernel, and its worker when the template forked it (tests/plugins/cellblock_zygote.py)."""
    return set(cellblock_zygote.kernel_tree(pid)) - {pid}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _second_client(kernel):
    """A client of its own on the same kernel, as a restarted gateway is: its own Session (manager.client()
    would share the manager's, and so its routing identity, and the kernel's ROUTER drops a duplicate)."""
    client = BlockingKernelClient()
    client.load_connection_info(kernel.manager.get_connection_info())
    client.start_channels()
    return client


def _of_request(replay: dict, msg_id: str) -> list:
    return [m for m in replay["messages"] if m["parent_header"].get("msg_id") == msg_id]


def _streams(messages: list) -> list:
    return [m for m in messages if m["channel"] == "iopub" and m["header"]["msg_type"] == "stream"]


def _text(messages: list) -> str:
    return "".join(m["content"]["text"] for m in _streams(messages))


def test_replay_gives_a_second_client_every_line_in_order(fresh_kernel):
    k = fresh_kernel()
    run = k.execute(PRINT_30_LINES)
    assert run.content["status"] == "ok", run.content
    assert run.stream_text() == EXPECTED_30_LINES
    execute_id = run.reply["parent_header"]["msg_id"]
    gateway = _second_client(k)
    try:
        reply = control_request(gateway, "cellblock_replay_request", {"after": None})
        assert reply["msg_type"] == "cellblock_replay_reply"
        replay = reply["content"]
        assert replay["status"] == "ok" and replay["found"] is True and replay["dropped"] == 0, \
            {key: replay[key] for key in ("status", "found", "dropped")}
        cell = _of_request(replay, execute_id)
        assert _text(cell) == EXPECTED_30_LINES
        # Exactly what the first client got: the same messages, in the same order.
        assert [m["header"]["msg_id"] for m in _streams(cell)] == \
            [m["header"]["msg_id"] for m in run.of_type("stream")]
        kinds = [(m["channel"], m["header"]["msg_type"]) for m in cell]
        assert kinds[0] == ("iopub", "status") and kinds[-1] == ("iopub", "status"), kinds
        assert ("shell", "execute_reply") in kinds
        assert kinds.index(("shell", "execute_reply")) > max(i for i, kind in enumerate(kinds)
                                                             if kind == ("iopub", "stream"))
        streams = _streams(cell)
        assert len(streams) >= 3, "the lines should arrive as several stream messages"

        middle = streams[len(streams) // 2]
        after = control_request(gateway, "cellblock_replay_request",
                                 {"after": middle["header"]["msg_id"]})["content"]
        assert after["found"] is True
        rest = _of_request(after, execute_id)
        assert rest == cell[cell.index(middle) + 1:]
        assert _text(rest) == "".join(m["content"]["text"] for m in streams[len(streams) // 2 + 1:])
        assert _text([middle]) + _text(rest) == EXPECTED_30_LINES[EXPECTED_30_LINES.index(middle["content"]["text"]):]
        assert not any(m["header"]["msg_type"].startswith("cellblock_") for m in after["messages"]), \
            "replay replies are never recorded"

        unknown = control_request(gateway, "cellblock_replay_request", {"after": "no-such-msg-id"})["content"]
        assert unknown["found"] is False
        assert _text(_of_request(unknown, execute_id)) == EXPECTED_30_LINES
    finally:
        gateway.stop_channels()
    # The kernel still serves its first client.
    assert k.execute("print('still here')").stream_text() == "still here\n"


def test_output_of_a_cell_nobody_listened_to_is_replayed(fresh_kernel):
    """The gateway dies while a cell prints: nobody subscribes to IOPub, yet nothing is lost."""
    k = fresh_kernel()
    execute_id = k.client.execute(PRINT_30_LINES)
    k.client.stop_channels()  # the only client is gone while the cell runs
    time.sleep(1)
    gateway = _second_client(k)
    try:
        # Asks again until the cell has finished (its reply is recorded), as a re-attaching gateway would.
        deadline = time.monotonic() + 60
        while True:
            replay = control_request(gateway, "cellblock_replay_request", {"after": None})["content"]
            cell = _of_request(replay, execute_id)
            if any(m["header"]["msg_type"] == "execute_reply" for m in cell) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert _text(cell) == EXPECTED_30_LINES
        replies = [m for m in cell if m["header"]["msg_type"] == "execute_reply"]
        assert len(replies) == 1 and replies[0]["content"]["status"] == "ok"
    finally:
        gateway.stop_channels()


def test_record_bound_drops_oldest_and_reports_the_gap(fresh_kernel):
    k = fresh_kernel(CELLBLOCK_RECORD_MESSAGES=5)
    run = k.execute(PRINT_30_LINES)
    first_line = run.of_type("stream")[0]["header"]["msg_id"]
    gateway = _second_client(k)
    try:
        replay = control_request(gateway, "cellblock_replay_request", {"after": first_line})["content"]
        assert replay["found"] is False, "the first line was dropped from a 5-message record"
        assert replay["dropped"] > 0
        assert 0 < len(replay["messages"]) <= 5
        assert replay["messages"][-1]["header"]["msg_type"] == "status"  # the newest message is kept
    finally:
        gateway.stop_channels()


def test_lease_expiry_stops_kernel_and_worker_and_removes_the_directory(fresh_kernel, tmp_path):
    kernel_dir = tmp_path / "kernel-dir"
    workspace = kernel_dir / "workspace"
    workspace.mkdir(parents=True)
    (kernel_dir / "connection-copy.json").write_text("{}")
    (workspace / "notes.txt").write_text("scratch")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.txt").write_text("PRECIOUS")
    os.symlink(outside / "precious.txt", kernel_dir / "link-to-file")
    os.symlink(outside, workspace / "link-to-dir")
    log_path = tmp_path / "kernel.log"
    with open(log_path, "w") as log:
        k = fresh_kernel(stderr=log, CELLBLOCK_LEASE_S=2, CELLBLOCK_LEASE_CLEANUP_DIR=kernel_dir,
                         CELLBLOCK_WORKSPACE=workspace)
    k.client.stop_channels()  # nothing is sent from now on (not even heartbeats)
    process = k.manager.provisioner.process
    workers = set()
    deadline = time.monotonic() + 1.5
    while not workers and time.monotonic() < deadline:
        workers = _descendants(k.pid)
        time.sleep(0.05)
    assert workers, "the worker should be running under the kernel"

    try:
        status = process.wait(timeout=30)
    except Exception:
        pytest.fail("the kernel did not stop itself within 30 s of a 2 s lease")
    assert status == LEASE_EXPIRED_STATUS
    left = {pid for pid in workers if _alive(pid)}
    deadline = time.monotonic() + 10  # the kernel is gone; its worker's sandbox may take a moment to tear down
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = {pid for pid in left if _alive(pid)}
    assert not left, f"worker processes survived the lease: {left}"
    assert not os.path.lexists(kernel_dir), "the cleanup directory was left behind"
    assert (outside / "precious.txt").read_text() == "PRECIOUS", "a symlink target outside was touched"
    events = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
    expired = [event for event in events if event.get("event") == "lease_expired"]
    assert len(expired) == 1, events
    assert expired[0]["idle_s"] >= 2 and expired[0]["lease_s"] == 2


def test_lease_requests_keep_the_kernel_alive(fresh_kernel):
    k = fresh_kernel(CELLBLOCK_LEASE_S=2)
    process = k.manager.provisioner.process
    gateway = _second_client(k)
    try:
        renew_until = time.monotonic() + 6  # three leases long
        while time.monotonic() < renew_until:
            reply = control_request(gateway, "cellblock_lease_request", {})
            assert reply["msg_type"] == "cellblock_lease_reply"
            assert reply["content"] == {"status": "ok", "lease_s": 2}
            time.sleep(0.5)
        assert process.poll() is None, f"the kernel exited ({process.returncode}) although renewed"
        assert k.execute("print(6 * 7)").stream_text() == "42\n"
    finally:
        gateway.stop_channels()
    k.client.stop_channels()
    # Renewals stop: it was a real lease.
    assert process.wait(timeout=30) == LEASE_EXPIRED_STATUS


def test_sighup_does_not_stop_the_kernel(fresh_kernel):
    k = fresh_kernel()
    k.execute("x = 42")
    os.kill(k.pid, signal.SIGHUP)
    time.sleep(0.5)
    assert k.manager.is_alive()
    assert k.execute("print(x)").stream_text() == "42\n"


FAKE_GATEWAY = """
import json, os, subprocess, sys
argv, env = json.loads(sys.argv[1]), json.loads(sys.argv[2])
# As the gateway does: own session, output to this process (here a pipe, the harsher case).
kernel = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, start_new_session=True)
print(kernel.pid, flush=True)
sys.stdin.read()
"""


def test_kernel_outlives_its_killed_parent_and_its_output_pipe(tmp_path):
    """kill -9 of the process that started the kernel (and held its stdout/stderr pipes): the kernel keeps
    serving, with its state, while it writes debug log lines into the broken pipe."""
    import subprocess
    import sys
    from jupyter_client.connect import write_connection_file
    from jupyter_client.kernelspec import KernelSpecManager

    connection_file, _ = write_connection_file(str(tmp_path / "kernel.json"), key=os.urandom(16).hex().encode())
    argv = [part.replace("{connection_file}", connection_file)
            for part in KernelSpecManager().get_kernel_spec("cellblock-python").argv]
    env = dict(os.environ, CELLBLOCK_LOG="debug")
    gateway = subprocess.Popen([sys.executable, "-c", FAKE_GATEWAY, json.dumps(argv), json.dumps(env)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    kernel_pid = int(gateway.stdout.readline())
    client = BlockingKernelClient()
    client.load_connection_file(connection_file)
    client.start_channels()
    try:
        client.wait_for_ready(timeout=60)
        client.execute_interactive("x = 42", timeout=60)
        gateway.kill()
        gateway.wait()
        time.sleep(0.5)
        assert _alive(kernel_pid), "the kernel died with the process that started it"
        outputs = []
        reply = client.execute_interactive("print(x)", timeout=60, output_hook=outputs.append)
        assert reply["content"]["status"] == "ok"
        assert "".join(m["content"].get("text", "") for m in outputs if m["msg_type"] == "stream") == "42\n"
        assert _alive(kernel_pid)
    finally:
        if _alive(kernel_pid):
            client.shutdown()
            deadline = time.monotonic() + 15
            while _alive(kernel_pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if _alive(kernel_pid):
                os.kill(kernel_pid, signal.SIGKILL)
        client.stop_channels()
        if gateway.poll() is None:
            gateway.kill()
