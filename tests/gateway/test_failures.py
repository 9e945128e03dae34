"""The Kernel Gateway API when things go wrong: kernels that cannot start or die during start, the restart limit,
max_kernels through /api/sessions, the bounded replay for reconnecting WebSocket clients, gateway exit with running
kernels and confined workers (also as `share/scripts/start.sh` runs it, Ctrl-C included), and TLS client
certificates. Host-side checks read /proc."""
import json
import os
import queue
import re
import signal
import ssl
import subprocess
import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import requests
import websocket

import broken_kernels
from gateway_harness import PREFIX, TOKEN, Gateway, KernelSocket, _die_with_parent, gateway_binary, outputs
from host_processes import descendants, kernel_tree, wait_for, wait_until_gone, with_cmdline

GONE_TIMEOUT_S = 60


@pytest.fixture
def launch(tmp_path):
    """Gateways with a runtime directory of their own, so their kernel processes can be told apart on the host."""
    started = []

    def make(*arguments, config=None, warm_pool=0, name="gateway", **kwargs):
        runtime = tmp_path / f"{name}-runtime"
        extra = ["--runtime-dir", str(runtime)]
        if config is not None:
            config_file = tmp_path / f"{name}-config.json"
            config_file.write_text(json.dumps(config))
            extra += ["--config", str(config_file)]
        gateway = Gateway(*extra, *arguments, warm_pool=warm_pool, **kwargs)
        gateway.runtime_dir = str(runtime)
        started.append(gateway)
        return gateway

    yield make
    for gateway in started:
        gateway.stop()


def kernel_processes(gateway, kernel_id=None):
    return kernel_tree(gateway.runtime_dir, kernel_id or "")


def main_kernel_process(gateway, kernel_id):
    return next(p for p in kernel_processes(gateway, kernel_id) if f"kernel-{kernel_id}.json" in p.cmdline)


def statuses_until(client, wanted, timeout=GONE_TIMEOUT_S):
    """IOPub execution states seen until `wanted` arrives."""
    seen = []
    deadline = time.monotonic() + timeout
    while wanted not in seen:
        assert time.monotonic() < deadline, f"no '{wanted}' status; saw {seen}"
        message = client.recv(timeout=max(0.1, deadline - time.monotonic()))
        if message["msg_type"] == "status":
            seen.append(message["content"]["execution_state"])
    return seen


# ------------------------------------------------------------------------------------------ start failures


@pytest.mark.parametrize("make_spec, cause", [
    (broken_kernels.missing_binary, "No such file or directory"),
    (broken_kernels.dies_during_start, "exited with status 3 before it answered kernel_info_request"),
])
def test_kernel_start_failure_is_reported_and_leaves_nothing(launch, tmp_path, make_spec, cause):
    specs = make_spec(tmp_path / "kernels", "broken")
    gateway = launch("--kernelspec-dir", str(specs))
    refused = gateway.post("/api/kernels", json={"name": "broken"})
    # Kernel Gateway's status for a kernel that fails to start is 500, with the cause in the message.
    assert refused.status_code == 500, refused.text
    assert "Kernel failed to start" in refused.json()["message"] and cause in refused.json()["message"], refused.text
    assert gateway.get("/api/kernels").json() == []
    wait_for(lambda: not kernel_processes(gateway), timeout=GONE_TIMEOUT_S, what="no kernel process left")
    # The gateway still starts a good kernel.
    assert gateway.post("/api/kernels", json={}).status_code == 201
    assert gateway.alive()


def test_restart_limit_exhausted_reports_dead_and_leaves_no_process(launch):
    gateway = launch(config={"restart_limit": 1})
    kernel_id = gateway.start_kernel()["id"]
    client = gateway.connect(kernel_id)
    client.wait_ready()
    client.execute("x = 1")
    first = kernel_processes(gateway, kernel_id)
    assert [p for p in first if p.is_worker], first
    signal_target = main_kernel_process(gateway, kernel_id)
    os.kill(signal_target.pid, signal.SIGKILL)
    # Within the limit: restarted, and usable again.
    statuses_until(client, "restarting")
    statuses_until(client, "idle")
    assert "False" in outputs(client.execute("'x' in globals()"))
    assert not wait_until_gone(first, GONE_TIMEOUT_S), "the first kernel's processes outlived it"
    second = kernel_processes(gateway, kernel_id)
    os.kill(main_kernel_process(gateway, kernel_id).pid, signal.SIGKILL)
    # Past the limit: clients are told the kernel is dead, and so is the REST model; nothing is left running.
    statuses_until(client, "dead")
    assert not wait_until_gone(second, GONE_TIMEOUT_S), "the dead kernel's processes are still running"
    assert gateway.get(f"/api/kernels/{kernel_id}").json()["execution_state"] == "dead"
    # The model said "dead" once the exit was handled, and dead is final (an exit in it is ignored; only a
    # client's restart leaves it: gateway/include/cellblock/gateway/kernels/kernel_lifecycle.hpp), so no later
    # automatic restart can come: what runs now is all that will.
    assert not kernel_processes(gateway, kernel_id), "a kernel past its restart limit was started again"
    assert gateway.delete(f"/api/kernels/{kernel_id}").status_code == 204
    assert gateway.alive()
    client.close()


def test_max_kernels_is_enforced_through_api_sessions(launch):
    gateway = launch("--max-kernels", "1")
    first = gateway.post("/api/sessions", json={"path": "a.ipynb", "type": "notebook", "kernel": {"name": "python3"}})
    assert first.status_code == 201, first.text
    refused = gateway.post("/api/sessions", json={"path": "b.ipynb", "type": "notebook",
                                                  "kernel": {"name": "python3"}})
    assert refused.status_code == 403 and "Resource Limit" in refused.json()["message"], refused.text
    assert [s["path"] for s in gateway.get("/api/sessions").json()] == ["a.ipynb"]
    assert gateway.delete(f"/api/sessions/{first.json()['id']}").status_code == 204
    second = gateway.post("/api/sessions", json={"path": "b.ipynb", "type": "notebook",
                                                 "kernel": {"name": "python3"}})
    assert second.status_code == 201, second.text


# ------------------------------------------------------------------------------------------ replay on reconnect

LINES = 30
# The cell prints once the test opens its gate ('gate' in the kernel's working directory, its workspace).
NOISY_CODE = (f"import os, time\nwhile not os.path.exists('gate'):\n    time.sleep(0.02)\nfor i in range({LINES}):\n"
              "    print(f'line {i:02d} ' + 'x' * 400, flush=True)\n    time.sleep(0.02)\n")
DROPPED_NOTE = "dropped (offline buffer full)"


def run_while_away(gateway, kernel_id):
    """Starts NOISY_CODE, disconnects, waits until it finished, reconnects with the same session_id; returns the
    messages replayed up to the execute's reply and final idle status (or whatever arrived within the deadline)."""
    session_id = "away-" + uuid.uuid4().hex
    client = gateway.connect(kernel_id, session_id=session_id)
    client.wait_ready()
    msg_id = client.send("execute_request", {"code": NOISY_CODE, "silent": False})
    client.replies_to(msg_id, lambda m: m["msg_type"] == "execute_input")
    client.close()
    # Every line is printed while the client is away: once the gateway counts no connection to the kernel.
    wait_for(lambda: gateway.get(f"/api/kernels/{kernel_id}").json()["connections"] == 0,
             what="the gateway to see the client leave")
    (workspace_of(gateway, kernel_id) / "gate").write_text("")
    wait_for(lambda: gateway.get(f"/api/kernels/{kernel_id}").json()["execution_state"] == "idle",
             what="the code to finish while the client is away")
    time.sleep(1)
    resumed = gateway.connect(kernel_id, session_id=session_id)
    replayed = []
    deadline = time.monotonic() + 15

    def seen(msg_type, **content):
        return any(m["msg_type"] == msg_type and m["parent_header"].get("msg_id") == msg_id
                   and content.items() <= m["content"].items() for m in replayed)
    try:
        # IOPub and shell are separate sockets: the reply may come before or after the idle status.
        while time.monotonic() < deadline and not (seen("execute_reply") and seen("status", execution_state="idle")):
            replayed.append(resumed.recv(timeout=max(0.1, deadline - time.monotonic())))
    except TimeoutError:
        pass
    resumed.close()
    return msg_id, replayed


def printed_lines(messages):
    return [line for line in outputs(messages).splitlines() if line.startswith("line ")]


@pytest.mark.parametrize("cap", [{"offline_buffer_messages": 8}, {"offline_buffer_bytes": 6000}])
def test_reconnect_replay_is_bounded_and_says_what_was_dropped(launch, cap):
    # Positive control: with the default buffer every line, the reply and the final idle status come back.
    roomy = launch(name="roomy")
    kernel_id = roomy.start_kernel()["id"]
    msg_id, replayed = run_while_away(roomy, kernel_id)
    assert len(printed_lines(replayed)) == LINES, outputs(replayed)
    assert any(m["msg_type"] == "execute_reply" and m["parent_header"]["msg_id"] == msg_id for m in replayed)
    assert DROPPED_NOTE not in outputs(replayed)
    # ... and that is more than the cap under test holds, so the bounded run below must drop some.
    if "offline_buffer_messages" in cap:
        assert len(replayed) > 2 * cap["offline_buffer_messages"], len(replayed)
    else:
        assert sum(len(json.dumps(m["content"])) for m in replayed) > 2 * cap["offline_buffer_bytes"]

    bounded = launch(config=cap, name="bounded")
    kernel_id = bounded.start_kernel()["id"]
    msg_id, replayed = run_while_away(bounded, kernel_id)
    assert DROPPED_NOTE in outputs(replayed), [m["msg_type"] for m in replayed]
    kept = [m for m in replayed if DROPPED_NOTE not in json.dumps(m.get("content", {}))]
    if "offline_buffer_messages" in cap:
        assert len(kept) <= cap["offline_buffer_messages"], [m["msg_type"] for m in kept]
    else:
        size = sum(len(json.dumps(m["content"], separators=(",", ":"))) for m in kept)
        assert size <= cap["offline_buffer_bytes"], size
    assert 0 < len(printed_lines(replayed)) < LINES
    # What a client needs to go on is the newest traffic: the reply and the idle status are kept.
    assert any(m["msg_type"] == "execute_reply" and m["parent_header"]["msg_id"] == msg_id for m in kept), \
        [m["msg_type"] for m in kept]
    assert any(m["msg_type"] == "status" and m["parent_header"]["msg_id"] == msg_id
               and m["content"]["execution_state"] == "idle" for m in kept), [m["msg_type"] for m in kept]
    # And the session is usable afterwards.
    again = bounded.connect(kernel_id)
    assert "2" in outputs(again.execute("1 + 1"))
    again.close()


# ------------------------------------------------------------------------------------------ gateway exit


def test_an_option_given_twice_takes_its_last_value(tmp_path):
    # What `share/scripts/start.sh --port 9999` runs (README): the script's defaults, then the user's arguments.
    state = tmp_path / "state"
    completed = subprocess.run(
        [gateway_binary(), "--ip", "127.0.0.1", "--port", "8888", "--state-dir", "/var/lib/cellblock",
         "--port", "9999", "--state-dir", str(state), "--print-config"],
        capture_output=True, text=True, timeout=30)
    assert completed.returncode == 0, completed.stderr
    effective = json.loads(completed.stdout)
    assert (effective["port"], effective["state_dir"]) == (9999, str(state))


@pytest.mark.parametrize("arguments, environment, named", [
    (["--cull-interval", "1e300"], {}, "cull_interval"),
    (["--header-timeout", "1.6e9"], {}, "header_timeout"),
    ([], {"CELLBLOCK_GATEWAY_CULL_IDLE_TIMEOUT": "-1"}, "cull_idle_timeout"),
    (["--agent-max-timeout", "1e300"], {}, "--agent-max-timeout"),
    (["--agent-max-memory-mb", "17592186044416"], {}, "--agent-max-memory-mb"),
    ([], {"CELLBLOCK_AGENT_MAX_TIMEOUT": "1e300"}, "--agent-max-timeout"),
])
def test_a_duration_or_limit_past_what_the_kernels_and_timers_hold_stops_the_start(tmp_path, arguments, environment,
                                                                                    named):
    # 1e300 s overflowed a timer's milliseconds (undefined behaviour); 2^44 MiB became a kernel with no memory limit.
    completed = subprocess.run(
        [gateway_binary(), "--state-dir", str(tmp_path / "state"), *arguments, "--print-config"],
        capture_output=True, text=True, timeout=30, env={**os.environ, **environment})
    assert completed.returncode != 0, completed.stdout
    assert named in completed.stderr, completed.stderr


def print_config(tmp_path, *arguments, environment=None):
    return subprocess.run([gateway_binary(), "--state-dir", str(tmp_path / "state"), *arguments, "--print-config"],
                          capture_output=True, text=True, timeout=30, env={**os.environ, **(environment or {})})


@pytest.mark.parametrize("source", ["config file", "environment"])
def test_an_agent_setting_from_the_config_file_or_the_environment_is_printed_and_holds(tmp_path, source):
    # The agent API's settings are in the gateway's one table of settings (settings_table.cpp): each has a key in
    # the config file's "agent" object and a CELLBLOCK_AGENT_* variable, below its flag.
    config = tmp_path / "gateway-config.json"
    config.write_text(json.dumps({"agent": {"max_sessions": 1 if source == "config file" else 5,
                                            "approvals_mcp": "on"}}))
    environment = {"CELLBLOCK_AGENT_MAX_SESSIONS": "1"} if source == "environment" else {}
    printed = print_config(tmp_path, "--config", str(config), environment=environment)
    assert printed.returncode == 0, printed.stderr
    agent = json.loads(printed.stdout)["agent"]
    assert (agent["max_sessions"], agent["approvals_mcp"], agent["keepalive_s"]) == (1, "on", 10), agent
    overridden = print_config(tmp_path, "--config", str(config), "--agent-max-sessions", "3", environment=environment)
    assert json.loads(overridden.stdout)["agent"]["max_sessions"] == 3, overridden.stderr
    gateway = Gateway("--config", str(config), env=environment)
    try:
        assert gateway.post("/agent/v1/sessions", json={"name": "first"}).status_code == 201
        refused = gateway.post("/agent/v1/sessions", json={"name": "second"})
        assert refused.status_code == 429 and refused.json()["reason"] == "too_many_sessions", refused.text
    finally:
        gateway.stop()


def test_an_agent_setting_in_the_config_file_is_checked_as_its_flag(tmp_path):
    # 0 s between keepalive lines is refused on the command line (CLI11) and so in the file.
    config = tmp_path / "gateway-config.json"
    config.write_text(json.dumps({"agent": {"keepalive_s": 0}}))
    refused = print_config(tmp_path, "--config", str(config))
    assert refused.returncode != 0 and "agent.keepalive_s" in refused.stderr, refused.stderr
    config.write_text(json.dumps({"agent": {"approvals_mcp": True}}))
    refused = print_config(tmp_path, "--config", str(config))
    assert refused.returncode != 0 and "agent.approvals_mcp" in refused.stderr, refused.stderr


def gateway_accepts(option):
    return option in subprocess.run([gateway_binary(), "--help"], capture_output=True, text=True).stdout


def assert_stop_leaves_no_kernel_and_no_worker(launch, stop_signal, *arguments):
    gateway = launch(*arguments, warm_pool=1)
    kernel_id = gateway.start_kernel()["id"]
    client = gateway.connect(kernel_id)
    client.wait_ready()
    assert "2" in outputs(client.execute("1 + 1"))  # its worker is up and has run code
    client.close()
    wait_for(lambda: len([p for p in descendants(gateway.process.pid) if p.is_worker]) >= 2,
             what="a worker below the kernel and below the warm-pool kernel")
    everything = descendants(gateway.process.pid)
    workers = [p for p in everything if p.is_worker]
    assert workers, everything
    gateway.process.send_signal(stop_signal)
    assert gateway.process.wait(timeout=GONE_TIMEOUT_S) == 0, "".join(gateway.output)
    left = wait_until_gone(everything, GONE_TIMEOUT_S)
    assert not left, f"still running after the gateway stopped: {[str(p) for p in left]}"
    assert not kernel_processes(gateway), "a kernel of this gateway is still running"


def test_sigint_stop_leaves_no_kernel_and_no_confined_worker(launch):
    assert_stop_leaves_no_kernel_and_no_worker(launch, signal.SIGINT)


def test_sigterm_stop_with_shutdown_kernels_leaves_no_kernel_and_no_confined_worker(launch):
    # SIGTERM detaches kernels for re-adoption unless --shutdown-kernels-on-exit is given.
    arguments = ["--shutdown-kernels-on-exit"] if gateway_accepts("--shutdown-kernels-on-exit") else []
    assert_stop_leaves_no_kernel_and_no_worker(launch, signal.SIGTERM, *arguments)


START_SH = Path(__file__).resolve().parents[2] / "share" / "scripts" / "start.sh"


def test_start_sh_prints_url_and_token_serves_and_ctrl_c_stops_the_gateway_and_every_kernel(tmp_path):
    """The README's first command as a user runs it, against the staged prefix (CELLBLOCK_SKIP_BUILD=1 leaves out
    the dependency install and the build, nothing else): it prints the URL and a generated token, the token is
    needed and enough, an execute answers, and Ctrl-C (SIGINT to the terminal's foreground process group) stops
    the gateway with status 0 and every kernel and confined worker it started, the warm pool's included."""
    gateway_binary()  # a missing install is a failure here, not a build started by start.sh
    state = tmp_path / "state"
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("KG_", "CELLBLOCK_GATEWAY_"))}
    environment.update(CELLBLOCK_PREFIX=str(PREFIX), CELLBLOCK_SKIP_BUILD="1", CELLBLOCK_STATE_DIR=str(state))
    process = subprocess.Popen(["bash", str(START_SH), "--port", "0"], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env=environment, start_new_session=True,
                               preexec_fn=_die_with_parent)
    printed, lines = [], queue.Queue()

    def pump():
        for line in process.stdout:
            printed.append(line)
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    try:
        url = token = None
        deadline = time.monotonic() + GONE_TIMEOUT_S
        while token is None:
            assert time.monotonic() < deadline, "start.sh printed no URL and token:\n" + "".join(printed)
            try:
                line = lines.get(timeout=0.5)
            except queue.Empty:
                continue
            assert line is not None, "start.sh ended:\n" + "".join(printed)
            if match := re.search(r"is available at (http://127\.0\.0\.1:\d+)", line):
                url = match.group(1)
            if match := re.search(r"\btoken: ([0-9a-f]{16,})$", line.strip()):
                token = match.group(1)
        assert url, "".join(printed)
        assert printed[0].startswith("[start] cellblock-gateway, state in " + str(state)), printed[0]
        assert f"{url}/api?token={token}" in "".join(printed)
        assert requests.get(url + "/api/kernels", timeout=30).status_code == 401
        created = requests.post(url + "/api/kernels", json={}, headers={"Authorization": f"token {token}"},
                                timeout=120)
        assert created.status_code == 201, created.text
        kernel_id = created.json()["id"]
        client = KernelSocket(SimpleNamespace(ws_base=url.replace("http", "ws", 1), token=token), kernel_id)
        assert outputs(client.execute("6 * 7")) == "42"
        client.close()

        gateway = process.pid  # start.sh execs the gateway: the process the terminal's Ctrl-C reaches
        assert "cellblock-gateway" in Path(f"/proc/{gateway}/cmdline").read_text(), "start.sh did not exec it"
        # Its kernel's worker (it ran code) and the warm pool's kernel with its worker.
        wait_for(lambda: len([p for p in descendants(gateway) if p.is_worker]) >= 2, what="two confined workers")
        kernels = [p for p in with_cmdline(f"{state}/") if "cellblock-kernel" in p.cmdline]
        assert len(kernels) >= 2, [str(p) for p in kernels]
        everything = descendants(gateway) + kernels

        os.killpg(process.pid, signal.SIGINT)  # Ctrl-C
        assert process.wait(timeout=GONE_TIMEOUT_S) == 0, "".join(printed)
        left = wait_until_gone(everything, GONE_TIMEOUT_S)
        assert not left, f"still running after Ctrl-C: {[str(p) for p in left]}"
        assert not with_cmdline(f"{state}/"), "a process of the gateway's state directory still runs"
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        for leftover in with_cmdline(f"{state}/"):
            try:
                os.kill(leftover.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


# ------------------------------------------------------------------------------------------ TLS client certificates


def openssl(*arguments, cwd):
    subprocess.run(["openssl", *arguments], cwd=cwd, check=True, capture_output=True)


def issue_certificate(directory, name, ca, extensions=None):
    openssl("req", "-new", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key",
            "-out", f"{name}.csr", cwd=directory)
    command = ["x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
               "-days", "1", "-out", f"{name}.pem"]
    if extensions:
        (directory / f"{name}.ext").write_text(extensions)
        command += ["-extfile", f"{name}.ext"]
    openssl(*command, cwd=directory)
    return directory / f"{name}.pem", directory / f"{name}.key"


def make_ca(directory, name):
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", f"/CN={name}",
            "-keyout", f"{name}.key", "-out", f"{name}.pem", cwd=directory)
    return directory / f"{name}.pem"


def test_client_certificates_signed_by_the_client_ca_are_required(launch, tmp_path):
    ca = make_ca(tmp_path, "clients-ca")
    rogue_ca = make_ca(tmp_path, "rogue-ca")
    server_cert, server_key = issue_certificate(tmp_path, "server", "clients-ca",
                                                "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
    good = issue_certificate(tmp_path, "agent", "clients-ca", "extendedKeyUsage=clientAuth\n")
    rogue = issue_certificate(tmp_path, "intruder", "rogue-ca", "extendedKeyUsage=clientAuth\n")
    assert rogue_ca.exists()
    gateway = launch("--certfile", str(server_cert), "--keyfile", str(server_key), "--client-ca", str(ca))
    assert gateway.url.startswith("https://")
    headers = {"Authorization": f"token {TOKEN}"}

    accepted = requests.get(gateway.url + "/api", headers=headers, verify=str(ca), cert=tuple(map(str, good)),
                            timeout=30)
    assert accepted.status_code == 200
    kernel_id = requests.post(gateway.url + "/api/kernels", headers=headers, verify=str(ca),
                              cert=tuple(map(str, good)), timeout=120).json()["id"]
    ws = websocket.create_connection(
        f"wss://{gateway.url.split('//')[1]}/api/kernels/{kernel_id}/channels", header=[f"Authorization: token {TOKEN}"],
        timeout=60, sslopt={"ca_certs": str(ca), "cert_reqs": ssl.CERT_REQUIRED, "check_hostname": False,
                            "certfile": str(good[0]), "keyfile": str(good[1])})
    ws.send('{"header": {"msg_type": "kernel_info_request", "msg_id": "mtls-1"}, "channel": "shell"}')
    while json.loads(ws.recv())["msg_type"] != "kernel_info_reply":
        pass
    ws.close()

    for refused_cert in (None, tuple(map(str, rogue))):
        with pytest.raises(requests.exceptions.ConnectionError):
            requests.get(gateway.url + "/api", headers=headers, verify=str(ca), cert=refused_cert, timeout=30)
    with pytest.raises((ssl.SSLError, ConnectionError, websocket.WebSocketException, OSError)):
        websocket.create_connection(
            f"wss://{gateway.url.split('//')[1]}/api/kernels/{kernel_id}/channels",
            header=[f"Authorization: token {TOKEN}"], timeout=30,
            sslopt={"ca_certs": str(ca), "cert_reqs": ssl.CERT_REQUIRED, "check_hostname": False}).recv()
    # Refusals cost nothing: the gateway still serves the good client.
    assert requests.get(gateway.url + "/api", headers=headers, verify=str(ca), cert=tuple(map(str, good)),
                        timeout=30).status_code == 200


# ------------------------------------------------------------------------------------------ a client that lingers


def workspace_of(gateway, kernel_id):
    return gateway.state_dir / "workspaces" / kernel_id


def assert_files_removed(gateway, kernel_id):
    connection_file = os.path.join(gateway.runtime_dir, f"kernel-{kernel_id}.json")
    deadline = time.monotonic() + GONE_TIMEOUT_S
    while time.monotonic() < deadline and (os.path.exists(connection_file) or workspace_of(gateway, kernel_id).exists()):
        time.sleep(0.2)
    assert not os.path.exists(connection_file), "the deleted kernel's connection file is still on disk"
    assert not workspace_of(gateway, kernel_id).exists(), "the deleted kernel's workspace is still on disk"
    assert not kernel_processes(gateway, kernel_id)


def test_deleted_kernel_leaves_no_files_while_a_websocket_client_lingers(launch):
    """Soak finding: with a WebSocket client that keeps its TCP socket open after the close frame, a deleted
    kernel's connection file (with its HMAC key) and workspace stayed on disk, and a stop never ended (the
    client's link to the kernel kept its ZMQ sockets open, so zmq_ctx_term waited): the files stayed for good."""
    gateway = launch()
    kernel_id = gateway.start_kernel()["id"]
    connection_file = os.path.join(gateway.runtime_dir, f"kernel-{kernel_id}.json")
    client = gateway.connect(kernel_id)
    client.execute("open('kept.txt', 'w').write('x')")
    assert os.path.exists(connection_file)
    assert workspace_of(gateway, kernel_id).exists(), list(gateway.state_dir.rglob("*"))[:20]

    assert gateway.delete(f"/api/kernels/{kernel_id}").status_code == 204
    # The client neither reads the close frame nor closes its socket.
    assert_files_removed(gateway, kernel_id)

    # The same through the agent API (the soak's case): the agent session's kernel, watched over /channels.
    session = gateway.post("/agent/v1/sessions", json={}).json()
    watcher = gateway.connect(session["kernel_id"])
    watcher.execute("1")
    assert gateway.delete(f"/agent/v1/sessions/{session['id']}").status_code in (200, 204)
    assert_files_removed(gateway, session["kernel_id"])

    # A stop with such a client still connected ends promptly and leaves no kernel files behind.
    second = gateway.start_kernel()["id"]
    lingering = gateway.connect(second)
    lingering.execute("1")
    gateway.process.send_signal(signal.SIGTERM)
    # Before the fix the lingering connection's ZMQ sockets kept zmq_ctx_term (and the gateway) waiting forever.
    assert gateway.process.wait(timeout=10) == 0, "".join(gateway.output)
    assert not os.path.exists(os.path.join(gateway.runtime_dir, f"kernel-{second}.json"))
    assert not workspace_of(gateway, second).exists()
    for socket_ in (client, watcher, lingering):
        socket_.ws.sock.close()
