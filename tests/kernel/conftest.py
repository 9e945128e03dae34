"""Fixtures for driving the installed cellblock-kernel through jupyter_client.

ctest sets JUPYTER_PATH=<prefix>/share/jupyter, so KernelManager(kernel_name="cellblock-python") finds the
installed kernelspec. Every kernel a test starts is shut down (and killed if need be) at the end.
"""
from __future__ import annotations

import json
import os
import queue
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from jupyter_client import KernelManager
from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

import cellblock_zygote  # tests/plugins (PYTHONPATH)

KERNEL_NAME = "cellblock-python"
START_TIMEOUT = 60


@pytest.fixture(scope="session", autouse=True)
def zygote_switch(tmp_path_factory):
    """CELLBLOCK_TEST_ZYGOTE=1 (tests/plugins/cellblock_zygote.py): every kernel of the suite runs with
    `worker.zygote: true` — a kernelspec of the same name whose config says so comes first on JUPYTER_PATH."""
    import cellblock_zygote

    if not cellblock_zygote.ENABLED:
        yield None
        return
    _require_kernelspec()
    installed = KernelSpecManager().get_kernel_spec(KERNEL_NAME)
    argv = list(installed.argv)
    config_path = Path(argv[argv.index("--config") + 1])
    config = cellblock_zygote.switch_config(cellblock_zygote.resolved_config(config_path))
    root = tmp_path_factory.mktemp("zygote-kernelspec")
    (root / "kernel-config.json").write_text(json.dumps(config))
    argv[argv.index("--config") + 1] = str(root / "kernel-config.json")
    spec = installed.to_dict()
    spec["argv"] = argv
    (root / "kernels" / KERNEL_NAME).mkdir(parents=True)
    (root / "kernels" / KERNEL_NAME / "kernel.json").write_text(json.dumps(spec))
    previous = os.environ.get("JUPYTER_PATH")
    os.environ["JUPYTER_PATH"] = os.pathsep.join([str(root)] + ([previous] if previous else []))
    # The tenant's first launch starts the template and goes by exec: warm it up, so that the suite's
    # workers are forks.
    warm = Kernel()
    try:
        cellblock_zygote.template_serving(config["sandbox_policy"], timeout=240)
    finally:
        warm.shutdown()
    yield config
    cellblock_zygote.TALLY.require_forks("tests/kernel")
    if previous is None:
        del os.environ["JUPYTER_PATH"]
    else:
        os.environ["JUPYTER_PATH"] = previous
    cellblock_zygote.stop_templates(config["sandbox_policy"])


def _require_kernelspec() -> None:
    try:
        KernelSpecManager().get_kernel_spec(KERNEL_NAME)
    except NoSuchKernel:
        pytest.fail(f"kernelspec {KERNEL_NAME!r} not found; JUPYTER_PATH={os.environ.get('JUPYTER_PATH')!r} "
                    "(install cellblock and point JUPYTER_PATH at <prefix>/share/jupyter)")


def control_request(client, msg_type: str, content: dict, timeout: float = 10) -> dict:
    """Sends a signed control request from `client` and returns its reply (other control traffic is skipped)."""
    request = client.session.msg(msg_type, content=content)
    client.control_channel.send(request)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            reply = client.get_control_msg(timeout=0.2)
        except queue.Empty:
            continue
        if reply["parent_header"].get("msg_id") == request["header"]["msg_id"]:
            return reply
    raise TimeoutError(f"no reply to {msg_type} within {timeout} s")


@dataclass
class Run:
    """One execute: the reply, the IOPub messages for it (with arrival times) and stdin traffic."""
    reply: dict
    outputs: list = field(default_factory=list)      # (seconds since the request, msg)
    published: list = field(default_factory=list)    # msg_id of every IOPub message for it but the idle, in order
    input_requests: list = field(default_factory=list)

    @property
    def content(self) -> dict:
        return self.reply["content"]

    @property
    def outcome(self) -> dict:
        """What happened (metadata.cellblock) without the ordering hint beside it, which is checked here: it
        names the IOPub message the kernel published last before the reply, this execute's last before idle."""
        ours = dict(self.reply["metadata"]["cellblock"])
        named = ours.pop("last_iopub_msg_id")
        assert self.published and named == self.published[-1], (named, self.published)
        return ours

    def of_type(self, msg_type: str) -> list:
        return [msg for _, msg in self.outputs if msg["msg_type"] == msg_type]

    def stream_text(self, name: str = "stdout") -> str:
        return "".join(m["content"]["text"] for m in self.of_type("stream") if m["content"]["name"] == name)


class Kernel:
    """A started kernel with a connected client and helpers to execute code."""

    def __init__(self, extra_env: dict | None = None, key: bytes | None = None, stderr=None):
        _require_kernelspec()
        self.manager = KernelManager(kernel_name=KERNEL_NAME)
        if key is not None:
            self.manager.session.key = key  # written to the connection file; b"" = unsigned messages
        env = dict(os.environ)
        env.update(extra_env or {})
        started = time.monotonic()
        self.manager.start_kernel(env=env, **({"stderr": stderr} if stderr is not None else {}))
        self.client = self.manager.client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=START_TIMEOUT)
        self.start_seconds = time.monotonic() - started
        self._iopub_stash: dict = {}
        self._shell_stash: dict = {}

    @property
    def pid(self) -> int:
        return self.manager.provisioner.process.pid

    def execute(self, code: str, timeout: float = 60, stop_on_error: bool = True, allow_stdin: bool = False,
                answers: list | None = None, silent: bool = False, user_expressions: dict | None = None) -> Run:
        kc = self.client
        msg_id = kc.execute(code, silent=silent, stop_on_error=stop_on_error, allow_stdin=allow_stdin,
                            user_expressions=user_expressions or {})
        return self.collect(msg_id, timeout, answers)

    def collect(self, msg_id: str, timeout: float = 60, answers: list | None = None) -> Run:
        """Waits for the reply and the IOPub idle of msg_id, answering input requests from `answers`.

        Messages for other requests are kept for their own collect() call (requests may be queued)."""
        kc = self.client
        started = time.monotonic()
        deadline = started + timeout
        run = Run(reply={})
        idle = False
        pending_answers = list(answers or [])
        for msg in self._iopub_stash.pop(msg_id, []):
            idle = self._note_iopub(run, msg, started) or idle
        if msg_id in self._shell_stash:
            run.reply = self._shell_stash.pop(msg_id)
        while not run.reply or not idle:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no reply/idle within {timeout} s; got {[m['msg_type'] for _, m in run.outputs]}")
            if answers is not None:
                try:
                    request = kc.get_stdin_msg(timeout=0.01)
                    run.input_requests.append(request)
                    kc.input(pending_answers.pop(0) if pending_answers else "")
                except queue.Empty:
                    pass
            try:
                msg = kc.get_iopub_msg(timeout=0.02)
                parent = msg["parent_header"].get("msg_id")
                if parent == msg_id:
                    idle = self._note_iopub(run, msg, started) or idle
                else:
                    self._iopub_stash.setdefault(parent, []).append(msg)
            except queue.Empty:
                pass
            if not run.reply:
                try:
                    msg = kc.get_shell_msg(timeout=0.01)
                    parent = msg["parent_header"].get("msg_id")
                    if parent == msg_id:
                        run.reply = msg
                    else:
                        self._shell_stash[parent] = msg
                except queue.Empty:
                    pass
        return run

    def wait_for_stdout(self, msg_id: str, text: str, timeout: float = 60) -> None:
        """Returns once msg_id's stdout contains `text` (so the cell is running); collect() still sees every message."""
        deadline = time.monotonic() + timeout
        seen = ""
        while text not in seen:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{text!r} not printed within {timeout} s; stdout so far: {seen!r}")
            try:
                msg = self.client.get_iopub_msg(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            parent = msg["parent_header"].get("msg_id")
            self._iopub_stash.setdefault(parent, []).append(msg)
            if parent == msg_id and msg["msg_type"] == "stream" and msg["content"]["name"] == "stdout":
                seen += msg["content"]["text"]

    @staticmethod
    def _note_iopub(run: Run, msg: dict, started: float) -> bool:
        """Records an output; returns True for the idle status that ends the request."""
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return True
        run.published.append(msg["header"]["msg_id"])
        if msg["msg_type"] == "status":
            return False
        run.outputs.append((time.monotonic() - started, msg))
        return False

    def shutdown(self) -> None:
        if cellblock_zygote.ENABLED and self.manager.has_kernel:
            cellblock_zygote.TALLY.note(self.pid)
        try:
            self.client.stop_channels()
        finally:
            if self.manager.has_kernel:
                self.manager.shutdown_kernel(now=False)


@pytest.fixture(scope="module")
def kernel():
    """One kernel shared by the tests of a module (they must leave it usable)."""
    k = Kernel()
    yield k
    k.shutdown()


@pytest.fixture
def fresh_kernel():
    """A kernel of its own, for tests that crash, kill or restart it."""
    kernels = []

    def start(key: bytes | None = None, stderr=None, **extra_env):
        k = Kernel(extra_env={name: str(value) for name, value in extra_env.items()}, key=key, stderr=stderr)
        kernels.append(k)
        return k

    yield start
    for k in kernels:
        try:
            k.shutdown()
        except Exception:
            pass
