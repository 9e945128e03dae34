#!/usr/bin/env python3
"""Worker-only latency (no kernel, no sandbox): start-up to the `ready` frame, and one `execute 1+1`
round trip (request frame out → execute_result + reply frames back). Not a test; prints a markdown table.

    /usr/bin/python3 tests/worker/bench_worker.py [--starts 10] [--round-trips 200]
"""

import argparse
import os
import pathlib
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from conftest import WorkerProcess  # noqa: E402


def percentile(samples, fraction):
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(round(fraction * (len(ordered) - 1))))]


def cpu_ms(pid):
    """CPU time (user + system) the process has used so far: unlike wall time, insensitive to machine load."""
    with open(f"/proc/{pid}/stat", "rb") as stat_file:
        fields = stat_file.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1000 / os.sysconf("SC_CLK_TCK")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--starts", type=int, default=10)
    parser.add_argument("--round-trips", type=int, default=200)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as cwd:
        starts, start_cpu = [], []
        for _ in range(args.starts):
            worker = WorkerProcess(cwd)
            starts.append((worker.ready_at - worker.started_at) * 1000)
            start_cpu.append(cpu_ms(worker.process.pid))
            worker.stop()

        worker = WorkerProcess(cwd)
        for count in range(1, 21):  # warm-up
            worker.execute("1+1", execution_count=count)
        trips = []
        for count in range(21, 21 + args.round_trips):
            begin = time.perf_counter()
            exchange = worker.execute("1+1", execution_count=count)
            trips.append((time.perf_counter() - begin) * 1000)
            assert exchange.result["data"]["text/plain"] == "2"
            worker.events.clear()
        worker.stop()

    print("| worker measurement | n | median ms | p99 ms |")
    print("|---|---|---|---|")
    print(f"| start-up → ready | {len(starts)} | {statistics.median(starts):.1f} | {percentile(starts, 0.99):.1f} |")
    print(f"| start-up CPU time (user+sys) | {len(start_cpu)} | {statistics.median(start_cpu):.0f} | "
          f"{percentile(start_cpu, 0.99):.0f} |")
    print(f"| execute `1+1` round trip | {len(trips)} | {statistics.median(trips):.3f} | "
          f"{percentile(trips, 0.99):.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
