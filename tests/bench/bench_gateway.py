#!/usr/bin/env python3
"""cellblock-gateway vs Jupyter Server 1.23 + ipykernel 6.17 (Debian), and from PyPI Jupyter Server 2.x and the
Jupyter Kernel Gateway 3.0 with ipykernel 7.x, in the same run.

Measures, for both servers:
  * create: POST /api/kernels → WebSocket open → kernel_info_reply (cellblock: from its warm pool; the pool is
    refilled between samples, untimed). Jupyter Server has no pool, so each sample is a cold ipykernel start.
  * execute `1+1` over the WebSocket: execute_request → status idle, plus the server's own CPU per round trip.
    Jupyter Server is measured twice: as shipped (no TCP_NODELAY on its kernel WebSocket: Nagle + delayed ACK)
    and patched to set TCP_NODELAY (a fair latency peer).
  * N concurrent session creates (N = 50, 10 with --quick): all must succeed; wall time until all answered.
  * the gateway's own memory (RSS) idle and with N sessions (N = 100, 10 with --quick).
The client is websocket-client, which sets TCP_NODELAY on its side.

    /usr/bin/python3 tests/bench/bench_gateway.py [--quick] [--kernelspec-dir DIR]
"""
import argparse
import concurrent.futures
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402
from benchlib import Row, Stats, markdown_table, progress  # noqa: E402


def wait_for_pool(server, want=1, timeout=120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = server.http.get(f"{server.base_url}/api/status", timeout=30).json()
        if status.get("warm_pool_ready", 0) >= want:
            return
        time.sleep(0.02)
    raise TimeoutError("warm pool did not refill")


def create_samples(server, repeat, warm_pool):
    samples = []
    for _ in range(repeat):
        if warm_pool:
            wait_for_pool(server)
        start = time.perf_counter()
        kernel_id = server.create_kernel()
        client = server.connect(kernel_id)
        client.kernel_info()
        samples.append((time.perf_counter() - start) * 1000.0)
        client.close()
        server.delete_kernel(kernel_id)
    return Stats(samples)


def execute_samples(server, repeat):
    kernel_id = server.create_kernel()
    client = server.connect(kernel_id)
    client.kernel_info()
    for _ in range(5):
        client.execute("1+1")
    pids = [server.server.pid]
    cpu_before = benchlib.cpu_seconds(pids)
    samples = [client.execute("1+1")[0] for _ in range(repeat)]
    cpu_ms = (benchlib.cpu_seconds(pids) - cpu_before) * 1000.0 / repeat
    client.close()
    server.delete_kernel(kernel_id)
    return Stats(samples), Stats([cpu_ms])


def concurrent_creates(server, count):
    def one(_):
        try:
            return server.create_kernel(timeout=300)
        except Exception as error:  # noqa: BLE001 - a failure is counted, not fatal
            progress(f"{server.label}: create failed: {error}")
            return None

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(count) as pool:
        ids = list(pool.map(one, range(count)))
    elapsed = (time.perf_counter() - start) * 1000.0
    created = [kernel_id for kernel_id in ids if kernel_id]
    return elapsed, count - len(created), created


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="short smoke run")
    parser.add_argument("--kernelspec-dir", help="kernelspec directory for the gateway (default: the installed one)")
    parser.add_argument("--no-peer", action="store_true", help="measure cellblock only")
    args = parser.parse_args()
    creates, executes = (5, 50) if args.quick else (30, 300)
    concurrent_count, memory_sessions = (10, 10) if args.quick else (50, 100)

    if not benchlib.gateway_binary().exists():
        progress(f"cellblock-gateway not installed at {benchlib.gateway_binary()}")
        return 1
    workdir = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    extra = ["--warm-pool", "2", "--log-level", "error"]
    if args.kernelspec_dir:
        extra += ["--kernelspec-dir", args.kernelspec_dir]
    rows_latency, rows_scale = [], []
    try:
        progress("starting cellblock-gateway")
        ours = benchlib.start_gateway(workdir / "gateway", extra)
        peers = {}
        if not args.no_peer:
            progress("starting jupyter server 1.23 (as shipped, and with TCP_NODELAY)")
            peers["jupyter-server"] = benchlib.start_jupyter_server(workdir / "js", nodelay=False)
            peers["jupyter-server+nodelay"] = benchlib.start_jupyter_server(workdir / "js-nodelay", nodelay=True)
            progress("starting the PyPI peers: jupyter server 2.x with TCP_NODELAY, the Jupyter Kernel Gateway")
            peers["jupyter-server-2+nodelay"] = benchlib.start_jupyter_server(workdir / "js2-nodelay", nodelay=True,
                                                                              pypi=True)
            peers["kernel-gateway"] = benchlib.start_kernel_gateway(workdir / "kg")
        try:
            wait_for_pool(ours, 2)
            idle_rss = benchlib.rss_kib(ours.server.pid)
            progress("create → kernel_info_reply")
            create_ours = create_samples(ours, creates, warm_pool=True)
            create_peer = {}
            for name, peer in peers.items():
                if name != "jupyter-server":  # the same server as its nodelay twin: a cold ipykernel either way
                    create_peer[name] = create_samples(peer, max(3, creates // 5), warm_pool=False)
            rows_latency.append(Row("POST /api/kernels → kernel_info_reply over WS", create_ours, create_peer,
                                    target="≤ 10 ms median (warm pool)", note="peer: cold ipykernel start"))
            progress("execute 1+1")
            exec_ours, cpu_ours = execute_samples(ours, executes)
            exec_peer, cpu_peer = {}, {}
            for name, peer in peers.items():
                exec_peer[name], cpu_peer[name] = execute_samples(peer, executes if name != "jupyter-server" else
                                                                  max(20, executes // 5))
            rows_latency.append(Row("execute `1+1` over WS (request → idle)", exec_ours, exec_peer,
                                    target="≤ 1.5 ms median",
                                    note="different kernels: cellblock vs ipykernel 6.17 (1.23) / 7.x (PyPI)"))
            rows_latency.append(Row("server CPU per `1+1` round trip", cpu_ours, cpu_peer, unit="ms CPU",
                                    note="gateway process only"))

            progress(f"{concurrent_count} concurrent creates")
            elapsed, failed, created = concurrent_creates(ours, concurrent_count)
            peer_elapsed = {}
            peer_failed = {}
            if peers and not args.quick:
                p_elapsed, p_failed, p_created = concurrent_creates(peers["jupyter-server+nodelay"], concurrent_count)
                peer_elapsed["jupyter-server+nodelay"] = Stats([p_elapsed])
                peer_failed["jupyter-server+nodelay"] = Stats([float(p_failed)])
                for kernel_id in p_created:
                    peers["jupyter-server+nodelay"].delete_kernel(kernel_id)
            rows_scale.append(Row(f"{concurrent_count} concurrent POST /api/kernels, all answered", Stats([elapsed]),
                                  peer_elapsed, target="≤ 2000 ms, 0 failed"))
            rows_scale.append(Row(f"failed of {concurrent_count} concurrent creates", Stats([float(failed)]),
                                  peer_failed, unit="failed"))
            progress(f"gateway memory with {memory_sessions} sessions")
            while len(created) < memory_sessions:
                more = min(16, memory_sessions - len(created))
                _, batch_failed, batch = concurrent_creates(ours, more)
                failed += batch_failed
                created += batch
                if batch_failed:
                    break  # the table below would report fewer sessions than asked for; the exit status says so
            busy_rss = benchlib.rss_kib(ours.server.pid)
            rows_scale.append(Row("gateway RSS, idle (warm pool of 2)", Stats([idle_rss / 1024.0]), unit="MiB"))
            rows_scale.append(Row(f"gateway RSS with {len(created)} sessions", Stats([busy_rss / 1024.0]), unit="MiB",
                                  note="the gateway process alone, kernels excluded"))
            for kernel_id in created:
                ours.delete_kernel(kernel_id)
        finally:
            ours.stop()
            for peer in peers.values():
                peer.stop()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(markdown_table("cellblock-gateway vs Jupyter Server 1.23 (Debian), 2.x and the Kernel Gateway (PyPI) "
                         "(latency)", rows_latency))
    print(markdown_table("cellblock-gateway (scale)", rows_scale))
    if failed:
        progress(f"{failed} session creates failed (every create must succeed)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
