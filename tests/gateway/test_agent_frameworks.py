"""The call sequences of AutoGen, OpenHands and E2B (reference §6), replayed as real HTTP/WebSocket traffic."""
import json
import re
import select
import subprocess
import time
import uuid

import requests
import websocket

from gateway_harness import Gateway, gateway_binary, kernelspec_arguments


def test_autogen_sequence(gateway):
    headers = {"Authorization": f"token {gateway.token}"}
    specs = requests.get(gateway.url + "/api/kernelspecs", headers=headers, timeout=60).json()
    assert "python3" in specs["kernelspecs"]
    kernel_id = requests.post(gateway.url + "/api/kernels", json={"name": "python3"}, headers=headers,
                              timeout=60).json()["id"]
    ws = websocket.create_connection(f"{gateway.ws_base}/api/kernels/{kernel_id}/channels", header=headers, timeout=60)
    session = uuid.uuid4().hex

    def send(msg_type, content):
        msg_id = uuid.uuid4().hex
        ws.send(json.dumps({"header": {"username": "autogen", "version": "5.0", "session": session, "msg_id": msg_id,
                                       "msg_type": msg_type, "date": "2026-11-29T21:00:00.000001"},
                            "parent_header": {}, "channel": "shell", "content": content, "metadata": {},
                            "buffers": {}}))
        return msg_id

    ready = send("kernel_info_request", {})
    while True:  # wait_for_ready: frames until the matching kernel_info_reply
        message = json.loads(ws.recv())
        if message["parent_header"].get("msg_id") == ready and message["msg_type"] == "kernel_info_reply":
            break

    def run(code):
        msg_id = send("execute_request", {"code": code, "silent": False, "store_history": True,
                                          "user_expressions": {}, "allow_stdin": False, "stop_on_error": True})
        text, error = [], None
        while True:  # AutoGen ends on iopub status idle and never waits for execute_reply
            message = json.loads(ws.recv())
            if message["parent_header"].get("msg_id") != msg_id:
                continue
            kind = message["msg_type"]
            if kind in ("execute_result", "display_data"):
                text.append(message["content"]["data"]["text/plain"])
            elif kind == "stream":
                text.append(message["content"]["text"])
            elif kind == "error":
                return "", f"ERROR: {message['content']['ename']}: {message['content']['evalue']}"
            elif kind == "status" and message["content"]["execution_state"] == "idle":
                return "".join(text), error

    assert run("print('hello autogen')") == ("hello autogen\n", None)
    assert run("21*2")[0] == "42"
    output, error = run("1/0")
    assert error.startswith("ERROR: ZeroDivisionError")
    assert requests.post(gateway.url + f"/api/kernels/{kernel_id}/restart", headers=headers, timeout=60).ok
    ws.close()
    ws = websocket.create_connection(f"{gateway.ws_base}/api/kernels/{kernel_id}/channels", header=headers, timeout=60)
    assert run("'after restart'")[0] == "'after restart'"
    ws.close()
    requests.delete(gateway.url + f"/api/kernels/{kernel_id}", headers=headers, timeout=60).raise_for_status()


def test_openhands_connects_after_the_first_stdout_line_containing_at(tmp_path):
    # OpenHands starts the gateway, reads its STDOUT line by line and connects as soon as a line contains "at": that
    # line must be the ready line, printed once the gateway answers, not an earlier line that happens to contain "at".
    log = open(tmp_path / "stderr.log", "wb")
    process = subprocess.Popen([gateway_binary(), "--ip", "127.0.0.1", "--port", "0", *kernelspec_arguments(),
                                "--token", "", "--state-dir", str(tmp_path / "state"),
                                "--shutdown-kernels-on-exit"],
                               stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, text=True,
                               start_new_session=True)
    try:
        lines = []
        deadline = time.monotonic() + 60  # generous: a loaded 2-core machine
        while not any("at" in line for line in lines):
            assert time.monotonic() < deadline and process.poll() is None, (lines, process.poll())
            if select.select([process.stdout], [], [], 0.5)[0]:
                lines.append(process.stdout.readline())
        first_at = lines[-1]
        match = re.search(r"is available at (http://[\d.]+:\d+)", first_at)
        assert match, f"OpenHands would connect after {first_at!r} (stdout so far: {lines})"
        assert requests.get(match.group(1) + "/api", timeout=60).status_code == 200
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()


def test_openhands_sequence(make_gateway):
    gateway = make_gateway(token="")  # OpenHands runs its gateway without a token
    kernel_id = requests.post(gateway.url + "/api/kernels", json={"name": "python"}, timeout=60).json()["id"]
    ws = websocket.create_connection(f"{gateway.ws_base}/api/kernels/{kernel_id}/channels", timeout=60)
    ws.ping()

    def execute(code):
        msg_id = uuid.uuid4().hex
        ws.send(json.dumps({"header": {"username": "", "version": "5.0", "session": "", "msg_id": msg_id,
                                       "msg_type": "execute_request"},
                            "parent_header": {}, "channel": "shell",
                            "content": {"code": code, "silent": False, "store_history": False,
                                        "user_expressions": {}, "allow_stdin": False},
                            "metadata": {}, "buffers": {}}))
        outputs = []
        while True:  # OpenHands is done on the shell execute_reply
            message = json.loads(ws.recv())
            if message["parent_header"].get("msg_id") != msg_id:
                continue
            kind = message["msg_type"]
            if kind == "stream":
                outputs.append(message["content"]["text"])
            elif kind in ("execute_result", "display_data"):
                outputs.append(message["content"]["data"]["text/plain"])  # a KeyError here breaks OpenHands
            elif kind == "error":
                outputs.append("\n".join(message["content"]["traceback"]))
            elif kind == "execute_reply":
                return "".join(outputs)

    execute("%colors nocolor")
    assert execute("print(6*7)").strip() == "42"
    assert "NameError" in execute("undefined_name")
    # A timed-out action is interrupted with the kernel id in the body.
    msg_id = uuid.uuid4().hex
    ws.send(json.dumps({"header": {"username": "", "version": "5.0", "session": "", "msg_id": msg_id,
                                   "msg_type": "execute_request"}, "parent_header": {}, "channel": "shell",
                        "content": {"code": "import time; time.sleep(60)", "silent": False}, "metadata": {},
                        "buffers": {}}))
    time.sleep(1)
    assert requests.post(gateway.url + f"/api/kernels/{kernel_id}/interrupt", json={"kernel_id": kernel_id},
                         timeout=60).status_code == 204
    while True:
        message = json.loads(ws.recv())
        if message["msg_type"] == "execute_reply" and message["parent_header"]["msg_id"] == msg_id:
            assert message["content"]["status"] == "error"
            break
    ws.close()
    assert requests.delete(gateway.url + f"/api/kernels/{kernel_id}", timeout=60).status_code == 204


def test_e2b_sequence(make_gateway):
    gateway = make_gateway(token="", env={"KG_ALLOW_ORIGIN": "*"})
    assert requests.get(gateway.url + "/api/status", timeout=60).status_code == 200  # E2B's health probe
    context = str(uuid.uuid4())
    created = requests.post(gateway.url + "/api/sessions", timeout=60,
                            json={"path": context, "kernel": {"name": "python"}, "type": "notebook", "name": context})
    assert created.status_code == 201
    session_id, kernel_id = created.json()["id"], created.json()["kernel"]["id"]
    ws = websocket.create_connection(f"{gateway.ws_base}/api/kernels/{kernel_id}/channels", timeout=60)

    def execute(code, silent=False):
        msg_id = str(uuid.uuid4())
        ws.send(json.dumps({"header": {"msg_id": msg_id, "username": "e2b", "session": session_id,
                                       "msg_type": "execute_request", "version": "5.3",
                                       "date": time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime())},
                            "parent_header": {}, "metadata": {"trusted": True, "deletedCells": [],
                                                              "recordTiming": False, "cellId": str(uuid.uuid4())},
                            "content": {"code": code, "silent": silent, "store_history": True,
                                        "user_expressions": {}, "allow_stdin": False, "stop_on_error": True}}))
        seen_input, events = silent, []
        while True:  # E2B: done on idle after execute_input (or busy for silent code); no "channel" sent
            message = json.loads(ws.recv())
            if message["parent_header"].get("msg_id") != msg_id:
                continue
            kind = message["msg_type"]
            if kind == "execute_input":
                seen_input = True
            elif kind == "stream":  # E2B appends a stream's pieces, however the kernel split them
                if events and events[-1]["type"] == message["content"]["name"]:
                    events[-1]["text"] += message["content"]["text"]
                else:
                    events.append({"type": message["content"]["name"], "text": message["content"]["text"]})
            elif kind in ("execute_result", "display_data"):
                events.append({"type": "result", "text": message["content"]["data"].get("text/plain"),
                               "is_main_result": kind == "execute_result"})
            elif kind == "error":
                events.append({"type": "error", "name": message["content"]["ename"]})
            elif kind == "status" and message["content"]["execution_state"] == "idle" and seen_input:
                return events

    assert execute("%cd /tmp", silent=True) == []
    events = execute("import os\nprint(os.getcwd())\n'main'")
    assert {"type": "stdout", "text": "/tmp\n"} in events
    assert {"type": "result", "text": "'main'", "is_main_result": True} in events
    assert execute("raise ValueError('x')") == [{"type": "error", "name": "ValueError"}]
    ws.close()
    assert requests.post(gateway.url + f"/api/kernels/{kernel_id}/restart", timeout=60).status_code == 200
    assert requests.delete(gateway.url + f"/api/kernels/{kernel_id}", timeout=60).status_code == 204
    assert requests.get(gateway.url + f"/api/sessions/{session_id}", timeout=60).status_code == 404
