#!/usr/bin/env python3
"""Execute round trips for four kinds of output, cellblock vs ipykernel and xpython, over ZMQ and over the WebSocket.

    /usr/bin/python3 tests/bench/bench_outputs.py [--quick]

A round trip runs from sending `execute_request` to the kernel's `status: idle` for that request (the shell reply is
collected after the clock stops). Payloads: `1+1`, `print('x')`, a 1 MiB print and a small matplotlib plot (the first
plot of each kernel is a warm-up and not counted). ZMQ: one raw jupyter_client BlockingKernelClient per kernel,
cellblock-python vs Debian's ipykernel (`python3`) and xpython. WebSocket: websocket-client against cellblock-gateway
(cellblock kernels) vs Jupyter Server 1.23 (ipykernel) with its default sockets and with TCP_NODELAY set on the
kernel WebSocket. Kernels and servers are measured in interleaved passes so machine noise hits all of them alike.

cellblock caps the output of one execution at 1 MiB by default (`output_bytes`); this benchmark sets
CELLBLOCK_OUTPUT_BYTES=64 MiB for its kernels so that the 1 MiB print is delivered whole, as the peers deliver it.
Every output is checked (the `2`, the `x`, all 1,048,577 characters, an image/png) before a figure is reported.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

import benchlib
from benchlib import Row, Stats, markdown_table, progress

OUTPUT_BYTES_FOR_BENCH = str(64 << 20)
ONE_MIB_PRINT = "print('x' * 1048576)"
PLOT = "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.show()"

# (label, code, full repeats, quick repeats)
PAYLOADS = [
    ("`1+1`", "1+1", 300, 5),
    ("`print('x')`", "print('x')", 300, 5),
    ("1 MiB print", ONE_MIB_PRINT, 30, 2),
    ("matplotlib plot", PLOT, 30, 2),
]
TARGETS = {("zmq", "1+1"): "≤ 1.0 ms", ("ws", "1+1"): "≤ 1.5 ms"}
PASSES = 3


def check_output(code: str, messages: list[dict]) -> None:
    """Raises unless the IOPub messages carry the output a user expects from `code`."""
    kinds = [m.get("msg_type") for m in messages]
    if code == "1+1":
        results = [m for m in messages if m.get("msg_type") == "execute_result"]
        if not results or results[0]["content"]["data"].get("text/plain") != "2":
            raise AssertionError(f"1+1: no execute_result '2' in {kinds}")
    elif code == "print('x')":
        text = "".join(m["content"]["text"] for m in messages if m.get("msg_type") == "stream")
        if text != "x\n":
            raise AssertionError(f"print('x'): stream text {text[:40]!r}")
    elif code == ONE_MIB_PRINT:
        text = "".join(m["content"]["text"] for m in messages if m.get("msg_type") == "stream")
        if len(text) != 1048577 or text.strip("x\n"):
            raise AssertionError(f"1 MiB print: got {len(text)} characters of stream (expected 1048577)")
    elif code == PLOT:
        if not any(m.get("msg_type") == "display_data" and "image/png" in m["content"].get("data", {})
                   for m in messages):
            raise AssertionError(f"plot: no display_data with image/png in {kinds}")


class Target:
    """One thing that runs code: a kernel over ZMQ or a kernel over a server's WebSocket."""

    def __init__(self, label: str, execute, cpu_pids, main_pid: int | None = None):
        self.label = label
        self.main_pid = main_pid  # the server process alone (WebSocket targets), for its share of the CPU
        self.main_cpu_ms: dict[str, float] = {}
        self.execute = execute  # code -> (ms, iopub messages)
        self.cpu_pids = cpu_pids  # () -> pids whose CPU time counts for this target
        self.samples: dict[str, list[float]] = {}
        self.cpu_ms: dict[str, float] = {}
        self.client_cpu_ms: dict[str, float] = {}
        self.failure = ""

    def run(self, code: str, repeat: int) -> None:
        if self.failure:
            return
        try:
            before = benchlib.cpu_seconds(self.cpu_pids())
            main_before = benchlib.cpu_seconds([self.main_pid]) if self.main_pid else 0.0
            client_before = os.times()
            for _ in range(repeat):
                elapsed, messages = self.execute(code)
                check_output(code, messages)
                self.samples.setdefault(code, []).append(elapsed)
            spent = (benchlib.cpu_seconds(self.cpu_pids()) - before) * 1000.0
            client_after = os.times()
            client = (client_after.user - client_before.user + client_after.system - client_before.system) * 1000.0
            self.cpu_ms[code] = self.cpu_ms.get(code, 0.0) + spent
            if self.main_pid:
                main = (benchlib.cpu_seconds([self.main_pid]) - main_before) * 1000.0
                self.main_cpu_ms[code] = self.main_cpu_ms.get(code, 0.0) + main
            self.client_cpu_ms[code] = self.client_cpu_ms.get(code, 0.0) + client
        except Exception as error:  # noqa: BLE001 - reported in the table, the run goes on
            self.failure = f"{type(error).__name__}: {str(error)[:160]}"
            progress(f"{self.label}: {self.failure}")

    def stats(self, code: str):
        samples = self.samples.get(code)
        return Stats(samples) if samples else None

    def cpu_per_execute(self, code: str, client: bool = False, main: bool = False):
        samples = self.samples.get(code)
        spent = self.client_cpu_ms if client else self.main_cpu_ms if main else self.cpu_ms
        if code not in spent:
            return None
        return Stats([spent[code] / len(samples)]) if samples else None


def measure_all(targets: list[Target], quick: bool) -> None:
    for target in targets:  # warm-up: imports, first plot (matplotlib font cache), first 1 MiB buffer
        for _, code, _, _ in PAYLOADS:
            target.run(code, 1)
        target.samples.clear()
        target.cpu_ms.clear()
        target.client_cpu_ms.clear()
        target.main_cpu_ms.clear()
    passes = 1 if quick else PASSES
    for label, code, full, short in PAYLOADS:
        repeat = short if quick else full
        for number in range(passes):
            progress(f"{label}: pass {number + 1}/{passes}, {repeat // passes} executes per target")
            for target in targets:
                target.run(code, max(1, repeat // passes))


def table(title: str, transport: str, ours: Target, peers: list[Target], cpu_label: str) -> str:
    rows = []
    for label, code, _, _ in PAYLOADS:
        rows.append(Row(f"{label} round trip", ours.stats(code), {p.label: p.stats(code) for p in peers},
                        target=TARGETS.get((transport, code), ""), note=ours.failure))
    for label, code, _, _ in PAYLOADS:
        rows.append(Row(f"{cpu_label} CPU per {label}", ours.cpu_per_execute(code),
                        {p.label: p.cpu_per_execute(code) for p in peers}, unit="ms CPU"))
    if ours.main_pid:
        for label, code, _, _ in PAYLOADS:
            rows.append(Row(f"… of which the server process itself, per {label}", ours.cpu_per_execute(code, main=True),
                            {p.label: p.cpu_per_execute(code, main=True) for p in peers}, unit="ms CPU"))
    for label, code, _, _ in PAYLOADS:
        rows.append(Row(f"client (benchmark process) CPU per {label}", ours.cpu_per_execute(code, True),
                        {p.label: p.cpu_per_execute(code, True) for p in peers}, unit="ms CPU"))
    notes = [f"- {p.label}: {p.failure}" for p in peers if p.failure]
    return markdown_table(title, rows) + ("\n" + "\n".join(notes) + "\n" if notes else "")


def zmq_section(quick: bool) -> tuple[str, bool]:
    kernels = []
    try:
        specs = [("cellblock", "cellblock-python", {"CELLBLOCK_OUTPUT_BYTES": OUTPUT_BYTES_FOR_BENCH}),
                 ("ipykernel", "python3", {}), ("xpython", "xpython", {})]
        targets = []
        missing = []
        for label, name, env in specs:
            if not benchlib.kernelspec_available(name):
                progress(f"{label}: kernelspec {name} not installed: the run fails")
                missing.append(label)
                continue
            progress(f"ZMQ: starting {label}")
            try:
                kernel = benchlib.RunningKernel(name, env)
            except Exception as error:  # noqa: BLE001
                progress(f"{label}: did not start: {error}: the run fails")
                missing.append(label)
                continue
            kernels.append(kernel)
            targets.append(Target(label, lambda code, k=kernel: benchlib.execute_round_trip(k.client, code),
                                  kernel.tree))
        ours = next((t for t in targets if t.label == "cellblock"), None)
        if ours is None:
            return "cellblock kernel could not be started\n", False
        measure_all(targets, quick)
        text = table("Execute round trip over ZMQ (jupyter_client BlockingKernelClient)", "zmq", ours,
                     [t for t in targets if t is not ours], "kernel (+ worker)")
        failed = benchlib.failed_peers({t.label: t.failure for t in targets if t is not ours})
        return text, not ours.failure and not missing and not failed
    finally:
        benchlib.stop_kernels(kernels)


def websocket_section(quick: bool, workdir: Path) -> tuple[str, bool]:
    if not benchlib.gateway_binary().exists():
        progress(f"cellblock-gateway not installed at {benchlib.gateway_binary()}: the run fails")
        return f"_cellblock-gateway not installed at {benchlib.gateway_binary()}: WebSocket path not measured._\n", False
    servers, sockets = [], []
    try:
        targets = []
        progress("WebSocket: starting cellblock-gateway")
        gateway = benchlib.start_gateway(
            workdir / "gateway", ["--warm-pool", "0"],
            {"CELLBLOCK_OUTPUT_BYTES": OUTPUT_BYTES_FOR_BENCH, "KG_ENV_PROCESS_WHITELIST": "CELLBLOCK_OUTPUT_BYTES"})
        servers.append(gateway)
        peers = [("Jupyter Server", False), ("Jupyter Server nodelay", True)]
        for label, nodelay in peers:
            progress(f"WebSocket: starting {label}")
            (workdir / label.replace(" ", "-")).mkdir()
            servers.append(benchlib.start_jupyter_server(workdir / label.replace(" ", "-"), nodelay))
        for server, label, kernel_name in zip(servers, ["cellblock", *[p[0] for p in peers]],
                                              ["cellblock-python", "python3", "python3"]):
            kernel_id = server.create_kernel(kernel_name)
            socket = server.connect(kernel_id)
            sockets.append(socket)
            socket.kernel_info()
            # Gateway/server process and the kernel tree below it: what one round trip costs the machine.
            targets.append(Target(label, socket.execute, lambda s=server: benchlib.descendants(s.server.pid),
                                  server.server.pid))
        measure_all(targets, quick)
        ours, peer_targets = targets[0], targets[1:]
        text = table("Execute round trip over the WebSocket (websocket-client; server + ipykernel / cellblock kernel)",
                     "ws", ours, peer_targets, "server + kernel")
        return text, not ours.failure and not benchlib.failed_peers({t.label: t.failure for t in peer_targets})
    finally:
        for socket in sockets:
            socket.close()
        for server in servers:
            server.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a few executes of each payload (smoke run)")
    args = parser.parse_args()
    benchlib.use_installed_kernelspecs()
    workdir = Path(tempfile.mkdtemp(prefix="cellblock-bench-outputs-"))
    try:
        zmq_text, zmq_ok = zmq_section(args.quick)
        ws_text, ws_ok = websocket_section(args.quick, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"cellblock kernels ran with CELLBLOCK_OUTPUT_BYTES={OUTPUT_BYTES_FOR_BENCH} (default cap: 1 MiB per "
          "execution) so the 1 MiB print arrives whole. CPU = utime+stime deltas from /proc over the measured "
          "executes, divided by their number.\n")
    print(zmq_text)
    print(ws_text)
    return 0 if zmq_ok and ws_ok else 1


if __name__ == "__main__":
    sys.exit(main())
