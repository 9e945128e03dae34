"""Kernel side: a kernel started with a network policy (CELLBLOCK_NETWORK_POLICY, names pinned with
CELLBLOCK_EGRESS_HOSTS) gives its worker the egress proxy at 127.0.0.1:3128 inside the worker's network namespace
(every worker, replacements too) and the usual proxy variables; what the proxy does is reported on IOPub
(`cellblock_egress`), a held request is shown and decided over the control channel. The "internet" is a local HTTP
server on 127.0.0.2 whose request log is the host-side witness. Without a policy nothing changes: no inet socket at
all. HTTPS, pip and the gateway's side are tests/agent's (the egress-gateway branch)."""
from __future__ import annotations

import http.server
import json
import os
import queue
import secrets
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from conftest import Kernel

SERVER_ADDRESS = "127.0.0.2"   # a loopback address of the host's own network namespace
EVENT_TIMEOUT = 60             # generous: a loaded 2-core machine


class Origin:
    """A plain-HTTP server on 127.0.0.2 that records every request it gets (the host-side witness)."""

    def __init__(self):
        self.token = secrets.token_hex(16)
        self.payload = (self.token + "\n").encode() * 2048   # ~66 KB
        self.requests = []
        origin = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                origin.requests.append((self.headers.get("Host"), self.path))
                body = origin.payload if self.path == "/data" else b"not here\n"
                self.send_response(200 if self.path == "/data" else 404)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer((SERVER_ADDRESS, 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def origin():
    server = Origin()
    yield server
    server.close()


@pytest.fixture(scope="module")
def hosts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("egress") / "egress-hosts"
    path.write_text(f"# the test's names, all served by the Origin\n"
                    f"{SERVER_ADDRESS} allowed.test asked.test denied.test session.test evil.test\n")
    return path


def start_kernel(policy: dict, hosts_file) -> Kernel:
    return Kernel(extra_env={"CELLBLOCK_NETWORK_POLICY": json.dumps(policy), "CELLBLOCK_EGRESS_HOSTS": str(hosts_file)})


@pytest.fixture(scope="module")
def allowlist_kernel(origin, hosts_file):
    k = start_kernel({"allow": ["allowed.test"], "ceiling": ["*.test"], "ports": [origin.port]}, hosts_file)
    yield k
    k.shutdown()


@pytest.fixture(scope="module")
def asking_kernel(origin, hosts_file):
    k = start_kernel({"allow": ["allowed.test"], "ask": True, "ceiling": ["*.test"], "ports": [origin.port],
                      "approval_timeout_s": 120}, hosts_file)
    yield k
    k.shutdown()


def fetch(url: str) -> str:
    """A cell that downloads `url` with urllib (through the proxy variables) and prints what happened."""
    return ("import urllib.request, urllib.error, hashlib\n"
            "try:\n"
            f"    body = urllib.request.urlopen({url!r}, timeout=120).read()\n"
            "    print('FETCHED', len(body), hashlib.sha256(body).hexdigest())\n"
            "except urllib.error.HTTPError as error:\n"
            "    print('REFUSED', error.code, error.read().decode().strip())\n")


def fetched(origin: Origin) -> str:
    import hashlib
    return f"FETCHED {len(origin.payload)} {hashlib.sha256(origin.payload).hexdigest()}\n"


def iopub_until(k: Kernel, predicate, run=None, timeout: float = EVENT_TIMEOUT) -> dict:
    """The first IOPub message that satisfies `predicate`: among `run`'s outputs, those kept for collect(), then
    new ones (kept for collect() as well)."""
    for _, msg in (run.outputs if run else []):
        if predicate(msg):
            return msg
    for messages in list(k._iopub_stash.values()):
        for msg in messages:
            if predicate(msg):
                return msg
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            msg = k.client.get_iopub_msg(timeout=0.5)
        except queue.Empty:
            continue
        k._iopub_stash.setdefault(msg["parent_header"].get("msg_id"), []).append(msg)
        if predicate(msg):
            return msg
    raise AssertionError(f"no matching IOPub message within {timeout} s")


def egress_event(kind: str, **fields):
    def matches(msg):
        content = msg["content"]
        return (msg["msg_type"] == "cellblock_egress" and content.get("event") == kind and
                all(content.get(name) == value for name, value in fields.items()))
    return matches


def decide(k: Kernel, approval_id: str, decision: str, decided_by: str = "kernel test") -> dict:
    """Sends cellblock_approval_decision_request on the control channel; returns the reply."""
    request = k.client.session.msg("cellblock_approval_decision_request",
                                   content={"id": approval_id, "decision": decision, "decided_by": decided_by})
    k.client.control_channel.send(request)
    deadline = time.monotonic() + EVENT_TIMEOUT
    while time.monotonic() < deadline:
        try:
            reply = k.client.get_control_msg(timeout=0.5)
        except queue.Empty:
            continue
        if reply["parent_header"].get("msg_id") == request["header"]["msg_id"]:
            return reply
    raise AssertionError("no cellblock_approval_decision_reply")


def test_an_allowed_host_is_reached_through_the_proxy_and_reported(allowlist_kernel, origin):
    k = allowlist_kernel
    before = len(origin.requests)
    run = k.execute(fetch(f"http://allowed.test:{origin.port}/data"), timeout=180)
    assert run.content["status"] == "ok", run.content
    assert run.stream_text() == fetched(origin), run.stream_text("stderr")
    assert origin.requests[before:] == [(f"allowed.test:{origin.port}", "/data")]
    event = iopub_until(k, egress_event("connection", host="allowed.test"), run)
    content = event["content"]
    assert content["allowed"] is True and content["rule"] == "allowed.test", content
    assert content["port"] == origin.port and content["method"] == "GET", content
    assert content["bytes_down"] >= len(origin.payload) and content["bytes_up"] > 0, content
    assert event["parent_header"].get("msg_id") in (run.reply["parent_header"]["msg_id"], None), event


def test_a_host_not_on_the_allowlist_gets_a_readable_refusal(allowlist_kernel, origin):
    k = allowlist_kernel
    before = len(origin.requests)
    run = k.execute(fetch(f"http://evil.test:{origin.port}/data"), timeout=180)
    assert run.content["status"] == "ok", run.content
    assert run.stream_text().startswith("REFUSED 403 "), run.stream_text()
    assert "evil.test is not on this session's network allowlist (allowed: allowed.test)" in run.stream_text()
    assert origin.requests[before:] == []   # the host-side proof: nothing reached the server
    event = iopub_until(k, egress_event("connection", host="evil.test"), run)
    assert event["content"]["allowed"] is False, event["content"]
    # Uncaught, the refusal is the cell's error.
    uncaught = k.execute(f"import urllib.request\nurllib.request.urlopen('http://evil.test:{origin.port}/data')",
                         timeout=180)
    assert uncaught.content["status"] == "error"
    assert uncaught.content["ename"] == "HTTPError" and "403" in uncaught.content["evalue"], uncaught.content


def test_the_worker_has_the_proxy_and_nothing_else(allowlist_kernel, origin):
    k = allowlist_kernel
    before = len(origin.requests)
    run = k.execute(
        "import os, socket, errno, json\n"
        "outcome = {name: os.environ.get(name) for name in\n"
        "           ('HTTP_PROXY', 'HTTPS_PROXY', 'http_proxy', 'https_proxy', 'NO_PROXY', 'no_proxy')}\n"
        "try:\n"
        "    socket.getaddrinfo('allowed.test', 80)\n"
        "    outcome['dns'] = 'resolved'\n"
        "except OSError:\n"
        "    outcome['dns'] = 'failed'\n"
        f"for target in [('{SERVER_ADDRESS}', {origin.port}), ('1.1.1.1', 53)]:\n"
        "    try:\n"
        "        socket.create_connection(target, timeout=5).close()\n"
        "        outcome[target[0]] = 'connected'\n"
        "    except OSError as error:\n"
        "        outcome[target[0]] = errno.errorcode.get(error.errno, str(error))\n"
        "print(json.dumps(outcome))\n")
    outcome = json.loads(run.stream_text())
    proxy = "http://127.0.0.1:3128"
    assert outcome["HTTP_PROXY"] == outcome["HTTPS_PROXY"] == outcome["http_proxy"] == outcome["https_proxy"] == proxy
    assert outcome["NO_PROXY"] == outcome["no_proxy"] == ""
    assert outcome["dns"] == "failed"
    # 127.0.0.2 inside is the worker's own loopback (nobody listens), the outside has no route.
    assert outcome[SERVER_ADDRESS] == "ECONNREFUSED" and outcome["1.1.1.1"] == "ENETUNREACH", outcome
    assert origin.requests[before:] == []


def test_a_replaced_worker_still_reaches_the_network_through_the_proxy(allowlist_kernel, origin):
    k = allowlist_kernel
    died = k.execute("import os; os._exit(3)")
    assert died.content["ename"] == "WorkerDied", died.content
    run = k.execute(fetch(f"http://allowed.test:{origin.port}/data"), timeout=180)
    assert run.stream_text() == fetched(origin), (run.stream_text(), run.stream_text("stderr"))


def held_request(k: Kernel, host: str, origin: Origin):
    """Starts a cell that fetches from `host` and waits for its approval event and display; returns
    (msg_id, event, display)."""
    msg_id = k.client.execute(fetch(f"http://{host}:{origin.port}/data"))
    event = iopub_until(k, egress_event("approval_requested", host=host))
    approval_id = event["content"]["id"]
    display = iopub_until(k, lambda msg: msg["msg_type"] == "display_data" and
                          msg["content"].get("transient", {}).get("display_id") == f"cellblock-approval-{approval_id}")
    return msg_id, event, display


def test_an_approved_request_completes(asking_kernel, origin):
    k = asking_kernel
    before = len(origin.requests)
    msg_id, event, display = held_request(k, "asked.test", origin)
    assert event["parent_header"]["msg_id"] == msg_id and display["parent_header"]["msg_id"] == msg_id
    approval_id = event["content"]["id"]
    assert event["content"]["port"] == origin.port and event["content"]["method"] == "GET"
    assert event["content"]["timeout_s"] == 120
    data = display["content"]["data"]
    assert data["application/vnd.cellblock.approval+json"]["host"] == "asked.test"
    assert f"asked.test:{origin.port}" in data["text/plain"] and "held for approval" in data["text/plain"]
    assert origin.requests[before:] == []   # held: nothing reached the server yet

    reply = decide(k, approval_id, "allow_once", "alice")
    assert reply["msg_type"] == "cellblock_approval_decision_reply"
    assert reply["content"] == {"status": "ok"}
    run = k.collect(msg_id, timeout=180)
    assert run.stream_text() == fetched(origin), run.stream_text("stderr")
    assert origin.requests[before:] == [(f"asked.test:{origin.port}", "/data")]
    decided = iopub_until(k, egress_event("approval_decided", id=approval_id), run)
    assert decided["content"]["decision"] == "allow_once" and decided["content"]["decided_by"] == "alice"
    update = iopub_until(k, lambda msg: msg["msg_type"] == "update_display_data" and
                         msg["content"]["transient"]["display_id"] == f"cellblock-approval-{approval_id}", run)
    assert update["parent_header"]["msg_id"] == msg_id
    assert "allowed once by alice" in update["content"]["data"]["text/plain"]
    # Decided once: a second decision is refused.
    again = decide(k, approval_id, "deny")
    assert again["content"]["status"] == "error" and again["content"]["ename"] == "UnknownApproval"


def test_a_denied_request_is_refused_with_who_denied_it(asking_kernel, origin):
    k = asking_kernel
    before = len(origin.requests)
    msg_id, event, _ = held_request(k, "denied.test", origin)
    assert decide(k, event["content"]["id"], "deny", "bob")["content"] == {"status": "ok"}
    run = k.collect(msg_id, timeout=180)
    assert run.stream_text().startswith("REFUSED 403 "), run.stream_text()
    assert "denied by bob" in run.stream_text()
    assert origin.requests[before:] == []


def test_allow_session_lets_later_requests_through_without_asking(asking_kernel, origin):
    k = asking_kernel
    msg_id, event, _ = held_request(k, "session.test", origin)
    assert decide(k, event["content"]["id"], "allow_session", "carol")["content"] == {"status": "ok"}
    assert k.collect(msg_id, timeout=180).stream_text() == fetched(origin)
    again = k.execute(fetch(f"http://session.test:{origin.port}/data"), timeout=180)
    assert again.stream_text() == fetched(origin), again.stream_text("stderr")
    assert not [msg for _, msg in again.outputs if msg["msg_type"] == "display_data"], "asked again"
    connection = iopub_until(k, egress_event("connection", host="session.test"), again)
    assert connection["content"]["allowed"] is True, connection["content"]


def test_an_unknown_approval_is_refused(asking_kernel):
    reply = decide(asking_kernel, "no-such-approval", "allow_once")
    assert reply["content"]["status"] == "error" and reply["content"]["ename"] == "UnknownApproval"


def test_without_a_policy_there_is_no_inet_socket_and_no_proxy(fresh_kernel):
    k = fresh_kernel()
    run = k.execute("import os, socket, errno\n"
                    "print(os.environ.get('HTTP_PROXY'))\n"
                    "try:\n"
                    "    socket.socket(socket.AF_INET, socket.SOCK_STREAM)\n"
                    "    print('created')\n"
                    "except OSError as error:\n"
                    "    print(errno.errorcode[error.errno])\n")
    assert run.stream_text() == "None\nEAFNOSUPPORT\n", run.stream_text("stderr")
    assert decide(k, "x", "deny")["content"]["ename"] == "UnknownApproval"


@pytest.mark.parametrize("policy, complaint", [
    ('{"allow": ["allowed.test"]', "CELLBLOCK_NETWORK_POLICY is not valid JSON"),
    ('["allowed.test"]', "CELLBLOCK_NETWORK_POLICY must be a JSON object"),
    ('{"allow": "allowed.test"}', "allow"),
])
def test_a_bad_policy_stops_the_kernel_from_starting(policy, complaint):
    from jupyter_client import KernelManager
    import os
    manager = KernelManager(kernel_name="cellblock-python")
    env = dict(os.environ, CELLBLOCK_NETWORK_POLICY=policy)
    manager.start_kernel(env=env, stderr=subprocess.PIPE)
    try:
        process = manager.provisioner.process
        assert process.wait(timeout=60) == 1
        stderr = process.stderr.read().decode()
        failure = [json.loads(line) for line in stderr.splitlines() if '"kernel_start_failed"' in line]
        assert failure and complaint in failure[0]["error"], stderr
    finally:
        manager.cleanup_resources()


def rss_kib(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


HOLD_CONNECTIONS = """
import os, socket, time
r, w = os.pipe()
children = []
for _ in range({forks}):
    pid = os.fork()
    if pid == 0:
        held = []
        for _ in range({each}):
            s = socket.socket()
            s.setblocking(False)
            try:
                s.connect(("127.0.0.1", 3128))
            except BlockingIOError:
                pass
            held.append(s)
        os.write(w, b"x")
        time.sleep(3600)
        os._exit(0)
    children.append(pid)
for _ in children:
    os.read(r, 1)
print(len(children) * {each})
"""


def test_thousands_of_connections_to_the_proxy_cost_the_kernel_a_bounded_memory(origin, hosts_file):
    """The proxy runs in its own process, cellblock-egress (a child of the kernel), and both sit outside the worker's
    memory cgroup: a worker that forks and holds 3,000 connections to it grows the kernel's RSS plus the helper's
    (read from /proc) by at most 32 MiB, and the kernel keeps answering."""
    k = start_kernel({"allow": ["allowed.test"], "ceiling": ["*.test"], "ports": [origin.port]}, hosts_file)
    try:
        # The proxy has served a request and holds one connection (the helper exists, its thread and a relay's
        # buffers too) before the baseline is read.
        assert k.execute(fetch(f"http://allowed.test:{origin.port}/data")).stream_text() == fetched(origin)
        assert k.execute(HOLD_A_PROXY_CONNECTION).stream_text() == "held\n"
        [helper] = egress_helpers(k.pid)
        kernel_before, helper_before = rss_kib(k.pid), rss_kib(helper)
        held = k.execute(HOLD_CONNECTIONS.format(forks=15, each=200), timeout=120)
        assert held.stream_text().strip() == "3000", held.of_type("error") or held.stream_text("stderr")
        started = time.monotonic()
        answer = k.execute("6*7", timeout=10)
        assert answer.of_type("execute_result")[0]["content"]["data"]["text/plain"] == "42"
        answered_s = time.monotonic() - started
        assert answered_s < 1.0, f"6*7 answered in {answered_s:.2f} s while 3,000 connections were held"
        # The same helper serves them: a restarted one would have started from nothing and hide the growth.
        assert egress_helpers(k.pid) == [helper]
        kernel_mib = (rss_kib(k.pid) - kernel_before) / 1024
        helper_mib = (rss_kib(helper) - helper_before) / 1024
        print(f"3,000 proxy connections: kernel {kernel_before / 1024:.1f} MiB {kernel_mib:+.1f} MiB, "
              f"helper {helper_before / 1024:.1f} MiB {helper_mib:+.1f} MiB, 6*7 answered in {answered_s:.3f} s")
        assert kernel_mib + helper_mib <= 32, (
            f"the kernel and its egress helper grew by {kernel_mib + helper_mib:.1f} MiB for 3,000 proxy connections "
            f"(kernel {kernel_mib:+.1f} MiB, helper {helper_mib:+.1f} MiB)")
    finally:
        k.shutdown()


def egress_helpers(kernel_pid: int) -> list[int]:
    """The kernel's children that run cellblock-egress (the egress proxy's own process)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            exe = os.readlink(f"/proc/{entry}/exe")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == kernel_pid and exe.endswith("/cellblock-egress"):
            found.append(int(entry))
    return found


def proc_status(pid: int) -> dict:
    return dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)


# The worker keeps one connection to its proxy open, so the helper holds a worker-side socket while it is read.
HOLD_A_PROXY_CONNECTION = ("import socket\n_held = socket.create_connection(('127.0.0.1', 3128))\nprint('held')\n")


def test_the_proxy_runs_confined_in_its_own_process_without_the_kernels_key(allowlist_kernel):
    k = allowlist_kernel
    assert k.execute(HOLD_A_PROXY_CONNECTION).stream_text() == "held\n"
    [helper] = egress_helpers(k.pid)
    status = proc_status(helper)
    assert all(int(uid) != 0 for uid in status["Uid"].split()), status["Uid"]
    assert all(int(gid) != 0 for gid in status["Gid"].split()), status["Gid"]
    assert status["NoNewPrivs"].strip() == "1" and status["Seccomp"].strip() == "2", status
    assert int(status["CapEff"].strip(), 16) == 0 and int(status["CapPrm"].strip(), 16) == 0, status
    # The worker's connection is held by the helper: it has TCP sockets, the kernel's ZMQ sockets it has not.
    fds = {fd: os.readlink(f"/proc/{helper}/fd/{fd}") for fd in os.listdir(f"/proc/{helper}/fd")}
    sockets = {Path(f"/proc/{helper}/fd/{fd}").stat().st_ino for fd, target in fds.items() if target.startswith("socket:")}
    kernel_sockets = {Path(f"/proc/{k.pid}/fd/{fd}").stat().st_ino for fd in os.listdir(f"/proc/{k.pid}/fd")
                      if os.readlink(f"/proc/{k.pid}/fd/{fd}").startswith("socket:")}
    tcp = Path(f"/proc/{helper}/net/tcp").read_text() + Path(f"/proc/{helper}/net/tcp6").read_text()
    assert len(sockets) >= 2, fds  # its channel to the kernel, the worker's listener, the held connection
    zmq_ports = {k.manager.shell_port, k.manager.iopub_port, k.manager.control_port, k.manager.stdin_port,
                 k.manager.hb_port}
    kernel_listening = {int(line.split()[9]) for line in tcp.splitlines()
                        if line.split()[0] != "sl" and int(line.split()[1].rsplit(":", 1)[1], 16) in zmq_ports}
    assert not (sockets & kernel_listening), "the helper holds one of the kernel's ZMQ sockets"
    assert sockets - kernel_sockets, "every socket of the helper is also the kernel's: no connection of its own"
    key = k.manager.session.key
    assert key and key not in Path(f"/proc/{helper}/environ").read_bytes()
    assert key not in Path(f"/proc/{helper}/cmdline").read_bytes()
    assert not any(target.endswith(".json") or "kernel-" in target for target in fds.values()), fds
    # Its filesystem is the resolver's files alone, read-only, in a mount namespace of its own: seen from the host.
    assert os.stat(f"/proc/{helper}/ns/mnt").st_ino != os.stat(f"/proc/{k.pid}/ns/mnt").st_ino
    root = Path(f"/proc/{helper}/root")
    assert os.listdir(root) == ["etc"], os.listdir(root)
    assert set(os.listdir(root / "etc")) <= {"hosts", "resolv.conf", "nsswitch.conf", "host.conf", "gai.conf"}
    assert (root / "etc/hosts").read_bytes() == Path("/etc/hosts").read_bytes()
    mounts = Path(f"/proc/{helper}/mounts").read_text().splitlines()
    assert all(" ro," in line or line.split()[3].startswith("ro") for line in mounts), mounts


def test_a_killed_proxy_is_reported_and_restarted_and_allows_nothing_meanwhile(origin, hosts_file):
    k = start_kernel({"allow": ["allowed.test"], "ceiling": ["*.test"], "ports": [origin.port]}, hosts_file)
    try:
        assert k.execute(HOLD_A_PROXY_CONNECTION).stream_text() == "held\n"
        [helper] = egress_helpers(k.pid)
        os.kill(helper, signal.SIGKILL)
        started = time.monotonic()
        run = k.execute("print(6*7)")
        answered = time.monotonic() - started
        assert run.stream_text() == "42\n" and answered < 5, (run.stream_text(), answered)
        event = iopub_until(k, egress_event("helper_crashed"), run)
        assert "killed by signal 9" in event["content"]["detail"], event
        # The connection the worker held died with the helper: nothing relays it any more.
        run = k.execute("_held.settimeout(10)\nprint(repr(_held.recv(1)))", stop_on_error=False)
        assert run.stream_text() == "b''\n" or run.content["status"] == "error", run.stream_text()
        # Whatever happens during the restart, a host outside the policy is never reached.
        before = len(origin.requests)
        k.execute(fetch(f"http://evil.test:{origin.port}/data"), timeout=180, stop_on_error=False)
        deadline = time.monotonic() + 30
        while not (helpers := egress_helpers(k.pid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert helpers and helpers != [helper], helpers
        run = k.execute(fetch(f"http://allowed.test:{origin.port}/data"), timeout=180)
        assert run.stream_text() == fetched(origin), run.stream_text("stderr")
        assert [host for host, _ in origin.requests[before:]] == [f"allowed.test:{origin.port}"], origin.requests
    finally:
        k.shutdown()
