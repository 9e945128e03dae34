"""A local "internet" for the network tests: a test CA and one server certificate made with the openssl
CLI, HTTPS (443) and HTTP (80) servers on 127.x.y.z addresses for pypi.test, files.test, evil.test, ..., each
logging every request and every TLS server name it was asked for (the host-side proof of what reached it), a PEP 503
index with a tiny wheel on pypi.test, and the hosts(5) file that pins those names for the gateway's
--egress-hosts. Used by tests/agent/test_network.py and tests/bench/bench_egress.py. Nothing leaves the machine."""
import base64
import hashlib
import io
import json
import os
import random
import socket
import subprocess
import sys
import time
import zipfile
from pathlib import Path

SERVER_SCRIPT = r'''
import http.server, json, os, ssl, sys, threading, urllib.parse

name, address, cert, key, root, log_path = sys.argv[1:]
log_lock = threading.Lock()

def log(entry):
    with log_lock, open(log_path, "a") as out:
        out.write(json.dumps(entry) + "\n")

CHUNK = b"x" * (1 << 16)

class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def send_body(self, body, content_type="text/plain", status=200, extra=()):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for header, value in extra:
            self.send_header(header, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_HEAD(self):
        self.do_GET()

    def do_GET(self):
        url = urllib.parse.urlsplit(self.path)
        query = urllib.parse.parse_qs(url.query)
        log({"server": name, "path": self.path, "host": self.headers.get("Host"),
             "tls": isinstance(self.connection, ssl.SSLSocket)})
        if url.path == "/hello":
            return self.send_body(f"hello from {name}\n".encode())
        if url.path == "/redirect":
            return self.send_body(b"moved\n", status=302, extra=[("Location", query["to"][0])])
        if url.path == "/bytes":
            size = int(query["n"][0])
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(size))
            self.end_headers()
            while size > 0:
                part = CHUNK[:min(size, len(CHUNK))]
                self.wfile.write(part)
                size -= len(part)
            return
        if url.path.startswith("/simple"):
            parts = [part for part in url.path.split("/") if part]
            if len(parts) == 1:
                links = "".join(f'<a href="/simple/{p}/">{p}</a>' for p in sorted(os.listdir(root)))
                return self.send_body(f"<html><body>{links}</body></html>".encode(), "text/html")
            if len(parts) == 2 and os.path.isdir(os.path.join(root, parts[1])):
                links = ""
                for wheel in sorted(os.listdir(os.path.join(root, parts[1]))):
                    with open(os.path.join(root, parts[1], wheel), "rb") as f:
                        import hashlib
                        digest = hashlib.sha256(f.read()).hexdigest()
                    links += f'<a href="/files/{parts[1]}/{wheel}#sha256={digest}">{wheel}</a>'
                return self.send_body(f"<html><body>{links}</body></html>".encode(), "text/html")
        if url.path.startswith("/files/"):
            path = os.path.join(root, url.path[len("/files/"):])
            if os.path.isfile(path):
                with open(path, "rb") as f:
                    return self.send_body(f.read(), "application/octet-stream")
        self.send_body(b"not found\n", status=404)

class Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    address_family = __import__("socket").AF_INET

plain = Server((address, 80), Handler)
secure = Server((address, 443), Handler)
context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
context.load_cert_chain(cert, key)
def on_server_name(connection, server_name, ctx):
    log({"server": name, "sni": server_name})
context.sni_callback = on_server_name
secure.socket = context.wrap_socket(secure.socket, server_side=True)
for server in (plain, secure):
    threading.Thread(target=server.serve_forever, daemon=True).start()
print("ready", flush=True)
sys.stdin.read()
'''

NAMES = ["pypi.test", "files.test", "evil.test", "held.test", "late.test", "denied.test", "bulk.test"]


def _openssl(directory: Path, *arguments: str):
    subprocess.run(["openssl", *arguments], cwd=directory, check=True, capture_output=True)


def make_certificates(directory: Path, names, addresses):
    _openssl(directory, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
             "-days", "2", "-subj", "/CN=cellblock test CA")
    alt = ",".join([f"DNS:{name}" for name in names] + [f"IP:{address}" for address in addresses])
    (directory / "server.ext").write_text(
        f"subjectAltName={alt}\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=serverAuth\n")
    _openssl(directory, "req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
             "-subj", "/CN=cellblock test server")
    _openssl(directory, "x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "server.pem", "-days", "2", "-extfile", "server.ext")


def make_wheel(directory: Path, name="tinypkg", version="1.0") -> Path:
    """A minimal pure-Python wheel: a module plus dist-info METADATA, WHEEL and RECORD."""
    files = {
        f"{name}/__init__.py": f'GREETING = "hello from {name} {version}"\n'.encode(),
        f"{name}-{version}.dist-info/METADATA":
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\nSummary: cellblock test package\n".encode(),
        f"{name}-{version}.dist-info/WHEEL":
            b"Wheel-Version: 1.0\nGenerator: cellblock-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = ""
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record += f"{path},sha256={digest},{len(data)}\n"
    record += f"{name}-{version}.dist-info/RECORD,,\n"
    files[f"{name}-{version}.dist-info/RECORD"] = record.encode()
    package_dir = directory / name
    package_dir.mkdir(parents=True, exist_ok=True)
    wheel = package_dir / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
        for path, data in files.items():
            archive.writestr(path, data)
    return wheel


def _address_free(address: str) -> bool:
    for port in (80, 443):
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((address, port))
            except OSError:
                return False
    return True


class LocalInternet:
    """Servers for NAMES on their own loopback addresses (443 and 80 each), their request logs, the CA."""

    def __init__(self, directory: Path, names=NAMES):
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        # A block of 127/8 no other test on this machine is likely to use at the same time.
        rng = random.Random(os.getpid() ^ int(time.time()))
        while True:
            prefix = f"127.{rng.randint(20, 250)}.{rng.randint(1, 250)}."
            self.addresses = {name: prefix + str(index + 2) for index, name in enumerate(names)}
            if all(_address_free(address) for address in self.addresses.values()):
                break
        make_certificates(directory, list(names) + ["localhost"], list(self.addresses.values()))
        self.ca_path = directory / "ca.pem"
        self.index_root = directory / "index"
        self.wheel = make_wheel(self.index_root)
        self.hosts_file = directory / "egress-hosts"
        self.hosts_file.write_text("# pinned for the cellblock network tests\n" +
                                   "".join(f"{address}\t{name}\n" for name, address in self.addresses.items()))
        script = directory / "server.py"
        script.write_text(SERVER_SCRIPT)
        self.processes = []
        self.logs = {}
        for name, address in self.addresses.items():
            log_path = directory / f"{name}.log"
            log_path.write_text("")
            self.logs[name] = log_path
            process = subprocess.Popen(
                [sys.executable, str(script), name, address, str(directory / "server.pem"),
                 str(directory / "server.key"), str(self.index_root), str(log_path)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            self.processes.append(process)
            line = process.stdout.readline()
            if line.strip() != b"ready":
                self.stop()
                raise AssertionError(f"server for {name} did not start: {process.stderr.read().decode()}")

    def requests_seen(self, name):
        """What reached `name`'s server (requests and TLS server names), read on the host."""
        text = self.logs[name].read_text()
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def server_names_seen(self):
        return {entry["sni"] for name in self.logs for entry in self.requests_seen(name) if "sni" in entry}

    def stop(self):
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait()
