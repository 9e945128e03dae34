"""Streams, display frames and stdin round trips."""

import time


def _kinds(exchange):
    """The exchange as a list of ('stdout'|'stderr', text) and (frame type,) in kernel order."""
    kinds = []
    for event in exchange.events:
        if event[0] == "frame":
            kinds.append((event[1]["type"],))
        elif kinds and kinds[-1][0] == event[0]:
            kinds[-1] = (event[0], kinds[-1][1] + event[1])
        else:
            kinds.append((event[0], event[1]))
    return kinds


def test_print_and_display_keep_their_order(worker):
    code = ("import sys\nfrom IPython.display import display\n"
            "print('before')\n"
            "display('shown')\n"
            "print('between', file=sys.stderr)\n"
            "display('shown again')\n"
            "print('after')\n"
            "'result'")
    exchange = worker.execute(code).assert_ok()
    assert _kinds(exchange) == [("stdout", "before\n"), ("display_data",), ("stderr", "between\n"),
                                ("display_data",), ("stdout", "after\n"), ("execute_result",), ("reply",)]


def test_output_streams_while_the_cell_runs(worker, tmp_path):
    # The cell cannot end before the test opens the gate, and the test opens it only once 'early' has arrived: so
    # 'early' reached the kernel while the cell was still running (no timing involved).
    gate = tmp_path / "gate"
    worker.send({"type": "execute", "id": "gated", "silent": False, "store_history": True, "user_expressions": {},
                 "allow_stdin": False,
                 "code": f"import os, time\nprint('early', flush=False)\nwhile not os.path.exists({str(gate)!r}):\n"
                         "    time.sleep(0.01)\nprint('late')"})
    deadline = time.monotonic() + 60
    while "early\n" not in "".join(event[1] for event in worker.events if event[0] == "stdout"):
        assert time.monotonic() < deadline, "print() output did not arrive while the cell ran"
        try:
            frame = worker.next_frame(timeout=0.05)
            assert frame["type"] != "reply", f"the cell ended before its gate opened: {frame}"
        except TimeoutError:
            pass
    gate.touch()
    frames = [worker.next_frame(timeout=60)]
    while frames[-1]["type"] != "reply":
        frames.append(worker.next_frame(timeout=60))
    assert frames[-1]["content"]["status"] == "ok", frames
    assert "".join(event[1] for event in worker.events if event[0] == "stdout").endswith("early\nlate\n")


def test_an_unfinished_line_streams_while_the_cell_runs(worker, tmp_path):
    # A progress dot without newline or flush: the worker holds an unfinished line back only briefly.
    gate = tmp_path / "gate"
    worker.send({"type": "execute", "id": "gated", "silent": False, "store_history": True, "user_expressions": {},
                 "allow_stdin": False,
                 "code": f"import os, sys, time\nsys.stdout.write('dot')\nwhile not os.path.exists({str(gate)!r}):\n"
                         "    time.sleep(0.01)\nprint('done')"})
    deadline = time.monotonic() + 60
    while "dot" not in "".join(event[1] for event in worker.events if event[0] == "stdout"):
        assert time.monotonic() < deadline, "an unfinished line did not arrive while the cell ran"
        try:
            frame = worker.next_frame(timeout=0.05)
            assert frame["type"] != "reply", f"the cell ended before its gate opened: {frame}"
        except TimeoutError:
            pass
    gate.touch()
    frames = [worker.next_frame(timeout=60)]
    while frames[-1]["type"] != "reply":
        frames.append(worker.next_frame(timeout=60))
    assert frames[-1]["content"]["status"] == "ok", frames
    assert "".join(event[1] for event in worker.events if event[0] == "stdout").endswith("dotdone\n")


def test_print_then_a_subprocess_keep_their_order(worker):
    # print's text may wait a moment in the worker; it goes before anything a child process writes to fds 1/2.
    exchange = worker.execute("import os, subprocess\n"
                              "for i in range(3):\n"
                              "    print('py', i, end=' ')\n"
                              "    os.system('echo sh')\n"
                              "    print('py', i)\n"
                              "    subprocess.run(['echo', 'popen'])\n").assert_ok()
    assert exchange.text() == "".join(f"py {i} sh\npy {i}\npopen\n" for i in range(3))


def test_subprocess_and_fd_output_reach_the_kernel(worker):
    code = ("import os, subprocess\n"
            "os.write(1, b'raw fd 1\\n')\n"
            "subprocess.run(['sh', '-c', 'echo child out; echo child err >&2'])\n"
            "print('python out')")
    exchange = worker.execute(code).assert_ok()
    assert exchange.text("stdout") == "raw fd 1\nchild out\npython out\n"
    assert exchange.text("stderr") == "child err\n"


def test_shell_escape_output(worker):
    exchange = worker.execute("!echo hi").assert_ok()
    assert exchange.text() == "hi\n"
    captured = worker.execute("files = !echo one; echo two\nfiles").assert_ok()
    assert captured.result["data"]["text/plain"] == "['one', 'two']"
    assert worker.execute("!exit 3\n_exit_code").result["data"]["text/plain"] == "3"


def test_unencodable_text_never_breaks_output(worker):
    code = ("print('bad \\udc80 char')\n"
            "display({'text/plain': 'frame \\udcff text'}, raw=True)")
    exchange = worker.execute(code).assert_ok()
    assert exchange.text() == "bad \ufffd char\n"
    assert exchange.frames_of("display_data")[0]["data"]["text/plain"] == "frame \ufffd text"


def test_display_update_and_clear_output(worker):
    code = ("from IPython.display import display, update_display, clear_output\n"
            "handle = display('first', display_id='progress')\n"
            "update_display('second', display_id='progress')\n"
            "clear_output(wait=True)\n"
            "display({'text/markdown': '**md**'}, raw=True)\n"
            "clear_output()")
    exchange = worker.execute(code).assert_ok()
    frames = exchange.frames
    assert [frame["type"] for frame in frames] == ["display_data", "update_display_data", "clear_output",
                                                  "display_data", "clear_output"]
    assert frames[0]["data"] == {"text/plain": "'first'"}
    assert frames[0]["transient"] == {"display_id": "progress"}
    assert frames[1]["data"] == {"text/plain": "'second'"}
    assert frames[1]["transient"] == {"display_id": "progress"}
    assert frames[2]["wait"] is True and frames[4]["wait"] is False
    assert frames[3]["data"] == {"text/markdown": "**md**"}


def test_display_from_a_thread(worker):
    code = ("import threading\nfrom IPython.display import display\n"
            "threads = [threading.Thread(target=display, args=(i,)) for i in range(20)]\n"
            "[t.start() for t in threads]; [t.join() for t in threads];")
    exchange = worker.execute(code).assert_ok()
    shown = sorted(int(frame["data"]["text/plain"]) for frame in exchange.frames_of("display_data"))
    assert shown == list(range(20))


def test_input_round_trip(worker):
    worker.send({"type": "execute", "id": "ask", "code": "name = input('Name? ')\nprint('hello', name)",
                 "silent": False, "store_history": True, "user_expressions": {}, "allow_stdin": True})
    prompt = worker.next_frame()
    assert prompt == {"type": "input_request", "prompt": "Name? ", "password": False}
    worker.send({"type": "input_reply", "value": "Ada \u00e9"})
    reply = worker.next_frame()
    assert reply["type"] == "reply" and reply["content"]["status"] == "ok"
    assert "hello Ada \u00e9\n" in "".join(event[1] for event in worker.events if event[0] == "stdout")


def test_getpass_round_trip_sets_password(worker):
    worker.send({"type": "execute", "id": "secret", "code": "import getpass\nsecret = getpass.getpass()",
                 "silent": False, "store_history": True, "user_expressions": {}, "allow_stdin": True})
    assert worker.next_frame() == {"type": "input_request", "prompt": "Password: ", "password": True}
    worker.send({"type": "input_reply", "value": "hunter2"})
    assert worker.next_frame()["content"]["status"] == "ok"
    assert worker.execute("secret").result["data"]["text/plain"] == "'hunter2'"


def test_input_without_stdin_raises_stdin_not_implemented(worker):
    exchange = worker.execute("input('x')", allow_stdin=False)
    assert exchange.reply["ename"] == "StdinNotImplementedError"
    assert worker.execute("import getpass; getpass.getpass()", allow_stdin=False).reply["ename"] == \
        "StdinNotImplementedError"


def test_unanswerable_input_raises_eof(worker):
    worker.send({"type": "execute", "id": "eof", "code": "input()", "silent": False, "store_history": True,
                 "user_expressions": {}, "allow_stdin": True})
    assert worker.next_frame()["type"] == "input_request"
    worker.send({"type": "input_reply", "error": "the client went away"})
    error = worker.next_frame()
    assert error["type"] == "error" and error["ename"] == "EOFError"
    assert worker.next_frame()["content"]["ename"] == "EOFError"


def test_interrupting_input_then_a_late_reply_is_ignored(worker):
    worker.send({"type": "execute", "id": "wait", "code": "answer = input('?')", "silent": False,
                 "store_history": True, "user_expressions": {}, "allow_stdin": True})
    assert worker.next_frame()["type"] == "input_request"
    worker.interrupt()
    frames = [worker.next_frame()]
    while frames[-1]["type"] != "reply":
        frames.append(worker.next_frame())
    assert frames[-1]["content"]["ename"] == "KeyboardInterrupt"
    worker.send({"type": "input_reply", "value": "too late"})
    time.sleep(0.2)
    worker.send({"type": "execute", "id": "again", "code": "second = input('again?')", "silent": False,
                 "store_history": True, "user_expressions": {}, "allow_stdin": True})
    assert worker.next_frame()["prompt"] == "again?"
    worker.send({"type": "input_reply", "value": "fresh"})
    assert worker.next_frame()["content"]["status"] == "ok"
    assert worker.execute("second").result["data"]["text/plain"] == "'fresh'"


def test_ctrl_d_answer_is_end_of_input(worker):
    worker.send({"type": "execute", "id": "ctrl-d", "silent": False, "store_history": True, "user_expressions": {},
                 "allow_stdin": True,
                 "code": "try:\n    input('more? ')\nexcept EOFError:\n    print('got EOF')"})
    assert worker.next_frame()["prompt"] == "more? "
    worker.send({"type": "input_reply", "value": "\x04"})
    assert worker.next_frame()["content"]["status"] == "ok"
    assert "got EOF\n" in "".join(event[1] for event in worker.events if event[0] == "stdout")
