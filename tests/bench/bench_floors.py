#!/usr/bin/env python3
"""The floors under the kernel's missed targets: the least a libzmq kernel with an IPython worker costs on this machine.

    /usr/bin/python3 tests/bench/bench_floors.py [--quick] [--floor-kernel PATH] [--executes N] [--rounds N]
                                                 [--starts N] [--seconds S] [--no-zygote]

Four of the kernel's targets are missed on this machine: kernel CPU ≤ 0.25 ms per `1+1`, `1+1` ≤ 0.4 ms over ZMQ,
≥ 2,000 exec/s with 16 sessions, and a cold start ≤ 50 ms. This benchmark measures, in one run and beside
cellblock and ipykernel, what no kernel of this design (the brief's: libzmq sockets, an IPython worker in its own
process) can go below here:
- **cellblock-floor-kernel** (floor_kernel.cpp, built with the tests, path from --floor-kernel or
  $CELLBLOCK_FLOOR_KERNEL): a single-threaded libzmq kernel that checks each request's HMAC, parses it, publishes
  `busy`, `execute_input`, `execute_result` and `idle`, sends the reply, all signed, and exchanges one frame with a
  worker process that answers `2` after keeping a core busy for as long as `run_cell("1+1")` takes (below), so
  that the kernel's messages go out in the two bursts a real cell causes. No confinement, no limits, no xeus.
- **IPython's `run_cell("1+1")`** in a warmed `InteractiveShell` (history in memory, output to /dev/null): what any
  IPython-based worker runs for a cell, ipykernel's included; wall and CPU time per cell. Also its CPU time when as
  many warmed shells as sessions take turns (one cell in flight each, driven as the sessions are), because a worker
  that shares the cores and their caches with 15 others pays more per cell than one shell in a tight loop.
- **a fork of a warmed template** (IPython, numpy, pandas and matplotlib imported, `gc.freeze()`d, as cellblock's
  zygote template) into new user, mount, net, IPC and UTS namespaces (no pid namespace: `unshare` gives that only
  to children), up to the end of its first `run_cell("1+1")`: what a forked worker's start costs before any
  confinement, protocol or kernel is added.
- **`/bin/true`**: the cost of starting any program here.
- **what the floors are made of**: one system call, one page fault (a first touch, and a copy-on-write fault in a
  forked child, which a zygote worker takes on every page of the template it writes) and one wake-up round trip
  between two processes, each timed in a loop against the same loop without it.

The floors: kernel CPU = the floor kernel's CPU per execute (every thread, libzmq's I/O thread included); `1+1` =
the floor kernel's round trip, its worker busy for `run_cell`'s time; exec/s at 16 sessions = 16 floor kernels
driven by bench_throughput.py's driver, their workers busy as before (and, as a check, cores × 1000 / the CPU per
execute of kernel, `run_cell` and client), and again with their workers busy for the shells-taking-turns time;
cold start = the floor kernel's start to kernel_info_reply + the fork to its first `1+1` (in sequence; run side by
side on two cores they would overlap, so the larger of the two is also given). Round trips are driven by bench_kernel.py's lean client, one execute in flight, every kernel in
interleaved rounds.
"""
from __future__ import annotations

import argparse
import json
import os
import selectors
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import zmq

import benchlib
import bench_throughput
from bench_kernel import LaunchedKernel, LeanClient, cold_start_ms
from bench_memory import ZYGOTE_KIND, cellblock_zygote, install_zygote_kernelspec, warm_template
from benchlib import Row, Stats, markdown_table, progress
from profile_execute import REQUEST, run_executes, thread_times

FLOOR = ("floor kernel", "cellblock-floor")
# The same floor kernel, its worker busy for as long as run_cell("1+1") takes when as many shells as sessions take
# turns on the machine's cores (their caches shared), which is what a worker pays under the 16-session load.
FLOOR_SHARED = ("floor kernel, workers sharing the cores", "cellblock-floor-shared")
KINDS = [("cellblock", "cellblock-python"), FLOOR, ("ipykernel", "python3")]

# A warmed IPython shell as a worker holds one (history in memory, output to /dev/null); both scripts below start so.
WARMED_SHELL = r"""
import json, os, sys, time
from traitlets.config import Config
from IPython.core.interactiveshell import InteractiveShell
config = Config()
config.HistoryManager.hist_file = ":memory:"
shell = InteractiveShell.instance(config=config)
sys.stdout = open(os.devnull, "w")
for _ in range(200):
    shell.run_cell("1+1", store_history=True)
"""

# Prints the wall and CPU ms of each timed run_cell("1+1") as JSON.
RUN_CELL = WARMED_SHELL + r"""
wall, cpu = [], []
for _ in range(int(sys.argv[1])):
    started, started_cpu = time.perf_counter(), time.thread_time()
    result = shell.run_cell("1+1", store_history=True)
    cpu.append((time.thread_time() - started_cpu) * 1000.0)
    wall.append((time.perf_counter() - started) * 1000.0)
    assert result.result == 2, result
sys.__stdout__.write(json.dumps({"wall": wall, "cpu": cpu}) + "\n")
"""

# One of several shells taking turns: after "ready" it runs one timed run_cell("1+1") per byte on stdin and answers
# each with its CPU ms as a line, until stdin closes.
RUN_CELL_TURNS = WARMED_SHELL + r"""
sys.__stdout__.write("ready\n")
sys.__stdout__.flush()
while os.read(0, 1):
    started_cpu = time.thread_time()
    result = shell.run_cell("1+1", store_history=True)
    cpu = (time.thread_time() - started_cpu) * 1000.0
    assert result.result == 2, result
    sys.__stdout__.write(f"{cpu}\n")
    sys.__stdout__.flush()
"""

# A template as cellblock's zygote keeps one: for each line on stdin it forks a child that enters new namespaces and
# runs its first cell, and prints the ms from just before fork() to the child's answer.
FORK_TEMPLATE = r"""
import ctypes, gc, json, os, sys, time
import numpy, pandas, matplotlib
matplotlib.use("agg")
import matplotlib.pyplot
from traitlets.config import Config
from IPython.core.interactiveshell import InteractiveShell
config = Config()
config.HistoryManager.hist_file = ":memory:"
shell = InteractiveShell.instance(config=config)
null = open(os.devnull, "w")
sys.stdout = null
for _ in range(20):
    shell.run_cell("1+1", store_history=True)
libc = ctypes.CDLL(None, use_errno=True)
NAMESPACES = 0x10000000 | 0x00020000 | 0x40000000 | 0x08000000 | 0x04000000  # user, mount, net, IPC, UTS
gc.freeze()
sys.__stdout__.write("ready\n")
sys.__stdout__.flush()
for line in sys.stdin:
    answer_read, answer_write = os.pipe()
    started = time.perf_counter()
    child = os.fork()
    if child == 0:
        os.close(answer_read)
        status = 0 if libc.unshare(NAMESPACES) == 0 else 1
        result = shell.run_cell("1+1", store_history=True)
        os.write(answer_write, b"ok" if status == 0 and result.result == 2 else b"no")
        os._exit(0)
    os.close(answer_write)
    answer = os.read(answer_read, 2)
    elapsed = (time.perf_counter() - started) * 1000.0
    os.close(answer_read)
    os.waitpid(child, 0)
    if answer != b"ok":
        sys.exit(f"a fork could not enter its namespaces or run its first cell: {answer!r}")
    sys.__stdout__.write(json.dumps(elapsed) + "\n")
    sys.__stdout__.flush()
"""


# What the floors are made of here: the price of one system call, one page fault (a first touch, and a copy-on-write
# after fork, as a forked worker takes them) and one wake-up of another process. Each is the time of a loop that
# pays it once per pass minus the same loop without it, so Python's own cost per pass cancels; medians of rounds.
MACHINE_COSTS = r"""
import json, mmap, os, statistics, sys, time
rounds, calls, pages = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
PAGE = mmap.PAGESIZE
def per_pass(function, count):
    started = time.perf_counter()
    function(count)
    return (time.perf_counter() - started) / count * 1e6
def getppid_loop(count):
    for _ in range(count):
        os.getppid()
def empty_loop(count):
    nothing = int
    for _ in range(count):
        nothing()
def touch(memory, count):
    for index in range(0, count * PAGE, PAGE):
        memory[index] = 1
results = {"syscall": [], "fault": [], "cow": [], "wake": []}
for _ in range(rounds):
    results["syscall"].append(per_pass(getppid_loop, calls) - per_pass(empty_loop, calls))
    memory = mmap.mmap(-1, pages * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    first = per_pass(lambda count: touch(memory, count), pages)
    again = per_pass(lambda count: touch(memory, count), pages)
    results["fault"].append(first - again)
    answer_read, answer_write = os.pipe()
    child = os.fork()
    if child == 0:
        cow = per_pass(lambda count: touch(memory, count), pages)
        again = per_pass(lambda count: touch(memory, count), pages)
        os.write(answer_write, json.dumps(cow - again).encode())
        os._exit(0)
    os.close(answer_write)
    results["cow"].append(json.loads(os.read(answer_read, 100)))
    os.close(answer_read)
    os.waitpid(child, 0)
    memory.close()
    # Ping-pong over two pipes with a child: each round trip wakes each side once (plus 4 reads/writes).
    ping_read, ping_write = os.pipe()
    pong_read, pong_write = os.pipe()
    child = os.fork()
    if child == 0:
        while os.read(ping_read, 1) == b"p":
            os.write(pong_write, b"p")
        os._exit(0)
    trips = max(calls // 100, 100)
    started = time.perf_counter()
    for _ in range(trips):
        os.write(ping_write, b"p")
        os.read(pong_read, 1)
    results["wake"].append((time.perf_counter() - started) / trips * 1e6)
    os.write(ping_write, b"q")
    os.waitpid(child, 0)
    for fd in (ping_read, ping_write, pong_read, pong_write):
        os.close(fd)
print(json.dumps({key: statistics.median(values) for key, values in results.items()}))
"""


def machine_costs(rounds: int, calls: int, pages: int) -> dict[str, float]:
    """µs per system call (getppid), per first-touch page fault, per copy-on-write fault in a forked child, and per
    process wake-up round trip over pipes."""
    out = subprocess.run([sys.executable, "-c", MACHINE_COSTS, str(rounds), str(calls), str(pages)],
                         capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"machine cost measurement failed: {out.stderr.strip()[-400:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])

def floor_kernel_path(given: str | None) -> Path:
    path = given or os.environ.get("CELLBLOCK_FLOOR_KERNEL")
    if not path:
        raise SystemExit("bench_floors.py needs cellblock-floor-kernel: --floor-kernel PATH or $CELLBLOCK_FLOOR_KERNEL "
                         "(the tests' build makes it: build/<dir>/tests/bench/cellblock-floor-kernel)")
    if not os.access(path, os.X_OK):
        raise SystemExit(f"cellblock-floor-kernel {path} is not an executable")
    return Path(path).resolve()


def install_floor_kernelspec(binary: Path, directory: Path, worker_busy_ms: float, name: str = FLOOR[1]) -> None:
    """A kernelspec for the floor kernel, first on JUPYTER_PATH, so that LaunchedKernel and jupyter_client start it
    as they start any kernel. Its worker keeps a core busy for `worker_busy_ms` per cell, as IPython's run_cell
    does, so that the kernel's messages go out in the two bursts a real cell causes."""
    spec_dir = directory / "kernels" / name
    spec_dir.mkdir(parents=True)
    argv = [str(binary), "{connection_file}", str(round(worker_busy_ms * 1000))]
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": argv, "display_name": "cellblock floor kernel", "language": "python"}))
    if not os.environ.get("JUPYTER_PATH", "").startswith(f"{directory}:"):
        os.environ["JUPYTER_PATH"] = f"{directory}:{os.environ.get('JUPYTER_PATH', '')}"


def check_result(client: LeanClient) -> None:
    """The kernel answers `1+1` with an execute_result of 2 and an ok reply (the floor kernel, like the others)."""
    msg_id = client.send("execute_request", REQUEST)
    deadline = time.monotonic() + 60
    result = None
    while time.monotonic() < deadline:
        if not client.iopub.poll(100):
            continue
        frames = client.iopub.recv_multipart()
        start = frames.index(b"<IDS|MSG>")
        header, parent, content = (json.loads(frames[start + i]) for i in (2, 3, 5))
        if parent.get("msg_id", "").encode() != msg_id:
            continue
        if header["msg_type"] == "execute_result":
            result = content["data"]["text/plain"]
        if header["msg_type"] == "status" and content["execution_state"] == "idle":
            break
    reply = client.wait_reply(msg_id, timeout=10)
    if result != "2" or reply.get("status") != "ok":
        raise RuntimeError(f"`1+1` gave {result!r}, reply {reply.get('status')!r}")


def kernel_round_trips(context: zmq.Context, workdir: Path, executes: int, rounds: int) -> dict[str, dict]:
    """{label: {"rt": Stats ms, "kernel": Stats ms CPU, "worker": Stats ms CPU, "client": Stats ms CPU}}: every kernel
    running at once, measured in turn, round after round."""
    running = []
    try:
        for label, name in KINDS:
            kernel = LaunchedKernel(name, workdir)
            client = LeanClient(context, kernel.info)
            running.append((label, kernel, client))
            kernel.start()
            client.wait_reply(client.send("kernel_info_request", {}), timeout=120)
            time.sleep(0.3)  # the IOPub subscription is in place before the first execute
            check_result(client)
            run_executes(client, 50, REQUEST)
        results = {label: {"rt": [], "kernel": [], "worker": [], "client": []} for label, _ in KINDS}
        for round_index in range(rounds):
            for label, kernel, client in running:
                root = kernel.process.pid
                workers = [pid for pid in benchlib.descendants(root) if pid != root]
                kernel_before = sum(thread_times(root).values())
                worker_before = sum(sum(thread_times(pid).values()) for pid in workers)
                client_before = os.times()
                samples = run_executes(client, executes, REQUEST)
                client_after = os.times()
                kernel_ns = sum(thread_times(root).values()) - kernel_before
                worker_ns = sum(sum(thread_times(pid).values()) for pid in workers) - worker_before
                client_s = (client_after.user - client_before.user) + (client_after.system - client_before.system)
                entry = results[label]
                entry["rt"] += samples
                entry["kernel"].append(kernel_ns / executes / 1e6)
                entry["worker"].append(worker_ns / executes / 1e6)
                entry["client"].append(client_s * 1000.0 / executes)
                progress(f"round {round_index + 1}: {label}: {Stats(samples).median:.3f} ms, kernel "
                         f"{entry['kernel'][-1]:.3f} ms CPU per execute")
        return {label: {key: Stats(values) for key, values in entry.items()} for label, entry in results.items()}
    finally:
        for _, kernel, client in running:
            client.close()
            kernel.stop()


def run_cell_times(count: int) -> tuple[Stats, Stats]:
    """(wall ms, CPU ms) of IPython's run_cell("1+1") in a warmed shell."""
    out = subprocess.run([sys.executable, "-c", RUN_CELL, str(count)], capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"run_cell measurement failed: {out.stderr.strip()[-400:]}")
    times = json.loads(out.stdout.strip().splitlines()[-1])
    return Stats(times["wall"]), Stats(times["cpu"])


def shared_run_cell_cpu(shells: int, count: int) -> Stats:
    """CPU ms of run_cell("1+1") in each of `shells` warmed shells driven as bench_throughput.py drives sessions (one
    cell in flight per shell, the next sent as soon as one answers), so that they share the cores and their caches as
    16 sessions' workers do; no kernel, no sockets. The first pass of every shell is left out."""
    processes = [subprocess.Popen([sys.executable, "-c", RUN_CELL_TURNS], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True) for _ in range(shells)]
    selector = selectors.DefaultSelector()
    try:
        for process in processes:
            if process.stdout.readline().strip() != "ready":
                raise RuntimeError("a run_cell shell did not start")
        left = {}
        for process in processes:
            selector.register(process.stdout, selectors.EVENT_READ, process)
            left[process] = count + 1
            process.stdin.write("x")
            process.stdin.flush()
        cpu: list[float] = []
        while left:
            for key, _ in selector.select(timeout=60):
                process = key.data
                line = process.stdout.readline()
                if not line:
                    raise RuntimeError("a run_cell shell exited")
                left[process] -= 1
                if left[process] < count:
                    cpu.append(float(line))
                if left[process] == 0:
                    selector.unregister(process.stdout)
                    del left[process]
                else:
                    process.stdin.write("x")
                    process.stdin.flush()
        return Stats(cpu)
    finally:
        selector.close()
        for process in processes:
            process.stdin.close()
            benchlib.stop_process(process)


class ForkTemplate:
    """The warmed template of FORK_TEMPLATE; fork_ms() asks it for one fork to a first `1+1`."""

    def __init__(self):
        self.process = subprocess.Popen([sys.executable, "-c", FORK_TEMPLATE], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)
        if self.process.stdout.readline().strip() != "ready":
            self.stop()
            raise RuntimeError("the fork template did not start")

    def fork_ms(self) -> float:
        self.process.stdin.write("fork\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the fork template exited ({self.process.wait()})")
        return float(line)

    def stop(self) -> None:
        benchlib.stop_process(self.process)


def cold_starts(context: zmq.Context, workdir: Path, starts: int, zygote: bool) -> dict[str, Stats]:
    """Interleaved, one at a time: /bin/true, the floor kernel to kernel_info_reply, a template's fork to its first
    `1+1`, and (with zygote) cellblock's zygote kernel to its first `1+1`."""
    samples: dict[str, list[float]] = {"true": [], "floor_info": [], "fork": [], "cellblock": []}
    template = ForkTemplate()
    try:
        template.fork_ms()  # the first fork pays for pages the later ones find in the page cache
        for index in range(starts):
            started = time.perf_counter()
            subprocess.run(["/bin/true"], check=True)
            samples["true"].append((time.perf_counter() - started) * 1000.0)
            samples["floor_info"].append(cold_start_ms(context, FLOOR[1], workdir)[0])
            samples["fork"].append(template.fork_ms())
            if zygote:
                samples["cellblock"].append(cold_start_ms(context, ZYGOTE_KIND[1], workdir)[1])
            progress(f"start {index + 1}/{starts}: floor kernel {samples['floor_info'][-1]:.1f} ms, fork "
                     f"{samples['fork'][-1]:.1f} ms" + (f", cellblock (zygote) {samples['cellblock'][-1]:.1f} ms"
                                                        if zygote else ""))
    finally:
        template.stop()
    return {key: Stats(values) for key, values in samples.items() if values}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="short smoke run")
    parser.add_argument("--floor-kernel", help="cellblock-floor-kernel (default $CELLBLOCK_FLOOR_KERNEL)")
    parser.add_argument("--executes", type=int, help="`1+1` per kernel per round (default 1000, quick 50)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 5, quick 1)")
    parser.add_argument("--starts", type=int, help="cold starts of each kind (default 15, quick 2)")
    parser.add_argument("--seconds", type=float, help="throughput window per level (default 5, quick 0.5)")
    parser.add_argument("--no-zygote", dest="zygote", action="store_false",
                        help="leave out cellblock's zygote cold start")
    args = parser.parse_args()
    executes = args.executes or (50 if args.quick else 1000)
    rounds = args.rounds or (1 if args.quick else 5)
    starts = args.starts or (2 if args.quick else 15)
    seconds = args.seconds or (0.5 if args.quick else 5.0)
    levels = [1, 2] if args.quick else [1, 16]
    sessions = levels[-1]
    cores = os.cpu_count() or 1

    binary = floor_kernel_path(args.floor_kernel)
    benchlib.use_installed_kernelspecs()
    context = zmq.Context()
    with tempfile.TemporaryDirectory(prefix="bench-floors-") as tmp:
        workdir = Path(tmp)
        progress("machine costs: a system call, a page fault, a copy-on-write fault, a wake-up")
        costs = machine_costs(3 if args.quick else 7, 20000 if args.quick else 200000, 1024 if args.quick else 4096)
        progress(f"IPython's run_cell('1+1'), {executes * rounds} cells")
        cell_wall, cell_cpu = run_cell_times(executes * rounds)
        install_floor_kernelspec(binary, workdir / "jupyter", cell_cpu.median)
        progress(f"`1+1` over ZMQ: {', '.join(label for label, _ in KINDS)}, {rounds} rounds of {executes}")
        kernels = kernel_round_trips(context, workdir, executes, rounds)
        throughput = {}
        for label, name in (FLOOR, KINDS[0]):
            progress(f"{label}: exec/s with {', '.join(map(str, levels))} sessions")
            throughput[label] = bench_throughput.measure_kind(label, name, levels, seconds)
        progress(f"run_cell('1+1') in {sessions} warmed shells taking turns")
        shared_cell_cpu = shared_run_cell_cpu(sessions, 20 if args.quick else 300)
        install_floor_kernelspec(binary, workdir / "jupyter", shared_cell_cpu.median, FLOOR_SHARED[1])
        progress(f"{FLOOR_SHARED[0]}: exec/s with {sessions} sessions")
        throughput[FLOOR_SHARED[0]] = bench_throughput.measure_kind(FLOOR_SHARED[0], FLOOR_SHARED[1], [sessions],
                                                                     seconds)
        zygote_policy = None
        if args.zygote:
            zygote_policy = install_zygote_kernelspec(workdir)
            warm_template(zygote_policy)
        try:
            progress(f"cold starts, {starts} of each, interleaved")
            starts_ms = cold_starts(context, workdir, starts, args.zygote)
        finally:
            if zygote_policy is not None:
                cellblock_zygote.stop_templates(zygote_policy)
    context.term()

    floor, ours, peer = kernels[FLOOR[0]], kernels["cellblock"], kernels["ipykernel"]
    rows = [
        Row("execute `1+1` → idle (ZMQ)", ours["rt"], {FLOOR[0]: floor["rt"], "ipykernel": peer["rt"]},
            target="≤ 0.4 ms", note="the floor kernel's worker spins for run_cell's CPU time"),
        Row("kernel process CPU per `1+1`", ours["kernel"], {FLOOR[0]: floor["kernel"], "ipykernel": peer["kernel"]},
            unit="ms CPU", target="≤ 0.25 ms",
            note="every thread, libzmq's I/O thread included; ipykernel's runs the cell too"),
        Row("worker CPU per `1+1`", ours["worker"], {FLOOR[0]: floor["worker"]}, unit="ms CPU",
            note="cellblock: the confined IPython worker; floor: its worker, busy for run_cell's CPU time"),
        Row("client CPU per `1+1`", ours["client"], {FLOOR[0]: floor["client"], "ipykernel": peer["client"]},
            unit="ms CPU", note="the lean pyzmq client, its libzmq thread included"),
    ]
    for level in levels:
        rows.append(Row(f"`1+1` exec/s, {level} session{'s' if level > 1 else ''}",
                        bench_throughput.level_stat(throughput["cellblock"], level, 0),
                        {FLOOR[0]: bench_throughput.level_stat(throughput[FLOOR[0]], level, 0)}, unit="exec/s",
                        target="≥ 2,000" if level == 16 else "",
                        note="bench_throughput.py's driver"))
    print(f"{cores} cores, load average {os.getloadavg()[0]:.1f} at the end. Round trips: {rounds} interleaved rounds "
          f"of {executes} executes per kernel, all kernels running; CPU per execute from /proc schedstat (kernel, "
          "worker) and os.times (client), one figure per round.\n")
    print(markdown_table("`1+1`: cellblock, the floor kernel and ipykernel", rows))

    cell_ms = cell_cpu.median
    floors = []
    floors.append(("kernel CPU per `1+1`", "≤ 0.25 ms", f"{floor['kernel'].median:.3f} ms",
                   f"{ours['kernel'].median:.3f} ms", "the floor kernel's CPU per execute"))
    floors.append(("`1+1` over ZMQ", "≤ 0.4 ms", f"{floor['rt'].median:.3f} ms", f"{ours['rt'].median:.3f} ms",
                   f"the floor kernel's round trip, its worker busy for run_cell's {cell_ms:.3f} ms"))

    def add_rate_floor(title: str, kind: str, worker_ms: float, workers_busy_for: str) -> None:
        result = throughput[kind]
        at_level = result.get(sessions)
        if not at_level or "error" in result:
            return
        rate, _, _, client_cpu, kernel_cpu = at_level
        bound = cores * 1000.0 / (kernel_cpu + worker_ms + client_cpu)
        ours_at_level = throughput["cellblock"].get(sessions)
        floors.append((title, "≥ 2,000", f"{rate:.0f} exec/s",
                       f"{ours_at_level[0]:.0f} exec/s" if ours_at_level else "–",
                       f"{sessions} floor kernels, their workers busy for {workers_busy_for} (CPU bound: {cores} "
                       f"cores × 1000 / (floor kernel {kernel_cpu:.3f} + worker {worker_ms:.3f} + client "
                       f"{client_cpu:.3f} ms per execute) = {bound:.0f})"))

    shared_ms = shared_cell_cpu.median
    add_rate_floor(f"exec/s, {sessions} sessions", FLOOR[0], cell_ms, "run_cell's time")
    add_rate_floor(f"exec/s, {sessions} sessions (workers sharing the cores)", FLOOR_SHARED[0], shared_ms,
                   f"run_cell's time when {sessions} shells take turns ({shared_ms / cell_ms:.1f}× alone)")
    sequential = starts_ms["floor_info"].median + starts_ms["fork"].median
    overlapped = max(starts_ms["floor_info"].median, starts_ms["fork"].median)
    floors.append(("cold start → first `1+1`", "≤ 50 ms",
                   f"{sequential:.1f} ms ({overlapped:.1f} if the two ran side by side)",
                   f"{starts_ms['cellblock'].median:.1f} ms" if "cellblock" in starts_ms else "–",
                   f"floor kernel → kernel_info_reply {starts_ms['floor_info'].median:.1f} + fork → first `1+1` "
                   f"{starts_ms['fork'].median:.1f} (`/bin/true` {starts_ms['true'].median:.1f})"))
    print("### The floors of the kernel's missed targets on this machine\n")
    print("| target | wanted | floor here | cellblock here | the floor is |")
    print("|---|---|---|---|---|")
    for row in floors:
        print("| " + " | ".join(row) + " |")
    print(f"\nrun_cell('1+1') in a warmed shell: {cell_wall.median:.3f} ms wall (p99 {cell_wall.p99:.3f}), "
          f"{cell_cpu.median:.3f} ms CPU; in each of {sessions} warmed shells taking turns: "
          f"{shared_cell_cpu.median:.3f} ms CPU (p99 {shared_cell_cpu.p99:.3f}); fork of a warmed template to its "
          f"first `1+1`: {starts_ms['fork'].median:.1f} "
          f"ms (p99 {starts_ms['fork'].p99:.1f}); floor kernel start → kernel_info_reply "
          f"{starts_ms['floor_info'].median:.1f} ms (p99 {starts_ms['floor_info'].p99:.1f}).")
    print(f"\nWhat they are made of here (medians of rounds): a system call (getppid) {costs['syscall']:.2f} µs; a page "
          f"fault on first touch {costs['fault']:.2f} µs; a copy-on-write fault in a forked child {costs['cow']:.2f} µs; "
          f"a wake-up round trip between two processes over pipes {costs['wake']:.1f} µs.")
    measured_all = all("error" not in result for result in throughput.values())
    return 0 if measured_all and (not args.zygote or "cellblock" in starts_ms) else 1


if __name__ == "__main__":
    sys.exit(main())
