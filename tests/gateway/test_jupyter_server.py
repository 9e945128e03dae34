"""Debian's Jupyter Server 1.23 with --gateway-url in front of cellblock-gateway: kernels are created through
Jupyter Server's REST API and code runs through Jupyter Server's WebSocket, all of it relayed to our gateway. And
`jupyter lab --gateway-url` (JupyterLab 4 on Jupyter Server 2.x, in the peers' venv) holding a tenant's token: it
attaches to that tenant's agent kernel only."""
import contextlib
import json
import os
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import requests
import websocket

from gateway_harness import Gateway

SERVER_TOKEN = "server-token"
DEBIAN_JUPYTER_SERVER = ("/usr/bin/python3", "-m", "jupyter_server")  # Jupyter Server 1.23
# JupyterLab 4 on Jupyter Server 2.x from PyPI (tests/requirements-peers.txt), in the venv share/scripts/test-venv.sh
# makes: the one that attaches to a running gateway kernel by its id (1.23 starts a new kernel instead).
PEERS_VENV = Path(os.environ["CELLBLOCK_PEERS_VENV"]) if os.environ.get("CELLBLOCK_PEERS_VENV") else None


def jupyter_lab_command():
    jupyter = PEERS_VENV / "bin" / "jupyter" if PEERS_VENV else None
    if jupyter is None or not os.access(jupyter, os.X_OK):
        # Not a skip: a client that did not run must not look green (tests/README.md, skip policy).
        pytest.fail(f"JupyterLab is not installed in CELLBLOCK_PEERS_VENV={PEERS_VENV}: "
                    "share/scripts/test-venv.sh <build>/peers-venv tests/requirements-peers.txt")
    return (str(jupyter), "lab", "--no-browser")


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def running_jupyter_server(gateway_url, gateway_token, tmp_path, command=DEBIAN_JUPYTER_SERVER):
    """`command`: Debian's Jupyter Server 1.23, or jupyter_lab_command() (JupyterLab 4, Jupyter Server 2.x)."""
    port = free_port()
    environment = dict(os.environ)
    names = ["JUPYTER_CONFIG_DIR", "JUPYTER_DATA_DIR", "JUPYTER_RUNTIME_DIR"]
    if command != DEBIAN_JUPYTER_SERVER:
        # Lab finds its extensions in its venv only; kernelspecs come from the gateway. Nothing lands in $HOME.
        environment.pop("JUPYTER_PATH", None)
        names += ["JUPYTERLAB_SETTINGS_DIR", "JUPYTERLAB_WORKSPACES_DIR"]
    for name in names:
        (tmp_path / name).mkdir()
        environment[name] = str(tmp_path / name)
    environment["JUPYTER_GATEWAY_AUTH_TOKEN"] = gateway_token
    log = open(tmp_path / "jupyter-server.log", "w+")
    process = subprocess.Popen(
        [*command, f"--gateway-url={gateway_url}", "--ServerApp.ip=127.0.0.1",
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


def test_jupyter_server_with_a_tenants_token_sees_only_that_tenants_agent_kernel(gateway, tmp_path):
    """`jupyter lab --gateway-url` holding a tenant's token ("a tenant's token sees its own"): the tenant's
    agent kernel attaches (as JupyterLab's "use kernel from other session" does: POST /api/sessions with its id), is
    listed at Jupyter Server's /api/kernels and runs with the agent's variables; the operator's agent kernel, asked
    for the same way, is not attached, not listed and not found. Jupyter Server lists only gateway kernels it
    attached to, so the list is the proof that the gateway refused it the operator's."""
    tenant = gateway.post("/agent/v1/tenants", json={"name": "lab-reader"})
    assert tenant.status_code == 201, tenant.text
    tenant_headers = {"Authorization": f"token {tenant.json()['token']}"}
    created = []
    try:
        mine = requests.post(gateway.url + "/agent/v1/sessions", json={"name": "tenant-agent"},
                             headers=tenant_headers, timeout=120)
        assert mine.status_code == 201, mine.text
        created.append((mine.json()["id"], tenant_headers))
        ran = requests.post(gateway.url + f"/agent/v1/sessions/{mine.json()['id']}/execute",
                            json={"code": "x = 'tenant-x'"}, headers=tenant_headers, timeout=120)
        assert ran.status_code == 200 and ran.json()["status"] == "ok", ran.text
        operators = gateway.post("/agent/v1/sessions", json={"name": "operator-agent"})
        assert operators.status_code == 201, operators.text
        created.append((operators.json()["id"], gateway.headers))
        ran = gateway.post(f"/agent/v1/sessions/{operators.json()['id']}/execute", json={"code": "x = 'operator-x'"})
        assert ran.status_code == 200 and ran.json()["status"] == "ok", ran.text
        tenant_kernel, operator_kernel = mine.json()["kernel_id"], operators.json()["kernel_id"]
        # The operator's view holds both (what the operator's Jupyter Server may attach to).
        assert {tenant_kernel, operator_kernel} <= {k["id"] for k in gateway.get("/api/kernels").json()}

        with running_jupyter_server(gateway.url, tenant.json()["token"], tmp_path, jupyter_lab_command()) as server:
            attached = server_request(server, "POST", "/api/sessions",
                                      json={"path": "tenant.ipynb", "type": "notebook", "name": "tenant.ipynb",
                                            "kernel": {"id": tenant_kernel}})
            assert attached.status_code == 201, attached.text
            assert attached.json()["kernel"]["id"] == tenant_kernel, "attached to the running kernel, none started"
            # Asked for the operator's kernel by its id, Jupyter Server gets what an unknown id gets from the gateway.
            server_request(server, "POST", "/api/sessions",
                           json={"path": "operator.ipynb", "type": "notebook", "name": "operator.ipynb",
                                 "kernel": {"id": operator_kernel}})
            listed = server_request(server, "GET", "/api/kernels")
            assert listed.status_code == 200, listed.text
            assert [k["id"] for k in listed.json()] == [tenant_kernel], "Jupyter Server lists the tenant's kernel only"
            model = server_request(server, "GET", f"/api/kernels/{tenant_kernel}")
            assert model.status_code == 200 and model.json()["id"] == tenant_kernel, model.text
            assert server_request(server, "GET", f"/api/kernels/{operator_kernel}").status_code == 404

            ws = connect_through_server(server, tenant_kernel)
            seen = execute_through_server(ws, "print(x)")
            ws.close()
            assert seen["stream_text"] == "tenant-x\n", "the agent's variable, in the agent's kernel"
            # Jupyter Server only relayed: the agent's session is still on that kernel (checked before Jupyter Server
            # stops: its shutdown DELETEs every kernel it attached to, the agent's too).
            again = requests.get(gateway.url + f"/agent/v1/sessions/{mine.json()['id']}", headers=tenant_headers,
                                 timeout=30)
            assert again.status_code == 200 and again.json()["kernel_id"] == tenant_kernel, again.text
    finally:
        for session_id, headers in created:
            requests.delete(gateway.url + f"/agent/v1/sessions/{session_id}", headers=headers, timeout=60)


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
