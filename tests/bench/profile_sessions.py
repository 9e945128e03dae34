#!/usr/bin/env python3
"""Where the CPU of a `1+1` goes with 1 and with 16 sessions, cellblock beside the floor kernel, per thread.

    /usr/bin/python3 tests/bench/profile_sessions.py [--sessions 16] [--rounds 3] [--seconds 4]
                                                     [--floor-kernel PATH] [--floor-busy-us 300] [--perf]

Starts `--sessions` cellblock kernels and as many floor kernels (floor_kernel.cpp, its worker busy for
`--floor-busy-us` per cell) and drives them with bench_throughput.py's driver, the kinds and the levels (1 session,
all sessions) interleaved in each round. Around each window, every thread of every active session's tree (kernel
threads, libzmq's I/O thread, the worker) and of the driver itself is read from /proc: on-CPU and run-queue wait
(`schedstat`), time slices, voluntary and involuntary context switches (`status`), page faults (`stat`),
migrations between CPUs (`sched`). Printed per execute, grouped by role (thread name), as the median over rounds.
With `--perf`, one more window per kind and level under `perf record -e cpu-clock -a`, and the symbols whose
samples per execute grew most from one session to all of them.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import zmq

import benchlib
import bench_floors
import bench_throughput
from benchlib import progress

PERF_PERIOD_NS = 250_000  # one cpu-clock sample per 250 µs on a CPU (a fixed period, not a frequency)
FIELDS = ("cpu_us", "wait_us", "slices", "vol", "invol", "faults", "migrations")


def read_thread(pid: int, tid: str) -> tuple[str, list[float]] | None:
    base = f"/proc/{pid}/task/{tid}"
    try:
        with open(f"{base}/schedstat") as f:
            run_ns, wait_ns, slices = (int(x) for x in f.read().split()[:3])
        with open(f"{base}/comm") as f:
            comm = f.read().strip()
        status = {}
        with open(f"{base}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                status[key] = value.strip()
        with open(f"{base}/stat") as f:
            faults = int(f.read().rpartition(")")[2].split()[7])  # minflt
        migrations = 0
        try:
            with open(f"{base}/sched") as f:
                for line in f:
                    if line.startswith("se.nr_migrations"):
                        migrations = int(line.split(":")[1])
        except OSError:
            pass
    except (OSError, ValueError, IndexError):
        return None
    return comm, [run_ns / 1000.0, wait_ns / 1000.0, slices, int(status["voluntary_ctxt_switches"]),
                  int(status["nonvoluntary_ctxt_switches"]), faults, migrations]


def role(pid: int, tid: str, root: int, comm: str) -> str:
    """A thread's role: the kernel process's threads by name (its main thread apart), any descendant as 'worker',
    the driver as 'client'."""
    if pid == os.getpid():
        return "client"
    if pid == root:
        return "kernel:main thread" if str(pid) == tid else f"kernel:{comm}"
    return "worker"


def snapshot(roots: list[int]) -> dict[tuple[int, str], tuple[str, list[float]]]:
    threads = {}
    for pid in [os.getpid()] + [p for root in roots for p in benchlib.descendants(root)]:
        root = next((r for r in roots if pid == r), None)
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            read = read_thread(pid, tid)
            if read is not None:
                threads[(pid, tid)] = (role(pid, tid, root if root is not None else -1, read[0]), read[1])
    return threads


def per_role(before: dict, after: dict, executes: int) -> dict[str, list[float]]:
    sums: dict[str, list[float]] = collections.defaultdict(lambda: [0.0] * len(FIELDS))
    for key, (name, values) in after.items():
        if key not in before:
            continue
        for index, value in enumerate(values):
            sums[name][index] += (value - before[key][1][index]) / executes
    return dict(sums)


def drive_counted(sessions, seconds: float) -> tuple[float, dict[str, list[float]]]:
    roots = [session.kernel.pid for session in sessions]
    bench_throughput.drive(sessions, min(1.0, seconds / 4))  # warm-up
    before = snapshot(roots)
    executes, _, window, *_ = bench_throughput.drive(sessions, seconds)
    after = snapshot(roots)
    return executes / window, per_role(before, after, executes)


def perf_window(sessions, seconds: float, output: Path) -> tuple[int, dict[str, float]]:
    """Executes and {role comm dso symbol: samples} of `perf record -e cpu-clock` on the sessions' processes and
    the driver over one window."""
    bench_throughput.drive(sessions, min(1.0, seconds / 4))
    pids = [os.getpid()] + [pid for session in sessions for pid in session.kernel.tree()]
    workers = {pid for session in sessions for pid in session.kernel.tree() if pid != session.kernel.pid}
    recorder = subprocess.Popen(["perf", "record", "-q", "-e", "cpu-clock", "-c", str(PERF_PERIOD_NS), "-p",
                                 ",".join(map(str, pids)), "-o", str(output)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.3)
    executes, *_ = bench_throughput.drive(sessions, seconds)
    recorder.send_signal(signal.SIGINT)
    recorder.wait()
    report = subprocess.run(["perf", "script", "-i", str(output), "-F", "comm,pid,ip,sym,dso"],
                            capture_output=True, text=True).stdout
    samples: dict[str, float] = collections.Counter()
    for line in report.splitlines():
        match = re.match(r"\s*(\S+)\s+(\d+)\s+[0-9a-f]+\s+(.*) \((.*)\)$", line)
        if not match:
            continue
        comm, pid, symbol, dso = match[1], int(match[2]), match[3], os.path.basename(match[4])
        who = "client" if pid == os.getpid() else "worker" if pid in workers else "kernel"
        samples[f"{who} {comm} {dso} {symbol}"] += 1
    return executes, samples


def print_table(kind: str, results: dict[int, list[tuple[float, dict]]], levels: list[int]) -> None:
    rates = {level: statistics.median(rate for rate, _ in results[level]) for level in levels}
    print(f"\n### {kind}: " + ", ".join(f"{level} session(s) {rates[level]:,.0f} exec/s" for level in levels))
    print("\nper execute, median of rounds: " + " | ".join(FIELDS))
    roles = sorted({name for level in levels for _, rows in results[level] for name in rows})
    print("| role | " + " | ".join(f"{field} @{level}" for field in FIELDS for level in levels) + " |")
    print("|---|" + "---:|" * (len(FIELDS) * len(levels)))
    totals = {level: [0.0] * len(FIELDS) for level in levels}
    for name in roles:
        cells = []
        for index in range(len(FIELDS)):
            for level in levels:
                value = statistics.median(rows.get(name, [0.0] * len(FIELDS))[index] for _, rows in results[level])
                totals[level][index] += value
                cells.append(f"{value:.2f}" if index > 1 else f"{value:.0f}")
        print(f"| {name} | " + " | ".join(cells) + " |")
    cells = [f"{totals[level][index]:.2f}" if index > 1 else f"{totals[level][index]:.0f}"
             for index in range(len(FIELDS)) for level in levels]
    print("| **sum** | " + " | ".join(cells) + " |")


def print_perf_growth(kind: str, perf: dict[int, tuple[int, dict[str, float]]], levels: list[int]) -> None:
    low, high = levels[0], levels[-1]
    (ex_low, s_low), (ex_high, s_high) = perf[low], perf[high]
    us = PERF_PERIOD_NS / 1000.0
    growth = []
    for key in set(s_low) | set(s_high):
        a, b = s_low.get(key, 0.0) * us / ex_low, s_high.get(key, 0.0) * us / ex_high
        growth.append((b - a, a, b, key))
    growth.sort(reverse=True)
    print(f"\n{kind}: µs of CPU per execute by symbol (perf cpu-clock on the sessions' processes and the driver), "
          f"{low} → {high} sessions, largest growth first")
    for delta, a, b, key in growth[:25]:
        print(f"  {a:7.1f} → {b:7.1f}  (+{delta:6.1f})  {key}")
    by_comm: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for key in set(s_low) | set(s_high):
        who, comm = key.split()[:2]
        group = f"{who} ({comm}) {'Linux' if 'kernel.kallsyms' in key else 'user space'}"
        by_comm[group][0] += s_low.get(key, 0.0) * us / ex_low
        by_comm[group][1] += s_high.get(key, 0.0) * us / ex_high
    print("  by command, Linux vs user space:")
    for group, (a, b) in sorted(by_comm.items(), key=lambda item: -item[1][1])[:14]:
        print(f"    {a:7.1f} → {b:7.1f}  {group}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--floor-kernel", help="cellblock-floor-kernel (default $CELLBLOCK_FLOOR_KERNEL)")
    parser.add_argument("--floor-busy-us", type=float, default=300.0, help="the floor worker's busy time per cell")
    parser.add_argument("--kinds", default="cellblock,floor")
    parser.add_argument("--levels", default="", help="comma-separated session counts (default 1 and --sessions)")
    parser.add_argument("--perf", action="store_true", help="one more window per kind and level under perf record")
    args = parser.parse_args()
    levels = [int(level) for level in args.levels.split(",")] if args.levels else [1, args.sessions]
    args.sessions = max(levels)
    benchlib.use_installed_kernelspecs()
    wanted = args.kinds.split(",")
    with tempfile.TemporaryDirectory(prefix="profile-sessions-") as tmp:
        kernel_names = {"cellblock": "cellblock-python"}
        if "floor" in wanted:
            binary = bench_floors.floor_kernel_path(args.floor_kernel)
            bench_floors.install_floor_kernelspec(binary, Path(tmp) / "jupyter", args.floor_busy_us / 1000.0)
            kernel_names["floor"] = bench_floors.FLOOR[1]
        context = zmq.Context()
        running, sessions = {}, {}
        try:
            for kind in wanted:
                progress(f"{kind}: starting {args.sessions} kernels")
                running[kind], failures = benchlib.start_kernels(kernel_names[kind], args.sessions)
                if failures:
                    raise SystemExit(f"{kind}: {failures} kernels failed to start")
                for kernel in running[kind]:
                    kernel.client.stop_channels()
                sessions[kind] = [bench_throughput.LeanSession(context, kernel) for kernel in running[kind]]
            time.sleep(0.5)
            results = {kind: {level: [] for level in levels} for kind in wanted}
            for round_index in range(args.rounds):
                for kind in wanted if round_index % 2 == 0 else reversed(wanted):
                    for level in levels:
                        rate, rows = drive_counted(sessions[kind][:level], args.seconds)
                        results[kind][level].append((rate, rows))
                        progress(f"round {round_index + 1} {kind} {level}: {rate:.0f} exec/s")
            perf = {}
            if args.perf:
                for kind in wanted:
                    perf[kind] = {level: perf_window(sessions[kind][:level], args.seconds,
                                                     Path(tmp) / f"perf-{kind}-{level}.data") for level in levels}
            print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end; cpu_us = on-CPU µs, "
                  "wait_us = µs runnable but waiting for a CPU, slices = times put on a CPU, vol/invol = context "
                  "switches, faults = minor page faults, migrations = moves between CPUs; all per execute")
            for kind in wanted:
                print_table(kind, results[kind], levels)
            for kind, by_level in perf.items():
                print_perf_growth(kind, by_level, levels)
        finally:
            for kind_sessions in sessions.values():
                for session in kind_sessions:
                    session.close()
            context.term()
            for kernels in running.values():
                benchlib.stop_kernels(kernels)
    return 0


if __name__ == "__main__":
    sys.exit(main())
