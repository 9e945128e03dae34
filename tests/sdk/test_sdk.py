"""The Python SDK (clients/python, package `cellblock`) against a real gateway: what a user of the SDK notices."""
import asyncio
import logging
import os
import struct
import subprocess
import sys
import threading
import time
import uuid
import zlib
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().parents[2]


def tiny_png() -> bytes:
    """A valid 1×1 PNG, so the test knows the exact bytes the SDK must hand back."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\x00\xff\x00\x00")) + chunk(b"IEND", b""))


def test_package_installs_typed(cellblock, sdk_target):
    assert (sdk_target / "cellblock" / "py.typed").is_file()
    assert {"Gateway", "AsyncGateway", "Execution", "MimeBundle"} <= set(cellblock.__all__)
    assert issubclass(cellblock.errors.SessionNotFound, cellblock.errors.CellblockError)


def test_state_is_kept_between_runs_and_outputs_have_accessors(gw):
    with gw.session() as session:
        assert session.run("numbers = [1, 2, 3]").status == "ok"
        execution = session.run("import sys\nprint('to stdout')\nprint('to stderr', file=sys.stderr)\n"
                                "sum(numbers)")
        assert execution.status == "ok" and execution.ok
        assert execution.stdout == "to stdout\n"
        assert execution.stderr == "to stderr\n"
        assert execution.result is not None and execution.result.text == "6"
        assert execution.error is None and not execution.state_lost and not execution.truncated
        assert execution.saved == {}

        png = tiny_png()
        shown = session.run("from IPython.display import HTML, Image, display\n"
                            f"display(Image(data={png!r}))\n"
                            "display(HTML('<b>bold</b>'))")
        assert [bool(d.png) for d in shown.displays] == [True, False]
        assert shown.displays[0].png == png
        assert shown.displays[1].html == "<b>bold</b>"
        assert shown.result is None

        failed = session.run("def ratio(a, b):\n    return a / b\nratio(numbers[0], 0)")
        assert failed.status == "error" and not failed.ok
        assert failed.error is not None
        assert (failed.error.ename, failed.error.evalue) == ("ZeroDivisionError", "division by zero")
        assert "ratio" in failed.error.traceback
        assert session.run("numbers[-1]").result.text == "3"


def test_streaming_callbacks_are_called_while_the_code_runs(gw):
    """Each output is followed by a wait (bounded) for a file that only its callback writes: the cell reports
    'opened' only if every callback ran before the execute finished."""
    with gw.session() as session:
        seen = []

        def gate(name):
            def callback(value):
                seen.append((name, value))
                session.files.write(name, b"open")
            return callback

        code = ("import os, sys, time\n"
                "from IPython.display import display, HTML\n"
                "opened = []\n"
                "def wait(name):\n"
                "    if not all(opened):\n"
                "        return False\n"
                "    deadline = time.monotonic() + 30\n"
                "    while not os.path.exists(name) and time.monotonic() < deadline:\n"
                "        time.sleep(0.02)\n"
                "    return os.path.exists(name)\n"
                "print('first', flush=True)\n"
                "opened.append(wait('out'))\n"
                "print('oops', file=sys.stderr, flush=True)\n"
                "opened.append(wait('err'))\n"
                "display(HTML('<i>shown</i>'))\n"
                "opened.append(wait('disp'))\n"
                "'opened' if all(opened) else f'closed {opened}'")
        execution = session.run(code, on_stdout=gate("out"), on_stderr=gate("err"),
                                on_display=lambda bundle: gate("disp")(bundle.html))
        assert execution.result.text == "'opened'", execution
        assert [name for name, _ in seen] == ["out", "err", "disp"]
        assert seen[0][1] == "first\n" and seen[1][1] == "oops\n" and seen[2][1] == "<i>shown</i>"


def test_files_round_trip(gw, cellblock):
    with gw.session() as session:
        data = bytes(range(256))
        assert session.files.write("data/blob.bin", data) == 256
        session.files.write("notes.txt", "héllo")
        listed = {f.path: f.size for f in session.files.list()}
        assert listed["data/blob.bin"] == 256 and listed["notes.txt"] == len("héllo".encode())
        assert session.files.read("data/blob.bin") == data
        assert session.run("open('notes.txt', encoding='utf-8').read()").result.text == "'héllo'"
        session.run("open('made.txt', 'w').write('by code')")
        assert session.files.read_text("made.txt") == "by code"
        session.files.delete("notes.txt")
        with pytest.raises(cellblock.errors.FileNotFound) as raised:
            session.files.read("notes.txt")
        assert raised.value.reason == "file_not_found" and raised.value.status == 404
        with pytest.raises(cellblock.errors.BadPath):
            session.files.write("../escape.txt", b"x")


def test_notebook_and_audit_have_the_cells(gw):
    with gw.session() as session:
        session.run("a = 20")
        session.run("a + 22")
        notebook = session.notebook()
        assert notebook["nbformat"] == 4
        cells = [cell for cell in notebook["cells"] if cell["cell_type"] == "code"]
        sources = ["".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"] for cell in cells]
        assert sources == ["a = 20", "a + 22"]
        assert cells[1]["outputs"][0]["data"]["text/plain"] == "42"
        executes = session.audit(event="execute")
        assert [entry["code"] for entry in executes] == ["a = 20", "a + 22"]


def test_unknown_session_raises_session_not_found(gw, cellblock):
    for missing in (str(uuid.uuid4()), "no-such-session"):
        with pytest.raises(cellblock.SessionNotFound) as raised:
            gw.attach(missing)
        assert raised.value.reason == "unknown_session" and raised.value.status == 404


def test_context_manager_deletes_the_session_unless_keep(gw, cellblock):
    with gw.session(name=f"gone-{uuid.uuid4().hex[:8]}") as session:
        session.run("x = 1")
        session_id = session.id
    with pytest.raises(cellblock.SessionNotFound):
        gw.attach(session_id)

    with gw.session(name=f"kept-{uuid.uuid4().hex[:8]}", keep=True) as session:
        session.run("x = 41")
    again = gw.attach(session.name)
    assert again.id == session.id
    assert again.run("x + 1").result.text == "42"
    again.delete()
    with pytest.raises(cellblock.SessionNotFound):
        gw.attach(session.id)


def test_gateway_errors_become_exceptions_by_reason(gw, cellblock, gateway_process):
    with pytest.raises(cellblock.NetworkNotAllowed) as raised:
        gw.session(network=["example.com"])
    assert raised.value.reason == "network_not_allowed"
    with pytest.raises(cellblock.errors.BadLimit):
        gw.session(limits={"timeout_s": 10 ** 9})
    with gw.session(limits={"timeout_s": 30}) as session:
        with pytest.raises(cellblock.errors.BadLimit):
            session.run("1", timeout=31)
        with pytest.raises(cellblock.errors.NameTaken):
            gw.session(name=session.name)
    with cellblock.Gateway(gateway_process.url, "wrong-token") as intruder:
        with pytest.raises(cellblock.errors.Unauthorized):
            intruder.sessions()


def test_interrupt_and_reset(gw):
    with gw.session() as session:
        session.run("kept = 1")
        started = threading.Event()
        outcome = {}

        def long_run():
            outcome["execution"] = session.run("import time\nprint('running', flush=True)\ntime.sleep(600)",
                                               on_stdout=lambda text: started.set())

        runner = threading.Thread(target=long_run)
        runner.start()
        assert started.wait(120)
        session.interrupt()
        runner.join(60)
        assert not runner.is_alive()
        assert outcome["execution"].error.ename == "KeyboardInterrupt"
        assert session.run("kept").result.text == "1"
        session.reset()
        after = session.run("kept")
        assert after.error is not None and after.error.ename == "NameError"


def test_execute_is_never_retried_but_reads_are(cellblock, gateway_process, gw, proxy):
    with gw.session() as direct:
        through = cellblock.Gateway(proxy.url, gateway_process.token, retries=3, retry_backoff=0.01)
        session = through.attach(direct.id)
        proxy.drop, proxy.drops_left = b"/execute", 5
        with pytest.raises(cellblock.GatewayUnavailable):
            session.run("print('side effect')")
        assert len(proxy.matching("/execute")) == 1, proxy.request_lines

        # A read that meets the same dropped connection is sent again and succeeds.
        direct.files.write("seen.txt", b"1")
        proxy.drop, proxy.drops_left = b"/files", 1
        assert [f.path for f in session.files.list()] == ["seen.txt"]
        assert len(proxy.matching("/files")) == 2, proxy.request_lines
        through.close()


def test_async_gateway(cellblock, gateway_process):
    async def scenario():
        async with cellblock.AsyncGateway(gateway_process.url, gateway_process.token) as agw:
            async with agw.session() as first:
                second = await agw.session()
                try:
                    # Both sessions run at once on one gateway object.
                    a, b = await asyncio.gather(first.run("6 * 7"), second.run("'b' * 3"))
                    assert a.result.text == "42" and b.result.text == "'bbb'"
                    await first.files.write("x.txt", "async")
                    assert await first.files.read("x.txt") == b"async"
                    pieces = []
                    streamed = await first.run("print('hi')", on_stdout=pieces.append)
                    assert pieces == ["hi\n"] and streamed.stdout == "hi\n"
                finally:
                    await second.delete()
                session_id = first.id
            with pytest.raises(cellblock.SessionNotFound):
                await agw.attach(session_id)
    asyncio.run(scenario())


def test_quickstart_example_runs(sdk_target, gateway_process):
    example = SOURCE / "clients" / "python" / "examples" / "quickstart.py"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CELLBLOCK_")}
    env.update(CELLBLOCK_URL=gateway_process.url, CELLBLOCK_TOKEN=gateway_process.token,
               PYTHONPATH=str(sdk_target))
    completed = subprocess.run([sys.executable, str(example)], env=env, capture_output=True, text=True,
                               timeout=300)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert completed.stdout.splitlines() == [
        "live: apple=7, pear=5",
        "stdout: apple=7, pear=5",
        "result: 12",
        "error: ZeroDivisionError",
        "deleted on exit",
    ], completed.stdout


def test_the_readme_shows_the_quickstart():
    readme = (SOURCE / "clients" / "python" / "README.md").read_text()
    example = (SOURCE / "clients" / "python" / "examples" / "quickstart.py").read_text()
    assert example.strip() in readme


# ------------------------------------------------------------------------------------------- network approvals

def fetch(port, path):
    """Code that fetches http://approval.test:<port><path> and prints the body, or what the failure was."""
    return ("import urllib.request, urllib.error\n"
            "try:\n"
            f"    print(urllib.request.urlopen('http://approval.test:{port}{path}', timeout=60).read().decode(),"
            " end='')\n"
            "except urllib.error.HTTPError as error:\n"
            "    print('failed', error.code, error.read().decode(), end='')\n"
            "except Exception as error:\n"
            "    print('failed', type(error).__name__, error)\n")


def test_an_approval_allowed_from_on_approval_lets_the_request_through(cellblock, asking_gateway):
    process, host = asking_gateway
    with cellblock.Gateway(process.url, process.token, timeout=60) as gw, \
            gw.session(network={"allow": [], "ask": True}) as session:
        seen, listed = [], []

        def on_approval(approval):
            seen.append(approval)
            if approval.state == "pending":
                assert host.hits == []  # held: nothing reached the server yet
                listed.extend(session.approvals.pending())
                session.approvals.decide(approval.id, "allow_once")

        execution = session.run(fetch(host.port, "/allowed"), on_approval=on_approval)
        assert execution.status == "ok" and execution.stdout == "hello from the host\n", execution
        assert host.hits == ["/allowed"]
        assert [(a.state, a.host, a.port, a.method) for a in seen] == [
            ("pending", "approval.test", host.port, "GET"), ("decided", "approval.test", host.port, "GET")]
        assert seen[1].decision == "allow_once" and seen[1].decided_by == "agent api"
        assert [a.id for a in listed] == [seen[0].id]
        [kept] = session.approvals.list()
        assert (kept.id, kept.state, kept.decision) == (seen[0].id, "decided", "allow_once")
        assert session.approvals.get(kept.id).decision == "allow_once"
        assert session.approvals.pending() == []
        # Decided already: a second decision is refused by reason.
        with pytest.raises(cellblock.errors.ApprovalDecided):
            session.approvals.decide(kept.id, "deny")


def test_an_approval_denied_from_another_thread_keeps_the_request_from_the_host(cellblock, asking_gateway):
    process, host = asking_gateway
    with cellblock.Gateway(process.url, process.token, timeout=60) as gw, \
            gw.session(network={"allow": [], "ask": True}) as session:
        decided = {}

        def deny_when_held():
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline and not decided:
                for approval in session.approvals.pending():
                    decided["approval"] = session.approvals.decide(approval.id, "deny")
                time.sleep(0.05)

        decider = threading.Thread(target=deny_when_held)
        decider.start()
        execution = session.run(fetch(host.port, "/denied"))
        decider.join(120)
        assert decided["approval"].decision == "deny" and decided["approval"].host == "approval.test"
        assert execution.status == "ok", execution
        assert execution.stdout.startswith("failed 403") and "denied by agent api" in execution.stdout, execution
        assert "/denied" not in host.hits, host.hits
        with pytest.raises(ValueError):
            session.approvals.decide(decided["approval"].id, "maybe")  # refused before any request
        with pytest.raises(cellblock.errors.ApprovalNotFound):
            session.approvals.decide("no-such-approval", "deny")


# ------------------------------------------------------------------------------------------------ tenants

def add_tenant(gateway_process, **quota):
    name = f"sdk-{uuid.uuid4().hex[:8]}"
    answer = gateway_process.request("POST", "/agent/v1/tenants", json={"name": name, "quota": quota})
    assert answer.status_code == 201, answer.text
    return name, answer.json()["token"]


def test_a_tenant_past_its_sessions_quota_gets_quota_exceeded(cellblock, gateway_process):
    name, token = add_tenant(gateway_process, sessions=1)
    with cellblock.Gateway(gateway_process.url, token) as tenant:
        with tenant.session() as first:
            with pytest.raises(cellblock.QuotaExceeded) as raised:
                tenant.session()
            assert type(raised.value) is cellblock.QuotaExceeded
            assert raised.value.reason == "quota_exceeded" and raised.value.status == 429
            assert raised.value.message == f"tenant {name} has 1 of 1 sessions", raised.value.body
            assert first.run("1 + 1").result.text == "2"  # the refusal touched nothing running
        # The deleted session gave its place back.
        with tenant.session() as again:
            assert again.run("'fits'").result.text == "'fits'"


def test_forbidden_is_its_own_class_by_reason(cellblock, gateway_process):
    _, token = add_tenant(gateway_process)
    with cellblock.Gateway(gateway_process.url, token) as tenant, tenant.session() as session:
        # A tenant without self_approve may not decide its own session's approvals.
        with pytest.raises(cellblock.errors.RoleForbidden) as raised:
            session.approvals.decide("no-such-approval", "deny")
        assert isinstance(raised.value, cellblock.errors.Forbidden)
        assert not isinstance(raised.value, cellblock.errors.Unauthorized)
        assert raised.value.reason == "role_forbidden" and raised.value.status == 403
    errors = cellblock.errors
    refused = errors.error_from_response(403, {"reason": "operator_only", "message": "only the operator"})
    assert type(refused) is errors.OperatorOnly and isinstance(refused, errors.Forbidden)
    assert type(errors.error_from_response(403, {"reason": "newer_reason", "message": "m"})) is errors.Forbidden


# -------------------------------------------------------------------------------------- timeouts, silence

def silent_gateway(cellblock, silent, **options):
    return cellblock.Gateway(silent.url, "token", timeout=1, connect_timeout=1, stream_idle_timeout=1,
                             retries=2, retry_backoff=0.01, **options)


def raises_timeout_in_time(cellblock, call, limit=1.0):
    started = time.monotonic()
    with pytest.raises(cellblock.GatewayUnavailable) as raised:
        call()
    elapsed = time.monotonic() - started
    assert raised.value.reason == "timeout" and raised.value.status is None, raised.value
    assert limit * 0.9 <= elapsed < limit + 5, elapsed
    return raised.value


def test_a_gateway_that_never_answers_raises_a_timeout_instead_of_hanging(cellblock, silent):
    with silent_gateway(cellblock, silent) as gw:
        session = cellblock.Session(gw, {"id": "s1"})
        calls = {
            "GET /agent/v1/sessions ": gw.sessions,
            "POST /agent/v1/sessions ": gw.session,
            "GET /agent/v1/sessions/s1 ": lambda: gw.attach("s1"),
            "POST /agent/v1/sessions/s1/execute ": lambda: session.run("1"),
            "GET /agent/v1/sessions/s1/files/a.txt ": lambda: session.files.read("a.txt"),
            "PUT /agent/v1/sessions/s1/files/a.txt ": lambda: session.files.write("a.txt", b"x"),
            "GET /agent/v1/sessions/s1/approvals ": session.approvals.list,
            "POST /agent/v1/sessions/s1/reset ": session.reset,
        }
        for request_line, call in calls.items():
            raises_timeout_in_time(cellblock, call)
            # Sent once: an answer that does not come in time may still have been acted on.
            assert len(silent.matching(request_line)) == 1, (request_line, silent.request_lines)

    async def asynchronously():
        async with cellblock.AsyncGateway(silent.url, "token", timeout=1, connect_timeout=1) as agw:
            await agw.sessions()
    raises_timeout_in_time(cellblock, lambda: asyncio.run(asynchronously()))


def test_an_execute_stream_that_goes_silent_raises_a_timeout(cellblock, silent):
    silent.stream_head = True
    with silent_gateway(cellblock, silent) as gw:
        pieces = []
        raises_timeout_in_time(cellblock, lambda: cellblock.Session(gw, {"id": "s1"}).run(
            "print('started')\nimport time\ntime.sleep(600)", on_stdout=pieces.append))
        assert pieces == ["started\n"]
        assert len(silent.matching("/execute")) == 1


def test_a_whole_workflow_prints_and_logs_nothing(cellblock, gateway_process, proxy, silent, capfd, caplog):
    caplog.set_level(logging.DEBUG)
    with cellblock.Gateway(proxy.url, gateway_process.token, retries=3, retry_backoff=0.01) as gw:
        with gw.session(name=f"quiet-{uuid.uuid4().hex[:8]}") as session:
            streamed = []
            execution = session.run("import sys\nprint('out')\nprint('err', file=sys.stderr)\n"
                                    "from IPython.display import HTML, display\ndisplay(HTML('<p>x</p>'))\n1 / 0",
                                    on_stdout=streamed.append, on_stderr=streamed.append,
                                    on_display=lambda bundle: streamed.append(bundle.html))
            assert execution.error.ename == "ZeroDivisionError" and streamed == ["out\n", "err\n", "<p>x</p>"]
            session.files.write("q.txt", "quiet")
            proxy.drop, proxy.drops_left = b"/files", 2  # two dropped connections, retried without a word
            assert [f.path for f in session.files.list()] == ["q.txt"]
            assert session.files.read_text("q.txt") == "quiet"
            session.notebook()
            session.audit()
            session.approvals.list()
            session.reset()
            with pytest.raises(cellblock.errors.FileNotFound):
                session.files.read("missing.txt")
            with pytest.raises(cellblock.SessionNotFound):
                gw.attach("no-such-session")
    with silent_gateway(cellblock, silent) as unanswered:
        with pytest.raises(cellblock.GatewayUnavailable):
            unanswered.sessions()
    with cellblock.Gateway("http://127.0.0.1:9", "token", retries=1, retry_backoff=0.01) as unreachable:
        with pytest.raises(cellblock.GatewayUnavailable):
            unreachable.sessions()

    async def asynchronously():
        async with cellblock.AsyncGateway(gateway_process.url, gateway_process.token) as agw:
            async with agw.session() as quiet:
                assert (await quiet.run("print('a')")).stdout == "a\n"
    asyncio.run(asynchronously())

    out, err = capfd.readouterr()
    assert (out, err) == ("", "")
    louder = [f"{record.levelname} {record.name}: {record.getMessage()}" for record in caplog.records
              if record.levelno > logging.DEBUG]
    assert louder == []
