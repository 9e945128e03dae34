#!/usr/bin/env python3
"""Kernels as Slurm jobs (cellblock-gateway --provisioner slurm) vs local kernels, on the real two-node test
cluster (tests/cluster/slurm_cluster.py, started and stopped here).

    create cold   POST /api/kernels (no warm pool) -> kernel_info_reply over the kernel's WebSocket
                  (Slurm: sbatch -> job runs -> kernel reports over CurveZMQ -> gateway connects)
    create warm   the same with a warm pool of 1, after the pool kernel is ready
    1+1           execute_request -> status idle over the WebSocket (Slurm: gateway <-> kernel over CurveZMQ/TCP;
                  local: ipc://)
"""
import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "cluster"))
sys.path.insert(0, str(HERE.parent / "gateway"))

import benchlib  # noqa: E402
from benchlib import Row, Stats, markdown_table, progress  # noqa: E402
from gateway_harness import Gateway  # noqa: E402
from slurm_cluster import SlurmCluster  # noqa: E402


def create_and_probe(gateway):
    started = time.perf_counter()
    kernel_id = gateway.start_kernel(name="python3")["id"]
    socket = gateway.connect(kernel_id)
    socket.wait_ready()
    elapsed = (time.perf_counter() - started) * 1000
    socket.close()
    return kernel_id, elapsed


def delete(gateway, kernel_id):
    gateway.delete(f"/api/kernels/{kernel_id}")


def cold_creates(gateway, repeat):
    samples = []
    for _ in range(repeat):
        kernel_id, elapsed = create_and_probe(gateway)
        samples.append(elapsed)
        delete(gateway, kernel_id)
    return Stats(samples)


def wait_pool_ready(gateway, timeout=90):
    # /metrics: cellblock_warm_pool_kernels{state="ready"} 1
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = gateway.get("/metrics").text
        if 'cellblock_warm_pool_kernels{state="ready"} 1' in text:
            return
        time.sleep(0.2)
    raise RuntimeError("the warm pool did not fill")


def warm_creates(gateway, repeat):
    samples = []
    for _ in range(repeat):
        wait_pool_ready(gateway)
        kernel_id, elapsed = create_and_probe(gateway)
        samples.append(elapsed)
        delete(gateway, kernel_id)
    return Stats(samples)


def one_plus_one(gateway, repeat):
    kernel_id, _ = create_and_probe(gateway)
    socket = gateway.connect(kernel_id)
    try:
        socket.execute("1+1")
        samples = []
        for _ in range(repeat):
            started = time.perf_counter()
            messages = socket.execute("1+1")
            samples.append((time.perf_counter() - started) * 1000)
            assert any(m["msg_type"] == "execute_result" and m["content"]["data"]["text/plain"] == "2"
                       for m in messages)
        return Stats(samples)
    finally:
        socket.close()
        delete(gateway, kernel_id)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    creates, executes = (2, 20) if args.quick else (8, 300)
    benchlib.use_installed_kernelspecs()
    rows = []
    with SlurmCluster() as cluster:
        figures = {}
        for provisioner in ("slurm", "local"):
            for pool in (0, 1):
                progress(f"{provisioner}, warm pool {pool}")
                gateway = Gateway("--provisioner", provisioner, warm_pool=pool, env=cluster.environment)
                try:
                    if pool == 0:
                        figures[(provisioner, "cold")] = cold_creates(gateway, creates)
                        figures[(provisioner, "1+1")] = one_plus_one(gateway, executes)
                    else:
                        figures[(provisioner, "warm")] = warm_creates(gateway, creates)
                finally:
                    gateway.stop()
    for label, key, note in (
            ("create cold → kernel_info_reply", "cold", "Slurm: sbatch, job start, CurveZMQ report, connect"),
            ("create warm → kernel_info_reply", "warm", "a pool kernel that is a running job"),
            ("`1+1` over the WebSocket", "1+1", "Slurm: gateway ↔ kernel over CurveZMQ on TCP; local: ipc://")):
        rows.append(Row(label, ours=figures[("slurm", key)], peers={"local kernel": figures[("local", key)]},
                        note=note))
    print(markdown_table("cellblock kernels on Slurm (cellblock column) vs local kernels", rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
