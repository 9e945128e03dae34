#!/usr/bin/env python3
"""How many idle sessions one machine holds (2,000 idle sessions, each answering `1+1`).

    /usr/bin/python3 tests/bench/bench_density.py [--quick] [--sessions N] [--reserve-gib G] [--parallel P] [--exec]

Starts cellblock kernels (workers forked by the zygote template; `--exec` for the exec path) until N are running or
MemAvailable falls below the reserve (default 3 GiB, so a shared machine is never pushed into the OOM killer),
`--parallel` starts at a time. Each kernel is a plain process on an `ipc://` connection file with no client
attached (an agent's idle session holds no client between turns); a start counts once the kernel answered
kernel_info and a silent execute whose user expression `1+1` evaluated to `2`. After a pause, every session is
asked again (one at a time) and must still answer `2`; then the memory is read: PSS of every session's processes
(kernel, worker, the template's share) and how much MemAvailable fell per session (what the machine paid, including
page tables, mount namespaces, cgroups and tmpfs, which PSS does not show). The report says how many sessions were
alive and answering, and how many would fit in the machine's memory at that cost.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import hmac
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402
from benchlib import Row, Stats, markdown_table, progress  # noqa: E402
from bench_memory import ZYGOTE_KIND, install_zygote_kernelspec, warm_template  # noqa: E402

import cellblock_zygote  # noqa: E402 (tests/plugins, put on the path by bench_memory)

DELIMITER = b"<IDS|MSG>"
ANSWER_TIMEOUT_S = 180.0


class IdleSession:
    """One kernel process on its own ipc connection file; a short-lived DEALER asks it things when needed."""

    def __init__(self, argv: list[str], env: dict, directory: Path, index: int):
        self.connection_file = directory / f"kernel-{index}.json"
        self.key = uuid.uuid4().hex.encode()
        from jupyter_client.connect import write_connection_file
        write_connection_file(str(self.connection_file), transport="ipc", ip=str(directory / f"k{index}"),
                              key=self.key, signature_scheme="hmac-sha256")
        info = json.loads(self.connection_file.read_text())
        self.shell_endpoint = f"ipc://{info['ip']}-{info['shell_port']}"
        self.started = time.perf_counter()
        self.process = subprocess.Popen([a.replace("{connection_file}", str(self.connection_file)) for a in argv],
                                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, env=env, start_new_session=True)

    def _request(self, socket, msg_type: str, content: dict) -> dict:
        header = json.dumps({"msg_id": uuid.uuid4().hex, "msg_type": msg_type, "username": "bench",
                             "session": uuid.uuid4().hex, "version": "5.3",
                             "date": datetime.datetime.now(datetime.timezone.utc).isoformat()}).encode()
        frames = [header, b"{}", b"{}", json.dumps(content).encode()]
        signature = hmac.new(self.key, digestmod=hashlib.sha256)
        for frame in frames:
            signature.update(frame)
        socket.send_multipart([DELIMITER, signature.hexdigest().encode(), *frames])
        deadline = time.monotonic() + ANSWER_TIMEOUT_S
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"kernel exited with status {self.process.returncode}")
            if socket.poll(200):
                reply = socket.recv_multipart()
                return json.loads(reply[reply.index(DELIMITER) + 5])
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {msg_type} reply within {ANSWER_TIMEOUT_S:.0f} s")

    def answer_one_plus_one(self, context: zmq.Context, info_first: bool = False) -> float:
        """Milliseconds for a silent execute whose user expression `1+1` must come back as `2`."""
        socket = context.socket(zmq.DEALER)
        socket.linger = 0
        socket.connect(self.shell_endpoint)
        try:
            if info_first:
                self._request(socket, "kernel_info_request", {})
            asked = time.perf_counter()
            reply = self._request(socket, "execute_request",
                                  {"code": "", "silent": True, "store_history": False,
                                   "user_expressions": {"r": "1+1"}, "allow_stdin": False})
            value = reply.get("user_expressions", {}).get("r", {}).get("data", {}).get("text/plain")
            if reply.get("status") != "ok" or value != "2":
                raise RuntimeError(f"1+1 answered {value!r} (status {reply.get('status')})")
            return (time.perf_counter() - asked) * 1000.0
        finally:
            socket.close()

    def stop(self) -> None:
        """SIGTERM (the kernel ends its worker and leaves), SIGKILL for its process group after 10 s."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.process.wait()


def session_trees(kernel_pids: list[int]) -> list[list[int]]:
    """Each kernel with everything below it and the worker it holds by pidfd (a forked worker is the template's
    child) with everything below that; /proc is read once for all of them."""
    children = cellblock_zygote._children_map()
    trees = []
    for kernel_pid in kernel_pids:
        found = [kernel_pid]  # first: the rest are the kernel's descendants and its worker's tree
        todo = children.get(kernel_pid, []) + cellblock_zygote.pidfd_targets(kernel_pid)
        while todo:
            current = todo.pop()
            if current not in found:
                found.append(current)
                todo.extend(children.get(current, []))
        trees.append(found)
    return trees


def start_sessions(argv: list[str], env: dict, directory: Path, wanted: int, reserve_kib: int, parallel: int,
                   context: zmq.Context) -> tuple[list[IdleSession], list[float], list[str], str]:
    """Starts up to `wanted` sessions; returns (those that answered, their start → answer ms, failures, why it
    stopped)."""
    alive, ready_ms, failures = [], [], []
    lock = threading.Lock()
    stopped_because = f"{wanted} sessions started"

    def start_one(index: int) -> None:
        session = IdleSession(argv, env, directory, index)
        try:
            session.answer_one_plus_one(context, info_first=True)
            with lock:
                alive.append(session)
                ready_ms.append((time.perf_counter() - session.started) * 1000.0)
        except Exception as error:  # noqa: BLE001 - counted and reported
            session.stop()
            with lock:
                failures.append(f"{type(error).__name__}: {str(error)[:120]}")

    with ThreadPoolExecutor(max_workers=parallel) as pool:
        pending = []
        for index in range(wanted):
            while len([f for f in pending if not f.done()]) >= parallel:
                time.sleep(0.01)
            if benchlib.mem_available_kib() < reserve_kib:
                stopped_because = (f"MemAvailable below the {reserve_kib / 1048576:.1f} GiB reserve after "
                                   f"{index} starts")
                break
            pending.append(pool.submit(start_one, index))
            if (index + 1) % 100 == 0:
                with lock:
                    progress(f"density: {index + 1} started, {len(alive)} answering, {len(failures)} failed, "
                             f"MemAvailable {benchlib.mem_available_kib() / 1048576:.1f} GiB")
    return alive, ready_ms, failures, stopped_because


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 sessions (smoke run)")
    parser.add_argument("--sessions", type=int, default=2000)
    parser.add_argument("--reserve-gib", type=float, default=3.0, help="stop starting below this MemAvailable")
    parser.add_argument("--parallel", type=int, default=4, help="starts in flight at once")
    parser.add_argument("--exec", action="store_true", help="the exec path instead of zygote forks")
    args = parser.parse_args()
    wanted = 3 if args.quick else args.sessions
    benchlib.use_installed_kernelspecs()
    directory = Path(tempfile.mkdtemp(prefix="cellblock-density-"))
    context = zmq.Context()
    policy, sessions = None, []
    try:
        from jupyter_client.kernelspec import KernelSpecManager
        if args.exec:
            kernel_name = "cellblock-python"
        else:
            policy = install_zygote_kernelspec(directory)
            warm_template(policy)
            kernel_name = ZYGOTE_KIND[1]
        spec = KernelSpecManager().get_kernel_spec(kernel_name)
        argv, env = spec.argv, dict(os.environ, **(spec.env or {}))
        mem_total_kib = benchlib._proc_kib("/proc/meminfo", "MemTotal")
        available_before = benchlib.mem_available_kib()
        progress(f"density: starting up to {wanted} {kernel_name} sessions, {args.parallel} at a time "
                 f"(MemAvailable {available_before / 1048576:.1f} GiB)")
        began = time.monotonic()
        sessions, ready_ms, failures, stopped_because = start_sessions(
            argv, env, directory, wanted, int(args.reserve_gib * 1048576), args.parallel, context)
        start_s = time.monotonic() - began
        for failure in sorted(set(failures))[:3]:
            progress(f"density: start failed: {failure}")
        time.sleep(2.0 if args.quick else 10.0)  # the first execute's garbage and lazily started threads settle

        answer_ms, silent = [], []
        for session in sessions:
            try:
                answer_ms.append(session.answer_one_plus_one(context))
            except Exception as error:  # noqa: BLE001 - counted
                silent.append(f"{type(error).__name__}: {str(error)[:120]}")
        for failure in sorted(set(silent))[:3]:
            progress(f"density: an idle session did not answer: {failure}")
        available_after = benchlib.mem_available_kib()
        trees = session_trees([session.process.pid for session in sessions])
        # A forked worker's parent is a template (the serving one, or one retired after its generation of forks
        # that lives on while its forks do), not anything in the session's own tree.
        parents_outside = [{cellblock_zygote._ppid(pid) for pid in tree[1:]} - set(tree) for tree in trees]
        forked = sum(1 for outside in parents_outside if outside)
        templates = set().union(*parents_outside) if parents_outside else set()
        template_share = sum(benchlib.pss_kib(pid) for pid in templates)
        pss_mib = [sum(benchlib.pss_kib(pid) for pid in tree) / 1024.0 + template_share / 1024.0 / len(trees)
                   for tree in trees] if trees else []
        paid_mib = (available_before - available_after) / 1024.0 / max(1, len(sessions))

        label = "worker.zygote on" if not args.exec else "exec path"
        print(f"{len(sessions)} idle cellblock sessions ({label}: {forked} workers forked by "
              f"{len(templates)} template(s), counted in the PSS as a share) started in {start_s:.0f} s, "
              f"{args.parallel} at a time; stopped because: {stopped_because}; {len(failures)} failed to start. "
              f"MemTotal {mem_total_kib / 1048576:.1f} GiB, MemAvailable {available_before / 1048576:.1f} GiB "
              f"before and {available_after / 1048576:.1f} GiB with them running.\n")
        fits = (available_before / 1024.0 - args.reserve_gib * 1024.0) / paid_mib if paid_mib > 0 else 0
        rows = [Row("sessions alive and answering `1+1` = 2", Stats([len(sessions) - len(silent)]),
                    unit="sessions", target="2,000", note=f"of {wanted} asked for"),
                Row("start → first `1+1` answered", Stats(ready_ms), note="while the others start"),
                Row("`1+1` in an idle session among them", Stats(answer_ms), note="asked one at a time"),
                Row("PSS per idle session (kernel + worker + template share)", Stats(pss_mib), unit="MiB",
                    target="≤ 10 MB"),
                Row("MemAvailable spent per session", Stats([paid_mib]), unit="MiB",
                    note="incl. page tables, namespaces, cgroups"),
                Row("sessions that fit in MemAvailable less the reserve, at that cost", Stats([int(fits)]),
                    unit="sessions", target="2,000")]
        print(markdown_table("Idle sessions on one machine", rows))
        return 0 if sessions and not silent and len(failures) == 0 else 1
    finally:
        progress(f"density: stopping {len(sessions)} sessions")
        with ThreadPoolExecutor(max_workers=16) as pool:
            list(pool.map(lambda s: s.stop(), sessions))
        context.term()
        if policy is not None:
            cellblock_zygote.stop_templates(policy)
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
