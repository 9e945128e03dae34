"""Fixtures for the Python SDK tests: the SDK installed with pip into a temporary directory (proving the package
installs, without touching the system python) and a real cellblock-gateway from $CELLBLOCK_PREFIX, started by the
gateway tests' harness."""
import importlib
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(SOURCE / "tests" / "gateway"))
from gateway_harness import Gateway as GatewayProcess  # noqa: E402


@pytest.fixture(scope="session")
def sdk_target(tmp_path_factory):
    """The directory pip installed the SDK into. The source is copied first: an in-tree build would leave
    build/ and *.egg-info in the work tree."""
    work = tmp_path_factory.mktemp("sdk")
    copy = work / "source"
    shutil.copytree(SOURCE / "clients" / "python", copy, ignore=shutil.ignore_patterns("__pycache__"))
    target = work / "site"
    completed = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
         "--disable-pip-version-check", "--target", str(target), str(copy)],
        capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    return target


@pytest.fixture(scope="session")
def cellblock(sdk_target):
    sys.path.insert(0, str(sdk_target))
    module = importlib.import_module("cellblock")
    assert Path(module.__file__).resolve().is_relative_to(sdk_target.resolve()), module.__file__
    return module


@pytest.fixture(scope="session")
def gateway_process():
    process = GatewayProcess()
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture
def gw(cellblock, gateway_process):
    with cellblock.Gateway(gateway_process.url, gateway_process.token, timeout=120) as client:
        yield client


class DroppingProxy:
    """A TCP proxy in front of the gateway that closes, unanswered, every connection whose request line contains
    `drop` while `drops_left` > 0 (after reading the request headers), and forwards the others with
    `Connection: close`, so each request arrives on its own connection and is seen here. `request_lines` lists
    every request line received, dropped or not."""

    def __init__(self, upstream_url):
        host, port = upstream_url.split("//", 1)[1].split(":")
        self.upstream = (host, int(port))
        self.drop = b"\x00never"
        self.drops_left = 0
        self.request_lines = []
        self.lock = threading.Lock()
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client):
        with client:
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = client.recv(65536)
                if not chunk:
                    return
                head += chunk
            request_line, _, rest = head.partition(b"\r\n")
            with self.lock:
                self.request_lines.append(request_line.decode("latin-1"))
                dropping = self.drop in request_line and self.drops_left > 0
                if dropping:
                    self.drops_left -= 1
            if dropping:
                return
            with socket.create_connection(self.upstream) as upstream:
                headers, _, body = rest.partition(b"\r\n\r\n")
                kept = [line for line in headers.split(b"\r\n") if not line.lower().startswith(b"connection:")]
                upstream.sendall(b"\r\n".join([request_line, *kept, b"Connection: close"]) + b"\r\n\r\n" + body)
                threading.Thread(target=self._pipe, args=(client, upstream), daemon=True).start()
                self._pipe(upstream, client)

    @staticmethod
    def _pipe(source, destination):
        try:
            while True:
                chunk = source.recv(65536)
                if not chunk:
                    break
                destination.sendall(chunk)
        except OSError:
            pass
        try:
            destination.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def matching(self, fragment):
        with self.lock:
            return [line for line in self.request_lines if fragment in line]

    def close(self):
        self.listener.close()


@pytest.fixture
def proxy(gateway_process):
    server = DroppingProxy(gateway_process.url)
    try:
        yield server
    finally:
        server.close()
