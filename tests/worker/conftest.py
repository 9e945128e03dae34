"""Drives cellblock_worker.py directly, as cellblock-kernel does, without the kernel or the sandbox.

The worker gets a socketpair end as fd 3, pipes as fds 1/2 and /dev/null as fd 0. Python-level stdout/stderr
arrive in band, as stream frames (recorded as "stdout"/"stderr" events like pipe text); the worker sends a frame
only once the reader has consumed the fd-level text written before it, so a reader that services the channel
before the pipes records events in exactly the order the worker produced them.
"""

import ctypes
import json
import os
import pathlib
import select
import signal
import socket
import struct
import subprocess
import time
import codecs

import pytest

SOURCE_DIR = pathlib.Path(os.environ.get("CELLBLOCK_SOURCE_DIR", pathlib.Path(__file__).resolve().parents[2]))
_PR_SET_CHILD_SUBREAPER = 36
DEFAULT_TIMEOUT = 60.0


def worker_script():
    """The installed worker when the suite runs against an installed tree (ctest), else the source copy."""
    prefix = os.environ.get("CELLBLOCK_PREFIX")
    if prefix:
        installed = pathlib.Path(prefix) / "share/cellblock/worker/cellblock_worker.py"
        # No quiet fallback to the source copy: the suite must test what was installed.
        if not installed.exists():
            pytest.fail(f"CELLBLOCK_PREFIX={prefix} has no installed worker ({installed} missing)")
        return installed
    return SOURCE_DIR / "share/cellblock/worker/cellblock_worker.py"


def worker_environment(home):
    # Explicit and minimal, as the kernel builds it.
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
    }


class WorkerDied(AssertionError):
    pass


_session_template = []


def session_template():
    """With CELLBLOCK_TEST_ZYGOTE=1, every worker of the suite is forked by one template (zygote_harness.py, a
    stand-in for the C++ library: no confinement) instead of exec'd."""
    if not _session_template:
        import tempfile

        from zygote_harness import Template, build_standin_library

        directory = pathlib.Path(tempfile.mkdtemp(prefix="cellblock-worker-zygote-"))
        _session_template.append(Template(directory, build_standin_library(directory),
                                          worker_environment(directory)))
    return _session_template[0]


@pytest.fixture(scope="session", autouse=True)
def zygote_template_stopped():
    yield
    for template in _session_template:
        template.stop()


class WorkerProcess:
    def __init__(self, cwd, subreaper=False, template=None, plan=None):
        if template is None and os.environ.get("CELLBLOCK_TEST_ZYGOTE", "") == "1":
            template = session_template()
        if template is not None:
            self._forked_start(template, cwd, subreaper, plan)
            return
        kernel_end, worker_end = socket.socketpair()
        self._channel = kernel_end
        worker_fd = worker_end.fileno()
        libc = ctypes.CDLL(None, use_errno=True) if subreaper else None

        def become_worker():
            os.dup2(worker_fd, 3)
            if libc is not None:
                libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)

        self.started_at = time.monotonic()
        self.process = subprocess.Popen(
            ["/usr/bin/python3", str(worker_script())],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            pass_fds=(3,), preexec_fn=become_worker, cwd=str(cwd), env=worker_environment(cwd),
            start_new_session=True)
        worker_end.close()
        self._received = bytearray()
        self._decoders = {"stdout": codecs.getincrementaldecoder("utf-8")("replace"),
                          "stderr": codecs.getincrementaldecoder("utf-8")("replace")}
        self._frame_decoders = {"stdout": codecs.getincrementaldecoder("utf-8")("replace"),
                                "stderr": codecs.getincrementaldecoder("utf-8")("replace")}
        self._pipes = {self.process.stdout.fileno(): "stdout", self.process.stderr.fileno(): "stderr"}
        for fd in self._pipes:
            os.set_blocking(fd, False)
        self.events = []  # ("stdout"|"stderr", text, t) or ("frame", dict, t)
        self._next_id = 0
        self._interrupted = False  # since the last sync
        self.ready = self.next_frame()
        self.ready_at = time.monotonic()

    def _forked_start(self, template, cwd, subreaper, plan):
        self.started_at = time.monotonic()
        self._channel, stdout_read, stderr_read, self.process, self.answer = template.fork(cwd, subreaper, plan)
        self.process.stdout = os.fdopen(stdout_read, "rb")
        self.process.stderr = os.fdopen(stderr_read, "rb")
        self._received = bytearray()
        self._decoders = {"stdout": codecs.getincrementaldecoder("utf-8")("replace"),
                          "stderr": codecs.getincrementaldecoder("utf-8")("replace")}
        self._frame_decoders = {"stdout": codecs.getincrementaldecoder("utf-8")("replace"),
                                "stderr": codecs.getincrementaldecoder("utf-8")("replace")}
        self._pipes = {stdout_read: "stdout", stderr_read: "stderr"}
        for fd in self._pipes:
            os.set_blocking(fd, False)
        self.events = []
        self._next_id = 0
        self._interrupted = False
        self.ready = self.next_frame()
        self.ready_at = time.monotonic()

    # -- low level ------------------------------------------------------------------------------
    def send(self, message):
        payload = json.dumps(message).encode()
        self._channel.sendall(struct.pack(">I", len(payload)) + payload)

    def _drain_pipes(self):
        for fd, name in self._pipes.items():
            while True:
                try:
                    chunk = os.read(fd, 65536)
                except BlockingIOError:
                    break
                if not chunk:
                    break
                text = self._decoders[name].decode(chunk)
                if text:
                    self.events.append((name, text, time.monotonic()))

    def _pop_frame(self):
        while len(self._received) >= 4:
            (length,) = struct.unpack_from(">I", self._received)
            if len(self._received) < 4 + length:
                return None
            payload = bytes(self._received[4:4 + length])
            del self._received[:4 + length]
            if payload[:1] in (b"\x01", b"\x02"):
                assert len(payload) > 1, "a stream frame without text"
                name = "stdout" if payload[:1] == b"\x01" else "stderr"
                text = self._frame_decoders[name].decode(payload[1:])
                if text:
                    self.events.append((name, text, time.monotonic()))
                continue
            return json.loads(payload.decode("utf-8"))
        return None

    def next_frame(self, timeout=DEFAULT_TIMEOUT):
        deadline = time.monotonic() + timeout
        while True:
            frame = self._pop_frame()
            if frame is not None:
                self.events.append(("frame", frame, time.monotonic()))
                return frame
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no frame within {timeout} s; events so far: {self.events[-5:]}")
            readable, _, _ = select.select([self._channel, *self._pipes], [], [], remaining)
            if self._channel in readable:
                chunk = self._channel.recv(1 << 20)
                if not chunk:
                    self._drain_pipes()
                    raise WorkerDied(f"worker closed the channel (exit {self.process.wait(10)}); "
                                     f"output: {self.events[-5:]}")
                self._received += chunk
                continue  # frames first: pipe text still unread was written after them
            if any(fd in readable for fd in self._pipes):
                self._drain_pipes()

    def request(self, kind, timeout=DEFAULT_TIMEOUT, **fields):
        if self._interrupted:
            self.sync()  # as the kernel does after a request it interrupted (PROTOCOL.md, "Signals")
        self._next_id += 1
        request_id = f"req-{self._next_id}"
        start = len(self.events)
        self.send({"type": kind, "id": request_id, **fields})
        while True:
            frame = self.next_frame(timeout)
            if frame["type"] == "reply":
                assert frame["id"] == request_id
                return Exchange(self.events[start:], frame["content"])

    def execute(self, code, timeout=DEFAULT_TIMEOUT, **fields):
        request = {"code": code, "silent": False, "store_history": True, "user_expressions": {},
                   "allow_stdin": False}
        request.update(fields)
        return self.request("execute", timeout=timeout, **request)

    def stop(self):
        if self.process.poll() is None:
            try:
                self.send({"type": "shutdown"})
                self.process.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()
        self._channel.close()
        self.process.stdout.close()
        self.process.stderr.close()
        if hasattr(self.process, "close"):  # forked: the template's connection and the pidfd
            self.process.close()

    def interrupt(self):
        self._interrupted = True
        os.kill(self.process.pid, signal.SIGINT)

    def sync(self, timeout=DEFAULT_TIMEOUT):
        """Sends a sync and waits for its reply, which is left out of the events."""
        self._interrupted = False
        self._next_id += 1
        sync_id = f"sync-{self._next_id}"
        self.send({"type": "sync", "id": sync_id})
        while True:
            frame = self.next_frame(timeout)
            if frame["type"] == "reply":
                assert frame["id"] == sync_id and frame["content"] == {"status": "ok"}, frame
                self.events.pop()
                return


class Exchange:
    """Everything one request produced, in kernel publication order."""

    def __init__(self, events, reply):
        self.events = events
        self.reply = reply

    @property
    def frames(self):
        return [event[1] for event in self.events if event[0] == "frame" and event[1]["type"] != "reply"]

    def frames_of(self, kind):
        return [frame for frame in self.frames if frame["type"] == kind]

    def text(self, stream="stdout"):
        return "".join(event[1] for event in self.events if event[0] == stream)

    @property
    def result(self):
        results = self.frames_of("execute_result")
        assert len(results) == 1, f"expected one execute_result, got {self.frames}"
        return results[0]

    def assert_ok(self):
        assert self.reply["status"] == "ok", self.reply
        return self


@pytest.fixture
def worker(tmp_path):
    process = WorkerProcess(tmp_path)
    yield process
    process.stop()


@pytest.fixture
def make_worker(tmp_path):
    started = []

    def make(**options):
        process = WorkerProcess(tmp_path, **options)
        started.append(process)
        return process

    yield make
    for process in started:
        process.stop()
