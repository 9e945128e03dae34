"""Fixtures for the agent API tests: the installed cellblock-gateway on a free port with a token and a temporary
agent state directory, plus a small HTTP helper. Everything goes through real HTTP connections."""
import os
import re
import secrets
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import requests

PREFIX = Path(os.environ["CELLBLOCK_PREFIX"]) if os.environ.get("CELLBLOCK_PREFIX") else None
GATEWAY_BINARY = PREFIX / "bin" / "cellblock-gateway" if PREFIX else None
CLI_BINARY = PREFIX / "bin" / "cellblock" if PREFIX else None
KERNELSPEC = PREFIX / "share" / "jupyter" / "kernels" / "cellblock-python" / "kernel.json" if PREFIX else None
# Generous: CI is a loaded 2-core machine. None of these is a speed assertion.
STARTUP_TIMEOUT_S = 60
REQUEST_TIMEOUT_S = 120


def _absent_reason():
    if PREFIX is None:
        return "CELLBLOCK_PREFIX is not set (run through ctest, which installs the tree first)"
    if not os.access(GATEWAY_BINARY, os.X_OK):
        return f"cellblock-gateway is not installed at {GATEWAY_BINARY}"
    if not KERNELSPEC.is_file():
        return f"the cellblock kernel is not installed ({KERNELSPEC} missing)"
    return None


def pytest_collection_modifyitems(config, items):
    # Not a skip: a suite that did not run must not look green (tests/README.md, skip policy).
    reason = _absent_reason()
    if reason:
        raise pytest.UsageError(reason)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class AgentGateway:
    """One cellblock-gateway process; `state_dir` is its state directory (the store with session records and audit
    trails, kernels' sockets and workspaces). Its kernels stop with it unless `keep_kernels` (then SIGTERM leaves them
    running for the next gateway on the same state directory, as in production)."""

    def __init__(self, state_dir: Path, log_path: Path, *extra_arguments: str, keep_kernels: bool = False):
        self.port = free_port()
        self.token = secrets.token_hex(16)
        self.url = f"http://127.0.0.1:{self.port}"
        self.state_dir = state_dir
        self.log_path = log_path
        env = {k: v for k, v in os.environ.items() if not k.startswith("KG_")}
        env.setdefault("JUPYTER_PATH", str(PREFIX / "share" / "jupyter"))
        self._log = open(log_path, "ab")
        self.process = subprocess.Popen(
            [str(GATEWAY_BINARY), "--ip", "127.0.0.1", "--port", str(self.port), "--token", self.token,
             "--kernelspec-dir", str(KERNELSPEC.parent.parent), "--state-dir", str(state_dir),
             *([] if keep_kernels else ["--shutdown-kernels-on-exit"]), *extra_arguments],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        self.http = requests.Session()
        self.http.headers["Authorization"] = f"token {self.token}"
        ready = re.compile(rf"is available at http://127\.0\.0\.1:{self.port}\b")
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"gateway exited with {self.process.returncode}:\n{self.log_tail()}")
            if ready.search(log_path.read_text(errors="replace")):
                return
            time.sleep(0.05)
        self.stop()
        raise AssertionError(f"gateway not ready within {STARTUP_TIMEOUT_S} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def request(self, method: str, path: str, **kwargs) -> requests.Response:
        kwargs.setdefault("timeout", REQUEST_TIMEOUT_S)
        return self.http.request(method, self.url + path, **kwargs)

    def create_session(self, name=None, limits=None) -> dict:
        body = {}
        if name:
            body["name"] = name
        if limits:
            body["limits"] = limits
        response = self.request("POST", "/agent/v1/sessions", json=body)
        assert response.status_code == 201, f"{response.status_code} {response.text}\n{self.log_tail()}"
        return response.json()

    def execute(self, session: str, code: str, **extra) -> dict:
        response = self.request("POST", f"/agent/v1/sessions/{session}/execute", json={"code": code, **extra})
        assert response.status_code == 200, f"{response.status_code} {response.text}\n{self.log_tail()}"
        return response.json()

    def assert_alive(self):
        assert self.process.poll() is None, f"gateway died ({self.process.returncode}):\n{self.log_tail()}"

    def stop(self, grace_s: float = 20, sig: int = signal.SIGTERM) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.http.close()
        self._log.close()
        return self.process.returncode


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    """A gateway shared by a module's tests: short interrupt grace and keepalive so those paths run quickly."""
    directory = tmp_path_factory.mktemp("agent-gateway")
    server = AgentGateway(directory / "state", directory / "gateway.log",
                          "--agent-interrupt-grace", "2", "--agent-keepalive", "0.5")
    try:
        yield server
    finally:
        server.stop()
