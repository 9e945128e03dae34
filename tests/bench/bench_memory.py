#!/usr/bin/env python3
"""Memory per idle session and session creation under load, cellblock vs ipykernel and xpython / Jupyter Server.

    /usr/bin/python3 tests/bench/bench_memory.py [--quick] [--no-zygote] [--starts N] [--only-idle] [--no-peers]

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
4. Unless --no-zygote: a fourth kind, "cellblock (zygote)", the same kernel with `worker.zygote: true` (workers forked
   from one preloaded template of a tenant of this run, sandbox/README.md "Worker zygote"). Its PSS per session
   includes the template's PSS / N (the template exists for these sessions; it is also reported alone), and only
   forked workers count (a worker that fell back to exec fails the figure). Then, for exec and zygote alternately,
   `--starts` kernels one after another: start → kernel_info_reply, start → first `1+1` answered (the worker is
   ready), and the first `import pandas` timed inside the session.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import benchlib
from benchlib import Row, Stats, markdown_table, progress

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins"))
import cellblock_zygote  # noqa: E402 (tests/plugins: the zygote switch and forked workers on the host)

KINDS = [("cellblock", "cellblock-python"), ("ipykernel", "python3"), ("xpython", "xpython")]
ZYGOTE_KIND = ("cellblock (zygote)", "cellblock-zygote")
ZYGOTE_TENANT = cellblock_zygote.other_tenant("bench")
TIMED_PANDAS = "import time as _t; _s = _t.perf_counter(); import pandas; round((_t.perf_counter() - _s) * 1000, 3)"
FIXED_BUDGET_GIB = 8
CREATE_TIMEOUT_S = 120.0


def install_zygote_kernelspec(directory: Path) -> Path:
    """cellblock-zygote: the installed cellblock-python with `worker.zygote: true` for this run's tenant."""
    import json
    from jupyter_client.kernelspec import KernelSpecManager
    installed = KernelSpecManager().get_kernel_spec("cellblock-python")
    argv = list(installed.argv)
    config = cellblock_zygote.switch_config(
        cellblock_zygote.resolved_config(Path(argv[argv.index("--config") + 1])), True, ZYGOTE_TENANT)
    (directory / "kernel-config.json").write_text(json.dumps(config))
    argv[argv.index("--config") + 1] = str(directory / "kernel-config.json")
    spec = installed.to_dict()
    spec["argv"] = argv
    spec["display_name"] = "cellblock (zygote)"
    (directory / "kernels" / ZYGOTE_KIND[1]).mkdir(parents=True)
    (directory / "kernels" / ZYGOTE_KIND[1] / "kernel.json").write_text(json.dumps(spec))
    os.environ["JUPYTER_PATH"] = f"{directory}:{os.environ.get('JUPYTER_PATH', '')}"
    return Path(config["sandbox_policy"])


def warm_template(policy: Path) -> int:
    """The tenant's first kernel starts its template (its own worker by exec); returns the serving template."""
    progress("cellblock (zygote): starting the tenant's template")
    kernel = benchlib.RunningKernel(ZYGOTE_KIND[1])
    try:
        return cellblock_zygote.template_serving(policy, ZYGOTE_TENANT, timeout=300)
    finally:
        kernel.stop()


def session_tree(kernel) -> list[int]:
    """The kernel, its descendants, and a worker a template forked for it (held by the kernel's pidfd)."""
    return cellblock_zygote.kernel_tree(kernel.pid)


def idle_session_memory(label: str, kernel_name: str, count: int, settle_s: float, template: int = 0) -> dict:
    progress(f"{label}: starting {count} kernels for the idle-memory measurement")
    kernels, failures = benchlib.start_kernels(kernel_name, count)
    result: dict = {"failures": failures}
    try:
        for kernel in kernels:
            benchlib.execute_round_trip(kernel.client, "1+1")
        time.sleep(settle_s)  # let lazily started threads, the first execute's garbage and page faults settle
        trees = [session_tree(kernel) for kernel in kernels]
        if template:
            forked = sum(1 for tree in trees if any(cellblock_zygote._ppid(pid) == template for pid in tree))
            result["forked"] = forked
            if forked != len(trees):
                raise RuntimeError(f"{len(trees) - forked} of {len(trees)} workers were not forked by the template")
            result["template_pss_mib"] = benchlib.pss_kib(template) / 1024.0
        share = result.get("template_pss_mib", 0.0) / max(1, len(trees))
        result["pss_mib"] = [sum(benchlib.pss_kib(pid) for pid in tree) / 1024.0 + share for tree in trees]
        result["rss_mib"] = [sum(benchlib.rss_kib(pid) for pid in tree) / 1024.0 for tree in trees]
        result["processes"] = [len(tree) for tree in trees]
        result["kernel_pss_mib"] = [benchlib.pss_kib(kernel.pid) / 1024.0 for kernel in kernels]
        # Per component (kernel process, the rest of the tree = the worker): PSS and what is the process's alone.
        result["kernel_private_mib"] = [benchlib.private_dirty_kib(kernel.pid) / 1024.0 for kernel in kernels]
        result["worker_pss_mib"] = [sum(benchlib.pss_kib(pid) for pid in tree if pid != kernel.pid) / 1024.0
                                    for kernel, tree in zip(kernels, trees)]
        result["worker_private_mib"] = [sum(benchlib.private_dirty_kib(pid) for pid in tree if pid != kernel.pid)
                                        / 1024.0 for kernel, tree in zip(kernels, trees)]
        if trees:
            result["breakdown"] = [(pid, benchlib.process_name(pid), benchlib.pss_kib(pid), benchlib.rss_kib(pid),
                                    benchlib.smaps_breakdown(pid, 8)) for pid in trees[0]]
    except Exception as error:  # noqa: BLE001 - reported in the table
        result["error"] = f"{type(error).__name__}: {str(error)[:160]}"
        progress(f"{label}: {result['error']}")
    finally:
        benchlib.stop_kernels(kernels)
    return result


def start_latency(kernel_name: str, starts: int) -> dict:
    """Kernels started one at a time: start → kernel_info_reply, start → first `1+1` answered, first import pandas."""
    info_ms, ready_ms, pandas_ms, failures = [], [], [], []
    for _ in range(starts):
        started = time.perf_counter()
        try:
            kernel = benchlib.RunningKernel(kernel_name)
        except Exception as error:  # noqa: BLE001 - counted
            failures.append(f"{type(error).__name__}: {str(error)[:120]}")
            continue
        try:
            info_ms.append((time.perf_counter() - started) * 1000.0)
            benchlib.execute_round_trip(kernel.client, "1+1")
            ready_ms.append((time.perf_counter() - started) * 1000.0)
            _, messages = benchlib.execute_round_trip(kernel.client, TIMED_PANDAS)
            values = [m["content"]["data"]["text/plain"] for m in messages if m["msg_type"] == "execute_result"]
            if values:
                pandas_ms.append(float(values[0]))
            else:
                failures.append("import pandas gave no result")
        except Exception as error:  # noqa: BLE001 - counted
            failures.append(f"{type(error).__name__}: {str(error)[:120]}")
        finally:
            kernel.stop()
    for failure in sorted(set(failures))[:3]:
        progress(f"{kernel_name}: {failure}")
    return {"info_ms": info_ms, "ready_ms": ready_ms, "pandas_ms": pandas_ms, "failures": len(failures)}


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
    parser.add_argument("--no-zygote", dest="zygote", action="store_false",
                        help="leave out cellblock with worker.zygote: true (4. above)")
    parser.add_argument("--starts", type=int, default=20, help="sequential starts of exec and zygote kernels")
    parser.add_argument("--only-idle", action="store_true", help="skip the REST part (3.)")
    parser.add_argument("--no-peers", action="store_true", help="cellblock only: no ipykernel/xpython idle figures")
    args = parser.parse_args()
    benchlib.use_installed_kernelspecs()
    zygote_dir = Path(tempfile.mkdtemp(prefix="cellblock-bench-zygote-")) if args.zygote else None
    try:
        return measure_all(args, zygote_dir)
    finally:
        if zygote_dir is not None:
            if ZYGOTE_POLICY:
                cellblock_zygote.stop_templates(ZYGOTE_POLICY[0])  # not left idling for its hour
            shutil.rmtree(zygote_dir, ignore_errors=True)


ZYGOTE_POLICY: list = []


def measure_all(args, zygote_dir) -> int:
    idle_count = 2 if args.quick else args.idle_sessions
    creates, gateway_sessions = (2, 3) if args.quick else (50, 100)
    settle = 0.3 if args.quick else 2.0
    mem_available_mib = benchlib.mem_available_kib() / 1024.0

    idle = {}
    missing_peers = []
    for label, kernel_name in KINDS[:1] if args.no_peers else KINDS:
        if benchlib.kernelspec_available(kernel_name):
            idle[label] = idle_session_memory(label, kernel_name, idle_count, 0.5 if args.quick else 3.0)
        else:
            progress(f"{label}: kernelspec {kernel_name} not installed: the run fails")
            missing_peers.append(label)
    starts = {}
    if zygote_dir is not None:
        ZYGOTE_POLICY.append(install_zygote_kernelspec(zygote_dir))
        template = warm_template(ZYGOTE_POLICY[0])
        idle[ZYGOTE_KIND[0]] = idle_session_memory(ZYGOTE_KIND[0], ZYGOTE_KIND[1], idle_count,
                                                   0.5 if args.quick else 3.0, template)
        start_rounds = 2 if args.quick else args.starts
        for round_index in range(start_rounds):
            for label, kernel_name in (KINDS[0], ZYGOTE_KIND):  # interleaved: the shared machine's load hits both
                one = start_latency(kernel_name, 1)
                into = starts.setdefault(label, {"info_ms": [], "ready_ms": [], "pandas_ms": [], "failures": 0})
                for key in ("info_ms", "ready_ms", "pandas_ms"):
                    into[key] += one[key]
                into["failures"] += one["failures"]
            progress(f"start latency: round {round_index + 1} done")
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

    failed = benchlib.failed_peers({label: r.get("error") or (None if r.get("pss_mib") else "no sample")
                                    for label, r in peers.items()})
    ok = "error" not in ours and bool(ours.get("pss_mib")) and not missing_peers and not failed
    if zygote_dir is not None:
        forked = idle.get(ZYGOTE_KIND[0], {})
        ok = ok and "error" not in forked and bool(forked.get("pss_mib"))
        exec_starts, zygote_starts = starts.get("cellblock", {}), starts.get(ZYGOTE_KIND[0], {})

        def sample(result: dict, key: str):
            return Stats(result[key]) if result.get(key) else None

        print(f"cellblock (zygote): {forked.get('forked', 0)} of {idle_count} workers forked from one template "
              f"(template PSS {forked.get('template_pss_mib', float('nan')):.1f} MiB, counted as 1/{idle_count} per "
              f"session above); kernel process alone: "
              f"{Stats(forked['kernel_pss_mib']).median if forked.get('kernel_pss_mib') else float('nan'):.1f} MiB "
              f"PSS.\n")
        rows = []
        for label, key in (("kernel process PSS", "kernel_pss_mib"), ("kernel process Private_Dirty", "kernel_private_mib"),
                           ("worker PSS (template share not included)", "worker_pss_mib"),
                           ("worker Private_Dirty", "worker_private_mib")):
            rows.append(Row(label, stat(forked, key), {"exec path": stat(ours, key)}, unit="MiB"))
        print(markdown_table("Per component of an idle session (cellblock column = zygote)", rows))
        rows = [Row("start → kernel_info_reply", sample(zygote_starts, "info_ms"),
                    {"exec path": sample(exec_starts, "info_ms")}),
                Row("start → first `1+1` answered (worker ready)", sample(zygote_starts, "ready_ms"),
                    {"exec path": sample(exec_starts, "ready_ms")},
                    note="through jupyter_client's KernelManager and wait_for_ready, which cost most of it; "
                         "the lean-client cold start (≤ 50 ms) is bench_kernel.py's"),
                Row("first `import pandas` in a session", sample(zygote_starts, "pandas_ms"),
                    {"exec path": sample(exec_starts, "pandas_ms")}, target="≤ 5 ms"),
                Row("failed starts", Stats([zygote_starts.get("failures", 0)]),
                    {"exec path": Stats([exec_starts.get("failures", 0)])}, unit="failed")]
        print(markdown_table(f"Kernels started one at a time, zygote vs exec, interleaved ({start_rounds} each; "
                             "cellblock column = zygote)", rows))
        ok = ok and zygote_starts.get("failures", 1) == 0 and exec_starts.get("failures", 1) == 0
        if args.only_idle:
            return 0 if ok else 1
    elif args.only_idle:
        return 0 if ok else 1
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
                progress(f"{label}: kernelspec {kernel_name} not installed: the run fails")
                ok = False
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
        ok = ok and not benchlib.failed_peers({label: r.get("error") for label, r in server_peers.items()})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
