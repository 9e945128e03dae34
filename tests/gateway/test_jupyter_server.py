"""Debian's Jupyter Server 1.23 with --gateway-url in front of cellblock-gateway: kernels are created through
Jupyter Server's REST API and code runs through Jupyter Server's WebSocket, all of it relayed to our gateway."""
import json
import os
import socket
import subprocess
import time
import uuid

import pytest
import requests
import websocket

SERVER_TOKEN = "server-token"


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def jupyter_server(gateway, tmp_path):
    port = free_port()
    environment = dict(os.environ)
    for name in ("JUPYTER_CONFIG_DIR", "JUPYTER_DATA_DIR", "JUPYTER_RUNTIME_DIR"):
        (tmp_path / name).mkdir()
        environment[name] = str(tmp_path / name)
    environment["JUPYTER_GATEWAY_AUTH_TOKEN"] = gateway.token
    log = open(tmp_path / "jupyter-server.log", "w+")
    process = subprocess.Popen(
        ["/usr/bin/python3", "-m", "jupyter_server", f"--gateway-url={gateway.url}", "--ServerApp.ip=127.0.0.1",
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
    yield url
    process.terminate()
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
    log.close()


def server_request(url, method, path, **kwargs):
    return requests.request(method, url + path, headers={"Authorization": f"token {SERVER_TOKEN}"}, timeout=90,
                            **kwargs)


def test_jupyter_server_gateway_mode_creates_and_executes(gateway, jupyter_server):
    specs = server_request(jupyter_server, "GET", "/api/kernelspecs").json()
    assert specs["default"] == "python3" and "python3" in specs["kernelspecs"]

    created = server_request(jupyter_server, "POST", "/api/kernels", json={"name": "python3"})
    assert created.status_code == 201, created.text
    kernel_id = created.json()["id"]
    # The kernel lives in our gateway; Jupyter Server only relays.
    assert kernel_id in [k["id"] for k in gateway.get("/api/kernels").json()]

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
    msg_id = uuid.uuid4().hex
    ws.send(json.dumps({"header": {"msg_id": msg_id, "msg_type": "execute_request", "username": "lab",
                                   "session": uuid.uuid4().hex, "version": "5.3"},
                        "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
                        "content": {"code": "print('via jupyter server'); 40 + 2", "silent": False}}))
    seen, deadline = {}, time.monotonic() + 90
    while "execute_reply" not in seen or "idle" not in seen:
        assert time.monotonic() < deadline, seen
        message = json.loads(ws.recv())
        if message.get("parent_header", {}).get("msg_id") != msg_id:
            continue
        seen[message["msg_type"]] = message
        if message["msg_type"] == "status" and message["content"]["execution_state"] == "idle":
            seen["idle"] = message
    assert seen["stream"]["content"]["text"] == "via jupyter server\n"
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
