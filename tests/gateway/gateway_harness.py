"""Starts cellblock-gateway processes and talks to them over real HTTP and WebSocket connections.

The gateway under test is the installed one ($CELLBLOCK_PREFIX/bin/cellblock-gateway). Kernels come from the
installed cellblock kernelspec. A missing gateway or kernelspec is a failure, never a skip (tests/README.md).
"""
import json
import os
import pathlib
import queue
import re
import shutil
import signal
import struct
import subprocess
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest
import requests
import websocket

PREFIX = pathlib.Path(os.environ.get("CELLBLOCK_PREFIX", "/usr/local"))
TOKEN = "test-token"
START_TIMEOUT = 60  # seconds; kernels on a loaded 2-core CI machine can be slow
V1 = "v1.kernel.websocket.jupyter.org"


def _die_with_parent():
    """PR_SET_PDEATHSIG: a gateway must not outlive a test run that was killed (e.g. by a ctest timeout)."""
    import ctypes
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)


def gateway_binary():
    binary = PREFIX / "bin" / "cellblock-gateway"
    if not binary.exists():
        pytest.fail(f"cellblock-gateway is not installed at {binary} (build and `cmake --install` first)")
    return str(binary)


def kernelspec_arguments():
    spec = PREFIX / "share" / "jupyter" / "kernels" / "cellblock-python" / "kernel.json"
    if not spec.exists():
        pytest.fail(f"the cellblock kernel is not installed ({spec} missing); build with CELLBLOCK_BUILD_KERNEL=ON")
    return ["--kernelspec-dir", str(spec.parent.parent)]


class Gateway:
    """One cellblock-gateway process on a free port."""

    def __init__(self, *arguments, token=TOKEN, env=None, warm_pool=1, state_dir=None, keep_kernels=False, port=0):
        """`state_dir`: where the gateway keeps its store and kernels (a fresh temporary one by default; pass the
        same one to a second Gateway to test re-adoption). Kernels are stopped when the gateway stops unless
        `keep_kernels` (then SIGTERM leaves them running for the next gateway, as in production)."""
        self.owns_state_dir = state_dir is None and not keep_kernels
        self.state_dir = Path(state_dir) if state_dir is not None else Path(tempfile.mkdtemp(prefix="cbgw-"))
        command = [gateway_binary(), "--ip", "127.0.0.1", "--port", str(port), *kernelspec_arguments(),
                   "--warm-pool", str(warm_pool), "--state-dir", str(self.state_dir)]
        if not keep_kernels:
            command.append("--shutdown-kernels-on-exit")
        command += list(arguments)
        environment = {k: v for k, v in os.environ.items() if not k.startswith("KG_")}
        if token is not None:
            environment["KG_AUTH_TOKEN"] = token  # never on argv, where any local user reads it
        environment.update(env or {})
        self.token = token
        self.lines = queue.Queue()
        self.output = []
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        env=environment, start_new_session=True, preexec_fn=_die_with_parent)
        threading.Thread(target=self._pump, daemon=True).start()
        deadline = time.monotonic() + 30
        self.url = None
        while time.monotonic() < deadline and self.url is None:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                if self.process.poll() is not None:
                    break
                continue
            match = re.search(r"is available at (https?://[\d.]+:\d+)", line)
            if match:
                self.url = match.group(1)
        if self.url is None:
            self.stop()
            raise RuntimeError("gateway did not start:\n" + "".join(self.output))
        self.ws_base = self.url.replace("http", "ws", 1)

    def _pump(self):
        for line in self.process.stdout:
            self.output.append(line)
            self.lines.put(line)

    @property
    def headers(self):
        return {"Authorization": f"token {self.token}"} if self.token else {}

    def request(self, method, path, **kwargs):
        headers = dict(self.headers)
        headers.update(kwargs.pop("headers", {}))
        kwargs.setdefault("timeout", START_TIMEOUT + 10)
        return requests.request(method, self.url + path, headers=headers, **kwargs)

    def get(self, path, **kwargs):
        return self.request("GET", path, **kwargs)

    def post(self, path, **kwargs):
        return self.request("POST", path, **kwargs)

    def delete(self, path, **kwargs):
        return self.request("DELETE", path, **kwargs)

    def start_kernel(self, **body):
        response = self.post("/api/kernels", json=body)
        assert response.status_code == 201, response.text
        return response.json()

    def connect(self, kernel_id, **kwargs):
        return KernelSocket(self, kernel_id, **kwargs)

    def alive(self):
        return self.process.poll() is None and self.get("/api").status_code == 200

    def stop(self, sig=signal.SIGTERM):
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.owns_state_dir:
            shutil.rmtree(self.state_dir, ignore_errors=True)
        return self.process.returncode


def new_header(msg_type, session="test-session", **overrides):
    header = {"msg_id": uuid.uuid4().hex, "msg_type": msg_type, "username": "test", "session": session,
              "date": time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime()), "version": "5.3"}
    header.update(overrides)
    return header


def decode_v1(frame):
    count = struct.unpack_from("<Q", frame, 0)[0]
    offsets = [struct.unpack_from("<Q", frame, 8 * (i + 1))[0] for i in range(count)]
    parts = [frame[offsets[i]:offsets[i + 1]] for i in range(count - 1)]
    message = {"channel": parts[0].decode()}
    for key, part in zip(("header", "parent_header", "metadata", "content"), parts[1:5]):
        message[key] = json.loads(part)
    message["buffers"] = parts[5:]
    message["msg_type"] = message["header"]["msg_type"]
    message["msg_id"] = message["header"]["msg_id"]
    return message


def encode_v1(channel, header, parent, metadata, content, buffers=()):
    parts = [channel.encode()] + [json.dumps(p).encode() for p in (header, parent, metadata, content)] + list(buffers)
    count = len(parts) + 1
    offsets = [8 * (count + 1)]
    for part in parts:
        offsets.append(offsets[-1] + len(part))
    return struct.pack("<Q", count) + b"".join(struct.pack("<Q", o) for o in offsets) + b"".join(parts)


def decode_legacy_binary(frame):
    count = struct.unpack_from(">I", frame, 0)[0]
    offsets = [struct.unpack_from(">I", frame, 4 * (i + 1))[0] for i in range(count)] + [len(frame)]
    message = json.loads(frame[offsets[0]:offsets[1]])
    message["buffers"] = [frame[offsets[i]:offsets[i + 1]] for i in range(1, count)]
    return message


class KernelSocket:
    """A /channels WebSocket speaking either the legacy JSON format or v1."""

    def __init__(self, gateway, kernel_id, session_id=None, v1=False, auth="header", timeout=START_TIMEOUT):
        query = {}
        if session_id:
            query["session_id"] = session_id
        headers = []
        if auth == "header" and gateway.token:
            headers.append(f"Authorization: token {gateway.token}")
        elif auth == "query" and gateway.token:
            query["token"] = gateway.token
        url = f"{gateway.ws_base}/api/kernels/{kernel_id}/channels"
        if query:
            url += "?" + "&".join(f"{k}={v}" for k, v in query.items())
        self.v1 = v1
        self.session = session_id or uuid.uuid4().hex
        self.ws = websocket.create_connection(url, header=headers, timeout=timeout,
                                              subprotocols=[V1] if v1 else None)
        self.pending = []

    def send_raw(self, message):
        if self.v1:
            self.ws.send_binary(encode_v1(message.get("channel", "shell"), message["header"],
                                          message.get("parent_header", {}), message.get("metadata", {}),
                                          message.get("content", {})))
        else:
            self.ws.send(json.dumps(message))

    def send(self, msg_type, content=None, channel="shell", **header_overrides):
        header = new_header(msg_type, session=self.session, **header_overrides)
        self.send_raw({"header": header, "parent_header": {}, "metadata": {}, "content": content or {},
                       "channel": channel, "buffers": []})
        return header["msg_id"]

    def recv(self, timeout=START_TIMEOUT):
        if self.pending:
            return self.pending.pop(0)
        # Control frames are returned too, so the gateway's keepalive pings cannot stretch the deadline.
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no message within the deadline")
            self.ws.settimeout(left)
            opcode, data = self.ws.recv_data(control_frame=True)
            if opcode not in (websocket.ABNF.OPCODE_PING, websocket.ABNF.OPCODE_PONG):
                break
        if opcode == websocket.ABNF.OPCODE_TEXT:
            assert not self.v1, "v1 connections must only get binary frames"
            return json.loads(data.decode("utf-8"))
        if opcode == websocket.ABNF.OPCODE_BINARY:
            return decode_v1(data) if self.v1 else decode_legacy_binary(data)
        if opcode == websocket.ABNF.OPCODE_CLOSE:
            raise ConnectionError("the gateway closed the WebSocket")
        raise ConnectionError(f"unexpected opcode {opcode}")

    def replies_to(self, msg_id, done, timeout=START_TIMEOUT):
        """Messages whose parent is msg_id until done(message) is true; other traffic is dropped."""
        deadline = time.monotonic() + timeout
        collected = []
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no completion for {msg_id}; got {[m['msg_type'] for m in collected]}")
            message = self.recv(timeout=left)
            if message.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            collected.append(message)
            if done(message):
                return collected

    def execute(self, code, timeout=START_TIMEOUT, **content):
        body = {"code": code, "silent": False, "store_history": True, "user_expressions": {}, "allow_stdin": False,
                "stop_on_error": True}
        body.update(content)
        msg_id = self.send("execute_request", body)
        messages = self.replies_to(msg_id, lambda m: m["msg_type"] == "execute_reply", timeout=timeout)
        # IOPub and shell travel on different sockets: wait for the idle status too.
        if not any(m["msg_type"] == "status" and m["content"]["execution_state"] == "idle" for m in messages):
            messages += self.replies_to(msg_id, lambda m: m["msg_type"] == "status" and
                                        m["content"]["execution_state"] == "idle", timeout=timeout)
        return messages

    def wait_ready(self, timeout=START_TIMEOUT):
        msg_id = self.send("kernel_info_request")
        return self.replies_to(msg_id, lambda m: m["msg_type"] == "kernel_info_reply", timeout=timeout)[-1]

    def close(self):
        self.ws.close()


def outputs(messages):
    """Concatenated stream text and text/plain results."""
    text = ""
    for message in messages:
        if message["msg_type"] == "stream":
            text += message["content"]["text"]
        elif message["msg_type"] in ("execute_result", "display_data"):
            text += message["content"]["data"].get("text/plain", "")
    return text


def kernel_pids(kernel_id):
    """PIDs of the processes running this kernel. A process the kernel has just forked shows the kernel's command
    line until it execs: the sandbox's clone of a new worker (a child of the kernel), and the double-forked zygote
    template, whose parent is an intermediate process or, once that has exited, not the kernel's at all. Both sit
    in network namespaces of their own from the clone on, while a kernel runs in the gateway's: this host's."""
    host_network = os.readlink("/proc/self/ns/net")
    parents = {}
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            if f"kernel-{kernel_id}.json".encode() not in cmdline:
                continue
            stat = (entry / "stat").read_bytes()
            if os.readlink(entry / "ns" / "net") != host_network:
                continue
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may contain spaces and parentheses.
        parents[int(entry.name)] = int(stat[stat.rfind(b")") + 2:].split()[1])
    return sorted(pid for pid, parent in parents.items() if parent not in parents)
