#!/usr/bin/env python3
"""The worker's CPU per `1+1`, without the kernel or the sandbox: cProfile and syscalls of cellblock_worker.py.

    /usr/bin/python3 tests/bench/profile_worker.py [--executes 2000] [--top 40] [--strace] [--no-profile]

The worker is started as the kernel starts it (fd 3 = one end of a socketpair, fds 1/2 = pipes, fd 0 = /dev/null,
the kernel's minimal environment), from the installed tree ($CELLBLOCK_PREFIX) or the source. This script plays the
kernel: it sends `execute` frames for `1+1` one at a time and reads the channel and the pipes until the reply.
Reported: on-CPU time of the worker per execute (/proc/PID/schedstat, without the profiler) and, in a second worker
run under cProfile (started when the request loop starts, so start-up is not in it; `time.thread_time` as the clock),
the top functions by own time and by cumulative time. With `--strace`: syscalls per execute (strace -f -c).
"""
from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Runs the worker's main() with cProfile switched on for the request loop only; the stats go to argv[1] at exit.
PROFILED_MAIN = r"""
import cProfile, os, sys, time
stats_path, worker_dir = sys.argv[1], sys.argv[2]
sys.argv = [sys.argv[0]]
sys.path.insert(0, worker_dir)
from cellblock_runtime import main as worker_main
serve = worker_main.serve
def profiled_serve(*args):
    profiler = cProfile.Profile(time.thread_time)
    profiler.enable()
    try:
        return serve(*args)
    finally:
        profiler.disable()
        profiler.dump_stats(stats_path)
worker_main.serve = profiled_serve
sys.exit(worker_main.main(worker_dir))
"""


def worker_dir() -> Path:
    prefix = os.environ.get("CELLBLOCK_PREFIX")
    if prefix:
        return Path(prefix) / "share/cellblock/worker"
    return REPO / "share/cellblock/worker"


class Worker:
    def __init__(self, argv: list[str], cwd: str):
        kernel_end, worker_end = socket.socketpair()
        self.channel = kernel_end
        fd = worker_end.fileno()
        self.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, pass_fds=(3,),
                                        preexec_fn=lambda: os.dup2(fd, 3), cwd=cwd,
                                        env={"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": cwd,
                                             "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"})
        worker_end.close()
        self.received = bytearray()
        self.next_id = 0
        ready = self.frame()
        assert ready["type"] == "ready", ready

    def frame(self) -> dict:
        while True:
            if len(self.received) >= 4:
                (length,) = struct.unpack(">I", self.received[:4])
                if len(self.received) >= 4 + length:
                    payload = bytes(self.received[4:4 + length])
                    del self.received[:4 + length]
                    if payload[:1] in (b"\x01", b"\x02"):  # stream text in band (PROTOCOL.md), not JSON
                        return {"type": "stream", "text": payload[1:].decode()}
                    return json.loads(payload)
            readable, _, _ = select.select([self.channel, self.process.stdout, self.process.stderr], [], [], 30)
            if not readable:
                raise TimeoutError("worker silent for 30 s")
            for source in readable:
                if source is self.channel:
                    chunk = self.channel.recv(65536)
                    if not chunk:
                        raise EOFError(f"worker closed its channel: {self.process.stderr.read1(4096)!r}")
                    self.received += chunk
                else:
                    os.read(source.fileno(), 65536)

    def send(self, message: dict) -> None:
        payload = json.dumps(message).encode()
        self.channel.sendall(struct.pack(">I", len(payload)) + payload)

    def execute(self, code: str) -> None:
        self.next_id += 1
        self.send({"type": "execute", "id": self.next_id, "code": code, "silent": False, "store_history": True,
                   "user_expressions": {}, "allow_stdin": False, "execution_count": self.next_id})
        while True:
            frame = self.frame()
            if frame["type"] == "reply":
                assert frame["content"]["status"] == "ok", frame
                return

    def stop(self) -> None:
        try:
            self.send({"type": "shutdown"})
            self.process.wait(timeout=30)
        except Exception:
            self.process.kill()
            self.process.wait()
        self.channel.close()


def on_cpu_ns(pid: int) -> int:
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
            total += int(f.read().split()[0])
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--executes", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--code", default="1+1")
    parser.add_argument("--strace", action="store_true")
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--save-profile", help="keep the cProfile stats in this file (for pstats callers)")
    args = parser.parse_args()
    directory = worker_dir()
    script = str(directory / "cellblock_worker.py")
    with tempfile.TemporaryDirectory(prefix="profile-worker-") as cwd:
        worker = Worker(["/usr/bin/python3", script], cwd)
        try:
            for _ in range(200):
                worker.execute(args.code)
            per_execute = []
            for _ in range(args.rounds):
                before = on_cpu_ns(worker.process.pid)
                started = time.perf_counter()
                for _ in range(args.executes):
                    worker.execute(args.code)
                elapsed = time.perf_counter() - started
                per_execute.append((on_cpu_ns(worker.process.pid) - before) / args.executes / 1000.0)
                print(f"worker CPU per execute: {per_execute[-1]:.0f} us; round trip {elapsed / args.executes * 1e6:.0f} us "
                      f"(load {os.getloadavg()[0]:.2f})", flush=True)
            if args.strace:
                out = Path(cwd) / "strace.txt"
                tracer = subprocess.Popen(["strace", "-f", "-c", "-o", str(out), "-p", str(worker.process.pid)],
                                          stderr=subprocess.DEVNULL)
                time.sleep(1.0)
                count = 300
                for _ in range(count):
                    worker.execute(args.code)
                tracer.send_signal(signal.SIGINT)
                tracer.wait(timeout=30)
                table = out.read_text().splitlines()
                total = next(int(line.split()[3]) for line in table if line.strip().endswith(" total"))
                print(f"\nstrace -f -c over {count} executes: {total / count:.1f} syscalls per execute")
                print("\n".join("    " + line for line in table[:20]))
        finally:
            worker.stop()
        if args.no_profile:
            return 0
        stats_path = Path(cwd) / "worker.prof"
        worker = Worker(["/usr/bin/python3", "-c", PROFILED_MAIN, str(stats_path), str(directory)], cwd)
        try:
            for _ in range(args.executes):
                worker.execute(args.code)
        finally:
            worker.stop()
        import pstats
        if args.save_profile:
            shutil.copy(stats_path, args.save_profile)
        stats = pstats.Stats(str(stats_path))
        print(f"\ncProfile (thread_time) of the request loop over {args.executes} executes + the profiler's own cost:")
        stats.sort_stats("tottime").print_stats(args.top)
        stats.sort_stats("cumulative").print_stats(args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
