"""The template's service (cellblock_runtime/zygote.py, sandbox/README.md "Worker zygote") without the C++ library: the
template is started as the kernel starts it, with a test-only stand-in for libcellblock_zygote.so
(zygote_harness.py, zygote_standin.c: the same C ABI and ctypes/fork-hook path, no confinement). These tests cover
the protocol, reaping and bookkeeping, not the confinement (that is tests/sandbox with `worker.zygote: true`).
This test process plays the kernel.
"""
import os
import pathlib
import time

import pytest

from conftest import WorkerProcess, worker_environment, worker_script
from zygote_harness import GENEROUS, PidfdProcess, Template, build_standin_library, receive


@pytest.fixture(scope="session")
def standin_library(tmp_path_factory):
    return build_standin_library(tmp_path_factory.mktemp("standin"))


@pytest.fixture
def template(tmp_path, standin_library):
    started = []

    def start(**settings):
        made = Template(tmp_path, standin_library, worker_environment(tmp_path), **settings)
        started.append(made)
        return made

    yield start
    for made in started:
        made.stop()


class ForkedWorker(WorkerProcess):
    """A worker forked by the template, driven over its channel exactly like an exec'd one (conftest)."""

    def __init__(self, template, plan=None):
        super().__init__(template.path.parent, template=template, plan=plan)
        self.pidfd = self.process.pidfd
        self.connection = self.process.connection


def pidfd_pid(pidfd):
    for line in pathlib.Path(f"/proc/self/fdinfo/{pidfd}").read_text().splitlines():
        if line.startswith("Pid:"):
            return int(line.split()[1])
    raise AssertionError("no Pid: in the pidfd's fdinfo")


def gone(pid, timeout=GENEROUS):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not os.path.exists(f"/proc/{pid}"):
            return True
        time.sleep(0.05)
    return False


def test_a_fork_serves_its_channel_and_its_exit_is_reported_with_usage(template):
    zygote = template()
    worker = ForkedWorker(zygote)
    try:
        # The answer's pidfd is that worker's, and the worker's own ready frame names the same process.
        assert pidfd_pid(worker.pidfd) == worker.answer["pid"] == worker.ready["pid"]
        assert pathlib.Path(f"/proc/{worker.answer['pid']}/stat").read_text().split()[3] == str(zygote.pid)
        assert worker.execute("1+1").assert_ok().result["data"]["text/plain"] == "2"
        # Started with the template's argv and the worker's environment: no CELLBLOCK_ZYGOTE_* setting in
        # /proc/PID/environ, which shows the environment the process image was started with.
        pid = worker.answer["pid"]
        assert pathlib.Path(f"/proc/{pid}/cmdline").read_bytes() == \
            b"/usr/bin/python3\0" + str(worker_script()).encode() + b"\0"
        raw = pathlib.Path(f"/proc/{pid}/environ").read_bytes()
        assert dict(entry.partition("=")[::2] for entry in raw.decode().split("\0") if entry) == \
            zygote.start_environment
        assert worker.execute("import time; [i * i for i in range(2_000_000)]; 0").reply["status"] == "ok"
        worker.send({"type": "shutdown"})
        report = worker.process.report()
        assert report["status"] == 0, report
        assert report["utime_us"] + report["stime_us"] > 0 and report["maxrss_kib"] > 10_000, report
        assert gone(pid)  # reaped by the template, not left a zombie
        # A second fork that ends with an exit status of its own.
        second = ForkedWorker(zygote)
        second.send({"type": "execute", "id": "x", "code": "import os; os._exit(7)", "silent": False,
                     "store_history": True, "user_expressions": {}, "allow_stdin": False})
        assert second.process.report()["status"] == 7 << 8
        assert zygote.process.poll() is None, zygote.log()
    finally:
        worker._channel.close()


def test_a_closed_connection_kills_its_worker_and_only_that_one(template):
    zygote = template()
    first, second = ForkedWorker(zygote), ForkedWorker(zygote)
    running = first.send({"type": "execute", "id": "busy", "code": "import time; time.sleep(600)", "silent": False,
                          "store_history": True, "user_expressions": {}, "allow_stdin": False})
    del running
    time.sleep(0.5)
    first.connection.close()  # the kernel's side of the request: the kernel went away
    # Killed although its channel is still open and its cell still running; reaped by the template.
    assert first.process.exited(GENEROUS), "the worker outlived its kernel's connection"
    assert gone(first.answer["pid"])
    assert second.execute("6*7").assert_ok().result["data"]["text/plain"] == "42"
    assert zygote.process.poll() is None, zygote.log()
    second.send({"type": "shutdown"})
    assert second.process.report()["status"] == 0


def serve_one(zygote):
    """A worker started and ended: the template is serving and holds only its own fds again."""
    worker = ForkedWorker(zygote)
    worker.send({"type": "shutdown"})
    assert worker.process.report()["status"] == 0
    worker._channel.close()


def refused(zygote, message, fds):
    connection, answer, received = zygote.request(message, fds)
    assert received == []
    assert receive(connection) == (None, []), "the template kept the connection open after refusing"
    connection.close()
    return answer


def test_a_request_without_the_magic_is_refused_and_its_fds_are_not_kept(template):
    zygote = template()
    serve_one(zygote)
    held = zygote.fds()
    pipe_read, pipe_write = os.pipe()
    answer = refused(zygote, b"CBZ0\0\1\2\3", [pipe_read, pipe_write, pipe_write, pipe_read])
    assert "CBZ1" in answer["error"], answer
    assert refused(zygote, b"", [pipe_read])["error"], "an empty request with an fd"
    assert zygote.fds() == held, "the template kept a refused request's fds"
    # Nothing was started; the template still serves.
    assert ForkedWorker(zygote).execute("1+1").assert_ok()


def test_more_than_sixteen_fds_are_refused(template):
    zygote = template()
    serve_one(zygote)
    held = zygote.fds()
    pipe_read, pipe_write = os.pipe()
    answer = refused(zygote, b"CBZ1\0\1\2\3", [pipe_read, pipe_write, pipe_write, pipe_read] + [pipe_read] * 13)
    assert "16" in answer["error"], answer
    assert zygote.fds() == held
    assert ForkedWorker(zygote).execute("1+1").assert_ok()


def test_a_spawn_that_starts_nothing_answers_an_error_and_a_failed_child_is_reported(template):
    zygote = template()
    pipe_read, pipe_write = os.pipe()
    answer = refused(zygote, b"CBZ1FAIL", [pipe_read, pipe_write])
    assert "Exec format error" in answer["error"], answer  # the library's -ENOEXEC, as text
    connection, answer, received = zygote.request(b"CBZ1DIE!", [pipe_read])
    assert "pid" in answer and len(received) == 1, answer
    # A child that failed its confinement (_exit(127) before returning into Python) is reaped and reported.
    assert PidfdProcess(answer["pid"], received[0], connection).report()["status"] == 127 << 8


def test_a_template_retires_after_its_generation_and_still_reports_its_workers(template):
    zygote = template(generation_forks=2)
    first, second = ForkedWorker(zygote), ForkedWorker(zygote)
    # Retired after answering the second: a kernel connecting now finds the socket dead (and starts the next
    # generation), while the two workers keep being supervised.
    deadline = time.monotonic() + GENEROUS
    while True:
        try:
            zygote.connect().close()
        except ConnectionRefusedError:
            break
        assert time.monotonic() < deadline, "the template still accepts after its generation"
        time.sleep(0.05)
    assert "retired" in zygote.log()
    assert first.execute("1+1").assert_ok()
    assert zygote.process.poll() is None, "the template left before its workers"
    first.send({"type": "shutdown"})
    assert first.process.report()["status"] == 0
    second.send({"type": "execute", "id": "x", "code": "import os; os._exit(3)", "silent": False,
                 "store_history": True, "user_expressions": {}, "allow_stdin": False})
    assert second.process.report()["status"] == 3 << 8
    # The last worker reported: the template exits.
    assert zygote.process.wait(GENEROUS) == 0, zygote.log()
