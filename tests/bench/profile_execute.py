#!/usr/bin/env python3
"""Where one kernel's CPU goes under a steady stream of executes (`1+1` unless --code): per process and per thread,
and syscalls.

    /usr/bin/python3 tests/bench/profile_execute.py [--kernel cellblock-python] [--executes 2000] [--rounds 3]
                                                    [--code CODE] [--strace] [--perf SECONDS]

One kernel, launched from its kernelspec argv with a fresh connection file, driven by bench_kernel.py's lean client
(one execute in flight: send, wait for the IOPub idle, drain the reply). For each round of `--executes`:
- the round trip (median, p99);
- on-CPU time per execute of every thread of the kernel process and of each descendant (the worker), from
  /proc/PID/task/TID/schedstat (nanoseconds, unlike the 10 ms ticks of /proc/PID/stat), named by the thread's comm;
- with `--strace`: one more round under `strace -f -c` attached to the kernel and, separately, one under strace
  attached to the worker; syscalls per execute (the strace round's latency is not reported);
- with `--perf S`: `perf record -e cpu-clock -g` on the kernel for S seconds of executes, then `perf report`'s top
  symbols (children excluded).
"""
from __future__ import annotations

import argparse
import collections
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import zmq

import benchlib
from bench_kernel import LaunchedKernel, LeanClient
from benchlib import Stats, progress

REQUEST = {"code": "1+1", "silent": False, "store_history": True, "user_expressions": {}, "allow_stdin": False,
           "stop_on_error": True}


def thread_times(pid: int) -> dict[tuple[int, str], int]:
    """{(tid, comm): on-CPU nanoseconds} of every thread of pid."""
    times = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return times
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                comm = f.read().strip()
        except (OSError, ValueError, IndexError):
            continue
        times[(int(tid), comm)] = ns
    return times


def context_switches(root: int) -> int:
    """Voluntary context switches (each a sleep and a wake-up) of every thread in the tree so far."""
    total = 0
    for pid in benchlib.descendants(root):
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/status") as f:
                    for line in f:
                        if line.startswith("voluntary_ctxt_switches:"):
                            total += int(line.split()[1])
            except (OSError, ValueError):
                continue
    return total


def tree_times(root: int) -> dict[tuple[int, str], dict[tuple[int, str], int]]:
    result = {}
    for pid in benchlib.descendants(root):
        result[(pid, benchlib.process_name(pid))] = thread_times(pid)
    return result


def run_executes(client: LeanClient, count: int, request: dict) -> list[float]:
    samples = []
    for _ in range(count):
        started = time.perf_counter()
        msg_id = client.send("execute_request", request)
        client.wait_idle(msg_id, timeout=30)
        samples.append((time.perf_counter() - started) * 1000.0)
        client.drain_shell()
    return samples


def warm_up(client: LeanClient, request: dict) -> None:
    client.wait_reply(client.send("kernel_info_request", {}), timeout=60)
    for attempt in range(100):
        try:
            client.wait_idle(client.send("execute_request", request), timeout=30 if attempt == 0 else 2)
            break
        except TimeoutError:
            continue
    run_executes(client, 50, request)


def strace_counts(pid: int, client: LeanClient, request: dict, executes: int,
                  follow_threads: bool) -> tuple[int, list[str]]:
    """Total syscalls of pid (and its threads) over `executes` executes, and strace's table."""
    out = tempfile.NamedTemporaryFile(prefix="strace-", suffix=".txt", delete=False)
    out.close()
    argv = ["strace", "-c", "-o", out.name, "-p", str(pid)]
    if follow_threads:
        argv.insert(1, "-f")
    tracer = subprocess.Popen(argv, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # attached to every thread
    run_executes(client, executes, request)
    tracer.send_signal(signal.SIGINT)
    tracer.wait(timeout=30)
    text = Path(out.name).read_text()
    os.unlink(out.name)
    total = 0
    for line in text.splitlines():
        if line.strip().endswith(" total"):
            fields = line.split()
            total = int(fields[3])  # % time, seconds, usecs/call, calls, [errors], total
    return total, text.splitlines()


def perf_top(pid: int, client: LeanClient, request: dict, seconds: float) -> list[str]:
    data = tempfile.NamedTemporaryFile(prefix="perf-", suffix=".data", delete=False)
    data.close()
    recorder = subprocess.Popen(["perf", "record", "-q", "-e", "cpu-clock", "-g", "-o", data.name, "-p", str(pid)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.5)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        run_executes(client, 100, request)
    recorder.send_signal(signal.SIGINT)
    recorder.wait(timeout=60)
    report = subprocess.run(["perf", "report", "-i", data.name, "--no-children", "--sort", "dso,sym", "--stdio",
                             "-g", "none", "--percent-limit", "0.7"], capture_output=True, text=True)
    os.unlink(data.name)
    return [line for line in report.stdout.splitlines() if line and not line.startswith("#")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernel", default="cellblock-python", help="kernelspec name (default cellblock-python)")
    parser.add_argument("--executes", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--strace", action="store_true", help="also count syscalls (strace -c) of kernel and worker")
    parser.add_argument("--perf", type=float, default=0.0, help="also perf record the kernel for this many seconds")
    parser.add_argument("--code", default="1+1",
                        help="the cell to execute (default 1+1); the kernel's output cap is raised to 64 MiB")
    args = parser.parse_args()
    request = dict(REQUEST, code=args.code)

    benchlib.use_installed_kernelspecs()
    context = zmq.Context()
    with tempfile.TemporaryDirectory(prefix="profile-execute-") as tmp:
        # A large print arrives whole, as bench_outputs.py has it.
        kernel = LaunchedKernel(args.kernel, Path(tmp), env={"CELLBLOCK_OUTPUT_BYTES": str(64 << 20)})
        client = LeanClient(context, kernel.info)
        try:
            kernel.start()
            warm_up(client, request)
            root = kernel.process.pid
            progress(f"load average {os.getloadavg()}")
            per_thread = collections.defaultdict(list)  # (process, comm) -> [us per execute per round]
            per_process = collections.defaultdict(list)
            latencies = []
            switches = []
            for round_index in range(args.rounds):
                before = tree_times(root)
                switches_before = context_switches(root)
                samples = run_executes(client, args.executes, request)
                after = tree_times(root)
                switches.append((context_switches(root) - switches_before) / args.executes)
                latencies.append(Stats(samples))
                for (pid, name), threads in after.items():
                    process_total = 0
                    label = "kernel" if pid == root else ("worker" if "cellblock_worker" in name else name)
                    by_comm = collections.Counter()
                    for key, ns in threads.items():
                        delta = ns - before.get((pid, name), {}).get(key, 0)
                        by_comm[key[1]] += delta
                        process_total += delta
                    for comm, ns in by_comm.items():
                        per_thread[(label, comm)].append(ns / args.executes / 1000.0)
                    per_process[label].append(process_total / args.executes / 1000.0)
                progress(f"round {round_index + 1}: median {latencies[-1].median:.3f} ms, "
                         + ", ".join(f"{label} {values[-1]:.0f} us" for label, values in per_process.items()))
            print(f"\n## {args.kernel}: {args.executes} executes x {args.rounds} rounds, load {os.getloadavg()}\n")
            print("| round | median ms | p99 ms | " + " | ".join(f"{label} us CPU/exec" for label in per_process) + " |")
            print("|---|---|---|" + "---|" * len(per_process))
            for index, stats in enumerate(latencies):
                print(f"| {index + 1} | {stats.median:.3f} | {stats.p99:.3f} | "
                      + " | ".join(f"{values[index]:.0f}" for values in per_process.values()) + " |")
            for label, values in per_process.items():
                ordered = sorted(values)
                print(f"{label}: CPU per execute min {ordered[0]:.0f} us, median {ordered[len(ordered) // 2]:.0f} us")
            print(f"voluntary context switches per execute (kernel tree): median {sorted(switches)[len(switches) // 2]:.1f}")
            print("\nper thread (median over rounds, us CPU per execute):")
            for (label, comm), values in sorted(per_thread.items(), key=lambda item: -sorted(item[1])[len(item[1]) // 2]):
                median = sorted(values)[len(values) // 2]
                if median >= 1:
                    print(f"  {label:>24} {comm:<18} {median:8.1f}")
            if args.strace:
                if not shutil.which("strace"):
                    raise SystemExit("strace not installed")
                count = min(args.executes, 300)
                total, table = strace_counts(root, client, request, count, follow_threads=True)
                print(f"\nstrace -f -c of the kernel over {count} executes: {total / count:.1f} syscalls per execute")
                print("\n".join("    " + line for line in table[:24]))
                workers = [pid for pid in benchlib.descendants(root) if "python" in benchlib.process_name(pid)]
                for worker in workers[-1:]:
                    total, table = strace_counts(worker, client, request, count, follow_threads=True)
                    print(f"\nstrace -f -c of the worker ({worker}) over {count} executes: "
                          f"{total / count:.1f} syscalls per execute")
                    print("\n".join("    " + line for line in table[:24]))
            if args.perf > 0:
                print(f"\nperf record -e cpu-clock -g of the kernel, {args.perf:g} s (self time by dso, symbol):")
                print("\n".join("    " + line for line in perf_top(root, client, request, args.perf)[:60]))
        finally:
            client.close()
            kernel.stop()
    context.term()
    return 0


if __name__ == "__main__":
    sys.exit(main())
