"""What happened to an execute, said once by the kernel in execute_reply metadata
({"cellblock": {"outcome", "state_lost", "output_truncated"}}), per-execute limits a client asks for in the
request's metadata, and interrupts: escalation when the code swallows them, and interrupts that arrive before
the code started. All through jupyter_client against the installed kernel."""
import queue
import time

import pytest

BOUND_S = 60  # generous (loaded 2-core machine); every case below would otherwise take 600 s
SWALLOWING_CELL = ("import time\nprint('swallowing', flush=True)\n"
                   "while True:\n try: time.sleep(100)\n except KeyboardInterrupt: pass")


def outcome(run):
    return run.outcome


def execute_with_metadata(kernel, code, metadata, timeout=BOUND_S):
    kc = kernel.client
    message = kc.session.msg("execute_request", {"code": code, "silent": False, "store_history": True,
                                                 "user_expressions": {}, "allow_stdin": False,
                                                 "stop_on_error": True}, metadata=metadata)
    kc.shell_channel.send(message)
    return kernel.collect(message["header"]["msg_id"], timeout=timeout)


def interrupt(kernel):
    kc = kernel.client
    kc.control_channel.send(kc.session.msg("interrupt_request", {}))
    assert kc.get_control_msg(timeout=10)["msg_type"] == "interrupt_reply"


def test_every_execute_reply_says_what_happened(kernel):
    ok = kernel.execute("6 * 7")
    assert outcome(ok) == {"outcome": "ok", "state_lost": False, "output_truncated": False}
    failed = kernel.execute("1 / 0")
    assert failed.content["ename"] == "ZeroDivisionError"
    assert outcome(failed) == {"outcome": "error", "state_lost": False, "output_truncated": False}
    silent = kernel.execute("1 / 0", silent=True)
    assert outcome(silent)["outcome"] == "error"
    # The code's own TimeoutError (a socket timeout) is an error of the code, not the time limit.
    own = kernel.execute("raise TimeoutError('socket')")
    assert own.content["ename"] == "TimeoutError"
    assert outcome(own)["outcome"] == "error"
    # The outcome lives in the metadata only; the content is the protocol's.
    assert "cellblock" not in ok.content and "cellblock" not in failed.content


def test_a_client_can_ask_for_a_shorter_time_limit(kernel):
    kernel.execute("kept = 5")
    started = time.monotonic()
    run = execute_with_metadata(kernel, "import time\ntime.sleep(600)", {"cellblock": {"timeout_s": 1}})
    assert time.monotonic() - started < BOUND_S
    assert run.content["ename"] == "TimeoutError"
    assert outcome(run) == {"outcome": "time_limit", "state_lost": False, "output_truncated": False}
    assert kernel.execute("kept").of_type("execute_result")[0]["content"]["data"]["text/plain"] == "5"


def test_a_client_can_ask_for_a_larger_output_limit(kernel):
    run = execute_with_metadata(kernel, "print('y' * 3_000_000)", {"cellblock": {"output_bytes": 8 << 20}})
    assert run.stream_text("stdout") == "y" * 3_000_000 + "\n"
    assert outcome(run)["outcome"] == "ok"


def busy(kernel, msg_id):
    """Waits for msg_id's busy status (the kernel took the request), keeping every message for collect()."""
    deadline = time.monotonic() + BOUND_S
    while True:
        assert time.monotonic() < deadline, "no busy status"
        try:
            message = kernel.client.get_iopub_msg(timeout=1)
        except queue.Empty:
            continue
        kernel._iopub_stash.setdefault(message["parent_header"].get("msg_id"), []).append(message)
        if message["msg_type"] == "status" and message["parent_header"].get("msg_id") == msg_id:
            return


def test_interrupt_that_arrives_before_the_code_starts_is_not_lost(fresh_kernel):
    # A fresh kernel, or one whose worker just died, answers at once while its worker starts: an interrupt
    # sent as soon as the execute is busy reaches the kernel before the worker runs the code (the window in
    # which it used to be dropped, leaving a 600 s sleep). Whenever it lands, it must interrupt this execute.
    kernel = fresh_kernel()
    for round in range(3):
        msg_id = kernel.client.execute("import time\nprint('started', flush=True)\ntime.sleep(600)")
        busy(kernel, msg_id)
        interrupt(kernel)
        run = kernel.collect(msg_id, timeout=BOUND_S)
        assert run.content["ename"] == "KeyboardInterrupt", run.content
        assert outcome(run)["outcome"] == "interrupted"
        assert kernel.execute("6 * 7").of_type("execute_result")[0]["content"]["data"]["text/plain"] == "42"
        kernel.execute("import os; os._exit(0)")  # the next round waits for a new worker again


def test_swallowed_interrupt_escalates_to_a_killed_worker(fresh_kernel):
    kernel = fresh_kernel(CELLBLOCK_INTERRUPT_GRACE_S=2)
    kernel.execute("kept = 1")
    kc = kernel.client
    msg_id = kc.execute(SWALLOWING_CELL)
    kernel.wait_for_stdout(msg_id, "swallowing")
    interrupted_at = time.monotonic()
    for _ in range(3):  # as an impatient user would
        interrupt(kernel)
        time.sleep(0.3)
    run = kernel.collect(msg_id, timeout=BOUND_S)
    waited = time.monotonic() - interrupted_at
    assert 1.5 <= waited < BOUND_S, waited  # the grace period was given, then the worker was killed
    assert run.content["status"] == "error" and run.content["ename"] == "KeyboardInterrupt", run.content
    assert "killed" in run.content["evalue"]
    assert outcome(run) == {"outcome": "interrupted", "state_lost": True, "output_truncated": False}
    started = time.monotonic()
    answer = kernel.execute("6 * 7", timeout=BOUND_S)
    assert answer.of_type("execute_result")[0]["content"]["data"]["text/plain"] == "42"
    assert time.monotonic() - started < BOUND_S
    # A fresh worker: the state is gone, and the reply says so.
    assert kernel.execute("'kept' in globals()").of_type("execute_result")[0]["content"]["data"][
        "text/plain"] == "False"


@pytest.mark.parametrize("bad_field", ["data", "metadata", "transient"])
def test_wrongly_typed_worker_frame_ends_the_worker_not_the_limit(fresh_kernel, bad_field):
    # User code can write to the channel fd (3). A display frame whose field has the wrong type is a protocol
    # error: the kernel kills the worker at once (PROTOCOL.md) instead of failing the request and leaving the
    # code running until its time limit.
    kernel = fresh_kernel(CELLBLOCK_TIMEOUT_S=600)
    frame = {"type": "display_data", "data": {"text/plain": "x"}, "metadata": {}, "transient": {}}
    frame[bad_field] = "not an object"
    code = ("import json, os, struct, time\n"
            f"payload = json.dumps({frame!r}).encode()\n"
            "os.write(3, struct.pack('>I', len(payload)) + payload)\n"
            "time.sleep(600)")
    started = time.monotonic()
    run = kernel.execute(code, timeout=BOUND_S)
    assert time.monotonic() - started < BOUND_S
    assert run.content["ename"] == "WorkerDied", run.content
    assert "protocol error" in run.content["evalue"]
    assert outcome(run) == {"outcome": "worker_died", "state_lost": True, "output_truncated": False}
    assert kernel.execute("6 * 7").of_type("execute_result")[0]["content"]["data"]["text/plain"] == "42"


@pytest.mark.parametrize("body", [b"", b"\x01", b"\x03text"], ids=["empty", "stream-without-text", "unknown-channel"])
def test_malformed_stream_frame_ends_the_worker_and_the_kernel_keeps_serving(fresh_kernel, body):
    # Python-level output travels as stream frames (a channel byte, then text); user code can forge one on fd 3.
    kernel = fresh_kernel(CELLBLOCK_TIMEOUT_S=600)
    code = ("import os, struct, time\n"
            "print('before', flush=True)\n"
            f"body = {body!r}\n"
            "os.write(3, struct.pack('>I', len(body)) + body)\n"
            "time.sleep(600)")
    started = time.monotonic()
    run = kernel.execute(code, timeout=BOUND_S)
    assert time.monotonic() - started < BOUND_S
    assert run.content["ename"] == "WorkerDied", run.content
    assert "protocol error" in run.content["evalue"]
    assert outcome(run)["outcome"] == "worker_died"
    assert kernel.execute("print('next')").stream_text("stdout") == "next\n"
