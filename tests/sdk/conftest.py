"""Fixtures for the Python SDK tests: the SDK installed with pip into a temporary directory (proving the package
installs, without touching the system python) and a real cellblock-gateway from $CELLBLOCK_PREFIX, started by the
gateway tests' harness."""
import http.server
import importlib
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import threading
import time
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


class LocalTcpServer:
    """A listener on 127.0.0.1 serving each accepted connection on a thread of its own (`_serve`), noting every
    request line it reads in `request_lines`."""

    def __init__(self):
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
            self._accepted(client)
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _accepted(self, client):
        """Called with each connection before it is served."""

    def _serve(self, client):
        raise NotImplementedError

    def matching(self, fragment):
        with self.lock:
            return [line for line in self.request_lines if fragment in line]

    def close(self):
        self.listener.close()


class DroppingProxy(LocalTcpServer):
    """A TCP proxy in front of the gateway that closes, unanswered, every connection whose request line contains
    `drop` while `drops_left` > 0 (after reading the request headers), and forwards the others with
    `Connection: close`, so each request arrives on its own connection and is seen here. `request_lines` lists
    every request line received, dropped or not."""

    def __init__(self, upstream_url):
        host, port = upstream_url.split("//", 1)[1].split(":")
        self.upstream = (host, int(port))
        self.drop = b"\x00never"
        self.drops_left = 0
        super().__init__()

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


@pytest.fixture
def proxy(gateway_process):
    server = DroppingProxy(gateway_process.url)
    try:
        yield server
    finally:
        server.close()


class HostServer:
    """An HTTP server on a loopback address of its own (127.x.y.7, any port) that answers every GET with
    `hello from the host` and records its path in `hits`: the host-side proof of what a session's code reached."""

    def __init__(self):
        hits = self.hits = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *arguments):
                pass

            def do_GET(self):
                hits.append(self.path)
                body = b"hello from the host\n"
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        rng = random.Random(os.getpid() ^ time.monotonic_ns())
        for _ in range(50):
            self.address = f"127.{rng.randint(20, 250)}.{rng.randint(1, 250)}.7"
            try:
                self.server = http.server.ThreadingHTTPServer((self.address, 0), Handler)
                break
            except OSError:
                continue
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def asking_gateway(tmp_path_factory):
    """A gateway whose ceiling allows *.test on the host server's port, with `approval.test` pinned to the host
    server's address (--egress-hosts): a session with {"allow": [], "ask": True} has each of its connections to
    approval.test held for a decision. Yields (gateway process, host server)."""
    directory = tmp_path_factory.mktemp("asking")
    host = HostServer()
    hosts_file = directory / "egress-hosts"
    hosts_file.write_text(f"{host.address}\tapproval.test\n")
    config = directory / "gateway-config.json"
    config.write_text(json.dumps({"network": {"ports": [host.port]}}))
    process = GatewayProcess("--config", str(config), "--network-allow", "*.test", "--egress-hosts", str(hosts_file),
                             "--network-approval-timeout", "60")
    try:
        yield process, host
    finally:
        process.stop()
        host.close()


class SilentServer(LocalTcpServer):
    """A gateway that accepts TCP connections and reads requests but never answers, except that an /execute
    request gets, when `stream_head` is set, the head of an NDJSON stream and one stdout line, then silence.
    `request_lines` lists the request lines read."""

    STREAM_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\nTransfer-Encoding: chunked\r\n\r\n")

    def __init__(self):
        self.stream_head = False
        self.connections = []
        super().__init__()

    def _accepted(self, client):
        with self.lock:
            self.connections.append(client)

    def _serve(self, client):
        head = b""
        try:
            while True:
                chunk = client.recv(65536)
                if not chunk:
                    return
                head += chunk
                while b"\r\n\r\n" in head:
                    request, _, head = head.partition(b"\r\n\r\n")
                    line = request.partition(b"\r\n")[0].decode("latin-1")
                    with self.lock:
                        self.request_lines.append(line)
                    if self.stream_head and "/execute" in line:
                        event = json.dumps({"type": "stdout", "text": "started\n"}).encode() + b"\n"
                        client.sendall(self.STREAM_HEAD + b"%x\r\n%s\r\n" % (len(event), event))
        except OSError:
            return

    def close(self):
        super().close()
        with self.lock:
            for connection in self.connections:
                connection.close()


@pytest.fixture
def silent():
    server = SilentServer()
    try:
        yield server
    finally:
        server.close()
