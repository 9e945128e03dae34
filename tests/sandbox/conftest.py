"""Harness for the hostile battery: runs attack code inside the installed cellblock-sandbox and gives
tests host-side witnesses (listeners, secrets, process scans) to prove that nothing leaked."""
import hashlib
import json
import os
import secrets
import shutil
import socket
import subprocess
import textwrap
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

PREFIX = Path(os.environ.get("CELLBLOCK_PREFIX", "/usr/local"))
SANDBOX = PREFIX / "bin" / "cellblock-sandbox"
DEFAULT_POLICY = PREFIX / "share" / "cellblock" / "sandbox-policy.json"
# The battery leases uids from its own range, so that "no process of the session uid is left" can never
# see a sandbox of another test suite that happens to reuse the uid right after ours.
UID_FIRST, UID_COUNT = 260000, 1000

# Prepended to every attack: a raw syscall helper and a way to report results as one JSON line.
PRELUDE = textwrap.dedent(
    """
    import ctypes, errno, json, os, socket, sys
    libc = ctypes.CDLL(None, use_errno=True)
    def syscall(number, *args):
        ctypes.set_errno(0)
        result = libc.syscall(ctypes.c_long(number), *[ctypes.c_long(a) for a in args])
        return result, errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno())) if result < 0 else "OK"
    def report(**values):
        print("RESULT " + json.dumps(values), flush=True)
    """
)


@pytest.fixture(scope="session", autouse=True)
def zygote_templates_stopped():
    """With CELLBLOCK_TEST_ZYGOTE=1 the kernels of this run share a template (tests/plugins/cellblock_zygote.py):
    it does not outlive the run."""
    yield
    import cellblock_zygote

    cellblock_zygote.stop_templates(DEFAULT_POLICY)  # test_zygote_template.py starts some whatever the switch
    if cellblock_zygote.ENABLED:
        cellblock_zygote.TALLY.require_forks("tests/sandbox")


def pytest_collection_modifyitems(config, items):
    # Not a skip: a hostile battery that did not run must not look green (tests/README.md, skip policy).
    if "CELLBLOCK_PREFIX" not in os.environ:
        raise pytest.UsageError("set CELLBLOCK_PREFIX to the cellblock under test (ctest sets the staged prefix; "
                                "/usr/local for the one start.sh installed)")
    if not SANDBOX.exists():
        raise pytest.UsageError(f"{SANDBOX} is not installed (build, `cmake --install`, set CELLBLOCK_PREFIX)")
    if os.geteuid() != 0:
        raise pytest.UsageError("the hostile battery needs root: the sandbox maps a dedicated host uid")


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    uid: int            # the session's host uid (the workspace is chowned to it)
    workspace: Path
    seconds: float

    def result(self):
        """The JSON the attack reported with report(...)."""
        for line in self.stdout.splitlines():
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT "):])
        raise AssertionError(f"no RESULT line; rc={self.returncode}\nstdout={self.stdout[-2000:]}\nstderr={self.stderr[-2000:]}")

    @property
    def output(self):
        return self.stdout + self.stderr


def session_processes(uid):
    """Host pids (and names) of processes running as `uid`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("Uid:") and int(line.split()[1]) == uid:
                found.append((int(entry.name), status.splitlines()[0]))
    return found


def assert_no_session_process(uid):
    # The pid namespace dies with its pid 1 before the CLI returns; allow a moment for reaping (generous:
    # the test machine may be heavily loaded).
    for _ in range(100):
        left = session_processes(uid)
        if not left:
            return
        time.sleep(0.1)
    raise AssertionError(f"processes of session uid {uid} outlived the sandbox: {left}")


def sha256(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


class Sandbox:
    def __init__(self, tmp_path, default_policy):
        self.tmp_path = tmp_path
        self.default_policy = default_policy
        self.count = 0

    def workspace(self):
        self.count += 1
        path = self.tmp_path / f"ws{self.count}"
        path.mkdir()
        return path

    def command(self, argv, *, workspace, policy=None, memory_mb=None, timeout=None, output_bytes=None):
        cmd = [str(SANDBOX), "--workspace", str(workspace), "--policy", str(policy or self.default_policy)]
        if memory_mb:
            cmd += ["--memory-mb", str(memory_mb)]
        if timeout:
            cmd += ["--timeout", str(timeout)]
        if output_bytes:
            cmd += ["--output-bytes", str(output_bytes)]
        return cmd + ["--"] + list(argv)

    def run(self, argv, *, workspace=None, env=None, pass_fds=(), limit=120, check_leftovers=True, **options):
        workspace = workspace or self.workspace()
        started = time.monotonic()
        completed = subprocess.run(
            self.command(argv, workspace=workspace, **options), capture_output=True, text=True, errors="replace",
            env=env if env is not None else os.environ.copy(), pass_fds=pass_fds, timeout=limit, stdin=subprocess.DEVNULL)
        seconds = time.monotonic() - started
        uid = workspace.stat().st_uid
        assert UID_FIRST <= uid < UID_FIRST + UID_COUNT, f"workspace not owned by a session uid: {uid}"
        if check_leftovers:
            assert_no_session_process(uid)
        return Run(completed.returncode, completed.stdout, completed.stderr, uid, workspace, seconds)

    def python(self, code, **kwargs):
        return self.run(["/usr/bin/python3", "-c", PRELUDE + textwrap.dedent(code)], **kwargs)

    def spawn_python(self, code, *, workspace=None, **options):
        """Starts a sandbox in the background; returns (Popen, workspace)."""
        workspace = workspace or self.workspace()
        process = subprocess.Popen(
            self.command(["/usr/bin/python3", "-c", PRELUDE + textwrap.dedent(code)], workspace=workspace, **options),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
        return process, workspace


def battery_policy():
    """The installed default policy, with the battery's own uid range."""
    policy = json.loads(DEFAULT_POLICY.read_text())
    policy["uid_range"] = {"first": UID_FIRST, "count": UID_COUNT}
    return policy


@pytest.fixture(scope="session")
def default_policy(tmp_path_factory):
    path = tmp_path_factory.mktemp("policy") / "battery-policy.json"
    path.write_text(json.dumps(battery_policy()))
    return path


@pytest.fixture
def sandbox(tmp_path, default_policy):
    return Sandbox(tmp_path, default_policy)


@pytest.fixture
def small_policy(tmp_path):
    """The default policy with small limits, so that resource attacks end quickly."""
    policy = battery_policy()
    policy["limits"].update({"memory": "256M", "pids": 64, "file_size": "16M", "open_files": 64})
    for mount in policy["mounts"]:
        if mount["target"] == "/tmp":
            mount["size"] = "8M"
    path = tmp_path / "small-policy.json"
    path.write_text(json.dumps(policy))
    return path


@pytest.fixture
def host_secret(tmp_path):
    """A random secret in a host file, outside any workspace."""
    value = "HOSTSECRET-" + secrets.token_hex(16)
    path = tmp_path / "host-secret.txt"
    path.write_text(value + "\n")
    path.chmod(0o644)
    return value, path


class Listener:
    """A host socket that records every connection or datagram it receives."""

    def __init__(self, family, kind, address):
        self.sock = socket.socket(family, kind)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(address)
        self.kind = kind
        if kind == socket.SOCK_STREAM:
            self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.address = self.sock.getsockname()
        self.events = []
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while not self.stopped.is_set():
            try:
                if self.kind == socket.SOCK_STREAM:
                    connection, peer = self.sock.accept()
                    self.events.append(("connect", peer))
                    connection.close()
                else:
                    data, peer = self.sock.recvfrom(65536)
                    self.events.append(("datagram", peer, data))
            except (socket.timeout, OSError):
                continue

    def close(self):
        self.stopped.set()
        self.thread.join()
        self.sock.close()


@pytest.fixture
def listeners():
    opened = []

    def open_listener(family, kind, address):
        listener = Listener(family, kind, address)
        opened.append(listener)
        return listener

    yield open_listener
    for listener in opened:
        listener.close()


def host_ip():
    """The host's address on its default route (no packet is sent)."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("10.255.255.255", 1))
        return probe.getsockname()[0]
    except OSError:
        return "127.0.0.1"
    finally:
        probe.close()


@pytest.fixture
def canary():
    """A host process (as root) that must survive whatever the sandbox does."""
    process = subprocess.Popen(["/usr/bin/sleep", "300"])
    yield process
    process.kill()
    process.wait()
