"""Exhaustion before authentication (issue 13): thousands of idle, tokenless TCP connections against a gateway
held to the common file limit of 1,024 must not stop authenticated clients or kernel starts.

Each test starts its own gateway under RLIMIT_NOFILE 1024:1024 (so it cannot raise its soft limit) and floods it
from the loopback address 127.0.0.2 (Linux routes all of 127.0.0.0/8 to lo, so nothing leaves the machine) with
connections that send half a request line and no token. The authenticated client connects from 127.0.0.1.
A positive control with the protection turned off by configuration shows the same flood really does stop the
gateway from answering.
"""
import json
import resource
import signal
import socket
import subprocess
import tempfile
import threading
import time
import shutil
from pathlib import Path

import pytest
import requests
import websocket

from gateway_harness import (START_TIMEOUT, TOKEN, V1, decode_v1, encode_v1, gateway_binary, kernelspec_arguments,
                             new_header, outputs)

GATEWAY_FILE_LIMIT = 1024
FLOOD_CONNECTIONS = 3000
ATTACKER_ADDRESS = "127.0.0.2"
HALF_A_REQUEST_LINE = b"GET /api/kern"


def _gateway_preexec(soft, hard):
    def preexec():
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return preexec


@pytest.fixture(scope="module", autouse=True)
def own_file_limit():
    """The flood needs thousands of sockets in this process: raise its soft limit to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = FLOOD_CONNECTIONS + 500
    if hard != resource.RLIM_INFINITY and hard < needed:
        pytest.fail(f"the test process needs {needed} file descriptors; its hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


class LimitedGateway:
    """A cellblock-gateway under RLIMIT_NOFILE 1024:1024 whose JSON log lines are collected."""

    def __init__(self, *arguments, file_limit=(GATEWAY_FILE_LIMIT, GATEWAY_FILE_LIMIT)):
        self.state_dir = Path(tempfile.mkdtemp(prefix="cbgw-exh-"))
        command = [gateway_binary(), "--ip", "127.0.0.1", "--port", "0", *kernelspec_arguments(),
                   "--warm-pool", "1", "--state-dir", str(self.state_dir), "--shutdown-kernels-on-exit",
                   "--token", TOKEN, "--log-level", "info", *arguments]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        start_new_session=True, preexec_fn=_gateway_preexec(*file_limit))
        self.output = []
        self.ready = threading.Event()
        self.url = None
        threading.Thread(target=self._pump, daemon=True).start()
        if not self.ready.wait(30) or self.url is None:
            self.stop()
            raise RuntimeError("gateway did not start:\n" + "".join(self.output))
        self.port = int(self.url.rsplit(":", 1)[1])

    def _pump(self):
        for line in self.process.stdout:
            self.output.append(line)
            if "is available at " in line and self.url is None:
                self.url = line.split("is available at ", 1)[1].strip()
                self.ready.set()
        self.ready.set()

    def events(self, name):
        found = []
        for line in list(self.output):
            if line.startswith("{"):
                try:
                    entry = json.loads(line)
                except ValueError:
                    continue
                if entry.get("event") == name:
                    found.append(entry)
        return found

    def open_descriptors(self):
        return len(list(Path(f"/proc/{self.process.pid}/fd").iterdir()))

    def stop(self):
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.state_dir, ignore_errors=True)


@pytest.fixture
def limited_gateway():
    started = []

    def make(*arguments, **kwargs):
        gateway = LimitedGateway(*arguments, **kwargs)
        started.append(gateway)
        return gateway

    yield make
    for gateway in started:
        gateway.stop()


def flood(port, count, source=ATTACKER_ADDRESS, deadline_s=60):
    """`count` connections from `source`, each sending half a request line and no token; returns the sockets."""
    sockets = []
    deadline = time.monotonic() + deadline_s
    for _ in range(count):
        if time.monotonic() > deadline:
            break
        attacker = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        attacker.settimeout(2)
        attacker.bind((source, 0))
        try:
            attacker.connect(("127.0.0.1", port))
            attacker.sendall(HALF_A_REQUEST_LINE)
        except OSError:
            attacker.close()  # the listen backlog is full: that connection never existed
            continue
        attacker.setblocking(False)
        sockets.append(attacker)
    return sockets


def still_open(sockets):
    """The attack connections the gateway has neither closed nor reset (seen from the client side)."""
    alive = []
    for attacker in sockets:
        try:
            if attacker.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK) == b"":
                continue  # EOF: closed by the gateway
        except BlockingIOError:
            alive.append(attacker)
            continue
        except OSError:
            continue  # reset by the gateway
    return alive


def refused_in_reports(gateway):
    reports = gateway.events("unauthenticated_connections_refused")
    return sum(r["over_address_cap"] + r["over_global_cap"] for r in reports)


def wait_until(predicate, timeout, interval=0.25):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return predicate()


def authenticated_execute(url, code):
    """POST /api/kernels, then an execute over the kernel's /channels WebSocket (v1 protocol); returns output."""
    headers = {"Authorization": f"token {TOKEN}"}
    started = requests.post(url + "/api/kernels", json={}, headers=headers, timeout=START_TIMEOUT)
    assert started.status_code == 201, started.text
    kernel_id = started.json()["id"]
    ws = websocket.create_connection(f"{url.replace('http', 'ws', 1)}/api/kernels/{kernel_id}/channels",
                                     header=[f"Authorization: token {TOKEN}"], timeout=START_TIMEOUT,
                                     subprotocols=[V1])
    try:
        header = new_header("execute_request", session="exhaustion")
        ws.send_binary(encode_v1("shell", header, {}, {}, {"code": code, "silent": False, "store_history": False,
                                                           "user_expressions": {}, "allow_stdin": False}))
        messages = []
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            ws.settimeout(max(0.1, deadline - time.monotonic()))
            opcode, data = ws.recv_data()
            if opcode != websocket.ABNF.OPCODE_BINARY:
                continue
            message = decode_v1(data)
            if message["parent_header"].get("msg_id") != header["msg_id"]:
                continue
            messages.append(message)
            if message["msg_type"] == "status" and message["content"]["execution_state"] == "idle":
                break
        return outputs(messages)
    finally:
        ws.close()
        requests.delete(f"{url}/api/kernels/{kernel_id}", headers=headers, timeout=START_TIMEOUT)


def test_authenticated_clients_are_served_while_thousands_of_tokenless_connections_are_open(limited_gateway):
    # A header deadline no execute reaches however loaded the machine (the flood is held throughout, whatever a
    # kernel start takes); the deadline itself closes a flood's held connections on a gateway of its own below.
    gateway = limited_gateway("--header-timeout", "3600")
    admission = gateway.events("connection_admission")
    assert admission, "the gateway reports its admission limits at start:\n" + "".join(gateway.output)
    per_address_cap = admission[0]["max_unauthenticated_per_address"]
    assert gateway.events("file_limit")[0]["soft"] == GATEWAY_FILE_LIMIT

    flood_started = time.monotonic()
    attackers = flood(gateway.port, FLOOD_CONNECTIONS)
    assert len(attackers) >= FLOOD_CONNECTIONS * 0.9, f"only {len(attackers)} connections could be opened"
    # Over the per-address cap the gateway closes at once; up to the cap it holds them, waiting for headers.
    wait_until(lambda: len(still_open(attackers)) <= per_address_cap, timeout=10)
    held = still_open(attackers)
    assert len(held) == per_address_cap, \
        f"{len(held)} of {len(attackers)} tokenless connections still open, cap {per_address_cap}"

    # While they are open: an authenticated client from another address is answered promptly...
    headers = {"Authorization": f"token {TOKEN}"}
    asked = time.monotonic()
    listed = requests.get(gateway.url + "/api/kernels", headers=headers, timeout=10)
    assert listed.status_code == 200, listed.text
    assert time.monotonic() - asked < 5
    # ...and can start a kernel and run code on it over the WebSocket.
    assert authenticated_execute(gateway.url, "print(6 * 7)").strip() == "42"
    still_held = still_open(held)
    assert len(still_held) == per_address_cap, "the tokenless connections were still open during the execute"

    # Thousands of refusals, logged once per interval rather than once per connection.
    refused = len(attackers) - per_address_cap
    assert wait_until(lambda: refused_in_reports(gateway) == refused, timeout=15), \
        f"{refused} refusals, reported: {gateway.events('unauthenticated_connections_refused')}"
    reports = gateway.events("unauthenticated_connections_refused")
    interval = reports[0]["next_report_after_s"]
    elapsed = time.monotonic() - flood_started
    assert len(reports) <= elapsed / interval + 1, f"{len(reports)} refusal reports in {elapsed:.0f} s"
    assert all(r["over_global_cap"] == 0 and r["last_address"] == ATTACKER_ADDRESS for r in reports), reports
    assert not gateway.events("accept_failed"), "the gateway ran out of descriptors"
    for attacker in attackers:
        attacker.close()

    # The header deadline closes a flood's held connections.
    header_timeout = 3
    deadline_gateway = limited_gateway("--header-timeout", str(header_timeout))
    attackers = flood(deadline_gateway.port, FLOOD_CONNECTIONS)
    assert len(attackers) >= FLOOD_CONNECTIONS * 0.9, f"only {len(attackers)} connections could be opened"
    wait_until(lambda: len(still_open(attackers)) <= per_address_cap, timeout=10)
    held = still_open(attackers)
    assert held, "no tokenless connection was held"
    closed_in_time = wait_until(lambda: not still_open(held), timeout=header_timeout + 15)
    assert closed_in_time, f"{len(still_open(held))} tokenless connections outlived the {header_timeout} s deadline"
    for attacker in attackers:
        attacker.close()


def test_the_global_cap_and_the_descriptor_reserve_keep_kernels_starting(limited_gateway):
    """Attackers from many addresses: the global cap binds, the gateway keeps descriptors for kernel starts, and a
    client that authenticated before the flood keeps working."""
    gateway = limited_gateway("--header-timeout", "30")
    admission = gateway.events("connection_admission")[0]
    global_cap = admission["max_unauthenticated_connections"]
    assert global_cap < GATEWAY_FILE_LIMIT - admission["fd_reserve"]
    session = requests.Session()
    session.headers["Authorization"] = f"token {TOKEN}"
    assert session.get(gateway.url + "/api", timeout=10).status_code == 200  # authenticated keep-alive

    attackers = []
    host = 2
    while len(attackers) < FLOOD_CONNECTIONS and host < 255:
        attackers += flood(gateway.port, admission["max_unauthenticated_per_address"], source=f"127.0.0.{host}",
                           deadline_s=10)
        host += 1
    wait_until(lambda: len(still_open(attackers)) <= global_cap, timeout=10)
    held = still_open(attackers)
    assert len(held) == global_cap, f"{len(held)} of {len(attackers)} held, global cap {global_cap}"
    assert gateway.open_descriptors() < GATEWAY_FILE_LIMIT - admission["fd_reserve"]

    # The authenticated keep-alive connection is served and a new kernel starts (the warm pool refills too).
    started = session.post(gateway.url + "/api/kernels", json={}, timeout=START_TIMEOUT)
    assert started.status_code == 201, started.text
    kernel_id = started.json()["id"]
    assert wait_until(lambda: session.get(f"{gateway.url}/api/kernels/{kernel_id}", timeout=10)
                      .json()["execution_state"] in ("idle", "busy"), timeout=START_TIMEOUT)
    assert session.delete(f"{gateway.url}/api/kernels/{kernel_id}", timeout=START_TIMEOUT).status_code == 204
    assert len(still_open(held)) == global_cap
    assert not gateway.events("accept_failed"), "the gateway ran out of descriptors"
    assert wait_until(lambda: refused_in_reports(gateway) == len(attackers) - global_cap, timeout=15), \
        gateway.events("unauthenticated_connections_refused")
    assert sum(r["over_global_cap"] for r in gateway.events("unauthenticated_connections_refused")) > 0
    for attacker in attackers:
        attacker.close()


def test_control_without_the_protection_the_flood_silences_the_gateway(limited_gateway):
    """Positive control: caps, reserve and short deadline turned off by configuration; the same flood leaves an
    authenticated client unanswered (the accept loop hits EMFILE), so the tests above measure a real attack."""
    gateway = limited_gateway("--header-timeout", "60", "--max-unauthenticated-connections", "1000000",
                              "--max-unauthenticated-per-address", "0", "--fd-reserve", "0")
    attackers = flood(gateway.port, 1100)
    assert len(attackers) >= 1000
    assert wait_until(lambda: gateway.events("accept_failed"), timeout=10), "the gateway never ran out of descriptors"
    with pytest.raises(requests.exceptions.Timeout):
        requests.get(gateway.url + "/api/kernels", headers={"Authorization": f"token {TOKEN}"}, timeout=5)
    for attacker in attackers:
        attacker.close()


def test_the_soft_file_limit_is_raised_to_the_hard_one_at_start(limited_gateway):
    gateway = limited_gateway(file_limit=(GATEWAY_FILE_LIMIT, 4 * GATEWAY_FILE_LIMIT))
    limits = Path(f"/proc/{gateway.process.pid}/limits").read_text()
    open_files = next(line for line in limits.splitlines() if line.startswith("Max open files")).split()
    assert open_files[3:5] == [str(4 * GATEWAY_FILE_LIMIT)] * 2, limits
    reported = gateway.events("file_limit")[0]
    assert (reported["soft_at_start"], reported["soft"]) == (GATEWAY_FILE_LIMIT, 4 * GATEWAY_FILE_LIMIT)
    # The automatic global cap follows the raised limit.
    admission = gateway.events("connection_admission")[0]
    assert admission["max_unauthenticated_connections"] == (4 * GATEWAY_FILE_LIMIT - admission["fd_reserve"]) // 2


def test_a_flood_from_the_agents_own_address_does_not_lock_the_agent_out(limited_gateway):
    """Every local agent shares 127.0.0.1 with a flood from this host (and clients behind one NAT share theirs): over
    the per-address cap the gateway closes the oldest idle tokenless connection, never the new one, so an agent that
    sends its headers promptly is read."""
    gateway = limited_gateway("--header-timeout", "60")
    per_address_cap = gateway.events("connection_admission")[0]["max_unauthenticated_per_address"]
    attackers = flood(gateway.port, 1100, source="127.0.0.1")
    assert len(attackers) >= 1000, f"only {len(attackers)} connections could be opened"
    assert wait_until(lambda: len(still_open(attackers)) <= per_address_cap, timeout=10)
    newest = attackers[-per_address_cap:]
    assert len(still_open(newest)) == per_address_cap, "the newest tokenless connections are the ones held"
    assert authenticated_execute(gateway.url, "print(6 * 7)").strip() == "42"
    assert not gateway.events("accept_failed"), "the gateway ran out of descriptors"
    for attacker in attackers:
        attacker.close()
