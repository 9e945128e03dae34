#!/usr/bin/env python3
"""What a worker zygote would buy, measured on the real worker runtime before the zygote exists.

    /usr/bin/python3 tests/bench/bench_zygote_model.py [--quick] [--sessions N] [--prefix PREFIX]

Everything runs inside ONE cellblock-sandbox (the default policy, the installed worker runtime bound at
/opt/cellblock/worker as the kernel binds it, pids/memory limits raised for N workers), so the template and
the workers are confined alike and the figures leave out what both paths pay per session in the real design
(namespaces, mounts, cgroup, seccomp: `bench_sandbox_start.py`, ~10-20 ms) and the kernel process (2.4 MiB
PSS, `bench_memory.py`). Two ways to get N ready workers, each speaking PROTOCOL.md on its own fd 3:

* exec (today): fork + execve `/usr/bin/python3 cellblock_worker.py`;
* fork (the zygote model, two variants): one template imports the worker runtime, IPython's InteractiveShell,
  numpy, pandas, matplotlib (+ the inline backend), runs `gc.freeze()`; each worker is a fork of it that either
  reseeds `random` and `numpy.random` and runs the worker's own `main()` (which builds its InteractiveShell after
  the fork) or, `fork+shell`, runs the worker's own zygote half (`cellblock_runtime/zygote.py`: `make_template`
  built the shell in the template, `serve_forked` redraws the random state and attaches the shell to fd 3).

Each worker answers `1+1`; after a pause the PSS of the workers (+ the template, for fork) is summed and divided
by N. Also: start → `ready` per worker (median, p99), the first `import pandas` in a worker, and what forking
shares between sessions that exec does not: `hash('x')` (the interpreter's hash secret is drawn once per
interpreter and cannot be changed after start) and the address-space layout (ASLR), each compared across the
first two workers of each path. Needs root (the sandbox maps a session uid).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import Row, Stats, markdown_table, progress  # noqa: E402

WORKER_INSIDE = "/opt/cellblock/worker"

# Runs inside the sandbox as the template/launcher; prints one JSON line with every measurement.
INSIDE = textwrap.dedent(r"""
import gc, json, os, socket, struct, sys, time
MODE, COUNT, SETTLE = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
WORKER_DIR = "/opt/cellblock/worker"
PYTHON = "/usr/bin/python3"
ENV_FOR_WORKER = dict(os.environ, PYTHONIOENCODING="utf-8", PYTHONUNBUFFERED="1")

def send(sock, message):
    body = json.dumps(message).encode()
    sock.sendall(struct.pack(">I", len(body)) + body)

def receive(sock, buffer):
    while True:
        if len(buffer) >= 4:
            size = struct.unpack(">I", bytes(buffer[:4]))[0]
            if len(buffer) >= 4 + size:
                body = bytes(buffer[4:4 + size])
                del buffer[:4 + size]
                if body[:1] in (b"\x01", b"\x02"):
                    continue  # a stream frame (Python-level output)
                return json.loads(body)
        chunk = sock.recv(65536)
        if not chunk:
            raise EOFError("worker closed its channel")
        buffer += chunk

def until(sock, buffer, kind):
    seen = []
    while True:
        message = receive(sock, buffer)
        seen.append(message)
        if message["type"] == kind:
            return message, seen

def execute(sock, buffer, code, number):
    send(sock, {"type": "execute", "id": number, "code": code, "silent": False, "store_history": True,
                "user_expressions": {}, "allow_stdin": False, "execution_count": number})
    reply, seen = until(sock, buffer, "reply")
    results = [m["data"]["text/plain"] for m in seen if m["type"] == "execute_result"]
    assert reply["content"]["status"] == "ok", reply
    return results[0] if results else None

if MODE in ("fork", "fork+shell"):
    os.environ.update(ENV_FOR_WORKER)
    sys.path.insert(0, WORKER_DIR)
    started = time.perf_counter()
    from cellblock_runtime import zygote
    zygote.occupy_worker_fds()  # before any import opens a file: fds 0-3 are the workers'
    from cellblock_runtime.ipython_boot import apply_environment_defaults, install_lazy_ipython_package
    apply_environment_defaults()
    install_lazy_ipython_package()
    import cellblock_runtime.main, cellblock_runtime.shell, cellblock_runtime.requests  # noqa: E401
    import cellblock_runtime.children, cellblock_runtime.stdin  # noqa: E401
    import IPython.core.interactiveshell  # noqa: F401
    import numpy, pandas, matplotlib, matplotlib.pyplot, matplotlib_inline.backend_inline  # noqa: E401,F401
    if MODE == "fork+shell":
        prepared = zygote.make_template(WORKER_DIR)  # main.prepare + preload + gc.freeze
        zygote.check_forkable()
    template_import_ms = (time.perf_counter() - started) * 1000
    gc.collect()
    gc.freeze()
else:
    template_import_ms = 0.0

devnull = os.open("/dev/null", os.O_RDWR)
workers = []  # (pid, socket, buffer)
ready_ms = []
for number in range(COUNT):
    kernel_end, worker_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    started = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        try:
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            os.dup2(worker_end.fileno(), 3)
            os.closerange(4, 4096)
            if MODE == "exec":
                os.execve(PYTHON, [PYTHON, WORKER_DIR + "/cellblock_worker.py"], ENV_FOR_WORKER)
            if MODE == "fork+shell":
                os._exit(zygote.serve_forked(prepared) or 0)  # redraws random state itself
            import random
            random.seed()
            numpy.random.seed()
            if MODE == "fork":
                os._exit(cellblock_runtime.main.main(WORKER_DIR) or 0)
        finally:
            os._exit(127)
    worker_end.close()
    buffer = bytearray()
    until(kernel_end, buffer, "ready")
    ready_ms.append((time.perf_counter() - started) * 1000)
    workers.append((pid, kernel_end, buffer))

probe = ("import time as _t; _s = _t.perf_counter(); import pandas; _ms = (_t.perf_counter() - _s) * 1000; "
         "import random as _r, numpy as _n; "
         "(_ms, hash('x'), _r.getrandbits(62), int(_n.random.randint(0, 2**62)), id(object()), id(len))")
firsts = []
for index, (pid, sock, buffer) in enumerate(workers):
    if index < 2:
        firsts.append(eval(execute(sock, buffer, probe, 1)))
    assert execute(sock, buffer, "1+1", 2) == "2"
time.sleep(SETTLE)

def pss_kib(pid):
    with open(f"/proc/{pid}/smaps_rollup") as rollup:
        for line in rollup:
            if line.startswith("Pss:"):
                return int(line.split()[1])
    return 0

worker_pss = [pss_kib(pid) for pid, _, _ in workers]
template_pss = pss_kib(os.getpid()) if MODE != "exec" else 0
for pid, sock, buffer in workers:
    send(sock, {"type": "shutdown"})
    sock.close()
for pid, _, _ in workers:
    os.waitpid(pid, 0)
print(json.dumps({"mode": MODE, "ready_ms": ready_ms, "worker_pss_kib": worker_pss, "template_pss_kib": template_pss,
                  "template_import_ms": template_import_ms, "firsts": firsts}), flush=True)
""")


def run_inside(prefix: Path, mode: str, count: int, settle: float, workdir: Path) -> dict:
    policy = json.loads((prefix / "share/cellblock/sandbox-policy.json").read_text())
    policy["mounts"].append({"type": "bind", "source": str(prefix / "share/cellblock/worker"),
                             "target": WORKER_INSIDE})
    policy["limits"].update({"pids": max(256, 4 * count + 16), "processes": max(512, 4 * count + 16)})
    policy_file = workdir / f"policy-{mode}.json"
    policy_file.write_text(json.dumps(policy))
    workspace = workdir / f"workspace-{mode}"
    workspace.mkdir()
    memory_mb = 1024 + 80 * count
    argv = [str(prefix / "bin/cellblock-sandbox"), "--policy", str(policy_file), "--workspace", str(workspace),
            "--memory-mb", str(memory_mb), "--", "/usr/bin/python3", "-c", INSIDE, mode, str(count), str(settle)]
    completed = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=1800)
    for line in completed.stdout.splitlines():
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"{mode}: no result (exit {completed.returncode}): {completed.stderr[-2000:]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 workers per path (smoke run)")
    parser.add_argument("--sessions", type=int, default=32, help="workers per path")
    parser.add_argument("--density", action="store_true",
                        help="only the fork+shell path (for a large --sessions: memory per session at that density)")
    parser.add_argument("--prefix", type=Path, default=Path(os.environ.get("CELLBLOCK_PREFIX", "/usr/local")))
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("needs root: the sandbox maps a session uid", file=sys.stderr)
        return 2
    count = 3 if args.quick else args.sessions
    settle = 0.3 if args.quick else 3.0
    workdir = Path(tempfile.mkdtemp(prefix="cellblock-bench-zygote-"))
    try:
        results = {}
        for mode in (("fork+shell",) if args.density else ("exec", "fork", "fork+shell")):
            progress(f"{mode}: {count} workers in one sandbox")
            results[mode] = run_inside(args.prefix, mode, count, settle, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    def per_session_mib(result: dict) -> Stats:
        total = sum(result["worker_pss_kib"]) + result["template_pss_kib"]
        return Stats([total / len(result["worker_pss_kib"]) / 1024.0])

    ours = results["fork+shell"]
    peers = {label: results[mode] for label, mode in (("fork, shell built after fork", "fork"), ("exec", "exec"))
             if mode in results}
    print(f"{count} workers per path, all in one sandbox. cellblock column: fork of a template that also built the "
          f"InteractiveShell (imports + shell: {ours['template_import_ms']:.0f} ms before the first fork).\n")
    rows = [
        Row("worker PSS per session (+ template / N)", per_session_mib(ours),
            {label: per_session_mib(r) for label, r in peers.items()}, unit="MiB",
            target="≤ 10 MB with the kernel's 2.4", note="one sample: sum / N"),
        Row("start → worker `ready`", Stats(ours["ready_ms"]),
            {label: Stats(r["ready_ms"]) for label, r in peers.items()}, unit="ms",
            target="≤ 30 ms p50 incl. kernel + sandbox", note="sandbox setup not included"),
        Row("first `import pandas` in a session", Stats([f[0] for f in ours["firsts"]]),
            {label: Stats([f[0] for f in r["firsts"]]) for label, r in peers.items()}, unit="ms", target="≤ 5 ms"),
    ]
    print(markdown_table("Worker zygote model: fork from a preloaded template vs exec", rows))
    print("What two workers of the same path share (first two workers, same probe cell):\n")
    print("| path | hash('x') equal | random.getrandbits equal | numpy.random equal | id(object()) equal "
          "| id(len) equal (ASLR) |")
    print("|---|---|---|---|---|---|")
    for mode, result in results.items():
        first, second = result["firsts"][:2]
        print(f"| {mode} | " + " | ".join("yes" if first[i] == second[i] else "no" for i in range(1, 6)) + " |")
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
