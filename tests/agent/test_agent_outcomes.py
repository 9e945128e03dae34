"""What an agent is told happened, from the kernel's own word (execute_reply metadata), through the real agent
API: the code's own TimeoutError is an error, the call's time limit is enforced by the kernel, a swallowed
interrupt costs the worker but not the session, and a 10 MB output keeps its end inline and in the saved file."""
import time

import pytest
from conftest import AgentGateway

SAVED_OUTPUT_BYTES = 16_000_000


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    directory = tmp_path_factory.mktemp("agent-outcomes")
    server = AgentGateway(directory / "state", directory / "gateway.log", "--agent-interrupt-grace", "2",
                          "--agent-saved-output-bytes", str(SAVED_OUTPUT_BYTES))
    try:
        yield server
    finally:
        server.stop()


def metric(gateway, outcome):
    text = gateway.request("GET", "/metrics").text
    for line in text.splitlines():
        if line.startswith(f'cellblock_agent_executes_total{{outcome="{outcome}"}}'):
            return float(line.split()[-1])
    raise AssertionError(f"no agent execute counter for {outcome!r}")


def test_the_codes_own_timeout_error_is_an_error_not_a_timeout(gateway):
    gateway.create_session("socket")
    gateway.execute("socket", "kept = 1")
    errors_before, timeouts_before = metric(gateway, "error"), metric(gateway, "timeout")
    answer = gateway.execute("socket", "raise TimeoutError('socket')")
    assert answer["status"] == "error", answer
    assert answer["error"]["ename"] == "TimeoutError" and answer["error"]["evalue"] == "socket"
    assert answer["state_lost"] is False
    assert metric(gateway, "error") == errors_before + 1
    assert metric(gateway, "timeout") == timeouts_before
    # A class of the user's named like a worker failure is the code's error too.
    named = gateway.execute("socket", "class WorkerDied(Exception): pass\nraise WorkerDied('time limit')")
    assert named["status"] == "error" and named["state_lost"] is False, named
    assert gateway.execute("socket", "kept")["result"]["text/plain"] == "1"


def test_the_kernel_enforces_the_calls_time_limit(gateway):
    # The gateway's own timer is only a safety net well past limit + grace (30 s more): an answer within a few
    # seconds of the 2 s limit comes from the kernel, which got the call's limit with the request.
    gateway.create_session("limited")
    gateway.execute("limited", "kept = 41")
    started = time.monotonic()
    answer = gateway.execute("limited", "import time\ntime.sleep(120)", timeout_s=2)
    elapsed = time.monotonic() - started
    assert answer["status"] == "timeout", answer
    assert answer["error"]["ename"] == "TimeoutError" and "state is kept" in answer["error"]["evalue"]
    assert answer["state_lost"] is False
    assert elapsed < 25, elapsed
    assert gateway.execute("limited", "kept + 1")["result"]["text/plain"] == "42"


def test_a_limit_the_code_ignores_costs_the_worker_not_the_session(gateway):
    session = gateway.create_session("stubborn")
    gateway.execute("stubborn", "kept = 1")
    started = time.monotonic()
    answer = gateway.execute("stubborn", "import time\nwhile True:\n try: time.sleep(100)\n"
                                         " except KeyboardInterrupt: pass", timeout_s=1)
    assert time.monotonic() - started < 25
    assert answer["status"] == "timeout", answer
    assert answer["state_lost"] is True and "lost" in answer["error"]["evalue"]
    after = gateway.execute("stubborn", "6 * 7")
    assert after["status"] == "ok" and after["result"]["text/plain"] == "42"
    assert gateway.execute("stubborn", "'kept' in globals()")["result"]["text/plain"] == "False"
    assert gateway.request("GET", "/agent/v1/sessions/stubborn").json()["kernel_id"] == session["kernel_id"]


def test_10_mb_output_keeps_its_end_inline_and_in_the_saved_file(gateway):
    gateway.create_session("long-log")  # default limits: the kernel's own 1 MiB output limit
    answer = gateway.execute("long-log", "for i in range(100_000):\n    print('%099d' % i)\nprint('THE END')")
    assert answer["status"] == "ok", {k: v for k, v in answer.items() if k != "stdout"}
    assert answer["truncated"] is True
    assert len(answer["stdout"]) < 100_000
    assert answer["stdout"].startswith("0" * 99) and answer["stdout"].endswith("THE END\n")
    saved = answer["saved"]["stdout"]
    full = gateway.request("GET", f"/agent/v1/sessions/long-log/files/{saved}")
    assert full.status_code == 200
    assert len(full.content) == 100_000 * 100 + len("THE END\n")
    assert full.content.endswith(b"%099d\nTHE END\n" % 99_999)
    assert "notice" not in answer or "limit for saved output" not in answer["notice"]


def test_output_beyond_the_disk_limit_keeps_head_and_tail_and_says_so(gateway):
    gateway.create_session("huge")
    answer = gateway.execute("huge", "print('x' * 40_000_000)\nprint('THE END')")
    assert answer["status"] == "ok", {k: v for k, v in answer.items() if k != "stdout"}
    assert answer["stdout"].endswith("THE END\n")
    assert "limit for saved output" in answer["notice"], answer.get("notice")
    saved = answer["saved"]["stdout"]
    full = gateway.request("GET", f"/agent/v1/sessions/huge/files/{saved}").content
    assert len(full) <= SAVED_OUTPUT_BYTES + 1000
    assert full.startswith(b"x" * 1000) and full.endswith(b"x\nTHE END\n")
    assert b"bytes of this stream were left out here" in full
