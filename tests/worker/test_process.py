"""Signals, lifecycle, malformed requests and child processes."""

import os
import random
import select
import signal
import socket
import struct
import time


def _wait_for_stdout(worker, text, timeout=60):
    deadline = time.monotonic() + timeout
    while text not in "".join(event[1] for event in worker.events if event[0] == "stdout"):
        assert time.monotonic() < deadline, f"{text!r} never appeared"
        try:
            worker.next_frame(timeout=0.05)
        except TimeoutError:
            pass


def _reply_after(worker, timeout=60):
    frames = [worker.next_frame(timeout)]
    while frames[-1]["type"] != "reply":
        frames.append(worker.next_frame(timeout))
    return frames


def test_sigint_interrupts_sleep_and_keeps_state(worker):
    worker.execute("kept = 'still here'").assert_ok()
    # The sleep is far longer than the generous per-frame wait: only an interrupt can end it in time.
    worker.send({"type": "execute", "id": "sleepy", "code": "import time\nprint('sleeping', flush=True)\n"
                 "time.sleep(600)", "silent": False, "store_history": True, "user_expressions": {},
                 "allow_stdin": False})
    _wait_for_stdout(worker, "sleeping")
    worker.interrupt()
    frames = _reply_after(worker, timeout=60)
    errors = [frame for frame in frames if frame["type"] == "error"]
    assert len(errors) == 1 and errors[0]["ename"] == "KeyboardInterrupt"
    traceback = "\n".join(errors[0]["traceback"])
    assert "time.sleep(600)" in traceback and "cellblock_runtime" not in traceback, traceback
    assert frames[-1]["id"] == "sleepy"
    assert frames[-1]["content"]["ename"] == "KeyboardInterrupt"
    assert worker.execute("kept").result["data"]["text/plain"] == "'still here'"


def test_sigint_sent_with_the_request_is_not_lost(worker):
    # The kernel interrupts right after it forwarded a request, before the worker can have started the code:
    # the interrupt belongs to that request (it is not an idle worker's), so the 600 s sleep never runs out.
    worker.execute("kept = 3").assert_ok()
    for attempt in range(10):  # each one races the worker's read of the request differently
        worker.send({"type": "execute", "id": f"early-{attempt}", "code": "import time\ntime.sleep(600)",
                     "silent": False, "store_history": True, "user_expressions": {}, "allow_stdin": False})
        worker.interrupt()
        frames = _reply_after(worker, timeout=60)
        assert frames[-1]["id"] == f"early-{attempt}"
        assert frames[-1]["content"]["ename"] == "KeyboardInterrupt", frames[-1]
        worker.sync()
    assert worker.execute("kept").result["data"]["text/plain"] == "3"


def test_an_interrupt_taken_late_is_dropped_at_the_sync_not_raised_in_the_next_cell(worker):
    # The interrupt is sent while the cell is in flight (its reply not read yet), but the worker runs its
    # handler only after the next request is already waiting: here because it is stopped, in production
    # because it was descheduled. The sync the kernel sends first takes it, so the next cell runs.
    worker.execute("total = 0").assert_ok()
    for attempt in range(3):
        worker.send({"type": "execute", "id": f"done-{attempt}", "code": "total += 1", "silent": False,
                     "store_history": True, "user_expressions": {}, "allow_stdin": False})
        select.select([worker._channel], [], [], 60)  # the reply is written, not read
        os.kill(worker.process.pid, signal.SIGSTOP)
        worker.interrupt()
        assert _reply_after(worker)[-1]["content"]["status"] == "ok"
        worker.send({"type": "sync", "id": f"sync-{attempt}"})
        worker.send({"type": "execute", "id": f"next-{attempt}", "code": "total", "silent": False,
                     "store_history": True, "user_expressions": {}, "allow_stdin": False})
        os.kill(worker.process.pid, signal.SIGCONT)
        assert _reply_after(worker)[-1] == {"type": "reply", "id": f"sync-{attempt}", "content": {"status": "ok"}}
        reply = _reply_after(worker)[-1]
        assert reply["id"] == f"next-{attempt}" and reply["content"]["status"] == "ok", reply
        worker._interrupted = False  # synced by hand above
    assert worker.execute("total").result["data"]["text/plain"] == "3"


def test_sigints_at_every_moment_of_short_cells_never_kill_or_wedge_the_worker(worker):
    # Interrupts at random moments around tiny cells land everywhere: before the code, inside it, in IPython's
    # bookkeeping around it, after the reply. Each cell is answered, interrupted or not, and nothing is left
    # broken for the next one: not the worker (it died of the next interrupt while waiting for a request when
    # one had raised outside user code), not IPython (an interrupt inside its history's lock hung every
    # later cell).
    worker.execute("total = 0").assert_ok()
    rng = random.Random(11)
    outcomes = {"ok": 0, "KeyboardInterrupt": 0}
    for attempt in range(3000):
        worker.send({"type": "execute", "id": f"short-{attempt}", "code": "total += 1", "silent": False,
                     "store_history": True, "user_expressions": {}, "allow_stdin": False})
        spin_until = time.perf_counter() + rng.random() * 0.0008  # sub-millisecond: sleep() is too coarse
        while time.perf_counter() < spin_until:
            pass
        worker.interrupt()
        reply = _reply_after(worker, timeout=60)[-1]
        assert reply["id"] == f"short-{attempt}"
        content = reply["content"]
        outcomes["ok" if content["status"] == "ok" else content["ename"]] += 1
        worker.sync()
        worker.events.clear()
    assert outcomes["ok"] > 0 and outcomes["KeyboardInterrupt"] > 0, outcomes  # both sides of the race were hit
    total = int(worker.execute("total").result["data"]["text/plain"])
    # Every cell answered ok ran; one answered interrupted may have run to its end first.
    assert outcomes["ok"] <= total <= 3000, (total, outcomes)
    assert worker.execute("total * 0 + 42").result["data"]["text/plain"] == "42"


def test_code_that_runs_a_cell_itself_stays_interruptible_after_it(worker):
    # %%capture and user code call IPython's run_cell from within a cell: when that inner cell ends, the
    # outer cell is still user code.
    worker.send({"type": "execute", "id": "outer", "silent": False, "store_history": True,
                 "user_expressions": {}, "allow_stdin": False,
                 "code": "import time\n"
                         "def outer():\n"  # one statement: IPython runs each top-level one separately
                         "    get_ipython().run_cell('inner = 1')\n"
                         "    print('inner done', flush=True)\n"
                         "    time.sleep(600)\n"
                         "outer()"})
    _wait_for_stdout(worker, "inner done")
    worker.interrupt()
    frames = _reply_after(worker, timeout=60)
    assert frames[-1]["id"] == "outer"
    assert frames[-1]["content"]["ename"] == "KeyboardInterrupt", frames[-1]
    assert worker.execute("inner").result["data"]["text/plain"] == "1"


def test_sigint_while_idle_is_harmless(worker):
    worker.execute("counter = 5").assert_ok()
    for _ in range(5):
        worker.interrupt()
        time.sleep(0.05)
    time.sleep(0.2)
    assert worker.process.poll() is None
    exchange = worker.execute("counter + 1").assert_ok()
    assert exchange.result["data"]["text/plain"] == "6"
    assert exchange.frames_of("error") == []


def test_interrupts_never_corrupt_frames(worker):
    # A cell that publishes big frames as fast as it can (each needs several writes into a full socket
    # buffer), interrupted repeatedly: every frame must still parse and the worker must keep serving.
    for attempt in range(5):
        worker.send({"type": "execute", "id": f"flood-{attempt}", "silent": False, "store_history": False,
                     "user_expressions": {}, "allow_stdin": False,
                     "code": "from IPython.display import display\nprint('go', flush=True)\n"
                             "while True:\n    display('x' * 2_000_000)"})
        _wait_for_stdout(worker, "go")
        time.sleep(0.1)
        worker.interrupt()
        frames = _reply_after(worker, timeout=30)
        assert frames[-1]["content"]["ename"] == "KeyboardInterrupt"
        worker.events.clear()
    assert worker.execute("'alive'").result["data"]["text/plain"] == "'alive'"


def test_interrupts_never_corrupt_stream_frames(worker):
    # The same for Python-level output, which travels as stream frames: large prints (each more than a socket
    # buffer) and small ones from a loop, interrupted repeatedly.
    for attempt, body in enumerate(["print('x' * 2_000_000)", "print('y' * 2_000_000)", "print(1)", "print(2)"]):
        worker.send({"type": "execute", "id": f"flood-{attempt}", "silent": False, "store_history": False,
                     "user_expressions": {}, "allow_stdin": False,
                     "code": f"print('go', flush=True)\nwhile True:\n    {body}"})
        _wait_for_stdout(worker, "go")
        time.sleep(0.1)
        worker.interrupt()
        frames = _reply_after(worker, timeout=30)
        assert frames[-1]["content"]["ename"] == "KeyboardInterrupt"
        worker.events.clear()
    assert worker.execute("print('alive')").text() == "alive\n"


def test_shutdown_exits_zero(worker):
    worker.execute("1").assert_ok()
    worker.send({"type": "shutdown"})
    assert worker.process.wait(10) == 0


def test_channel_eof_exits(worker):
    worker._channel.shutdown(socket.SHUT_WR)
    assert worker.process.wait(10) == 0


def test_bad_requests_get_error_replies_and_the_worker_keeps_serving(worker):
    unknown = worker.request("frobnicate")
    assert unknown.reply["status"] == "error" and unknown.reply["ename"] == "ProtocolError"
    wrong_type = worker.request("execute", code=42)
    assert wrong_type.reply["ename"] == "RequestError" and "'code'" in wrong_type.reply["evalue"]
    bad_expressions = worker.execute("1", user_expressions={"a": 1})
    assert bad_expressions.reply["ename"] == "RequestError"
    assert worker.request("complete", code="x", cursor_pos="end").reply["ename"] == "RequestError"
    # Frames without an id cannot be answered and are ignored.
    worker.send({"type": "execute", "code": "print('never run')"})
    assert worker.execute("'fine'").result["data"]["text/plain"] == "'fine'"
    assert "never run" not in "".join(event[1] for event in worker.events if event[0] == "stdout")


def test_oversized_output_is_an_error_not_a_dead_worker(worker):
    exchange = worker.execute("from IPython.display import display\n"
                              "display({'text/plain': 'x' * (65 * 1024 * 1024)}, raw=True)", timeout=120)
    assert exchange.reply["status"] == "error"
    assert exchange.reply["ename"] == "FrameTooLarge"
    assert worker.execute("'ok'").result["data"]["text/plain"] == "'ok'"


def test_malformed_frame_ends_the_worker_cleanly(worker):
    payload = b"{not json"
    worker._channel.sendall(struct.pack(">I", len(payload)) + payload)
    assert worker.process.wait(10) == 2


def test_orphaned_zombies_are_reaped(make_worker):
    worker = make_worker(subreaper=True)  # as pid 1 of its namespace, the worker inherits orphans
    spawn = worker.execute("import subprocess\n"
                           "orphan = int(subprocess.run(['sh', '-c', 'sleep 600 >/dev/null 2>&1 & echo $!'],"
                           " capture_output=True, text=True).stdout)\norphan").assert_ok()
    orphan = int(spawn.result["data"]["text/plain"])
    # Positive control, free of timing: the orphan's parent is now the worker, so if the worker did not reap it,
    # nobody would, and it would stay a zombie.
    assert _parent_pid(orphan) == worker.process.pid
    os.kill(orphan, signal.SIGKILL)
    # It exits (a zombie, or already reaped if the reaping after the first answer ran late) before the next request.
    _wait_for_state(orphan, lambda state: state in ("Z", None), "the orphan to exit")
    worker.execute("pass").assert_ok()  # the worker reaps right after answering a request
    _wait_for_state(orphan, lambda state: state is None, "the worker to reap its orphaned zombie")


def _parent_pid(pid):
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("PPid:")).split()[1])


def _process_state(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def _wait_for_state(pid, wanted, what, timeout=60):
    deadline = time.monotonic() + timeout  # generous: a loaded 2-core machine
    while not wanted(_process_state(pid)):
        assert time.monotonic() < deadline, f"timed out waiting for {what} (pid {pid}: {_process_state(pid)})"
        time.sleep(0.05)


def test_reaping_does_not_steal_popen_exit_status(make_worker):
    worker = make_worker(subreaper=True)
    worker.execute("import subprocess, time\nchild = subprocess.Popen(['sh', '-c', 'exit 7'])\n"
                   "time.sleep(0.5)").assert_ok()
    worker.execute("pass").assert_ok()
    assert worker.execute("child.wait()").result["data"]["text/plain"] == "7"


def test_sigint_stops_a_shell_command(worker):
    worker.send({"type": "execute", "id": "shell-sleep", "silent": False, "store_history": True,
                 "user_expressions": {}, "allow_stdin": False,
                 "code": "print('starting', flush=True)\n!echo started; exec sleep 600"})
    _wait_for_stdout(worker, "started")
    worker.interrupt()
    frames = _reply_after(worker, timeout=60)  # far less than the 600 s sleep: the interrupt ended it
    assert frames[-1]["id"] == "shell-sleep"
    # IPython reports an interrupted shell command as exit code -2, not as a failed cell (as ipykernel).
    assert worker.execute("_exit_code").result["data"]["text/plain"] == "-2"


def test_user_sigint_handler_is_kept_for_later_cells(worker):
    worker.execute("import signal\nhits = []\nsignal.signal(signal.SIGINT, lambda *a: hits.append(1))").assert_ok()
    worker.send({"type": "execute", "id": "loop", "silent": False, "store_history": True, "user_expressions": {},
                 "allow_stdin": False,
                 "code": "import time\nprint('looping', flush=True)\nwhile not hits:\n    time.sleep(0.01)\n'handled'"})
    _wait_for_stdout(worker, "looping")
    worker.interrupt()
    frames = _reply_after(worker, timeout=20)
    assert frames[-1]["content"]["status"] == "ok"
    assert [frame["data"]["text/plain"] for frame in frames if frame["type"] == "execute_result"] == ["'handled'"]
    # Back to the default: interrupts raise KeyboardInterrupt again.
    worker.execute("signal.signal(signal.SIGINT, signal.default_int_handler)").assert_ok()
    worker.send({"type": "execute", "id": "sleep", "silent": False, "store_history": True, "user_expressions": {},
                 "allow_stdin": False, "code": "print('napping', flush=True)\ntime.sleep(30)"})
    _wait_for_stdout(worker, "napping")
    worker.interrupt()
    assert _reply_after(worker, timeout=20)[-1]["content"]["ename"] == "KeyboardInterrupt"


def test_a_failing_handler_becomes_an_error_reply(worker):
    # Break IPython's completer from user code: the worker must answer, not die.
    worker.execute("get_ipython().Completer.completions = None").assert_ok()
    broken = worker.request("complete", code="pri", cursor_pos=3).reply
    assert broken["status"] == "error" and broken["ename"] == "WorkerInternalError"
    assert "TypeError" in broken["evalue"] and broken["traceback"]
    assert worker.execute("'serving'").result["data"]["text/plain"] == "'serving'"
