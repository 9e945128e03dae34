"""What a user of the kernel notices while running cells: state, outputs, streaming, stdin, errors."""
import re
import time

import pytest

# A cell that announces it runs, then sleeps far longer than any bound below: an interrupt that works ends it early
# with a KeyboardInterrupt raised inside the sleep; one that does not leaves it sleeping (or kills the worker).
SLEEPING_CELL = "import time\nprint('sleeping', flush=True)\ntime.sleep(600)"
INTERRUPT_BOUND_S = 60  # generous (loaded 2-core machine); the point is 60 s < 600 s, not speed


def test_state_persists_between_cells(kernel):
    assert kernel.execute("answer = 41").content["status"] == "ok"
    run = kernel.execute("answer + 1")
    assert run.content["status"] == "ok"
    results = run.of_type("execute_result")
    assert results[0]["content"]["data"]["text/plain"] == "42"
    assert results[0]["content"]["execution_count"] == run.content["execution_count"]


def test_error_reply_has_real_ename_and_traceback(kernel):
    run = kernel.execute("1/0")
    assert run.content["status"] == "error"
    assert run.content["ename"] == "ZeroDivisionError"
    assert run.content["evalue"] == "division by zero"
    errors = run.of_type("error")
    assert len(errors) == 1 and errors[0]["content"]["ename"] == "ZeroDivisionError"
    assert any("ZeroDivisionError" in line for line in errors[0]["content"]["traceback"])


def test_stop_on_error_aborts_queued_requests(kernel):
    failing = kernel.client.execute("import time; time.sleep(0.3); 1/0", stop_on_error=True)
    queued = kernel.client.execute("never_defined_by_this_cell = 1", stop_on_error=True)
    assert kernel.collect(failing).content["status"] == "error"
    assert kernel.collect(queued).content["status"] == "aborted"
    assert kernel.execute("'never_defined_by_this_cell' in dir()").of_type("execute_result")[0]["content"]["data"][
        "text/plain"] == "False"


def test_streaming_prints_arrive_while_the_cell_runs(kernel):
    # The cell cannot end by itself: the ticks arrive while it runs or never (no timing involved).
    msg_id = kernel.client.execute("import time\nfor i in range(3):\n    print('tick', i, flush=True)\n"
                                   "time.sleep(600)")
    kernel.wait_for_stdout(msg_id, "tick 0\ntick 1\ntick 2\n")
    kernel.manager.interrupt_kernel()
    run = kernel.collect(msg_id, timeout=INTERRUPT_BOUND_S)
    assert run.content["ename"] == "KeyboardInterrupt", run.content
    assert run.stream_text() == "tick 0\ntick 1\ntick 2\n"


def test_subprocess_and_fd_output_are_captured(kernel):
    run = kernel.execute("import os, subprocess\nos.write(1, b'raw fd write\\n')\n"
                         "subprocess.run(['echo', 'from a child process'])\n"
                         "os.write(2, b'raw stderr\\n')")
    assert run.content["status"] == "ok"
    assert "raw fd write" in run.stream_text("stdout")
    assert "from a child process" in run.stream_text("stdout")
    assert "raw stderr" in run.stream_text("stderr")


def test_invalid_utf8_output_does_not_cost_the_reply(kernel):
    run = kernel.execute("import os; os.write(1, b'bad:\\xff\\xfe end\\n'); 'still here'")
    assert run.content["status"] == "ok"
    assert "bad:\ufffd\ufffd end" in run.stream_text("stdout")
    assert run.of_type("execute_result")[0]["content"]["data"]["text/plain"] == "'still here'"


def test_rich_outputs(kernel):
    run = kernel.execute("import pandas as pd\npd.DataFrame({'fruit': ['apple', 'pear'], 'sold': [3, 5]})")
    data = run.of_type("execute_result")[0]["content"]["data"]
    assert "text/plain" in data and "<table" in data["text/html"]

    run = kernel.execute("import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [3, 1, 2])")
    displays = run.of_type("display_data")
    assert any("image/png" in m["content"]["data"] for m in displays), [m["content"]["data"].keys() for m in displays]

    run = kernel.execute("from IPython.display import display\nh = display('first', display_id=True)\n"
                         "h.update('second')")
    assert run.of_type("display_data")[0]["content"]["transient"]["display_id"]
    assert run.of_type("update_display_data")[0]["content"]["data"]["text/plain"] == "'second'"


def test_large_output_keeps_its_head_and_tail_with_a_visible_note(kernel):
    # The default limit is 1 MiB per execute: the first half is streamed, then each stream keeps its last
    # quarter, published at the end after a note of how much was left out (the end of a log is where the
    # error is).
    started = time.monotonic()
    run = kernel.execute("print('x' * 20_000_000)\nprint('THE END')\n'finished'", timeout=120)
    assert run.content["status"] == "ok"
    out = run.stream_text("stdout")
    assert 0 < len(out) <= 1_100_000, len(out)
    assert out.startswith("xxxx") and out.endswith("xxx\nTHE END\n"), out[-200:]
    note = re.search(r"\[cellblock\] Output truncated: (\d+) bytes of this stream were left out here", out)
    assert note, out[500_000:600_000]
    assert int(note.group(1)) > 18_000_000, note.group(0)
    assert run.outcome == {"outcome": "output_limit", "state_lost": False,
                          "output_truncated": True}
    assert time.monotonic() - started < 60


def test_input_and_getpass(kernel):
    run = kernel.execute("name = input('Name: ')\nprint('hello', name)", allow_stdin=True, answers=["Ada"])
    assert run.content["status"] == "ok"
    assert len(run.input_requests) == 1
    assert run.input_requests[0]["content"]["prompt"] == "Name: "
    assert run.input_requests[0]["content"]["password"] is False
    assert "hello Ada" in run.stream_text()

    run = kernel.execute("import getpass\nsecret = getpass.getpass('Password: ')\nlen(secret)", allow_stdin=True,
                         answers=["hunter22"])
    assert run.content["status"] == "ok"
    assert run.input_requests[0]["content"]["password"] is True
    assert run.of_type("execute_result")[0]["content"]["data"]["text/plain"] == "8"


def test_input_without_stdin_fails_cleanly(kernel):
    run = kernel.execute("input('?')", allow_stdin=False)
    assert run.content["status"] == "error"
    assert kernel.execute("1").content["status"] == "ok"


def test_silent_execution_publishes_nothing(kernel):
    run = kernel.execute("print('should not be seen'); 5", silent=True)
    assert run.content["status"] == "ok"
    assert run.outputs == []


def test_user_expressions(kernel):
    run = kernel.execute("ue_value = 6", user_expressions={"double": "ue_value * 2", "bad": "1/0"})
    expressions = run.content["user_expressions"]
    assert expressions["double"]["status"] == "ok"
    assert expressions["double"]["data"]["text/plain"] == "12"
    assert expressions["bad"]["status"] == "error"


def test_comm_messages_do_not_break_the_kernel(kernel):
    kc = kernel.client
    msg = kc.session.msg("comm_info_request", {})
    kc.shell_channel.send(msg)
    reply = kc.get_shell_msg(timeout=10)
    assert reply["msg_type"] == "comm_info_reply" and reply["content"]["status"] == "ok"
    kc.shell_channel.send(kc.session.msg("comm_open", {"comm_id": "c1", "target_name": "nobody", "data": {}}))
    kc.shell_channel.send(kc.session.msg("comm_msg", {"comm_id": "c1", "data": {"x": 1}}))
    kc.shell_channel.send(kc.session.msg("comm_close", {"comm_id": "c1", "data": {}}))
    assert kernel.execute("2 + 2").of_type("execute_result")[0]["content"]["data"]["text/plain"] == "4"


def assert_interrupted_in_the_sleep(run):
    assert run.content["status"] == "error", run.content
    assert run.content["ename"] == "KeyboardInterrupt", run.content
    traceback = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(run.content["traceback"]))  # without colours
    assert "time.sleep(600)" in traceback, traceback


def test_interrupt_by_signal_keeps_state(kernel):
    kernel.execute("kept = 'still here'")
    msg_id = kernel.client.execute(SLEEPING_CELL)
    kernel.wait_for_stdout(msg_id, "sleeping")
    kernel.manager.interrupt_kernel()
    run = kernel.collect(msg_id, timeout=INTERRUPT_BOUND_S)
    assert_interrupted_in_the_sleep(run)
    assert kernel.execute("kept").of_type("execute_result")[0]["content"]["data"]["text/plain"] == "'still here'"


def test_interrupt_request_on_control_keeps_state(kernel):
    kernel.execute("kept_too = 7")
    kc = kernel.client
    msg_id = kc.execute(SLEEPING_CELL)
    kernel.wait_for_stdout(msg_id, "sleeping")
    kc.control_channel.send(kc.session.msg("interrupt_request", {}))
    run = kernel.collect(msg_id, timeout=INTERRUPT_BOUND_S)
    assert_interrupted_in_the_sleep(run)
    reply = kc.get_control_msg(timeout=10)
    assert reply["msg_type"] == "interrupt_reply" and reply["content"]["status"] == "ok"
    assert kernel.execute("kept_too").of_type("execute_result")[0]["content"]["data"]["text/plain"] == "7"


@pytest.mark.parametrize("how", ["signal", "message"])
def test_interrupt_releases_an_unanswered_input(kernel, how):
    kc = kernel.client
    msg_id = kc.execute("input('never answered: ')", allow_stdin=True)
    request = kc.get_stdin_msg(timeout=30)
    assert request["content"]["prompt"] == "never answered: "
    if how == "signal":
        kernel.manager.interrupt_kernel()
    else:
        kc.control_channel.send(kc.session.msg("interrupt_request", {}))
    run = kernel.collect(msg_id, timeout=10)
    assert run.content["ename"] == "KeyboardInterrupt"
    if how == "message":
        assert kc.get_control_msg(timeout=10)["msg_type"] == "interrupt_reply"
    # A late answer to the abandoned prompt must not answer anything else.
    kc.input("too late")
    assert kernel.execute("1 + 1").of_type("execute_result")[0]["content"]["data"]["text/plain"] == "2"
    run = kernel.execute("input('again: ')", allow_stdin=True, answers=["fresh"])
    assert run.of_type("execute_result")[0]["content"]["data"]["text/plain"] == "'fresh'"


def test_streams_and_displays_keep_their_order(kernel):
    # (stdout and stderr are separate pipes: their relative order is not guaranteed, as with ipykernel.)
    run = kernel.execute("from IPython.display import display\nprint('before')\ndisplay('shown')\nprint('after')\n"
                         "display('again')\nprint('end')")
    sequence = []
    for _, msg in run.outputs:
        if msg["msg_type"] == "stream":
            label = msg["content"]["name"]
            if sequence and sequence[-1][0] == label:
                sequence[-1] = (label, sequence[-1][1] + msg["content"]["text"])
            else:
                sequence.append((label, msg["content"]["text"]))
        elif msg["msg_type"] == "display_data":
            sequence.append(("display", msg["content"]["data"]["text/plain"]))
    assert sequence == [("stdout", "before\n"), ("display", "'shown'"), ("stdout", "after\n"),
                        ("display", "'again'"), ("stdout", "end\n")]


def test_ipython_conveniences_agents_rely_on(kernel):
    first = kernel.execute("21 * 2")
    count = first.content["execution_count"]
    assert kernel.execute("_ + 1").of_type("execute_result")[0]["content"]["data"]["text/plain"] == "43"
    assert kernel.execute(f"Out[{count}]").of_type("execute_result")[0]["content"]["data"]["text/plain"] == "42"
    assert "hello from a shell" in kernel.execute("!echo hello from a shell").stream_text()
    run = kernel.execute("%cd /tmp")
    assert run.content["status"] == "ok"
    assert kernel.execute("import os; os.getcwd()").of_type("execute_result")[0]["content"]["data"][
        "text/plain"] == "'/tmp'"
    kernel.execute("%cd /workspace")
    assert "loop" in kernel.execute("%timeit -n1 -r1 sum(range(10))").stream_text()
    run = kernel.execute("%colors nocolor\n1/0")
    assert "\x1b[" not in "".join(run.content["traceback"])


def test_inspect_detail_levels(kernel):
    kc = kernel.client
    for level in (0, 1):
        msg_id = kc.inspect("len", cursor_pos=3, detail_level=level)
        reply = kc.get_shell_msg(timeout=20)
        while reply["parent_header"].get("msg_id") != msg_id:
            reply = kc.get_shell_msg(timeout=20)
        assert reply["content"]["status"] == "ok"
        assert reply["content"]["found"] is True
        assert "text/plain" in reply["content"]["data"]
