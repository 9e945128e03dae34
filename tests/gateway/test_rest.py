"""REST conformance of cellblock-gateway against the Kernel Gateway API (real HTTP requests)."""
import concurrent.futures
import re
import socket
import time

import pytest
import requests

from gateway_harness import TOKEN, Gateway

LAST_ACTIVITY = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z$")
KERNEL_FIELDS = {"id", "name", "last_activity", "execution_state", "connections"}


def assert_kernel_model(model):
    assert KERNEL_FIELDS <= set(model), model
    assert LAST_ACTIVITY.match(model["last_activity"]), model["last_activity"]
    assert isinstance(model["connections"], int)


def assert_json_error(response, status, reason, message_part=""):
    assert response.status_code == status, response.text
    assert response.headers["Content-Type"].startswith("application/json")
    body = response.json()
    assert body["reason"] == reason, body
    assert message_part in body["message"], body


def test_api_root_and_status(gateway):
    root = gateway.get("/api")
    assert root.status_code == 200 and "version" in root.json()
    status = gateway.get("/api/status").json()
    assert LAST_ACTIVITY.match(status["started"]) and "kernels" in status


def test_unknown_paths_are_json_404(gateway):
    for path in ("/", "/tree", "/api/contents", "/api/terminals", "/api/nope"):
        assert_json_error(gateway.get(path), 404, "Not Found")


def test_token_is_required_and_accepted_in_every_form(gateway):
    anonymous = requests.Session()
    for method, path in (("GET", "/api"), ("GET", "/api/kernelspecs"), ("POST", "/api/kernels"), ("GET", "/api/kernels"),
                         ("GET", "/api/sessions")):
        response = anonymous.request(method, gateway.url + path, timeout=30)
        assert_json_error(response, 401, "Unauthorized")
        wrong = anonymous.request(method, gateway.url + path, headers={"Authorization": "token wrong"}, timeout=30)
        assert wrong.status_code == 401
    assert anonymous.get(gateway.url + f"/api?token={TOKEN}", timeout=30).status_code == 200
    assert anonymous.get(gateway.url + "/api", headers={"Authorization": f"token {TOKEN}"}, timeout=30).status_code == 200
    assert anonymous.get(gateway.url + "/api", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30).status_code == 200
    assert anonymous.get(gateway.url + "/api", headers={"Authorization": f"Bearer {TOKEN}x"}, timeout=30).status_code == 401
    # CORS preflight never needs the token.
    assert anonymous.options(gateway.url + "/api/kernels", timeout=30).status_code == 200


def test_kernelspecs_models(gateway):
    listing = gateway.get("/api/kernelspecs").json()
    assert listing["default"] == "python3"
    assert "python3" in listing["kernelspecs"]
    for name, model in listing["kernelspecs"].items():
        assert model["name"] == name
        assert {"argv", "display_name", "language"} <= set(model["spec"])
        assert isinstance(model["resources"], dict)
        for url in model["resources"].values():
            assert url.startswith("/kernelspecs/")
            resource = gateway.get(url)
            assert resource.status_code == 200 and resource.content
    one = gateway.get("/api/kernelspecs/python3")
    assert one.status_code == 200 and one.json()["name"] == "python3"
    assert gateway.get("/api/kernelspecs/python").json()["spec"] == one.json()["spec"]
    assert_json_error(gateway.get("/api/kernelspecs/no-such-spec"), 404, "Not Found", "no-such-spec")
    assert gateway.get("/kernelspecs/python3/../../etc/passwd").status_code == 404
    assert gateway.get("/kernelspecs/python3/kernel.json").status_code == 200


def test_kernel_lifecycle(gateway):
    created = gateway.post("/api/kernels", json={"name": "python3"})
    assert created.status_code == 201, created.text
    model = created.json()
    assert_kernel_model(model)
    kernel_id = model["id"]
    assert created.headers["Location"] == f"/api/kernels/{kernel_id}"
    assert model["name"] == "python3" and model["connections"] == 0
    assert model["execution_state"] in ("idle", "busy", "starting")
    assert kernel_id in [k["id"] for k in gateway.get("/api/kernels").json()]
    assert_kernel_model(gateway.get(f"/api/kernels/{kernel_id}").json())
    # Interrupt accepts no body, {} and {"kernel_id": id}, as the real clients send.
    assert gateway.post(f"/api/kernels/{kernel_id}/interrupt").status_code == 204
    assert gateway.post(f"/api/kernels/{kernel_id}/interrupt", json={}).status_code == 204
    assert gateway.post(f"/api/kernels/{kernel_id}/interrupt", json={"kernel_id": kernel_id}).status_code == 204
    restarted = gateway.post(f"/api/kernels/{kernel_id}/restart")
    assert restarted.status_code == 200, restarted.text
    assert restarted.json()["id"] == kernel_id and restarted.json()["execution_state"] == "idle"
    deleted = gateway.delete(f"/api/kernels/{kernel_id}")
    assert deleted.status_code == 204 and deleted.content == b""
    assert_json_error(gateway.get(f"/api/kernels/{kernel_id}"), 404, "Not Found", kernel_id)
    assert gateway.delete(f"/api/kernels/{kernel_id}").status_code == 404
    assert gateway.post(f"/api/kernels/{kernel_id}/interrupt").status_code == 404
    assert gateway.post(f"/api/kernels/{kernel_id}/restart").status_code == 404
    assert kernel_id not in [k["id"] for k in gateway.get("/api/kernels").json()]


def test_post_body_variants(gateway):
    for body in (None, {}, {"name": "python"}, {"name": "python3", "path": None}, {"name": None, "env": {}}):
        response = gateway.post("/api/kernels", json=body) if body is not None else gateway.post("/api/kernels")
        assert response.status_code == 201, (body, response.text)
        assert response.json()["name"] == "python3", body  # "python" is an alias, reported as python3
        assert gateway.delete(f"/api/kernels/{response.json()['id']}").status_code == 204


def test_post_errors(gateway):
    unknown = gateway.post("/api/kernels", json={"name": "no-such-kernel"})
    assert unknown.status_code == 500 and "NoSuchKernel" in unknown.json()["message"]
    assert_json_error(gateway.post("/api/kernels", json={"env": ["KERNEL_X"]}), 400, "bad_env", "env")
    assert_json_error(gateway.post("/api/kernels", json={"env": {"KERNEL_X": 1}}), 400, "bad_env", "KERNEL_X")
    assert_json_error(gateway.post("/api/kernels", data="{not json", headers={"Content-Type": "application/json"}),
                      400, "Bad Request", "JSON")
    assert_json_error(gateway.post("/api/kernels", data=b'{"name": "\xff\xfe"}'), 400, "Bad Request")
    assert_json_error(gateway.post("/api/kernels", json=[1, 2]), 400, "Bad Request")
    assert gateway.alive()


def test_unknown_and_malformed_ids(gateway):
    for kernel_id in ("00000000-0000-0000-0000-000000000000", "not-an-id", "a" * 5000):
        response = gateway.get(f"/api/kernels/{kernel_id}")
        assert response.status_code in (404, 431), response.text
    # A segment that decodes to NUL (or '/', or is not valid percent-encoding) is a bad request, not an unknown id.
    for malformed in ("%00", "a%2Fb"):
        response = gateway.get(f"/api/kernels/{malformed}")
        assert response.status_code == 400 and response.json()["reason"] == "bad_path", response.text
    assert gateway.get("/api/sessions/nope").status_code == 404
    assert gateway.alive()


def test_oversized_body_is_413_and_gateway_keeps_serving(gateway):
    response = gateway.post("/api/kernels", data=b"{" + b" " * (9 << 20) + b"}",
                            headers={"Content-Type": "application/json"})
    assert_json_error(response, 413, "Payload Too Large")
    assert gateway.alive()


def test_a_body_without_a_token_is_refused_before_it_is_read(gateway):
    """A tokenless client that announces a large body gets 401 at once, not after we buffered the body (nor after
    a read timeout while we wait for it): it cannot make the gateway hold max_body_bytes per connection."""
    host, port = gateway.url.split("//")[1].split(":")
    with socket.create_connection((host, int(port)), timeout=10) as raw:
        raw.sendall(b"POST /api/kernels HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 8000000\r\n\r\n{")
        answer = raw.recv(4096)  # times out (a failure) if the gateway waits for the other 7,999,999 bytes
        assert answer.startswith(b"HTTP/1.1 401"), answer
        assert b"Missing or invalid token" in answer, answer
    # With the token the same announcement is read as usual: here, the incomplete body is a 400 once sent.
    with socket.create_connection((host, int(port)), timeout=10) as raw:
        raw.sendall(f"POST /api/kernels HTTP/1.1\r\nHost: x\r\nAuthorization: token {TOKEN}\r\n"
                    "Content-Type: application/json\r\nContent-Length: 3\r\n\r\n{}}".encode())
        answer = raw.recv(4096)
        assert answer.startswith(b"HTTP/1.1 400"), answer
    assert gateway.alive()


def test_garbage_and_vanishing_tcp_clients_do_not_hurt(gateway):
    host, port = gateway.url.split("//")[1].split(":")
    with socket.create_connection((host, int(port)), timeout=10) as raw:
        raw.sendall(b"THIS IS NOT HTTP\r\n\r\n")
        answer = raw.recv(4096)
        assert answer.startswith(b"HTTP/1.1 400"), answer
    # A client that sends half a request and disappears, and one that connects and sends nothing.
    half = socket.create_connection((host, int(port)), timeout=10)
    half.sendall(b"POST /api/kernels HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
    half.close()
    idle = socket.create_connection((host, int(port)), timeout=10)
    assert gateway.alive()
    idle.close()


def test_last_activity_always_has_microseconds(gateway, kernel):
    for _ in range(20):
        assert LAST_ACTIVITY.match(gateway.get(f"/api/kernels/{kernel['id']}").json()["last_activity"])


def test_sessions_crud_in_jupyter_server_shape(gateway):
    created = gateway.post("/api/sessions", json={"path": "agent/a.ipynb", "type": "notebook", "name": "a",
                                                  "kernel": {"name": "python3"}})
    assert created.status_code == 201, created.text
    session = created.json()
    assert {"id", "path", "name", "type", "kernel"} <= set(session)
    assert created.headers["Location"] == f"/api/sessions/{session['id']}"
    assert_kernel_model(session["kernel"])
    kernel_id = session["kernel"]["id"]
    again = gateway.post("/api/sessions", json={"path": "agent/a.ipynb", "type": "notebook"})
    assert again.status_code == 201 and again.json()["id"] == session["id"]
    legacy = gateway.post("/api/sessions", json={"notebook": {"path": "legacy.ipynb"}, "kernel": {"name": "python3"}})
    assert legacy.status_code == 201 and legacy.json()["type"] == "notebook"
    assert {s["id"] for s in gateway.get("/api/sessions").json()} >= {session["id"], legacy.json()["id"]}
    assert gateway.get(f"/api/sessions/{session['id']}").json()["path"] == "agent/a.ipynb"
    patched = gateway.request("PATCH", f"/api/sessions/{session['id']}", json={"name": "renamed", "path": "b.ipynb"})
    assert patched.status_code == 200 and patched.json()["name"] == "renamed" and patched.json()["path"] == "b.ipynb"
    assert_json_error(gateway.post("/api/sessions", json={"type": "notebook"}), 400, "Bad Request", "path")
    assert_json_error(gateway.post("/api/sessions", json={"path": "x"}), 400, "Bad Request", "type")
    unknown = gateway.post("/api/sessions", json={"path": "u", "type": "notebook", "kernel": {"name": "nope"}})
    assert unknown.status_code == 501 and "nope" in unknown.json()["message"]
    assert gateway.delete(f"/api/sessions/{session['id']}").status_code == 204
    assert gateway.get(f"/api/sessions/{session['id']}").status_code == 404
    assert gateway.get(f"/api/kernels/{kernel_id}").status_code == 404  # the session's kernel went with it
    assert gateway.delete(f"/api/sessions/{legacy.json()['id']}").status_code == 204


def test_listing_can_be_disabled(make_gateway):
    gateway = make_gateway("--list-kernels", "false", warm_pool=0)
    assert_json_error(gateway.get("/api/kernels"), 403, "Forbidden")
    assert_json_error(gateway.get("/api/sessions"), 403, "Forbidden")


def test_max_kernels_is_enforced_at_request_time(make_gateway):
    gateway = make_gateway("--max-kernels", "2", warm_pool=1)
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        responses = list(pool.map(lambda _: gateway.post("/api/kernels", json={}), range(6)))
    codes = sorted(r.status_code for r in responses)
    assert codes == [201, 201, 403, 403, 403, 403], codes
    refused = next(r for r in responses if r.status_code == 403)
    assert_json_error(refused, 403, "Forbidden", "Resource Limit")
    first = next(r for r in responses if r.status_code == 201).json()["id"]
    assert gateway.delete(f"/api/kernels/{first}").status_code == 204
    assert gateway.post("/api/kernels", json={}).status_code == 201


def test_cors_headers_and_origin_check(make_gateway):
    gateway = make_gateway(env={"KG_ALLOW_ORIGIN": "https://agents.example", "KG_ALLOW_METHODS": "GET,POST",
                                "KG_ALLOW_HEADERS": "Authorization,Content-Type", "KG_MAX_AGE": "600",
                                "KG_EXPOSE_HEADERS": "Location", "KG_ALLOW_CREDENTIALS": "true"}, warm_pool=0)
    preflight = requests.options(gateway.url + "/api/kernels", headers={"Origin": "https://agents.example"}, timeout=30)
    assert preflight.status_code == 200
    assert preflight.headers["Access-Control-Allow-Origin"] == "https://agents.example"
    assert preflight.headers["Access-Control-Allow-Methods"] == "GET,POST"
    assert preflight.headers["Access-Control-Allow-Headers"] == "Authorization,Content-Type"
    assert preflight.headers["Access-Control-Max-Age"] == "600"
    assert preflight.headers["Access-Control-Expose-Headers"] == "Location"
    assert preflight.headers["Access-Control-Allow-Credentials"] == "true"
    assert "Content-Security-Policy" not in preflight.headers
    ok = gateway.get("/api", headers={"Origin": "https://agents.example"})
    assert ok.status_code == 200 and ok.headers["Access-Control-Allow-Origin"] == "https://agents.example"
    assert gateway.get("/api", headers={"Origin": "https://evil.example"}).status_code == 404


def test_no_cors_headers_by_default(gateway):
    response = gateway.get("/api")
    assert not [h for h in response.headers if h.lower().startswith("access-control-")]


def test_idle_kernels_are_culled(make_gateway):
    gateway = make_gateway("--cull-idle-timeout", "2", "--cull-interval", "0.5", warm_pool=0)
    kernel_id = gateway.start_kernel()["id"]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and gateway.get(f"/api/kernels/{kernel_id}").status_code == 200:
        time.sleep(0.25)
    assert gateway.get(f"/api/kernels/{kernel_id}").status_code == 404


def test_connected_kernels_are_kept_unless_cull_connected(make_gateway):
    keep = make_gateway("--cull-idle-timeout", "1", "--cull-interval", "0.25", warm_pool=0)
    kept = keep.start_kernel()["id"]
    socket_ = keep.connect(kept)
    socket_.wait_ready()
    time.sleep(3)
    assert keep.get(f"/api/kernels/{kept}").status_code == 200
    socket_.close()

    cull = make_gateway("--cull-idle-timeout", "1", "--cull-interval", "0.25", "--cull-connected", "true",
                        warm_pool=0)
    culled = cull.start_kernel()["id"]
    watcher = cull.connect(culled)
    watcher.wait_ready()
    note = None
    try:
        while note is None:
            message = watcher.recv(timeout=30)
            if message["msg_type"] == "stream" and "inactivity" in message["content"]["text"]:
                note = message
    except Exception:  # the socket is closed right after the note
        pass
    assert note is not None, "connected clients must be told before a cull"
    assert cull.get(f"/api/kernels/{culled}").status_code == 404


def test_sigterm_stops_gateway_and_kernels(make_gateway):
    from gateway_harness import kernel_pids
    gateway = make_gateway(warm_pool=1)
    kernel_id = gateway.start_kernel()["id"]
    assert kernel_pids(kernel_id), "kernel process should be running"
    assert gateway.stop() == 0
    deadline = time.monotonic() + 10
    while kernel_pids(kernel_id) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not kernel_pids(kernel_id)


def test_generated_token_is_printed(make_gateway):
    gateway = make_gateway(token=None, warm_pool=0)
    printed = "".join(gateway.output)
    token = __import__("re").search(r"token: ([0-9a-f]+)", printed).group(1)
    assert requests.get(gateway.url + "/api", timeout=30).status_code == 401
    assert requests.get(gateway.url + f"/api?token={token}", timeout=30).status_code == 200
    open_gateway = make_gateway(token="", warm_pool=0)
    assert requests.get(open_gateway.url + "/api", timeout=30).status_code == 200


def test_tls_serves_https_and_wss(make_gateway, tmp_path):
    import ssl
    import subprocess

    import websocket
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    gateway = make_gateway("--certfile", str(cert), "--keyfile", str(key), warm_pool=0)
    assert gateway.url.startswith("https://")
    response = requests.get(gateway.url + "/api", headers={"Authorization": f"token {TOKEN}"}, verify=str(cert),
                            timeout=30)
    assert response.status_code == 200
    kernel_id = requests.post(gateway.url + "/api/kernels", headers={"Authorization": f"token {TOKEN}"},
                              verify=str(cert), timeout=90).json()["id"]
    ws = websocket.create_connection(f"wss://{gateway.url.split('//')[1]}/api/kernels/{kernel_id}/channels",
                                     header=[f"Authorization: token {TOKEN}"], timeout=60,
                                     sslopt={"ca_certs": str(cert), "cert_reqs": ssl.CERT_REQUIRED,
                                             "check_hostname": False})
    ws.send('{"header": {"msg_type": "kernel_info_request", "msg_id": "tls-1"}, "channel": "shell"}')
    while True:
        message = __import__("json").loads(ws.recv())
        if message["msg_type"] == "kernel_info_reply":
            assert message["parent_header"]["msg_id"] == "tls-1"
            break
    ws.close()
    with pytest.raises(requests.exceptions.ConnectionError):
        requests.get(gateway.url.replace("https", "http") + "/api", timeout=10)
