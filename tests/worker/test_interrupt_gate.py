"""The worker's SIGINT gate (cellblock_runtime/interrupts.py) around one frame read or write, in a fresh Python with a
real SIGINT sent to itself: an interrupt that arrives mid-frame is never acted on inside the frame, and once the
frame is complete it does what it would have done had it arrived then. The races of real requests are in
test_process.py; these pin each case down.
"""
import json
import os
import subprocess
import sys
import textwrap

from conftest import worker_script

SCRIPT = textwrap.dedent(r"""
    import json, os, signal, sys
    sys.path.insert(0, sys.argv[1])
    from cellblock_runtime.interrupts import InterruptGate

    def sigint_now():
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(100):  # CPython runs a Python-level handler at its next check
            pass

    def blocked():
        return signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])

    def run_request_code(label):  # the next request's code: it runs, or a kept interrupt stops it at once
        try:
            with gate.interruptible():
                return [label]
        except KeyboardInterrupt:
            return ["KeyboardInterrupt"]

    gate = InterruptGate()
    gate.ignore_interrupts()
    result = {}

    # In user code: raised when the frame is complete, not inside it.
    steps = []
    try:
        with gate.interruptible():
            with gate.frame_io():
                sigint_now()
                steps.append("rest of the frame")
            steps.append("after the frame")
    except KeyboardInterrupt:
        steps.append("KeyboardInterrupt")
    result["user_code"] = steps

    # Outside user code, while a request is in hand (its frame just read): kept, and raised as its code starts.
    gate.frame_taken()
    with gate.frame_io():
        sigint_now()
    result["request_in_hand"] = run_request_code("request's code ran")
    gate.request_finished()

    # Outside user code with nothing in hand or waiting: a late interrupt, dropped.
    with gate.frame_io():
        sigint_now()
    result["late"] = run_request_code("next request's code ran")

    # Under a handler the user installed: it does not run mid-frame; it runs once the frame is complete.
    calls = []
    with gate.interruptible():
        signal.signal(signal.SIGINT, lambda signum, frame: calls.append("user handler"))
        with gate.frame_io():
            result["blocked_in_frame_with_user_handler"] = blocked()
            sigint_now()
            calls.append("rest of the frame")
        calls.append("after the frame")
    result["user_handler"] = calls
    result["blocked_after"] = blocked()
    print(json.dumps(result))
""")


def test_an_interrupt_mid_frame_waits_for_the_frame_then_does_what_it_would_have_done():
    worker_dir = str(worker_script().parent)
    completed = subprocess.run([sys.executable, "-c", SCRIPT, worker_dir], capture_output=True, text=True,
                               timeout=60, env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"))
    assert completed.returncode == 0, completed.stderr
    result = json.loads(completed.stdout)
    assert result["user_code"] == ["rest of the frame", "KeyboardInterrupt"]
    assert result["request_in_hand"] == ["KeyboardInterrupt"]
    assert result["late"] == ["next request's code ran"]
    assert result["blocked_in_frame_with_user_handler"] is True
    assert result["user_handler"] == ["rest of the frame", "user handler", "after the frame"]
    assert result["blocked_after"] is False
