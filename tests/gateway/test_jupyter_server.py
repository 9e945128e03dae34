"""Debian's Jupyter Server 1.23 with --gateway-url in front of cellblock-gateway: kernels are created through
Jupyter Server's REST API and code runs through Jupyter Server's WebSocket, all of it relayed to our gateway."""
import contextlib
import json
import os
import socket
import subprocess
import time
import uuid

import pytest
import requests
import websocket

from gateway_harness import Gateway

SERVER_TOKEN = "server-token"


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def running_jupyter_server(gateway_url, gateway_token, tmp_path):
    port = free_port()
    environment = dict(os.environ)
    for name in ("JUPYTER_CONFIG_DIR", "JUPYTER_DATA_DIR", "JUPYTER_RUNTIME_DIR"):
        (tmp_path / name).mkdir()
        environment[name] = str(tmp_path / name)
    environment["JUPYTER_GATEWAY_AUTH_TOKEN"] = gateway_token
    log = open(tmp_path / "jupyter-server.log", "w+")
    process = subprocess.Popen(
        ["/usr/bin/python3", "-m", "jupyter_server", f"--gateway-url={gateway_url}", "--ServerApp.ip=127.0.0.1",
         f"--ServerApp.port={port}", "--ServerApp.port_retries=0", f"--ServerApp.token={SERVER_TOKEN}",
         "--ServerApp.open_browser=False", "--allow-root", f"--ServerApp.root_dir={tmp_path}"],
        stdout=log, stderr=subprocess.STDOUT, env=environment, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            if requests.get(url + "/api", params={"token": SERVER_TOKEN}, timeout=5).ok:
                break
        except requests.ConnectionError:
            pass
        assert process.poll() is None, "jupyter server exited:\n" + open(tmp_path / "jupyter-server.log").read()
        time.sleep(0.3)
    else:
        pytest.fail("jupyter server did not start:\n" + open(tmp_path / "jupyter-server.log").read())
    try:
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


@pytest.fixture
def jupyter_server(gateway, tmp_path):
    with running_jupyter_server(gateway.url, gateway.token, tmp_path) as url:
        yield url


def server_request(url, method, path, **kwargs):
    return requests.request(method, url + path, headers={"Authorization": f"token {SERVER_TOKEN}"}, timeout=90,
                            **kwargs)


def connect_through_server(jupyter_server, kernel_id):
    ws = websocket.create_connection(
        f"{jupyter_server.replace('http', 'ws')}/api/kernels/{kernel_id}/channels?session_id={uuid.uuid4().hex}",
        header=[f"Authorization: token {SERVER_TOKEN}"], timeout=90)
    # Jupyter Server 1.23 drops what the browser sends before its own gateway connection is up: handshake first,
    # resending kernel_info_request as JupyterLab effectively does.
    ready, deadline = False, time.monotonic() + 90
    while not ready and time.monotonic() < deadline:
        probe = uuid.uuid4().hex
        ws.send(json.dumps({"header": {"msg_id": probe, "msg_type": "kernel_info_request", "username": "lab",
                                       "session": uuid.uuid4().hex, "version": "5.3"}, "parent_header": {},
                            "metadata": {}, "channel": "shell", "buffers": [], "content": {}}))
        ws.settimeout(2)
        try:
            while not ready:
                message = json.loads(ws.recv())
                ready = message["msg_type"] == "kernel_info_reply" and message["parent_header"]["msg_id"] == probe
        except websocket.WebSocketTimeoutException:
            continue
    assert ready, "no kernel_info_reply through Jupyter Server"
    ws.settimeout(20)  # shorter than Jupyter Server's 30 s pings, so a lost message fails instead of hanging
    return ws


def execute_through_server(ws, code):
    msg_id = uuid.uuid4().hex
    ws.send(json.dumps({"header": {"msg_id": msg_id, "msg_type": "execute_request", "username": "lab",
                                   "session": uuid.uuid4().hex, "version": "5.3"},
                        "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
                        "content": {"code": code, "silent": False}}))
    seen, deadline = {}, time.monotonic() + 90
    while "execute_reply" not in seen or "idle" not in seen:
        assert time.monotonic() < deadline, seen
        message = json.loads(ws.recv())
        if message.get("parent_header", {}).get("msg_id") != msg_id:
            continue
        seen[message["msg_type"]] = message
        if message["msg_type"] == "stream":  # one print may arrive in several pieces
            seen["stream_text"] = seen.get("stream_text", "") + message["content"]["text"]
        if message["msg_type"] == "status" and message["content"]["execution_state"] == "idle":
            seen["idle"] = message
    return seen


def test_jupyter_server_gateway_mode_creates_and_executes(gateway, jupyter_server):
    specs = server_request(jupyter_server, "GET", "/api/kernelspecs").json()
    assert specs["default"] == "python3" and "python3" in specs["kernelspecs"]

    created = server_request(jupyter_server, "POST", "/api/kernels", json={"name": "python3"})
    assert created.status_code == 201, created.text
    kernel_id = created.json()["id"]
    # The kernel lives in our gateway; Jupyter Server only relays.
    assert kernel_id in [k["id"] for k in gateway.get("/api/kernels").json()]

    ws = connect_through_server(jupyter_server, kernel_id)
    seen = execute_through_server(ws, "print('via jupyter server'); 40 + 2")
    assert seen["stream_text"] == "via jupyter server\n"
    assert seen["execute_result"]["content"]["data"]["text/plain"] == "42"
    ws.close()

    model = server_request(jupyter_server, "GET", f"/api/kernels/{kernel_id}").json()
    assert model["id"] == kernel_id
    assert server_request(jupyter_server, "POST", f"/api/kernels/{kernel_id}/restart").status_code == 200
    assert server_request(jupyter_server, "DELETE", f"/api/kernels/{kernel_id}").status_code == 204
    assert gateway.get(f"/api/kernels/{kernel_id}").status_code == 404


def test_jupyter_server_sessions_start_gateway_kernels(gateway, jupyter_server):
    created = server_request(jupyter_server, "POST", "/api/sessions",
                             json={"path": "analysis.ipynb", "type": "notebook", "name": "analysis.ipynb",
                                   "kernel": {"name": "python3"}})
    assert created.status_code == 201, created.text
    kernel_id = created.json()["kernel"]["id"]
    assert gateway.get(f"/api/kernels/{kernel_id}").status_code == 200
    sessions = server_request(jupyter_server, "GET", "/api/sessions").json()
    assert kernel_id in [s["kernel"]["id"] for s in sessions]
    assert server_request(jupyter_server, "DELETE", f"/api/sessions/{created.json()['id']}").status_code == 204
    assert gateway.get(f"/api/kernels/{kernel_id}").status_code == 404


def test_jupyter_server_client_keeps_its_kernel_across_a_gateway_upgrade(tmp_path):
    """SIGTERM (an upgrade) leaves the kernel running; a new gateway on the same state directory and port re-adopts
    it, and the notebook behind Jupyter Server goes on with its old state once its WebSocket reconnects."""
    port, state = free_port(), tmp_path / "gateway-state"
    first = Gateway(state_dir=state, keep_kernels=True, port=port, warm_pool=0)
    second = None
    try:
        with running_jupyter_server(first.url, first.token, tmp_path) as server:
            created = server_request(server, "POST", "/api/sessions",
                                     json={"path": "upgrade.ipynb", "type": "notebook", "name": "upgrade.ipynb",
                                           "kernel": {"name": "python3"}})
            assert created.status_code == 201, created.text
            kernel_id = created.json()["kernel"]["id"]
            ws = connect_through_server(server, kernel_id)
            assert execute_through_server(ws, "before = 'upgrade'")["execute_reply"]["content"]["status"] == "ok"
            # Jupyter Server keeps its own sessions; one made at the gateway's /api/sessions must survive too.
            direct = first.post("/api/sessions", json={"path": "direct.ipynb", "type": "notebook",
                                                       "kernel": {"id": kernel_id}})
            assert direct.status_code == 201, direct.text
            assert first.stop() == 0, "".join(first.output)
            ws.close()
            second = Gateway(state_dir=state, port=port, warm_pool=0)
            ws = connect_through_server(server, kernel_id)
            seen = execute_through_server(ws, "before * 2")
            assert seen["execute_result"]["content"]["data"]["text/plain"] == "'upgradeupgrade'"
            ws.close()
            assert kernel_id in [k["id"] for k in second.get("/api/kernels").json()]
            sessions = {s["id"]: s["kernel"]["id"] for s in second.get("/api/sessions").json()}
            assert sessions.get(direct.json()["id"]) == kernel_id, sessions
    finally:
        first.stop()
        if second is not None:
            second.stop()
