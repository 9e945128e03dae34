#!/usr/bin/env python3
"""What an idle agent session costs the machine (target: ≤ 10 MiB of MemAvailable per session over 100 sessions,
with the defaults), cellblock's default (workers forked from the tenant's zygote template) beside the exec path
(`"worker": {"zygote": false}`) and ipykernel, through the same gateway's agent API.

    /usr/bin/python3 tests/bench/bench_session_memory.py [--quick] [--sessions N] [--parallel P] [--rounds R]

Default: 100 sessions of each kind, 3 rounds (kinds in turn), ~15 minutes; --quick: 5 sessions, 1 round, ~30 s.

For each kind, one installed cellblock-gateway in a temporary state directory (`--warm-pool 0`, the token in
KG_AUTH_TOKEN): for the default, nothing else, as share/scripts/start.sh starts it (the operator's sessions fork
from the operator's template, which the gateway supervises); for the exec path and ipykernel a `--kernelspec-dir`
with that kernel as `--default-kernel-name` (an agent session takes the gateway's default kernel). Then:
1. MemAvailable (/proc/meminfo) before the gateway starts and with the gateway up and no session, each read until
   it is stable (`settled_mem_available`: a window of reads spread ≤ `--tolerance-mib`; else the window's median).
2. The first session alone: `POST /agent/v1/sessions`, `1+1` must answer `2`. For the default it starts the
   operator's template; the bench waits for the template's "serving" line and, if the session's first worker went
   by exec meanwhile, ends that worker (`os._exit(0)`) until the kernel's next worker is a fork of the template.
3. The other N - 1 sessions, `--parallel` at a time, each answering `1+1` = `2` (creation stops below
   `--reserve-gib` of MemAvailable: the run then fails). The executes return once the kernel is idle again.
4. MemAvailable again (settled): the drop from 1. over N is what one idle session costs the machine, everything
   included (kernel, worker, the template and its service when there is one, page tables, namespaces, cgroups, the
   gateway's own growth). PSS per session from /proc/PID/smaps_rollup: the kernel, everything below it and the
   worker it holds by pidfd (a fork is the template's child), plus the template's and its service's PSS / N.
   For the default every worker must be a fork of the tenant's template (else the figure fails).
5. Every session deleted (`DELETE /agent/v1/sessions/{id}`), MemAvailable read again (what came back), the
   gateway stopped with SIGINT (Ctrl-C), and every process seen (kernels, workers, templates, services, the
   gateway) must have ended: one left behind fails the run (it is killed).
Kinds take turns, `--rounds` times (each round starts with the next kind). A MemAvailable row has one sample per
round (its median is the figure; another process's memory moves it by hundreds of MiB on a shared machine, which
100 sessions divide); a PSS row has one per session of every round. A missing peer (Debian's ipykernel) or a
kind that could not be measured fails the run.
"""
from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402
from benchlib import Row, Stats, markdown_table, progress  # noqa: E402
from bench_density import session_trees  # noqa: E402

import cellblock_zygote  # noqa: E402 (tests/plugins, put on the path by bench_memory through bench_density)

ZYGOTE, EXEC, IPYKERNEL = "cellblock (zygote, default)", "exec path", "ipykernel"
EXEC_KERNEL, IPYKERNEL_KERNEL = "cellblock-exec", "debian-ipykernel"
REQUEST_TIMEOUT_S = 300.0  # a first execute waits for its kernel (and on a loaded machine for the template)
TEMPLATE_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 60.0


SETTLE = {"window": 6, "timeout": 15.0}  # --quick: 3 reads, 2 s (its figures only show the harness works)


def settled_mem_available(tolerance_kib: int, interval: float = 0.5) -> tuple[int, int]:
    """MemAvailable in KiB once a window of reads `interval` s apart spreads ≤ tolerance, else the median of the
    last window at the timeout (a shared machine's other work moves it; waiting longer only adds drift); returns
    (KiB, the spread of the window used)."""
    reads: list[int] = []
    window = SETTLE["window"]
    deadline = time.monotonic() + SETTLE["timeout"]
    while True:
        reads.append(benchlib.mem_available_kib())
        recent = reads[-window:]
        spread = max(recent) - min(recent)
        if len(recent) == window and (spread <= tolerance_kib or time.monotonic() >= deadline):
            return int(Stats([float(r) for r in recent]).median), spread
        time.sleep(interval)


def installed_spec() -> dict:
    path = benchlib.cellblock_prefix() / "share" / "jupyter" / "kernels" / "cellblock-python" / "kernel.json"
    if not path.exists():
        raise RuntimeError(f"the cellblock kernel is not installed ({path} missing)")
    return json.loads(path.read_text())


def stock_policy() -> Path:
    """The sandbox policy of the installed kernel config (the default's template state lives where it says)."""
    argv = installed_spec()["argv"]
    return Path(cellblock_zygote.resolved_config(Path(argv[argv.index("--config") + 1]))["sandbox_policy"])


def write_kernelspecs(directory: Path) -> Path:
    """cellblock-exec (the installed kernel with `worker.zygote: false`) and debian-ipykernel under directory."""
    spec = installed_spec()
    argv = spec["argv"]
    config = cellblock_zygote.resolved_config(Path(argv[argv.index("--config") + 1]))
    config["worker"]["zygote"] = False
    (directory / "kernel-config-exec.json").write_text(json.dumps(config))
    argv[argv.index("--config") + 1] = str(directory / "kernel-config-exec.json")
    spec["display_name"] = "cellblock, worker by exec"
    kernels = directory / "kernels"
    (kernels / EXEC_KERNEL).mkdir(parents=True)
    (kernels / EXEC_KERNEL / "kernel.json").write_text(json.dumps(spec))
    (kernels / IPYKERNEL_KERNEL).mkdir(parents=True)
    (kernels / IPYKERNEL_KERNEL / "kernel.json").write_text(json.dumps({
        "argv": [benchlib.DEBIAN_PYTHON, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "ipykernel (Debian)", "language": "python"}))
    return kernels


def ipykernel_version() -> str:
    result = subprocess.run([benchlib.DEBIAN_PYTHON, "-c", "import ipykernel; print(ipykernel.__version__)"],
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"Debian's ipykernel is not installed: {result.stderr.strip()[-200:]}")
    return result.stdout.strip()


class Gateway:
    """The installed cellblock-gateway, its token in KG_AUTH_TOKEN, stopped with SIGINT (what Ctrl-C sends)."""

    def __init__(self, workdir: Path, extra_args: list[str]):
        import requests
        import secrets
        self.port, self.token = benchlib.free_port(), secrets.token_hex(16)
        env = {k: v for k, v in os.environ.items() if not k.startswith("KG_")}
        env["KG_AUTH_TOKEN"] = self.token
        argv = [str(benchlib.gateway_binary()), "--ip", "127.0.0.1", "--port", str(self.port),
                "--state-dir", str(workdir / "state"), "--warm-pool", "0", *extra_args]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = benchlib.ServerProcess("cellblock-gateway", argv, env, workdir / "gateway.log")
        self.local = threading.local()
        self.requests = requests
        try:
            self.server.wait_http(f"{self.url}/api", 60, {"Authorization": f"token {self.token}"})
        except Exception:
            self.server.stop()
            raise

    @property
    def pid(self) -> int:
        return self.server.pid

    def call(self, method: str, path: str, body=None, timeout: float = REQUEST_TIMEOUT_S):
        if not hasattr(self.local, "http"):  # one keep-alive connection per client thread
            self.local.http = self.requests.Session()
            self.local.http.headers["Authorization"] = f"token {self.token}"
        return self.local.http.request(method, self.url + path, json=body, timeout=timeout)

    def create_session(self, name: str) -> str:
        response = self.call("POST", "/agent/v1/sessions", {"name": name})
        if response.status_code != 201:
            raise RuntimeError(f"create session {name}: {response.status_code} {response.text[:200]}")
        return response.json()["id"]

    def execute(self, session: str, code: str) -> dict:
        response = self.call("POST", f"/agent/v1/sessions/{session}/execute", {"code": code})
        if response.status_code != 200:
            raise RuntimeError(f"execute in {session}: {response.status_code} {response.text[:200]}")
        return response.json()

    def one_plus_one(self, session: str) -> None:
        answer = self.execute(session, "1+1")
        value = (answer.get("result") or {}).get("text/plain")
        if answer.get("status") != "ok" or value != "2":
            raise RuntimeError(f"1+1 in {session} answered {value!r}: {json.dumps(answer)[:300]}")

    def kernel_id(self, session: str) -> str:
        response = self.call("GET", f"/agent/v1/sessions/{session}")
        if response.status_code != 200 or not response.json().get("kernel_id"):
            raise RuntimeError(f"session {session}: {response.status_code} {response.text[:200]}")
        return response.json()["kernel_id"]

    def delete_session(self, session: str) -> bool:
        try:
            return self.call("DELETE", f"/agent/v1/sessions/{session}", timeout=60).status_code in (200, 204)
        except Exception:  # noqa: BLE001 - counted by the caller
            return False

    def stop(self) -> int | None:
        """SIGINT, as Ctrl-C sends (it stops every kernel and template); the group is killed after the timeout.
        Returns the exit status, None if it had to be killed."""
        process = self.server.process
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                progress(f"cellblock-gateway (pid {self.pid}) still running {STOP_TIMEOUT_S:.0f} s after SIGINT")
        status = process.returncode
        self.server.stop()  # closes the log; kills the group if it is still there
        return status


def kernel_pids(kernel_ids: list[str]) -> dict[str, int]:
    """kernel id -> pid of the process running it (the topmost with `kernel-<id>.json` on its command line: a
    process the kernel forks shows its command line until it execs), from one pass over /proc."""
    wanted = {f"kernel-{kernel_id}.json".encode(): kernel_id for kernel_id in kernel_ids}
    matches: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        for needle, kernel_id in wanted.items():
            if needle in cmdline:
                matches[int(entry)] = kernel_id
    found = {}
    for pid, kernel_id in matches.items():
        if cellblock_zygote._ppid(pid) not in matches:
            found.setdefault(kernel_id, pid)
    return found


def zygote_tenant(kernel_pid: int) -> str:
    raw = Path(f"/proc/{kernel_pid}/environ").read_bytes()
    for entry in raw.split(b"\0"):
        if entry.startswith(b"CELLBLOCK_ZYGOTE_TENANT="):
            return entry.split(b"=", 1)[1].decode()
    raise RuntimeError(f"kernel {kernel_pid} has no CELLBLOCK_ZYGOTE_TENANT: the gateway named no tenant")


def make_first_worker_a_fork(gateway: Gateway, session: str, kernel_pid: int, policy: Path, tenant: str) -> int:
    """Waits for the tenant's template to serve; ends the session's worker until its kernel's worker is a fork of
    it (the first worker may have gone by exec while the template started). Returns the template's pid."""
    template = cellblock_zygote.template_serving(policy, tenant, timeout=TEMPLATE_TIMEOUT_S)
    for _ in range(5):
        workers = [pid for pid in cellblock_zygote.kernel_tree(kernel_pid) if pid != kernel_pid]
        if any(cellblock_zygote._ppid(pid) == template for pid in workers):
            return template
        progress(f"{ZYGOTE}: the first session's worker was not forked (exec while the template started); "
                 "ending it")
        gateway.execute(session, "import os; os._exit(0)")
        gateway.one_plus_one(session)
    raise RuntimeError(f"the first session's worker is not a fork of template {template} after 5 tries")


def watch(watched: dict[int, int], pids) -> None:
    """Adds a pidfd for each process not watched yet (a pid's fd, not its number, tells that it ended)."""
    for pid in set(pids) - set(watched):
        try:
            watched[pid] = os.pidfd_open(pid)
        except OSError:  # gone already
            pass


def still_running(fds: dict[int, int], timeout: float) -> list[int]:
    """Waits on the pidfds until every process ended or `timeout` passed; removes and closes the fds of those
    that ended and returns the pids still running (their fds stay in `fds`)."""
    deadline = time.monotonic() + timeout
    while fds and time.monotonic() < deadline:
        poller = select.poll()  # not select(): a run holds hundreds of fds, some above FD_SETSIZE
        for fd in fds.values():
            poller.register(fd, select.POLLIN)
        ready = {fd for fd, _ in poller.poll(max(0.0, deadline - time.monotonic()) * 1000.0)}
        for pid in [pid for pid, fd in fds.items() if fd in ready]:
            os.close(fds.pop(pid))
    return sorted(fds)


def processes_mentioning(needles: list[bytes]) -> list[int]:
    """Pids whose command line or environment holds one of `needles` (what a run leaves behind, found anew)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            text = Path(f"/proc/{entry}/cmdline").read_bytes() + b"\0" + Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        if any(needle in text for needle in needles):
            found.append(int(entry))
    return found


def measure_kind(kind: str, workdir: Path, kernels_dir: Path, count: int, parallel: int, reserve_kib: int,
                 tolerance_kib: int) -> dict:
    """One gateway, `count` idle agent sessions of the kind; the result dict (see the module docstring)."""
    extra = {EXEC: ["--kernelspec-dir", str(kernels_dir), "--default-kernel-name", EXEC_KERNEL],
             IPYKERNEL: ["--kernelspec-dir", str(kernels_dir), "--default-kernel-name", IPYKERNEL_KERNEL]}.get(kind, [])
    workdir.mkdir(parents=True)
    result: dict = {"sessions": 0, "create_ms": [], "errors": []}
    session_pids: set[int] = set()
    before_gateway, result["spread_before_kib"] = settled_mem_available(tolerance_kib)
    progress(f"{kind}: starting the gateway (MemAvailable {before_gateway / 1048576:.2f} GiB)")
    gateway = Gateway(workdir, extra)
    names: list[str] = []
    watched: dict[int, int] = {}
    watch(watched, [gateway.pid])
    tenant = None
    try:
        gateway_up, result["spread_gateway_kib"] = settled_mem_available(tolerance_kib)
        rss_gateway_up = benchlib.rss_kib(gateway.pid)
        names.append("s0")  # alone, and not in the creation times: for the default it starts the template
        started = time.perf_counter()
        gateway.create_session("s0")
        gateway.one_plus_one("s0")
        created = 1
        template = 0
        if kind == ZYGOTE:
            first_kernel = kernel_pids([gateway.kernel_id("s0")])
            if not first_kernel:
                raise RuntimeError("the first session's kernel process was not found")
            kernel_pid = next(iter(first_kernel.values()))
            tenant = cellblock_zygote.named_tenant(zygote_tenant(kernel_pid))
            progress(f"{kind}: waiting for tenant {tenant}'s template")
            template = make_first_worker_a_fork(gateway, "s0", kernel_pid, stock_policy(), tenant)
        result["first_ms"] = (time.perf_counter() - started) * 1000.0
        progress(f"{kind}: first session answered after {result['first_ms'] / 1000:.1f} s")

        lock = threading.Lock()
        stop_reason: list[str] = []

        def one(index: int) -> None:
            nonlocal created
            name = f"s{index}"
            with lock:
                if stop_reason:
                    return
                if benchlib.mem_available_kib() < reserve_kib:
                    stop_reason.append(f"MemAvailable below the {reserve_kib / 1048576:.1f} GiB reserve "
                                       f"after {len(names)} sessions")
                    return
                names.append(name)
            began = time.perf_counter()
            try:
                gateway.create_session(name)
                gateway.one_plus_one(name)
            except Exception as error:  # noqa: BLE001 - counted; the run then fails
                with lock:
                    result["errors"].append(f"{type(error).__name__}: {str(error)[:200]}")
                return
            with lock:
                result["create_ms"].append((time.perf_counter() - began) * 1000.0)
                created += 1

        progress(f"{kind}: creating {count - 1} more sessions, {parallel} at a time")
        began_all = time.monotonic()
        with ThreadPoolExecutor(max_workers=parallel) as pool:
            list(pool.map(one, range(1, count)))
        progress(f"{kind}: {created} sessions answered, the last after {time.monotonic() - began_all:.0f} s")
        result["errors"] += stop_reason
        result["sessions"] = created

        # Every session is idle: its execute came back after its kernel's IOPub idle. Now the machine's view.
        idle, result["spread_idle_kib"] = settled_mem_available(tolerance_kib)
        ids = {name: gateway.kernel_id(name) for name in names}
        pids = kernel_pids(list(ids.values()))
        if len(pids) != len(ids):
            raise RuntimeError(f"{len(ids) - len(pids)} of {len(ids)} sessions' kernel processes not found")
        trees = session_trees(list(pids.values()))
        session_pids.update(pid for tree in trees for pid in tree)
        watch(watched, session_pids)
        watch(watched, benchlib.descendants(gateway.pid))
        shared: list[int] = []
        if kind == ZYGOTE:
            parents = {cellblock_zygote._ppid(pid) for tree in trees for pid in tree[1:]}
            forked = [tree for tree in trees if any(cellblock_zygote._ppid(pid) == template for pid in tree[1:])]
            result["forked"] = len(forked)
            services = cellblock_zygote.template_services(tenant)
            shared = sorted((parents - {pid for tree in trees for pid in tree}) | {template} | set(services))
            result["template_pss_mib"] = sum(benchlib.pss_kib(pid) for pid in shared if pid not in services) / 1024
            result["service_pss_mib"] = sum(benchlib.pss_kib(pid) for pid in services) / 1024.0
            watch(watched, shared)
            if len(forked) != len(trees):
                result["errors"].append(f"{len(trees) - len(forked)} of {len(trees)} workers not forked by "
                                        f"template {template}")
        share_kib = sum(benchlib.pss_kib(pid) for pid in shared) / max(1, len(trees))
        result["pss_mib"] = [(sum(benchlib.pss_kib(pid) for pid in tree) + share_kib) / 1024.0 for tree in trees]
        result["kernel_pss_mib"] = [benchlib.pss_kib(tree[0]) / 1024.0 for tree in trees]
        result["worker_pss_mib"] = [sum(benchlib.pss_kib(pid) for pid in tree[1:]) / 1024.0 for tree in trees]
        result["processes"] = sum(len(tree) for tree in trees) + len(shared)
        sessions = max(1, len(names))
        result["drop_mib"] = (gateway_up - idle) / 1024.0 / sessions
        result["drop_all_in_mib"] = (before_gateway - idle) / 1024.0 / sessions
        result["gateway_rss_kib"] = (benchlib.rss_kib(gateway.pid) - rss_gateway_up) / sessions
        result["mem"] = (before_gateway, gateway_up, idle)
    except Exception as error:  # noqa: BLE001 - reported in the table; the run fails
        result["errors"].append(f"{type(error).__name__}: {str(error)[:300]}")
        progress(f"{kind}: {result['errors'][-1]}\n{gateway.server.log_tail(15)}")
    finally:
        try:
            progress(f"{kind}: deleting {len(names)} sessions")
            with ThreadPoolExecutor(max_workers=8) as pool:
                deleted = sum(pool.map(gateway.delete_session, names))
            if deleted != len(names):
                result["errors"].append(f"{len(names) - deleted} of {len(names)} sessions not deleted")
            # The sessions' processes end once deleted; what came back is read after they did (templates linger).
            if "mem" in result:
                sessions_fds = {pid: fd for pid, fd in watched.items() if pid in session_pids}
                left = set(still_running(sessions_fds, 30.0))
                for pid in list(watched):
                    if pid in session_pids and pid not in left:
                        watched.pop(pid)  # its fd was closed by still_running
                after_delete, _ = settled_mem_available(tolerance_kib)
                result["given_back_mib"] = (after_delete - result["mem"][2]) / 1024.0 / max(1, len(names))
        except Exception as error:  # noqa: BLE001 - reported; the gateway is stopped below all the same
            result["errors"].append(f"while deleting: {type(error).__name__}: {str(error)[:200]}")
        status = gateway.stop()
        if status != 0:
            result["errors"].append(f"the gateway exited with {status} on SIGINT")
        left = still_running(watched, 20.0)
        needles = [str(workdir).encode()] + ([f"CELLBLOCK_ZYGOTE_TENANT={tenant}".encode()] if tenant else [])
        left = sorted(set(left) | set(processes_mentioning(needles)))
        if left:
            result["errors"].append(f"{len(left)} processes still running after the gateway stopped: " +
                                    ", ".join(f"{pid} {benchlib.process_name(pid)}" for pid in left[:5]))
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for fd in watched.values():
            os.close(fd)
    for error in result["errors"]:
        progress(f"{kind}: {error}")
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="5 sessions of each kind (smoke run)")
    parser.add_argument("--sessions", type=int, default=100, help="idle agent sessions of each kind")
    parser.add_argument("--parallel", type=int, default=4, help="sessions created at once")
    parser.add_argument("--rounds", type=int, default=3,
                        help="gateways of each kind, kinds in turn (MemAvailable figures: the median of the rounds)")
    parser.add_argument("--reserve-gib", type=float, default=3.0, help="stop creating below this MemAvailable")
    parser.add_argument("--tolerance-mib", type=float, default=4.0,
                        help="MemAvailable counts as settled when 6 reads 0.5 s apart spread at most this (else their "
                             "median after 15 s)")
    args = parser.parse_args()
    count = 5 if args.quick else args.sessions
    if args.quick:
        SETTLE.update(window=3, timeout=2.0)
    rounds = 1 if args.quick else args.rounds
    if not benchlib.gateway_binary().exists():
        progress(f"cellblock-gateway is not installed at {benchlib.gateway_binary()} (set CELLBLOCK_PREFIX)")
        return 1
    ipykernel_label = f"ipykernel {ipykernel_version()}"
    scratch = Path(tempfile.mkdtemp(prefix="cellblock-bench-session-memory-"))
    mem_total = benchlib._proc_kib("/proc/meminfo", "MemTotal")
    mem_start = benchlib.mem_available_kib()
    load = os.getloadavg()[0]
    results: dict[str, list[dict]] = {ZYGOTE: [], EXEC: [], IPYKERNEL: []}
    try:
        kernels_dir = write_kernelspecs(scratch)
        kinds = list(results)
        for round_index in range(rounds):
            # Kinds in turn, each round starting one further on: the machine's drift hits every kind alike.
            for kind in kinds[round_index % 3:] + kinds[:round_index % 3]:
                results[kind].append(measure_kind(kind, scratch / f"{kind.split()[0]}-{round_index}", kernels_dir,
                                                  count, args.parallel, int(args.reserve_gib * 1048576),
                                                  int(args.tolerance_mib * 1024)))
    finally:
        cellblock_zygote.stop_templates(stock_policy())  # the templates' state files (the processes ended)
        shutil.rmtree(scratch, ignore_errors=True)

    def each(kind: str, key: str):
        values = [r[key] for r in results[kind] if key in r]
        return Stats(values) if values else None

    def pooled(kind: str, key: str):
        values = [value for r in results[kind] for value in r.get(key, [])]
        return Stats(values) if values else None

    peers = {EXEC: EXEC, ipykernel_label: IPYKERNEL}
    print(f"{count} idle agent sessions of each kind through one cellblock-gateway (`--warm-pool 0`), "
          f"{args.parallel} created at a time, {rounds} round(s); each answered `1+1` = 2. MemTotal "
          f"{mem_total / 1048576:.1f} GiB, MemAvailable at the start {mem_start / 1048576:.1f} GiB, load average "
          f"{load:.1f}. Columns: cellblock as installed (workers forked from the operator's zygote template), "
          f"the same kernel with `\"worker\": {{\"zygote\": false}}`, Debian's ipykernel.\n")
    rows = [
        Row(f"MemAvailable drop per idle session ({count} sessions, from the gateway with none)",
            each(ZYGOTE, "drop_mib"), {label: each(kind, "drop_mib") for label, kind in peers.items()}, unit="MiB",
            target="≤ 10 MiB", note="kernel, worker, template and its service, page tables, cgroups, gateway"),
        Row("the same, from before the gateway started", each(ZYGOTE, "drop_all_in_mib"),
            {label: each(kind, "drop_all_in_mib") for label, kind in peers.items()}, unit="MiB",
            note="adds the gateway's own start"),
        Row("PSS per idle session (kernel + worker + template's share)", pooled(ZYGOTE, "pss_mib"),
            {label: pooled(kind, "pss_mib") for label, kind in peers.items()}, unit="MiB",
            note="one sample per session"),
        Row("of which the kernel process", pooled(ZYGOTE, "kernel_pss_mib"),
            {label: pooled(kind, "kernel_pss_mib") for label, kind in peers.items()}, unit="MiB",
            note="ipykernel: the whole kernel"),
        Row("of which the worker", pooled(ZYGOTE, "worker_pss_mib"),
            {label: pooled(kind, "worker_pss_mib") for label, kind in peers.items()}, unit="MiB",
            note="zygote: without the template's share"),
        Row("template + its service, PSS (shared by all sessions)", each(ZYGOTE, "template_pss_mib"), {},
            unit="MiB", note=f"service alone: {each(ZYGOTE, 'service_pss_mib').median:.1f} MiB"
            if each(ZYGOTE, "service_pss_mib") else ""),
        Row("gateway RSS growth per session", each(ZYGOTE, "gateway_rss_kib"),
            {label: each(kind, "gateway_rss_kib") for label, kind in peers.items()}, unit="KiB"),
        Row("MemAvailable back per deleted session", each(ZYGOTE, "given_back_mib"),
            {label: each(kind, "given_back_mib") for label, kind in peers.items()}, unit="MiB",
            note="templates linger for their grace"),
        Row("first session: create → `1+1` answered", each(ZYGOTE, "first_ms"),
            {label: each(kind, "first_ms") for label, kind in peers.items()},
            note="zygote: until the template serves and the session's worker is a fork of it"),
        Row("each further session: create + first `1+1` answered", pooled(ZYGOTE, "create_ms"),
            {label: pooled(kind, "create_ms") for label, kind in peers.items()},
            note=f"{args.parallel} at a time"),
    ]
    print(markdown_table("An idle agent session's cost to the machine (cellblock column = zygote, the default)",
                         rows))
    for kind, runs in results.items():
        for index, r in enumerate(runs):
            if "mem" in r:
                before, up, idle = (value / 1048576 for value in r["mem"])
                forked = f", {r['forked']} of {r['sessions']} workers forked" if "forked" in r else ""
                print(f"- {kind}, round {index + 1}: {r['sessions']} sessions{forked}, {r['processes']} processes; "
                      f"MemAvailable {before:.2f} GiB before the gateway, {up:.2f} with it up, {idle:.2f} with the "
                      f"sessions idle (reads settled within {max(r['spread_gateway_kib'], r['spread_idle_kib'])} "
                      f"KiB)")
    print()
    failed = benchlib.failed_peers({f"{kind}, round {index + 1}": "; ".join(r["errors"]) or None
                                    for kind, runs in results.items() for index, r in enumerate(runs)})
    return 1 if failed or any(r.get("sessions", 0) != count for runs in results.values() for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
