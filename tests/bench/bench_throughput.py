#!/usr/bin/env python3
"""Executes per second of `1+1` with 1, 4, 16 and 64 concurrent sessions, cellblock vs ipykernel and xpython.

    /usr/bin/python3 tests/bench/bench_throughput.py [--quick] [--seconds 5]

A session is one kernel with one client that keeps exactly one `execute_request` in flight: it sends the next as soon
as the `execute_reply` of the previous one arrives (a user or agent waiting on each result). All sessions are driven
by one lean client thread (pyzmq: a DEALER on shell, a SUB on IOPub that is drained unparsed, the request signed
with hmac, only the reply's parent msg_id and status checked), so the load generator costs a small, reported fraction
of a core instead of the ~1 ms per message of jupyter_client's Session. On a 2-core machine the kernel's CPU per
execute (utime+stime of kernel + worker from /proc, summed over the active sessions) together with the client's sets
the ceiling, so both are reported next to the rate. Kernel kinds are measured one after another, each with its own
kernels started in parallel, so idle kernels of one kind never load the measurement of another.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import hmac
import json
import os
import sys
import time
import uuid

import zmq

import benchlib
from benchlib import Row, Stats, markdown_table, progress

KINDS = [("cellblock", "cellblock-python"), ("ipykernel", "python3"), ("xpython", "xpython")]
DELIMITER = b"<IDS|MSG>"


class LeanSession:
    """The minimum a Jupyter client must do to run `1+1` repeatedly on one kernel."""

    def __init__(self, context: zmq.Context, kernel: benchlib.RunningKernel):
        info = kernel.manager.get_connection_info(session=False)
        self.key = info["key"] if isinstance(info["key"], bytes) else info["key"].encode()
        self.session_id = uuid.uuid4().hex
        address = f"{info['transport']}://{info['ip']}"
        separator = "-" if info["transport"] == "ipc" else ":"
        self.shell = context.socket(zmq.DEALER)
        self.shell.linger = 0
        self.shell.connect(f"{address}{separator}{info['shell_port']}")
        self.iopub = context.socket(zmq.SUB)
        self.iopub.linger = 0
        self.iopub.setsockopt(zmq.SUBSCRIBE, b"")
        self.iopub.connect(f"{address}{separator}{info['iopub_port']}")
        self.in_flight = b""
        self.sent_at = 0.0
        self.kernel = kernel

    def send_execute(self) -> None:
        msg_id = uuid.uuid4().hex
        header = json.dumps({"msg_id": msg_id, "msg_type": "execute_request", "username": "bench",
                             "session": self.session_id, "version": "5.3",
                             "date": datetime.datetime.now(datetime.timezone.utc).isoformat()}).encode()
        content = b'{"code": "1+1", "silent": false, "store_history": true, "user_expressions": {}, ' \
                  b'"allow_stdin": false, "stop_on_error": true}'
        frames = [header, b"{}", b"{}", content]
        signature = hmac.new(self.key, digestmod=hashlib.sha256)
        for frame in frames:
            signature.update(frame)
        self.in_flight = msg_id.encode()
        self.sent_at = time.perf_counter()
        self.shell.send_multipart([DELIMITER, signature.hexdigest().encode(), *frames])

    def receive_reply(self) -> float:
        """Milliseconds since the request was sent; raises on a reply to something else or an error status."""
        frames = self.shell.recv_multipart()
        elapsed = (time.perf_counter() - self.sent_at) * 1000.0
        start = frames.index(DELIMITER)
        header, parent, content = frames[start + 2], frames[start + 3], frames[start + 5]
        if b"execute_reply" not in header or self.in_flight not in parent:
            raise RuntimeError(f"unexpected shell message {header[:120]!r}")
        status = json.loads(content).get("status")
        if status != "ok":
            raise RuntimeError(f"execute_reply status {status}: {content[:200]!r}")
        return elapsed

    def drain_iopub(self) -> None:
        try:
            while True:
                self.iopub.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            pass

    def close(self) -> None:
        self.shell.close()
        self.iopub.close()


def drive(sessions: list[LeanSession], seconds: float) -> tuple[int, list[float], float, float, float, float]:
    """Runs all sessions for `seconds`; returns (executes, latencies ms, window s, kernel tree CPU s, client CPU s,
    CPU s of the kernel processes alone)."""
    poller = zmq.Poller()
    by_socket = {}
    for session in sessions:
        poller.register(session.shell, zmq.POLLIN)
        poller.register(session.iopub, zmq.POLLIN)
        by_socket[session.shell] = session
        by_socket[session.iopub] = session
    pids = [pid for session in sessions for pid in session.kernel.tree()]
    main_pids = [session.kernel.pid for session in sessions]
    kernel_cpu_before = benchlib.cpu_seconds(pids)
    main_cpu_before = benchlib.cpu_seconds(main_pids)
    client_before = os.times()
    latencies: list[float] = []
    window_start = time.perf_counter()
    for session in sessions:
        session.send_execute()
    deadline = time.perf_counter() + seconds
    outstanding = len(sessions)
    while outstanding:
        events = poller.poll(30_000)
        if not events:
            raise TimeoutError("no reply from any session within 30 s")
        for socket, _ in events:
            session = by_socket[socket]
            if socket is session.iopub:
                session.drain_iopub()
                continue
            latencies.append(session.receive_reply())
            if time.perf_counter() < deadline:
                session.send_execute()
            else:
                outstanding -= 1
    window = time.perf_counter() - window_start
    client_after = os.times()
    kernel_cpu = benchlib.cpu_seconds(pids) - kernel_cpu_before
    main_cpu = benchlib.cpu_seconds(main_pids) - main_cpu_before
    client_cpu = (client_after.user - client_before.user) + (client_after.system - client_before.system)
    for session in sessions:
        session.drain_iopub()
    return len(latencies), latencies, window, kernel_cpu, client_cpu, main_cpu


def measure_kind(label: str, kernel_name: str, levels: list[int], seconds: float) -> dict:
    """{level: (rate, latency Stats, kernel CPU ms per execute, client CPU ms per execute)}, or {'error': ...}."""
    results: dict = {}
    progress(f"{label}: starting {max(levels)} kernels in parallel")
    started = time.monotonic()
    kernels, failures = benchlib.start_kernels(kernel_name, max(levels))
    results["start_s"] = time.monotonic() - started
    results["start_failures"] = failures
    context = zmq.Context()
    sessions: list[LeanSession] = []
    try:
        if len(kernels) < max(levels):
            results["error"] = f"only {len(kernels)} of {max(levels)} kernels started"
        for kernel in kernels:
            kernel.client.stop_channels()  # the lean client below is the only reader
            sessions.append(LeanSession(context, kernel))
        time.sleep(0.5)  # SUB subscriptions propagate before the first request
        for level in levels:
            if level > len(sessions):
                break
            active = sessions[:level]
            drive(active, min(1.0, seconds / 5))  # warm-up: first executes, caches, CPU frequency
            executes, latencies, window, kernel_cpu, client_cpu, main_cpu = drive(active, seconds)
            rate = executes / window
            results[level] = (rate, Stats(latencies), kernel_cpu * 1000.0 / executes, client_cpu * 1000.0 / executes,
                              main_cpu * 1000.0 / executes)
            progress(f"{label}: {level} sessions: {rate:.0f} exec/s, kernel CPU "
                     f"{results[level][2]:.2f} ms/exec, client CPU {results[level][3]:.2f} ms/exec")
    except Exception as error:  # noqa: BLE001 - reported in the table
        results["error"] = f"{type(error).__name__}: {str(error)[:160]}"
        progress(f"{label}: {results['error']}")
    finally:
        for session in sessions:
            session.close()
        context.term()
        benchlib.stop_kernels(kernels)
    return results


def level_stat(result: dict, level: int, index: int) -> Stats | None:
    """Field `index` of measure_kind's result at `level` (rate, latencies, CPU figures) as Stats, or None."""
    value = result.get(level)
    if value is None:
        return None
    return value[index] if isinstance(value[index], Stats) else Stats([value[index]])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 and 2 sessions, half a second each (smoke run)")
    parser.add_argument("--seconds", type=float, default=5.0, help="measuring window per level (full run)")
    parser.add_argument("--levels", default="", help="comma-separated session counts (default 1,4,16,64)")
    parser.add_argument("--kinds", default="", help="comma-separated subset of cellblock,ipykernel,xpython")
    args = parser.parse_args()
    benchlib.use_installed_kernelspecs()
    levels = [1, 2] if args.quick else [1, 4, 16, 64]
    if args.levels:
        levels = [int(level) for level in args.levels.split(",")]
    wanted = set(args.kinds.split(",")) if args.kinds else {label for label, _ in KINDS}
    seconds = 0.5 if args.quick else args.seconds

    measured = {}
    missing = []
    for label, kernel_name in KINDS:
        if label not in wanted:
            continue
        if not benchlib.kernelspec_available(kernel_name):
            progress(f"{label}: kernelspec {kernel_name} not installed: the run fails")
            missing.append(label)
            continue
        measured[label] = measure_kind(label, kernel_name, levels, seconds)
    ours = measured.get("cellblock", {"error": "kernelspec cellblock-python not installed"})
    peers = {label: result for label, result in measured.items() if label != "cellblock"}

    rows = []
    for level in levels:
        target = "≥ 2,000" if level == 16 else ""
        rows.append(Row(f"`1+1` exec/s, {level} session{'s' if level > 1 else ''}", level_stat(ours, level, 0),
                        {p: level_stat(r, level, 0) for p, r in peers.items()}, unit="exec/s", target=target))
    for level in levels:
        rows.append(Row(f"round trip at {level} in flight", level_stat(ours, level, 1),
                        {p: level_stat(r, level, 1) for p, r in peers.items()}))
    for level in levels:
        rows.append(Row(f"kernel (+ worker) CPU per execute, {level}", level_stat(ours, level, 2),
                        {p: level_stat(r, level, 2) for p, r in peers.items()}, unit="ms CPU"))
    for level in levels:
        rows.append(Row(f"… of which the kernel process itself, {level}", level_stat(ours, level, 4),
                        {p: level_stat(r, level, 4) for p, r in peers.items()}, unit="ms CPU"))
    for level in levels:
        rows.append(Row(f"client CPU per execute, {level}", level_stat(ours, level, 3),
                        {p: level_stat(r, level, 3) for p, r in peers.items()}, unit="ms CPU"))
    print(f"One lean pyzmq client thread drives all sessions, one request in flight per session, {seconds:g} s per "
          f"level after a warm-up; exec/s = completed execute_replies / window. {os.cpu_count()} cores: the CPU rows "
          "bound what the machine can do (cores × 1000 / (kernel + client CPU ms per execute)).\n")
    print(markdown_table("`1+1` throughput over ZMQ", rows))
    for label, result in measured.items():
        print(f"- {label}: {len([k for k in result if isinstance(k, int)])} levels measured; started "
              f"{max(levels)} kernels in {result.get('start_s', 0):.1f} s, {result.get('start_failures', 0)} failed to "
              f"start{'; ' + result['error'] if 'error' in result else ''}")
    failed = benchlib.failed_peers({label: result.get("error") for label, result in peers.items()})
    return 0 if "error" not in ours and all(level in ours for level in levels) and not missing and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
