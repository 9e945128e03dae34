"""The agent API end to end through HTTP: the data-analysis flow an agent runs (upload a CSV, group by,
plot, fix an error), timeouts as circuit breakers, context shielding of large output, hostile file names, notebook
export re-executed by nbclient, NDJSON streaming and disconnects, clear 4xx errors, and a notebook watching the
session's kernel through the Kernel Gateway WebSocket."""
import base64
import http.client
import json
import socket
import time
import uuid

import nbclient
import nbformat
import pytest
import websocket

SALES_CSV = "product,units\napple,3\npear,5\napple,4\nfig,1\n"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_sales_csv_group_by_gives_product_units(gateway):
    session = gateway.create_session("sales")
    assert session["name"] == "sales" and session["kernel_id"] and session["created"]
    assert set(session["limits"]) == {"timeout_s", "memory_mb", "output_bytes"}
    put = gateway.request("PUT", "/agent/v1/sessions/sales/files/data/sales.csv", data=SALES_CSV.encode())
    assert put.status_code == 201, put.text
    answer = gateway.execute("sales", "import pandas as pd\n"
                                      "df = pd.read_csv('data/sales.csv')\n"
                                      "print(df.groupby('product', as_index=False).units.sum().to_csv(index=False), end='')\n"
                                      "int(df.units.sum())")
    assert answer["status"] == "ok", answer
    assert answer["stdout"] == "product,units\napple,7\nfig,1\npear,5\n"
    assert answer["result"] == {"text/plain": "13"}
    assert answer["error"] is None and answer["truncated"] is False
    assert isinstance(answer["execution_count"], int) and answer["duration_ms"] > 0
    # The session is a kernel in /api/kernels, so a human can attach to it.
    kernels = gateway.request("GET", "/api/kernels").json()
    assert session["kernel_id"] in [kernel["id"] for kernel in kernels]


def test_plot_comes_back_as_png(gateway):
    gateway.create_session("plot")
    answer = gateway.execute("plot", "import matplotlib\nmatplotlib.use('module://matplotlib_inline.backend_inline')\n"
                                     "import matplotlib.pyplot as plt\n"
                                     "plt.bar(['apple', 'pear'], [7, 5])\nplt.show()")
    assert answer["status"] == "ok", answer
    pngs = [display["image/png"] for display in answer["displays"] if "image/png" in display]
    assert pngs, answer["displays"]
    assert base64.b64decode(pngs[0]).startswith(PNG_SIGNATURE)
    assert all("text/plain" in display for display in answer["displays"])


def test_error_traceback_is_plain_text_and_session_continues(gateway):
    gateway.create_session("errors")
    gateway.execute("errors", "numbers = [1, 2, 3]")
    answer = gateway.execute("errors", "def ratio(a, b):\n    return a / b\nratio(numbers[0], 0)")
    assert answer["status"] == "error"
    assert answer["error"]["ename"] == "ZeroDivisionError"
    assert answer["error"]["evalue"] == "division by zero"
    traceback = answer["error"]["traceback"]
    assert isinstance(traceback, str) and "ZeroDivisionError" in traceback and "ratio" in traceback
    assert "\x1b" not in traceback, "ANSI escape codes must be stripped"
    fixed = gateway.execute("errors", "sum(numbers)")
    assert fixed["status"] == "ok" and fixed["result"]["text/plain"] == "6"


def test_timeout_interrupts_and_keeps_state(gateway):
    gateway.create_session("slow")
    gateway.execute("slow", "kept = 41")
    started = time.monotonic()
    answer = gateway.execute("slow", "import time\ntime.sleep(120)", timeout_s=2)
    assert answer["status"] == "timeout", answer
    assert answer["state_lost"] is False
    assert answer["error"]["ename"] == "TimeoutError"
    assert time.monotonic() - started < 60
    after = gateway.execute("slow", "kept + 1")
    assert after["status"] == "ok" and after["result"]["text/plain"] == "42"


def test_timeout_that_ignores_the_interrupt_restarts_the_kernel(gateway):
    session = gateway.create_session("stubborn")
    gateway.execute("stubborn", "kept = 1")
    answer = gateway.execute("stubborn", "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
                                         "time.sleep(120)", timeout_s=1)
    assert answer["status"] == "timeout", answer
    assert answer["state_lost"] is True
    assert "lost" in answer["error"]["evalue"]
    # Same kernel id (restarted in place), fresh interpreter.
    after = gateway.execute("stubborn", "'kept' in globals()")
    assert after["status"] == "ok" and after["result"]["text/plain"] == "False"
    assert gateway.request("GET", "/agent/v1/sessions/stubborn").json()["kernel_id"] == session["kernel_id"]


def test_session_limit_reaches_the_kernel(gateway):
    gateway.create_session("short", limits={"timeout_s": 2})
    started = time.monotonic()
    answer = gateway.execute("short", "import time\ntime.sleep(120)")
    assert answer["status"] == "timeout", answer
    assert time.monotonic() - started < 60
    too_long = gateway.request("POST", "/agent/v1/sessions/short/execute", json={"code": "1", "timeout_s": 5})
    assert too_long.status_code == 400 and "timeout_s" in too_long.json()["message"]


def test_20_mb_output_is_capped_and_saved_in_the_workspace(gateway):
    gateway.create_session("big", limits={"output_bytes": 32 * 1024 * 1024})
    answer = gateway.execute("big", "print('x' * 20_000_000)\nprint('THE END')")
    assert answer["status"] == "ok", {k: v for k, v in answer.items() if k != "stdout"}
    assert answer["truncated"] is True
    assert len(answer["stdout"]) < 100_000
    assert answer["stdout"].startswith("xxxx") and answer["stdout"].rstrip().endswith("THE END")
    assert "bytes omitted" in answer["stdout"]
    saved = answer["saved"]["stdout"]
    assert saved in answer["stdout"]
    full = gateway.request("GET", f"/agent/v1/sessions/big/files/{saved}")
    assert full.status_code == 200
    assert len(full.content) == 20_000_000 + 1 + len("THE END\n")
    assert full.content.startswith(b"x" * 1000) and full.content.endswith(b"THE END\n")
    # The code sees the same file in its cwd.
    seen = gateway.execute("big", f"import os\nos.path.getsize({saved!r})")
    assert seen["result"]["text/plain"] == str(len(full.content))
    listed = {f["path"]: f["size"] for f in gateway.request("GET", "/agent/v1/sessions/big/files").json()["files"]}
    assert listed[saved] == len(full.content)


def raw_request(gateway, method, path, body=b""):
    """Sends the path exactly as given (no client-side normalisation of '..')."""
    connection = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=60)
    try:
        connection.putrequest(method, path, skip_accept_encoding=True)
        connection.putheader("Authorization", f"token {gateway.token}")
        connection.putheader("Content-Length", str(len(body)))
        connection.endheaders(body)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def test_hostile_file_names_are_refused(gateway):
    gateway.create_session("hostile")
    base = "/agent/v1/sessions/hostile/files"
    for path in (f"{base}/../x", f"{base}/a/../../x", f"{base}/%2E%2E/x", f"{base}/%2Fetc%2Fpasswd",
                 f"{base}/a%2F..%2F..%2Fx"):
        status, body = raw_request(gateway, "PUT", path, b"owned")
        assert status == 400, (path, status, body)
        assert json.loads(body)["reason"] == "bad_path"
    status, body = raw_request(gateway, "GET", f"{base}/../../../../etc/passwd")
    assert status == 400 and b"root:" not in body
    # Symlinks planted by the code are never followed, for reading or writing.
    marker = f"/tmp/cellblock-agent-escape-{uuid.uuid4().hex}"
    planted = gateway.execute("hostile", "import os\nos.symlink('/etc/passwd', 'passwd')\n"
                                         f"os.symlink('/tmp', 'tmpdir')\nos.symlink({marker!r}, 'dangling')")
    assert planted["status"] == "ok", planted
    read = gateway.request("GET", f"{base}/passwd")
    assert read.status_code == 400 and "root:" not in read.text
    assert read.json()["reason"] == "bad_path"
    write_through_dir = gateway.request("PUT", f"{base}/tmpdir/{marker.rsplit('/', 1)[1]}", data=b"owned")
    assert write_through_dir.status_code == 400
    write_dangling = gateway.request("PUT", f"{base}/dangling", data=b"owned")
    assert write_dangling.status_code in (201, 400)  # replacing the link itself is fine; following it is not
    import os
    assert not os.path.exists(marker), "a write followed a planted symlink out of the workspace"
    listed = [f["path"] for f in gateway.request("GET", base).json()["files"]]
    assert "passwd" not in listed and "tmpdir" not in listed
    missing = gateway.request("GET", f"{base}/no/such/file.csv")
    assert missing.status_code == 404 and missing.json()["reason"] == "file_not_found"


def test_delete_file(gateway):
    gateway.create_session("deletes")
    base = "/agent/v1/sessions/deletes/files"
    assert gateway.request("PUT", f"{base}/notes.txt", data=b"hello").status_code == 201
    assert gateway.request("GET", f"{base}/notes.txt").content == b"hello"
    assert gateway.execute("deletes", "open('notes.txt').read()")["result"]["text/plain"] == "'hello'"
    assert gateway.request("DELETE", f"{base}/notes.txt").status_code == 204
    assert gateway.request("GET", f"{base}/notes.txt").status_code == 404


def outputs_text(cell):
    """(kind, text) per output; consecutive pieces of one stream are joined, as frontends display them (the
    kernel may publish one print in several stream messages, depending on timing)."""
    pieces = []
    for output in cell["outputs"]:
        if output["output_type"] == "stream":
            if pieces and pieces[-1][0] == output["name"]:
                pieces[-1] = (output["name"], pieces[-1][1] + output["text"])
            else:
                pieces.append((output["name"], output["text"]))
        elif output["output_type"] in ("execute_result", "display_data"):
            pieces.append((output["output_type"], output["data"].get("text/plain")))
        elif output["output_type"] == "error":
            pieces.append(("error", output["ename"]))
    return pieces


def test_notebook_export_validates_and_reexecutes_to_the_same_results(gateway, tmp_path):
    gateway.create_session("notebook")
    assert gateway.request("PUT", "/agent/v1/sessions/notebook/files/data/sales.csv",
                           data=SALES_CSV.encode()).status_code == 201
    cells = ["totals = {'apple': 7, 'pear': 5}\nprint(sorted(totals))",
             "sum(totals.values())",
             "for name in sorted(totals):\n    print(name, totals[name])\ntotals['apple'] * 6",
             "import sys\nprint('to stderr', file=sys.stderr)\nlen(totals)"]
    for code in cells:
        assert gateway.execute("notebook", code)["status"] == "ok"
    failed = gateway.execute("notebook", "undefined_name")
    assert failed["status"] == "error"
    response = gateway.request("GET", "/agent/v1/sessions/notebook/notebook")
    assert response.status_code == 200
    exported = nbformat.reads(response.text, as_version=4)
    nbformat.validate(exported)
    assert exported.metadata.kernelspec.name == "cellblock-python"
    assert [cell.source for cell in exported.cells] == cells + ["undefined_name"]
    counts = [cell.execution_count for cell in exported.cells]
    assert counts == sorted(counts) and all(isinstance(c, int) for c in counts)

    # Without the failed cell, nbclient re-runs it on the cellblock kernel to the same outputs.
    clean = nbformat.reads(gateway.request("GET", "/agent/v1/sessions/notebook/notebook?errors=skip").text, as_version=4)
    nbformat.validate(clean)
    assert len(clean.cells) == len(cells)
    expected = [outputs_text(cell) for cell in clean.cells]
    assert expected[1] == [("execute_result", "12")] and expected[2][-1] == ("execute_result", "42")
    rerun = nbformat.reads(nbformat.writes(clean), as_version=4)
    nbclient.NotebookClient(rerun, kernel_name="cellblock-python", timeout=120,
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    assert [outputs_text(cell) for cell in rerun.cells] == expected


def stream_execute(gateway, session, code, **extra):
    response = gateway.request("POST", f"/agent/v1/sessions/{session}/execute", json={"code": code, **extra},
                               headers={"Accept": "application/x-ndjson"}, stream=True)
    assert response.status_code == 200, response.text
    assert response.headers["Content-Type"] == "application/x-ndjson"
    return response


def test_streaming_ndjson_events_arrive_in_order_with_keepalives(gateway):
    gateway.create_session("stream")
    # The cell cannot end until the test opens the gate, and the test opens it only after "first" and a keepalive
    # arrived: both were streamed while the code ran, whatever the machine's speed.
    response = stream_execute(gateway, "stream",
                              "import os, sys, time\nprint('first', flush=True)\n"
                              "while not os.path.exists('gate'):\n    time.sleep(0.05)\n"
                              "print('oops', file=sys.stderr, flush=True)\n"
                              "from IPython.display import display\ndisplay('shown')\n'done'")
    events = []
    for line in response.iter_lines():
        event = json.loads(line)
        events.append(event)
        types = [e["type"] for e in events]
        if event["type"] == "keepalive" and "stdout" in types and "gate" not in types:
            put = gateway.request("PUT", "/agent/v1/sessions/stream/files/gate", data=b"open")
            assert put.status_code in (200, 201, 204), put.text
            events.append({"type": "gate"})
    types = [event["type"] for event in events]
    assert types[0] == "start" and types[-1] == "end"
    assert "gate" in types, "no keepalive after the first output while the cell waited"
    assert types.index("stdout") < types.index("gate"), types
    meaningful = [t for t in types if t not in ("keepalive", "gate")]
    # One print may arrive as several stream events (the kernel batches by time); their order is what matters.
    collapsed = [t for i, t in enumerate(meaningful) if i == 0 or t != meaningful[i - 1]]
    assert collapsed == ["start", "stdout", "stderr", "display", "result", "end"], types
    end = events[-1]
    assert end["status"] == "ok" and end["stdout"] == "first\n" and end["stderr"] == "oops\n"
    assert end["result"]["text/plain"] == "'done'"

    errors = [json.loads(line)["type"] for line in stream_execute(gateway, "stream", "1/0").iter_lines()]
    assert [t for t in errors if t != "keepalive"] == ["start", "error", "end"]


def test_client_disconnect_interrupts_the_execution(gateway):
    gateway.create_session("dropped")
    code = "import time\nfor step in range(1200):\n    time.sleep(0.1)\n    print(step, flush=True)"
    response = stream_execute(gateway, "dropped", code)
    types = (json.loads(line)["type"] for line in response.iter_lines())
    assert next(types) == "start"
    assert next(t for t in types if t != "keepalive") == "stdout"  # the loop is running
    response.close()  # the client goes away mid-run
    started = time.monotonic()
    answer = gateway.execute("dropped", "'still here'")
    assert answer["status"] == "ok" and answer["result"]["text/plain"] == "'still here'"
    assert time.monotonic() - started < 60, "the abandoned loop (120 s) was not interrupted"
    audit = gateway.request("GET", "/agent/v1/sessions/dropped/audit").json()["entries"]
    abandoned = [e for e in audit if e.get("event") == "execute" and e["code"] == code]
    assert abandoned and abandoned[0]["status"] == "error"
    assert abandoned[0]["outputs"]["error"]["ename"] == "KeyboardInterrupt"


def test_unknown_sessions_and_bad_requests_get_clear_json_errors(gateway):
    def check(response, status, reason):
        assert response.status_code == status, response.text
        body = response.json()
        assert body["reason"] == reason and body["message"], body
        return body

    check(gateway.request("GET", "/agent/v1/sessions/no-such-session"), 404, "unknown_session")
    check(gateway.request("POST", "/agent/v1/sessions/no-such-session/execute", json={"code": "1"}), 404,
          "unknown_session")
    check(gateway.request("GET", "/agent/v1/sessions/no-such-session/files"), 404, "unknown_session")
    gateway.create_session("strict")
    url = "/agent/v1/sessions/strict/execute"
    check(gateway.request("POST", url, data=b"{not json"), 400, "bad_json")
    check(gateway.request("POST", url, json={}), 400, "missing_code")
    check(gateway.request("POST", url, json={"code": 42}), 400, "bad_type")
    check(gateway.request("POST", url, json={"code": "1", "timeout_s": "soon"}), 400, "bad_type")
    body = check(gateway.request("POST", "/agent/v1/sessions", json={"limits": {"memory_mb": 10**9}}), 400, "bad_limit")
    assert "memory_mb" in body["message"] and body["limit"] == "limits.memory_mb"
    check(gateway.request("POST", "/agent/v1/sessions", json={"limits": {"cpu": 4}}), 400, "bad_limit")
    check(gateway.request("POST", "/agent/v1/sessions", json={"name": "strict"}), 409, "name_taken")
    check(gateway.request("POST", "/agent/v1/sessions", json={"name": "../bad"}), 400, "bad_name")
    unauthenticated = gateway.request("GET", "/agent/v1/sessions", headers={"Authorization": ""})
    assert unauthenticated.status_code == 401
    gateway.assert_alive()


def test_list_and_delete_sessions(gateway):
    created = gateway.create_session("short-lived")
    listed = gateway.request("GET", "/agent/v1/sessions").json()["sessions"]
    assert created["id"] in [s["id"] for s in listed]
    by_id = gateway.request("GET", f"/agent/v1/sessions/{created['id']}").json()
    assert by_id["name"] == "short-lived"
    assert gateway.request("DELETE", "/agent/v1/sessions/short-lived").status_code == 204
    assert gateway.request("GET", f"/agent/v1/sessions/{created['id']}").status_code == 404
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        kernels = [k["id"] for k in gateway.request("GET", "/api/kernels").json()]
        if created["kernel_id"] not in kernels:
            break
        time.sleep(0.2)
    assert created["kernel_id"] not in kernels, "the session's kernel was not shut down"


def test_notebook_attached_to_the_session_kernel_sees_the_agent_execute(gateway):
    session = gateway.create_session("watched")
    ws = websocket.create_connection(
        f"ws://127.0.0.1:{gateway.port}/api/kernels/{session['kernel_id']}/channels?session_id=human-{uuid.uuid4().hex}",
        header=[f"Authorization: token {gateway.token}"], timeout=60)
    try:
        code = f"watched_value = {uuid.uuid4().int % 1000}\nprint('agent was here')"
        gateway.execute("watched", code)
        seen = {}
        streamed = ""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not ("execute_input" in seen and streamed == "agent was here\n"):
            message = json.loads(ws.recv())
            if message.get("channel") == "iopub":
                seen.setdefault(message["msg_type"], message["content"])
                if message["msg_type"] == "stream":
                    streamed += message["content"]["text"]  # the kernel may split a print into pieces
        assert seen["execute_input"]["code"] == code
        assert streamed == "agent was here\n"
    finally:
        ws.close()


def test_audit_trail_records_executes_with_digests(gateway):
    gateway.create_session("audited")
    gateway.execute("audited", "print('audit me')")
    entries = gateway.request("GET", "/agent/v1/sessions/audited/audit").json()["entries"]
    execute = [e for e in entries if e["event"] == "execute"][-1]
    assert execute["code"] == "print('audit me')" and execute["status"] == "ok"
    assert execute["client"] == "127.0.0.1" and execute["duration_ms"] > 0
    import hashlib
    assert execute["outputs"]["stdout"]["sha256"] == hashlib.sha256(b"audit me\n").hexdigest()
    assert execute["limits"]["timeout_s"] > 0
    assert execute["runtime"]["gateway"] and execute["runtime"]["python"].startswith("3.")
    assert entries[0]["event"] == "session_created"
    raw = gateway.request("GET", "/agent/v1/sessions/audited/audit", headers={"Accept": "application/x-ndjson"})
    assert [json.loads(line)["event"] for line in raw.text.splitlines()] == [e["event"] for e in entries]


def test_concurrent_executes_on_one_session_run_one_at_a_time(gateway):
    from concurrent.futures import ThreadPoolExecutor
    import requests
    gateway.create_session("queued")
    gateway.execute("queued", "import time\nlog = []")

    def run(index):
        with requests.Session() as http:
            response = http.post(f"{gateway.url}/agent/v1/sessions/queued/execute", timeout=120,
                                 headers={"Authorization": f"token {gateway.token}"},
                                 json={"code": f"log.append(('start', {index}))\ntime.sleep(0.2)\n"
                                               f"log.append(('end', {index}))\n{index}"})
            return response.json()

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(run, range(4)))
    assert [a["result"]["text/plain"] for a in answers] == ["0", "1", "2", "3"]
    assert len({a["execution_count"] for a in answers}) == 4
    log = eval(gateway.execute("queued", "log")["result"]["text/plain"])
    for position in range(0, len(log), 2):  # never interleaved: each start is followed by its own end
        assert log[position][0] == "start" and log[position + 1] == ("end", log[position][1])


def test_kernel_deleted_through_the_kg_api_is_replaced_and_the_answer_says_so(gateway):
    session = gateway.create_session("replaced")
    gateway.execute("replaced", "value = 1")
    assert gateway.request("DELETE", f"/api/kernels/{session['kernel_id']}").status_code == 204
    answer = gateway.execute("replaced", "'value' in globals()")
    assert answer["status"] == "ok" and answer["result"]["text/plain"] == "False"
    assert answer["state_lost"] is True and "new kernel" in answer["notice"]
    now = gateway.request("GET", "/agent/v1/sessions/replaced").json()
    assert now["kernel_id"] and now["kernel_id"] != session["kernel_id"]
    assert gateway.execute("replaced", "1 + 1")["state_lost"] is False
