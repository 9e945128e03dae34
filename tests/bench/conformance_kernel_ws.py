"""jupyter_kernel_test's checks through a Kernel Gateway-compatible server: the kernel the gateway starts, reached
only through its REST API and the /api/kernels/{id}/channels WebSocket (legacy JSON), as a gateway client sees it.

tests/kernel/test_kernel_conformance.py runs the same checks against cellblock-python over ZeroMQ; here the client is
jupyter_client's own BlockingKernelClient with its five ZeroMQ channels replaced by one WebSocket, so every request
is built and every reply read exactly as in that test, and the samples are that test's.

    CONFORMANCE_GATEWAY_URL=http://127.0.0.1:8888 CONFORMANCE_GATEWAY_TOKEN=T \
        /usr/bin/python3 -m pytest -q tests/bench/conformance_kernel_ws.py

conformance_peers.py runs it against cellblock-gateway and the Jupyter Kernel Gateway.
"""
import datetime
import importlib.util
import json
import os
import queue
import struct
import threading
import time
import uuid
from pathlib import Path

import jupyter_kernel_test as jkt
import requests
import websocket
from jupyter_client.blocking import BlockingKernelClient

URL = os.environ.get("CONFORMANCE_GATEWAY_URL", "").rstrip("/")
TOKEN = os.environ.get("CONFORMANCE_GATEWAY_TOKEN", "")
# jupyter_kernel_test waits without a timeout for some replies; a lost reply must fail the check, not hang the run.
DEFAULT_GET_TIMEOUT_S = 60
START_TIMEOUT_S = 120
SAMPLES_FILE = Path(__file__).resolve().parents[1] / "kernel" / "test_kernel_conformance.py"
# The attributes of jupyter_kernel_test.KernelTests that hold samples (everything else is the checks themselves).
SAMPLE_ATTRIBUTES = ("language_name", "file_extension", "code_hello_world", "code_stderr", "completion_samples",
                     "complete_code_samples", "incomplete_code_samples", "invalid_code_samples",
                     "code_page_something", "code_generate_error", "code_execute_result", "code_display_data",
                     "code_history_pattern", "supported_history_operations", "code_inspect_sample",
                     "code_clear_output")


def _samples_class() -> type:
    """The ZeroMQ conformance test's class, loaded under a private name so pytest does not collect it here too."""
    spec = importlib.util.spec_from_file_location("_kernel_conformance_samples", SAMPLES_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.CellblockKernelConformance


def _json_default(value):
    if isinstance(value, datetime.datetime):  # jupyter_client's Session puts datetimes in headers
        return value.isoformat()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def _decode_legacy_binary(frame: bytes) -> dict:
    """A legacy binary frame (a message with buffers): big-endian offsets, the JSON message, then the buffers."""
    count = struct.unpack_from(">I", frame, 0)[0]
    offsets = [struct.unpack_from(">I", frame, 4 * (i + 1))[0] for i in range(count)] + [len(frame)]
    message = json.loads(frame[offsets[0]:offsets[1]])
    message["buffers"] = [frame[offsets[i]:offsets[i + 1]] for i in range(1, count)]
    return message


class _WebSocketChannel:
    """Stands in for one of jupyter_client's ZMQSocketChannels: send() goes out on the shared WebSocket, get_msg()
    reads what the reader thread routed to this channel."""

    def __init__(self, name: str, client: "GatewayKernelClient"):
        self.name = name
        self.client = client
        self.messages: queue.Queue = queue.Queue()

    def send(self, message: dict) -> None:
        self.client.send_on(self.name, message)

    async def get_msg(self, timeout: float | None = None) -> dict:
        # async because jupyter_client's blocking wrappers (run_sync) expect a coroutine, as with its own channels.
        return self.messages.get(timeout=DEFAULT_GET_TIMEOUT_S if timeout is None else timeout)

    def msg_ready(self) -> bool:
        return not self.messages.empty()

    def is_alive(self) -> bool:
        return self.client.ws is not None

    def start(self) -> None:
        pass

    def stop(self) -> None:
        self.client.close()


class GatewayKernelClient(BlockingKernelClient):
    """jupyter_client's BlockingKernelClient whose channels are one Kernel Gateway WebSocket."""

    def connect_websocket(self, base_url: str, token: str, kernel_id: str) -> None:
        self.ws_channels = {name: _WebSocketChannel(name, self) for name in ("shell", "iopub", "stdin", "control")}
        ws_url = base_url.replace("http", "ws", 1) + f"/api/kernels/{kernel_id}/channels?session_id={uuid.uuid4().hex}"
        self.ws = websocket.create_connection(ws_url, header=[f"Authorization: token {token}"],
                                              timeout=START_TIMEOUT_S)
        self.ws.settimeout(None)  # the reader blocks until a frame or the close
        self.lock = threading.Lock()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        while self.ws is not None:
            try:
                frame = self.ws.recv()
            except Exception:  # noqa: BLE001 - closed by us or by the server: either way the reader is done
                return
            if not frame:
                continue
            message = _decode_legacy_binary(frame) if isinstance(frame, bytes) else json.loads(frame)
            channel = message.pop("channel", "shell")
            # What jupyter_client's Session.deserialize hands a test: the message parts plus msg_id and msg_type.
            message.setdefault("msg_id", message["header"].get("msg_id"))
            message.setdefault("msg_type", message["header"].get("msg_type"))
            message.setdefault("buffers", [])
            if channel in self.ws_channels:
                self.ws_channels[channel].messages.put(message)

    def wait_until_ready(self) -> None:
        """As jupyter_client's wait_for_ready after start_new_kernel: kernel_info_request until its reply comes and
        IOPub delivers (a gateway may connect the kernel's IOPub after the WebSocket opened), then nothing left
        over. Its own loop, not wait_for_ready: that one fails with UnboundLocalError if the first second is silent
        (jupyter_client 7.4)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            msg_id = self.kernel_info()
            try:
                while self.get_shell_msg(timeout=1)["parent_header"].get("msg_id") != msg_id:
                    pass
                self.get_iopub_msg(timeout=1)
            except queue.Empty:
                continue
            for channel in self.ws_channels.values():  # the status messages of the probes
                while not channel.messages.empty():
                    channel.messages.get()
            return
        raise TimeoutError(f"no kernel_info_reply and IOPub within {START_TIMEOUT_S} s")

    def send_on(self, channel: str, message: dict) -> None:
        frame = {"header": message["header"], "parent_header": message.get("parent_header") or {},
                 "metadata": message.get("metadata") or {}, "content": message.get("content") or {},
                 "channel": channel, "buffers": []}
        with self.lock:
            self.ws.send(json.dumps(frame, default=_json_default))

    def close(self) -> None:
        ws, self.ws = getattr(self, "ws", None), None
        if ws is not None:
            ws.close()

    # The channels jupyter_client's methods use (execute() calls self.shell_channel.send, and so on).
    shell_channel = property(lambda self: self.ws_channels["shell"])
    iopub_channel = property(lambda self: self.ws_channels["iopub"])
    stdin_channel = property(lambda self: self.ws_channels["stdin"])
    control_channel = property(lambda self: self.ws_channels["control"])
    hb_channel = property(lambda self: self.ws_channels["control"])  # no heartbeat over a gateway; never used

    def stop_channels(self) -> None:
        self.close()


class _KernelThroughGateway:
    """A kernel created with POST /api/kernels (the server's default kernelspec) and deleted afterwards; stands in
    for the KernelManager jupyter_kernel_test's tearDownClass shuts down."""

    def __init__(self):
        if not URL:
            raise RuntimeError("CONFORMANCE_GATEWAY_URL must name the gateway, CONFORMANCE_GATEWAY_TOKEN its token")
        self.http = requests.Session()
        self.http.headers["Authorization"] = f"token {TOKEN}"
        response = self.http.post(f"{URL}/api/kernels", json={}, timeout=START_TIMEOUT_S)
        response.raise_for_status()
        self.kernel_id = response.json()["id"]

    def shutdown_kernel(self) -> None:
        self.http.delete(f"{URL}/api/kernels/{self.kernel_id}", timeout=START_TIMEOUT_S)
        self.http.close()


class GatewayKernelConformance(jkt.KernelTests):
    """The twelve checks, with tests/kernel/test_kernel_conformance.py's samples (ipykernel-style Python)."""

    @classmethod
    def setUpClass(cls):
        cls.km = _KernelThroughGateway()
        cls.kc = GatewayKernelClient()
        cls.kc.connect_websocket(URL, TOKEN, cls.km.kernel_id)
        cls.kc.wait_until_ready()


_samples = _samples_class()
for _name in SAMPLE_ATTRIBUTES:
    setattr(GatewayKernelConformance, _name, getattr(_samples, _name))
del _samples, _name
