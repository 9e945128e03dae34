#!/usr/bin/env python3
"""Many gateways, one store: what sharing the store costs and what a second gateway brings.

- store cost per execute: `1+1` through one gateway, one session, one request at a time, with the embedded SQLite
  store vs a PostgreSQL store (a server this script starts: initdb/pg_ctl in a temporary directory, local TCP).
- throughput: `1+1` executes per second with N sessions, one client thread per session keeping one request in
  flight, through one gateway (PostgreSQL store) vs through A+B (each request to the other gateway than the one
  before: the worst case for a shared store, every execute takes the session's lease in PostgreSQL).
Both gateways run on this machine (2 cores shared by everything): A+B cannot add cores, so the figure shows the
overhead of sharing, not a scale-out gain.
"""
import argparse
import concurrent.futures
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

import benchlib
from benchlib import Row, Stats, markdown_table, progress


class Postgres:
    def __init__(self):
        versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
        if not versions:
            raise RuntimeError("PostgreSQL is not installed (share/scripts/install-deps.sh --with-test-tools)")
        self.bin = versions[-1].parent
        # Its own temporary directory: the postgres user cannot enter the benchmark's 0700 scratch directory.
        self.directory = Path(tempfile.mkdtemp(prefix="cb-pg-"))
        self.as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if os.geteuid() == 0:
            shutil.chown(self.directory, "postgres", "postgres")
        self.port = benchlib.free_port()
        data = self.directory / "data"
        for argv in ([str(self.bin / "initdb"), "--auth=trust", "-U", "cellblock", "-D", str(data)],
                     [str(self.bin / "pg_ctl"), "-D", str(data), "-l", str(self.directory / "server.log"), "-o",
                      f"-p {self.port} -k {self.directory} -c listen_addresses=127.0.0.1", "-w", "start"]):
            subprocess.run(self.as_user + argv, check=True, capture_output=True, timeout=120)
        self.url = f"postgresql://cellblock@127.0.0.1:{self.port}/postgres"

    def stop(self):
        subprocess.run(self.as_user + [str(self.bin / "pg_ctl"), "-D", str(self.directory / "data"), "-m",
                                       "immediate", "-w", "stop"], capture_output=True, timeout=120)
        shutil.rmtree(self.directory, ignore_errors=True)


def store_key_file(directory: Path) -> Path:
    """The secret every gateway on the shared store seals kernels' keys with (one file for all of them)."""
    path = directory / "store-key"
    if not path.exists():
        path.write_text(secrets.token_hex(32) + "\n")
        path.chmod(0o600)
    return path


class Gateway:
    def __init__(self, prefix: Path, state_dir: Path, log_path: Path, store: str):
        env = {k: v for k, v in os.environ.items() if not k.startswith("KG_")}
        env["JUPYTER_PATH"] = str(prefix / "share" / "jupyter")
        port, self.token = benchlib.free_port(), secrets.token_hex(16)
        self.url = f"http://127.0.0.1:{port}"
        self.process = subprocess.Popen(
            [str(prefix / "bin" / "cellblock-gateway"), "--ip", "127.0.0.1", "--port", str(port), "--token",
             self.token, "--kernelspec-dir", str(prefix / "share" / "jupyter" / "kernels"), "--state-dir",
             str(state_dir), "--warm-pool", "0", "--shutdown-kernels-on-exit", *(["--store", store, "--store-key-file", str(store_key_file(state_dir.parent))] if store else [])],
            stdout=open(log_path, "ab"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
            start_new_session=True)
        ready = re.compile(rf"is available at http://127\.0\.0\.1:{port}\b")
        deadline = time.monotonic() + 120
        while not ready.search(log_path.read_text(errors="replace")):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"gateway did not start:\n{log_path.read_text(errors='replace')[-2000:]}")
            time.sleep(0.01)
        self.local = threading.local()

    def session(self) -> requests.Session:
        if not hasattr(self.local, "http"):
            self.local.http = requests.Session()
            self.local.http.headers["Authorization"] = f"token {self.token}"
        return self.local.http

    def create(self, name: str):
        self.session().post(f"{self.url}/agent/v1/sessions", json={"name": name}, timeout=300).raise_for_status()

    def one_plus_one(self, name: str):
        response = self.session().post(f"{self.url}/agent/v1/sessions/{name}/execute", json={"code": "1+1"},
                                       timeout=300)
        response.raise_for_status()
        answer = response.json()
        if answer["status"] != "ok" or answer["result"]["text/plain"] != "2":
            raise RuntimeError(f"{name}: {answer}")

    def stop(self):
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=120)


def latency(gateway: Gateway, name: str, repeat: int) -> Stats:
    gateway.create(name)
    return benchlib.measure(lambda: gateway.one_plus_one(name), repeat, warmup=5)


def throughput(gateways: list[Gateway], sessions: int, seconds: float, tag: str) -> float:
    names = [f"{tag}-{i}" for i in range(sessions)]
    with concurrent.futures.ThreadPoolExecutor(sessions) as pool:
        list(pool.map(gateways[0].create, names))
    for name in names:  # every gateway has attached every session before the clock starts
        for gateway in gateways:
            gateway.one_plus_one(name)
    counts = [0] * sessions
    stop_at = time.monotonic() + seconds

    def client(index: int):
        turn = index
        while time.monotonic() < stop_at:
            gateways[turn % len(gateways)].one_plus_one(names[index])
            counts[index] += 1
            turn += 1
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(sessions) as pool:
        list(pool.map(client, range(sessions)))
    return sum(counts) / (time.monotonic() - started)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="short smoke run")
    args = parser.parse_args()
    prefix = benchlib.cellblock_prefix()
    if not (prefix / "bin" / "cellblock-gateway").exists():
        print(f"cellblock-gateway is not installed under {prefix} (set CELLBLOCK_PREFIX)", file=sys.stderr)
        return 1
    repeat = 30 if args.quick else 300
    sessions = 2 if args.quick else 8
    seconds = 3 if args.quick else 15
    rounds = 1 if args.quick else 3
    with tempfile.TemporaryDirectory(prefix="bench-shared-") as scratch_name:
        scratch = Path(scratch_name)
        postgres = Postgres()
        gateways = []
        try:
            sqlite_gateway = Gateway(prefix, scratch / "state-sqlite", scratch / "sqlite.log", "")
            gateways.append(sqlite_gateway)
            a = Gateway(prefix, scratch / "state-a", scratch / "a.log", postgres.url)
            gateways.append(a)
            b = Gateway(prefix, scratch / "state-b", scratch / "b.log", postgres.url)
            gateways.append(b)
            progress(f"shared store: {repeat} sequential executes, SQLite and PostgreSQL")
            sqlite_latency = latency(sqlite_gateway, "lat-sqlite", repeat)
            postgres_latency = latency(a, "lat-postgres", repeat)
            one, two = [], []
            for round_ in range(rounds):
                progress(f"shared store: round {round_ + 1}/{rounds}: {sessions} sessions, one gateway vs A+B")
                one.append(throughput([a], sessions, seconds, f"one{round_}"))
                two.append(throughput([a, b], sessions, seconds, f"two{round_}"))
        finally:
            for gateway in gateways:
                gateway.stop()
            postgres.stop()
    print(markdown_table("Store cost per execute (`1+1`, one session, one gateway)", [
        Row("PostgreSQL store (local TCP)", postgres_latency, {"SQLite store in --state-dir": sqlite_latency},
            note="writes go through the gateway's writer thread; the next execute keeps the session's execute lease "
                 "(one round trip)"),
    ]))
    print(markdown_table(f"`1+1` executes per second, {sessions} sessions (PostgreSQL store)", [
        Row("through A+B (alternating per request)", Stats(two), {"through one gateway": Stats(one)},
            unit="/s", note="both gateways on the same 2 cores"),
    ], higher_is_better=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
