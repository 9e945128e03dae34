#!/usr/bin/env python3
"""Memory per idle session and session creation under load, cellblock vs ipykernel and xpython / Jupyter Server.

    /usr/bin/python3 tests/bench/bench_memory.py [--quick]

1. PSS per idle session: N kernels of each kind run at once (started in parallel through jupyter_client), each has
   answered one `1+1`, then after a pause the PSS (/proc/<pid>/smaps_rollup) of each kernel's process tree (kernel +
   worker + anything else below it, benchlib.descendants) is one sample. PSS splits shared pages among the processes
   that map them, so the sum over the N trees is what the N sessions cost together; measuring with N running is what
   makes the shared libraries/code count at their real share.
2. How many idle sessions fit: budget / mean PSS per session, for the MemAvailable this machine had when the run
   started and for a fixed 8 GiB. It leaves out the gateway's own per-session memory (reported in 3) and the page
   cache the kernels' files need, so it is an upper bound; the gateway's share is small (see 3).
3. Through the servers' REST API: 50 concurrent `POST /api/kernels` each followed by a WebSocket kernel_info_reply
   (time until all 50 answered, failures within 120 s), cellblock-gateway vs Jupyter Server 1.23 (ipykernel,
   xpython); then the servers' own RSS with those sessions open, and for the gateway at 100 sessions.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import benchlib
from benchlib import Row, Stats, markdown_table, progress

KINDS = [("cellblock", "cellblock-python"), ("ipykernel", "python3"), ("xpython", "xpython")]
FIXED_BUDGET_GIB = 8
CREATE_TIMEOUT_S = 120.0


def idle_session_memory(label: str, kernel_name: str, count: int, settle_s: float) -> dict:
    progress(f"{label}: starting {count} kernels for the idle-memory measurement")
    kernels, failures = benchlib.start_kernels(kernel_name, count)
    result: dict = {"failures": failures}
    try:
        for kernel in kernels:
            benchlib.execute_round_trip(kernel.client, "1+1")
        time.sleep(settle_s)  # let lazily started threads, the first execute's garbage and page faults settle
        trees = [kernel.tree() for kernel in kernels]
        result["pss_mib"] = [sum(benchlib.pss_kib(pid) for pid in tree) / 1024.0 for tree in trees]
        result["rss_mib"] = [sum(benchlib.rss_kib(pid) for pid in tree) / 1024.0 for tree in trees]
        result["processes"] = [len(tree) for tree in trees]
        if trees:
            result["breakdown"] = [(pid, benchlib.process_name(pid), benchlib.pss_kib(pid), benchlib.rss_kib(pid),
                                    benchlib.smaps_breakdown(pid, 8)) for pid in trees[0]]
    except Exception as error:  # noqa: BLE001 - reported in the table
        result["error"] = f"{type(error).__name__}: {str(error)[:160]}"
        progress(f"{label}: {result['error']}")
    finally:
        benchlib.stop_kernels(kernels)
    return result


def create_and_connect(server: benchlib.KernelServer, kernel_name: str) -> tuple[str, object, float]:
    """POST /api/kernels, then a kernel_info_reply over the kernel's WebSocket: (id, socket, seconds)."""
    started = time.perf_counter()
    kernel_id = server.create_kernel(kernel_name, timeout=CREATE_TIMEOUT_S)
    socket = server.connect(kernel_id, timeout=CREATE_TIMEOUT_S)
    socket.kernel_info(timeout=CREATE_TIMEOUT_S)
    return kernel_id, socket, time.perf_counter() - started


def concurrent_creates(server: benchlib.KernelServer, kernel_name: str, count: int, opened: list) -> dict:
    """`count` creates at once; every success is appended to `opened` (id, socket) for the caller to close."""
    barrier = threading.Barrier(count)
    failures: list[str] = []
    durations: list[float] = []
    lock = threading.Lock()

    def one() -> None:
        barrier.wait()
        try:
            kernel_id, socket, seconds = create_and_connect(server, kernel_name)
            with lock:
                opened.append((kernel_id, socket))
                durations.append(seconds)
        except Exception as error:  # noqa: BLE001 - counted as a failure
            with lock:
                failures.append(f"{type(error).__name__}: {str(error)[:120]}")

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=count) as pool:
        list(pool.map(lambda _: one(), range(count)))
    all_ready = time.perf_counter() - started
    for failure in sorted(set(failures))[:3]:
        progress(f"{server.label}: create failed: {failure}")
    return {"all_ready_s": all_ready, "failures": len(failures), "each_s": durations}


def close_all(server: benchlib.KernelServer, opened: list) -> None:
    for _, socket in opened:
        socket.close()
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(lambda item: server.delete_kernel(item[0]), opened))
    opened.clear()


def server_under_load(label: str, start_server, kernel_name: str, creates: int, extra_to: int,
                      settle_s: float) -> dict:
    """Concurrent creates, then the server's RSS with them open (and after topping up to `extra_to` sessions)."""
    progress(f"{label}: {creates} concurrent creates")
    server = start_server()
    opened: list = []
    result: dict = {}
    try:
        time.sleep(settle_s)  # the gateway's warm pool (default size) fills as it would before traffic arrives
        result["rss0_mib"] = benchlib.rss_kib(server.server.pid) / 1024.0
        result.update(concurrent_creates(server, kernel_name, creates, opened))
        time.sleep(settle_s)
        # Keyed by the sessions asked for; "sessions" says how many are really open (failed creates are not).
        result["rss_at"] = {creates: benchlib.rss_kib(server.server.pid) / 1024.0}
        if extra_to > len(opened):
            progress(f"{label}: topping up to {extra_to} sessions")
            more = concurrent_creates(server, kernel_name, extra_to - len(opened), opened)
            result["top_up_failures"] = more["failures"]
            # kernel_info can come before the worker is up; one `1+1` per session makes every session complete.
            for _, socket in opened:
                socket.execute("1+1", timeout=CREATE_TIMEOUT_S)
            time.sleep(settle_s)
            result["rss_at"][extra_to] = benchlib.rss_kib(server.server.pid) / 1024.0
            kernel_pids = [pid for pid in benchlib.descendants(server.server.pid) if pid != server.server.pid]
            result["kernels_pss_mib"] = sum(benchlib.pss_kib(pid) for pid in kernel_pids) / 1024.0
            result["kernels_running"] = len(benchlib.children(server.server.pid))
        result["sessions"] = len(opened)
    except Exception as error:  # noqa: BLE001 - reported in the table
        result["error"] = f"{type(error).__name__}: {str(error)[:160]}"
        progress(f"{label}: {result['error']}")
    finally:
        close_all(server, opened)
        server.stop()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 sessions of each kind (smoke run)")
    parser.add_argument("--idle-sessions", type=int, default=32, help="kernels of each kind for the PSS figure")
    args = parser.parse_args()
    benchlib.use_installed_kernelspecs()
    idle_count = 2 if args.quick else args.idle_sessions
    creates, gateway_sessions = (2, 3) if args.quick else (50, 100)
    settle = 0.3 if args.quick else 2.0
    mem_available_mib = benchlib.mem_available_kib() / 1024.0

    idle = {}
    for label, kernel_name in KINDS:
        if benchlib.kernelspec_available(kernel_name):
            idle[label] = idle_session_memory(label, kernel_name, idle_count, 0.5 if args.quick else 3.0)
        else:
            progress(f"{label}: kernelspec {kernel_name} not installed, skipped")
    ours = idle.get("cellblock", {"error": "cellblock-python not installed"})
    peers = {label: r for label, r in idle.items() if label != "cellblock"}

    def stat(result: dict, key: str):
        return Stats(result[key]) if result.get(key) else None

    def fits(result: dict, budget_mib: float):
        pss = result.get("pss_mib")
        return Stats([budget_mib // (sum(pss) / len(pss))]) if pss else None

    print(f"{idle_count} idle kernels of each kind running at once; one sample per session. MemAvailable at the "
          f"start: {mem_available_mib / 1024:.1f} GiB.\n")
    rows = [Row("PSS per idle session (kernel + worker)", stat(ours, "pss_mib"),
                {p: stat(r, "pss_mib") for p, r in peers.items()}, unit="MiB", target="≤ 10 MB",
                note=ours.get("error", "")),
            Row("RSS per idle session (kernel + worker)", stat(ours, "rss_mib"),
                {p: stat(r, "rss_mib") for p, r in peers.items()}, unit="MiB")]
    print(markdown_table("Idle session memory", rows))
    rows = [Row(f"idle sessions in MemAvailable ({mem_available_mib / 1024:.1f} GiB)", fits(ours, mem_available_mib),
                {p: fits(r, mem_available_mib) for p, r in peers.items()}, unit="sessions"),
            Row(f"idle sessions in {FIXED_BUDGET_GIB} GiB", fits(ours, FIXED_BUDGET_GIB * 1024.0),
                {p: fits(r, FIXED_BUDGET_GIB * 1024.0) for p, r in peers.items()}, unit="sessions")]
    print(markdown_table("How many idle sessions fit (budget / mean PSS per session)", rows, higher_is_better=True))
    if ours.get("breakdown"):
        print("Where one idle cellblock session's PSS sits (largest mappings per process, KiB):\n")
        print("| pid | process | PSS | RSS | largest mappings (PSS) |\n|---|---|---|---|---|")
        for pid, name, pss, rss, mappings in ours["breakdown"]:
            top = ", ".join(f"{Path(m).name or m} {p}" for m, p, _ in mappings[:6])
            print(f"| {pid} | `{name}` | {pss} | {rss} | {top} |")
        print()

    ok = "error" not in ours and bool(ours.get("pss_mib"))
    workdir = Path(tempfile.mkdtemp(prefix="cellblock-bench-memory-"))
    try:
        servers = {}
        if benchlib.gateway_binary().exists():
            (workdir / "gateway").mkdir()
            servers["cellblock-gateway"] = server_under_load(
                "cellblock-gateway", lambda: benchlib.start_gateway(workdir / "gateway"), "cellblock-python",
                creates, gateway_sessions, settle)
        else:
            print(f"_cellblock-gateway not installed at {benchlib.gateway_binary()}: REST part not measured._\n")
            progress(f"cellblock-gateway not installed at {benchlib.gateway_binary()}")
            ok = False
        peers = [("Jupyter Server + ipykernel", "python3")] + ([] if args.quick else [("Jupyter Server + xpython",
                                                                                         "xpython")])
        for label, kernel_name in peers:
            if not benchlib.kernelspec_available(kernel_name):
                continue
            directory = workdir / label.replace(" ", "").replace("+", "-")
            directory.mkdir()
            servers[label] = server_under_load(label, lambda d=directory: benchlib.start_jupyter_server(d, True),
                                               kernel_name, creates, 0, settle)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    if servers:
        gateway = servers.get("cellblock-gateway", {})
        server_peers = {label: r for label, r in servers.items() if label != "cellblock-gateway"}

        def single(result: dict, key: str):
            if key == "each_s":
                return Stats([s * 1000.0 for s in result["each_s"]]) if result.get("each_s") else None
            return Stats([result[key]]) if key in result else None

        def rss(result: dict, sessions: int):
            value = result.get("rss_at", {}).get(sessions)
            return Stats([value]) if value is not None else None

        def per_session(result: dict):
            if not result.get("rss_at"):
                return None
            _, value = max(result["rss_at"].items())
            sessions = result.get("sessions", 0)
            return Stats([(value - result["rss0_mib"]) / sessions * 1024.0]) if sessions else None

        rows = [Row(f"{creates} concurrent creates → all kernel_info_reply", single(gateway, "all_ready_s"),
                    {p: single(r, "all_ready_s") for p, r in server_peers.items()}, unit="s",
                    note=gateway.get("error", "")),
                Row("one create → kernel_info_reply, under that load", single(gateway, "each_s"),
                    {p: single(r, "each_s") for p, r in server_peers.items()}),
                Row(f"failed creates (of {creates})", single(gateway, "failures"),
                    {p: single(r, "failures") for p, r in server_peers.items()}, unit="failed"),
                Row("server RSS, no session", single(gateway, "rss0_mib"),
                    {p: single(r, "rss0_mib") for p, r in server_peers.items()}, unit="MiB"),
                Row(f"server RSS, {creates} sessions", rss(gateway, creates),
                    {p: rss(r, creates) for p, r in server_peers.items()}, unit="MiB"),
                Row(f"server RSS, {gateway_sessions} sessions", rss(gateway, gateway_sessions), {}, unit="MiB"),
                Row("server RSS per open session", per_session(gateway),
                    {p: per_session(r) for p, r in server_peers.items()}, unit="KiB")]
        print(markdown_table("Sessions through the REST API (server = cellblock-gateway or Jupyter Server 1.23)", rows))
        if gateway.get("kernels_pss_mib"):
            running = max(1, gateway.get("kernels_running", 0))
            print(f"With {gateway.get('sessions')} sessions open through cellblock-gateway ({running} kernels running "
                  f"including the warm pool; each session has run `1+1`) the kernels' PSS sums to "
                  f"{gateway['kernels_pss_mib']:.0f} MiB ({gateway['kernels_pss_mib'] / running:.1f} MiB per kernel).\n")
        if "cellblock-gateway" in servers:
            # Every create must succeed and every session must be open: a benchmark that measured fewer sessions
            # than it reports did not measure what its table says.
            problems = [f"error: {gateway['error']}"] if "error" in gateway else []
            if gateway.get("failures", creates) != 0:
                problems.append(f"{gateway.get('failures', creates)} of {creates} concurrent creates failed")
            if gateway.get("top_up_failures", 0) != 0:
                problems.append(f"{gateway['top_up_failures']} creates failed while topping up")
            if gateway.get("sessions") != gateway_sessions:
                problems.append(f"{gateway.get('sessions')} sessions open, {gateway_sessions} asked for")
            for problem in problems:
                progress(f"cellblock-gateway: {problem}")
            ok = ok and not problems
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
