"""Shared pieces of the cellblock benchmarks: sample statistics, the side-by-side table, process hygiene.

Every benchmark measures cellblock and the peer a user would pick instead (ipykernel, Jupyter Server, a plain
interpreter) in the same run, on the same machine, and reports medians, p99 and the ratio peer/ours.
"""
from __future__ import annotations

import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Optional


@dataclass
class Stats:
    samples: list[float]

    @property
    def n(self) -> int:
        return len(self.samples)

    @property
    def median(self) -> float:
        return statistics.median(self.samples) if self.samples else math.nan

    def quantile(self, q: float) -> float:
        if not self.samples:
            return math.nan
        ordered = sorted(self.samples)
        index = min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))
        return ordered[index]

    @property
    def p99(self) -> float:
        return self.quantile(0.99)

    @property
    def minimum(self) -> float:
        return min(self.samples) if self.samples else math.nan


def measure(action: Callable[[], object], repeat: int, warmup: int = 1) -> Stats:
    """Wall-clock milliseconds of `action`, `repeat` times after `warmup` unrecorded calls."""
    for _ in range(warmup):
        action()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        action()
        samples.append((time.perf_counter() - start) * 1000.0)
    return Stats(samples)


@dataclass
class Row:
    measure: str
    ours: Optional[Stats] = None
    peers: dict[str, Optional[Stats]] = field(default_factory=dict)
    unit: str = "ms"
    target: str = ""
    note: str = ""


def _fmt(stats: Optional[Stats], unit: str) -> str:
    if stats is None or not stats.samples:
        return "–"
    if unit == "ms":
        return f"{stats.median:.2f} ({stats.p99:.2f})"
    digits = 2 if abs(stats.median) < 10 else 1  # sub-millisecond CPU figures need the second decimal
    if unit in ("sessions", "failed", "processes") and all(float(x).is_integer() for x in stats.samples):
        digits = 0  # counts (sessions, failures) read best without decimals
    if stats.n == 1:
        return f"{stats.median:.{digits}f} {unit}"
    return f"{stats.median:.{digits}f} ({stats.p99:.{digits}f}) {unit}"


def _ratio(ours: Optional[Stats], peer: Optional[Stats], higher_is_better: bool) -> str:
    if not ours or not peer or not ours.samples or not peer.samples or ours.median <= 0 or peer.median <= 0:
        return "–"
    ratio = ours.median / peer.median if higher_is_better else peer.median / ours.median
    return f"{ratio:.1f}×"


def markdown_table(title: str, rows: Iterable[Row], higher_is_better: bool = False) -> str:
    """One table: measure, cellblock median (p99), each peer median (p99) and the ratio (peer/ours for times)."""
    rows = list(rows)
    peers: list[str] = []
    for row in rows:
        for name in row.peers:
            if name not in peers:
                peers.append(name)
    header = ["measure", "cellblock median (p99)"]
    for name in peers:
        header += [f"{name} median (p99)", f"× vs {name}"]
    header += ["target", "n", "note"]
    lines = [f"### {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [row.measure, _fmt(row.ours, row.unit)]
        for name in peers:
            peer = row.peers.get(name)
            cells += [_fmt(peer, row.unit), _ratio(row.ours, peer, higher_is_better or row.unit == "exec/s")]
        cells += [row.target, str(row.ours.n if row.ours else 0), row.note]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _proc_kib(path: str, key: str) -> int:
    """The KiB figure on the `key:` line of a /proc file, 0 if the process is gone."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def pss_kib(pid: int) -> int:
    """Proportional set size of one process in KiB (smaps_rollup), 0 if it is gone."""
    return _proc_kib(f"/proc/{pid}/smaps_rollup", "Pss:")


def private_dirty_kib(pid: int) -> int:
    """Pages of one process that no other process maps and that it wrote (smaps_rollup), 0 if it is gone."""
    return _proc_kib(f"/proc/{pid}/smaps_rollup", "Private_Dirty:")


def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return children


def children(pid: int) -> list[int]:
    """Direct children of pid."""
    return _children_map().get(pid, [])


def descendants(pid: int) -> list[int]:
    """pid and every process below it (via /proc/*/stat ppid links)."""
    children = _children_map()
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(children.get(current, []))
    return found


def stop_process(proc: subprocess.Popen, timeout: float = 5.0) -> None:
    """SIGTERM, then SIGKILL the process group; never leaves a benchmark process behind."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def progress(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------------------
# Installed tree, processes and /proc accounting shared by bench_outputs/bench_throughput/bench_memory (additive).
# jupyter_client, requests and websocket-client are imported inside the functions that need them, so that scripts
# which never start a kernel or a server do not pay for those imports.

REPO_ROOT = Path(__file__).resolve().parents[2]
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
DEBIAN_PYTHON = "/usr/bin/python3"


def cellblock_prefix() -> Path:
    """The installed tree under test: $CELLBLOCK_PREFIX, default build/test/stage in the repository."""
    return Path(os.environ.get("CELLBLOCK_PREFIX") or REPO_ROOT / "build" / "test" / "stage").resolve()


def use_installed_kernelspecs() -> None:
    """Makes jupyter_client (in this process and its children) see cellblock-python next to Debian's kernelspecs."""
    os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")  # ipykernel's debugger warning on every start
    wanted = f"{cellblock_prefix() / 'share' / 'jupyter'}:/usr/share/jupyter"
    current = os.environ.get("JUPYTER_PATH", "")
    if str(cellblock_prefix() / "share" / "jupyter") not in current.split(":"):
        os.environ["JUPYTER_PATH"] = wanted + (":" + current if current else "")


def kernelspec_available(name: str) -> bool:
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel
    try:
        spec = KernelSpecManager().get_kernel_spec(name)
    except NoSuchKernel:
        return False
    return bool(spec.argv) and os.access(spec.argv[0], os.X_OK)


# Today's peers from PyPI (tests/requirements-peers.txt), in the venv share/scripts/test-venv.sh makes; their
# kernelspecs are written under these names so they sit beside Debian's `python3` (ipykernel 6.17) and `xpython`.
PYPI_IPYKERNEL = "pypi-ipykernel"
PYPI_XPYTHON = "pypi-xpython"


def peers_venv() -> Path:
    """The PyPI peers' venv; a missing one is an install step (share/scripts/test.sh makes it), never a skip."""
    venv = Path(os.environ.get("CELLBLOCK_PEERS_VENV") or REPO_ROOT / "build" / "test" / "peers-venv")
    if not (venv / "bin" / "python").exists():
        raise RuntimeError(f"{venv} is missing: share/scripts/test-venv.sh {venv} tests/requirements-peers.txt")
    return venv


def peer_version(distribution: str) -> str:
    return subprocess.run([str(peers_venv() / "bin" / "python"), "-c",
                           f"import importlib.metadata as m; print(m.version({distribution!r}))"],
                          capture_output=True, text=True, check=True).stdout.strip()


def install_pypi_kernelspecs(workdir: Path) -> dict[str, str]:
    """Kernelspecs for the PyPI ipykernel and xeus-python under `workdir`, put on JUPYTER_PATH; returns
    label -> kernelspec name."""
    python = str(peers_venv() / "bin" / "python")
    kernels = workdir / "pypi-jupyter" / "kernels"
    specs = {PYPI_IPYKERNEL: [python, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
             PYPI_XPYTHON: [python, "-m", "xpython_launcher", "-f", "{connection_file}"]}
    for name, argv in specs.items():
        (kernels / name).mkdir(parents=True, exist_ok=True)
        (kernels / name / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": name,
                                                                "language": "python"}))
    os.environ["JUPYTER_PATH"] = f"{kernels.parent}:{os.environ.get('JUPYTER_PATH', '')}".rstrip(":")
    return {f"ipykernel {peer_version('ipykernel')}": PYPI_IPYKERNEL,
            f"xpython {peer_version('xeus-python')}": PYPI_XPYTHON}


def failed_peers(results: dict[str, Optional[str]]) -> list[str]:
    """The peers that were not measured ({label: error or None}), each named on stderr: a peer that is missing or
    fails is an install or harness problem that must fail the run (its column would be silently empty)."""
    failed = [label for label, error in results.items() if error]
    for label in failed:
        progress(f"{label}: not measured ({results[label]}): the run fails")
    return failed


def free_port() -> int:
    import socket
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def cpu_seconds(pids: Iterable[int]) -> float:
    """utime + stime of the given processes (each counted once), in seconds; vanished processes count 0."""
    total = 0
    for pid in set(pids):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # fields 14 and 15 of stat(5): utime, stime
        except (OSError, IndexError, ValueError):
            continue
    return total / CLOCK_TICKS


def rss_kib(pid: int) -> int:
    return _proc_kib(f"/proc/{pid}/status", "VmRSS:")


def mem_available_kib() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1])
    return 0


def smaps_breakdown(pid: int, top: int = 12) -> list[tuple[str, int, int]]:
    """(mapping, Pss KiB, Rss KiB) of one process summed per mapped file ('[anon]' for anonymous), largest first."""
    totals: dict[str, list[int]] = {}
    current = "[anon]"
    try:
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                first = line.split(None, 1)[0]
                if "-" in first and not first.endswith(":"):
                    parts = line.split()
                    current = parts[5] if len(parts) > 5 else "[anon]"
                elif first == "Pss:":
                    totals.setdefault(current, [0, 0])[0] += int(line.split()[1])
                elif first == "Rss:":
                    totals.setdefault(current, [0, 0])[1] += int(line.split()[1])
    except OSError:
        return []
    ranked = sorted(((name, v[0], v[1]) for name, v in totals.items()), key=lambda item: -item[1])
    return ranked[:top]


def process_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        return " ".join(a.decode(errors="replace") for a in argv[:3] if a)[:80]
    except OSError:
        return "?"


class RunningKernel:
    """One kernel started by jupyter_client's KernelManager with a BlockingKernelClient, stopped by stop()."""

    def __init__(self, kernel_name: str, env: Optional[dict] = None, ready_timeout: float = 120.0,
                 start: bool = True):
        from jupyter_client import KernelManager
        self.kernel_name = kernel_name
        self.env = env
        self.ready_timeout = ready_timeout
        self.manager = KernelManager(kernel_name=kernel_name)
        self.client = None
        if start:
            self.start()

    def start(self) -> None:
        # stdout to /dev/null: a kernel's prints must never end up in a benchmark's markdown (stdout) or keep a
        # caller's pipe open; stderr stays, so crash reports (xpython's segfault trace) remain visible.
        self.manager.start_kernel(env=dict(os.environ, **(self.env or {})), stdout=subprocess.DEVNULL)
        self.client = self.manager.client()
        self.client.start_channels()
        try:
            self.client.wait_for_ready(timeout=self.ready_timeout)
        except Exception:
            self.stop()
            raise

    @property
    def pid(self) -> int:
        provisioner = getattr(self.manager, "provisioner", None)
        process = getattr(provisioner, "process", None) or getattr(self.manager, "kernel", None)
        return process.pid

    def tree(self) -> list[int]:
        return descendants(self.pid)

    def kill(self) -> None:
        """SIGKILL to the kernel's process group, for a start that is wedged (stop() could wedge too)."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (AttributeError, ProcessLookupError, PermissionError):
            pass  # not spawned yet, or gone already

    def stop(self) -> None:
        """Polite shutdown_request first (cellblock then removes its workspace and runtime dir), then kill."""
        pid, process = None, None
        try:
            pid = self.pid
            process = getattr(getattr(self.manager, "provisioner", None), "process", None)
        except Exception:
            pass
        try:
            if self.client is not None:
                self.client.stop_channels()
        except Exception:
            pass
        self.client = None  # its __del__ would otherwise run during interpreter teardown and log noise
        try:
            self.manager.shutdown_kernel(now=False)
        except Exception:
            try:
                self.manager.shutdown_kernel(now=True)
            except Exception:
                pass
        if process is not None and process.poll() is not None and process.returncode < 0 \
                and -process.returncode not in (signal.SIGKILL, signal.SIGTERM):
            # xpython 0.14.3 is known to crash while exiting; worth a line, never a failed benchmark.
            progress(f"{self.kernel_name} (pid {pid}) died from signal {-process.returncode} while shutting down")
        if pid is not None:
            try:
                os.killpg(pid, signal.SIGKILL)  # anything the kernel left in its process group
            except (ProcessLookupError, PermissionError):
                pass


def start_kernels(kernel_name: str, count: int, env: Optional[dict] = None, parallel: int = 16,
                  ready_timeout: float = 180.0, attempts: int = 3) -> tuple[list[RunningKernel], int]:
    """Starts `count` kernels, `parallel` at a time; returns (the ones that answered kernel_info, failures).

    jupyter_client picks a kernel's five TCP ports by binding port 0 and letting go, so among many parallel starts
    a port can be taken by another start, or by a client's outgoing connection, before its kernel binds it; the
    kernel (ipykernel, xpython) then dies at start with "Address already in use". Such a start is tried again with
    new ports, up to `attempts` times. A start that has not ended `ready_timeout` plus a minute after it began is
    given up and its process group killed, so that a wedged start costs the run one failure, not the run: the
    starts run in daemon threads for that reason (a thread pool's threads are joined at exit).
    """
    import queue
    import threading
    slots = threading.BoundedSemaphore(max(1, min(parallel, count)))
    outcomes: queue.Queue = queue.Queue()
    in_flight: dict[int, tuple[RunningKernel, float]] = {}
    given_up: set[int] = set()
    in_flight_lock = threading.Lock()

    def start_one(index: int) -> None:
        with slots:
            error: Optional[BaseException] = None
            for attempt in range(1, attempts + 1):
                with in_flight_lock:
                    if index in given_up:
                        return
                    kernel = RunningKernel(kernel_name, env, ready_timeout, start=False)
                    in_flight[index] = (kernel, time.monotonic())
                try:
                    kernel.start()
                except Exception as failure:  # noqa: BLE001 - tried again, then counted
                    error = failure
                    with in_flight_lock:
                        in_flight.pop(index, None)
                        if index in given_up:
                            return
                    if attempt < attempts:
                        progress(f"{kernel_name}: start failed ({type(failure).__name__}: {failure}); "
                                 f"trying again ({attempt + 1} of {attempts})")
                    continue
                with in_flight_lock:
                    in_flight.pop(index, None)
                    abandoned = index in given_up
                if abandoned:
                    kernel.stop()  # came up after it was counted as failed: nobody would stop it otherwise
                else:
                    outcomes.put((index, kernel, None))
                return
            outcomes.put((index, None, error))

    for index in range(count):
        threading.Thread(target=start_one, args=(index,), name=f"start-{kernel_name}-{index}", daemon=True).start()
    kernels, failures = [], 0
    give_up_after = ready_timeout + 60.0
    while len(kernels) + failures < count:
        try:
            index, kernel, error = outcomes.get(timeout=5.0)
        except queue.Empty:
            now = time.monotonic()
            with in_flight_lock:  # a start marked given up here never reports: it stops what it started
                wedged = [(index, kernel) for index, (kernel, began) in in_flight.items()
                          if now - began > give_up_after and index not in given_up]
                given_up.update(index for index, _ in wedged)
            for index, kernel in wedged:
                failures += 1
                progress(f"{kernel_name}: start {index} not ready after {give_up_after:.0f} s; killing it")
                kernel.kill()
            continue
        if kernel is not None:
            kernels.append(kernel)
        else:
            failures += 1
            progress(f"{kernel_name}: start failed: {type(error).__name__}: {error}")
    return kernels, failures


def stop_kernels(kernels: list[RunningKernel]) -> None:
    from concurrent.futures import ThreadPoolExecutor
    if not kernels:
        return
    with ThreadPoolExecutor(max_workers=min(16, len(kernels))) as pool:
        list(pool.map(lambda k: k.stop(), kernels))


def execute_round_trip(client, code: str, timeout: float = 60.0) -> tuple[float, list[dict]]:
    """Milliseconds from sending execute_request to its `status: idle` on IOPub, and the IOPub messages for it.

    The shell reply is collected after the clock stops, so replies never pile up in the client.
    """
    import queue
    start = time.perf_counter()
    msg_id = client.execute(code, store_history=True)
    messages = []
    deadline = start + timeout
    while True:
        remaining = deadline - time.perf_counter()
        if remaining <= 0:
            raise TimeoutError(f"no idle for {code[:30]!r} within {timeout} s")
        try:
            message = client.get_iopub_msg(timeout=remaining)
        except queue.Empty:
            continue
        if message.get("parent_header", {}).get("msg_id") != msg_id:
            continue
        if message["msg_type"] == "status" and message["content"].get("execution_state") == "idle":
            elapsed = (time.perf_counter() - start) * 1000.0
            break
        messages.append(message)
    while True:
        reply = client.get_shell_msg(timeout=timeout)
        if reply.get("parent_header", {}).get("msg_id") == msg_id:
            break
    if reply["content"].get("status") != "ok":
        raise RuntimeError(f"{code[:30]!r}: {reply['content'].get('ename')}: {reply['content'].get('evalue')}")
    return elapsed, messages


class ServerProcess:
    """A server (cellblock-gateway, jupyter server) in its own process group, output to a log file."""

    def __init__(self, name: str, argv: list[str], env: dict, log_path: Path):
        self.name = name
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.process = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        env=env, start_new_session=True)

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def wait_http(self, url: str, timeout: float = 60.0, headers: Optional[dict] = None) -> None:
        import requests
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                if requests.get(url, headers=headers, timeout=2).status_code < 500:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{self.name}: {url} not answering within {timeout} s:\n{self.log_tail()}")

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM to the server alone first, so that it shuts its kernels down itself; then the whole group."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                progress(f"{self.name} (pid {self.pid}) still running {timeout:g} s after SIGTERM; killing its group")
        stop_process(self.process, 2.0)
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # kernels it may have left in its process group
        except (ProcessLookupError, PermissionError):
            pass
        self._log.close()


class KernelServer:
    """REST + WebSocket client of one running kernel server (cellblock-gateway or Jupyter Server)."""

    def __init__(self, label: str, base_url: str, token: str, server: ServerProcess):
        import requests
        self.label = label
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.server = server
        self.http = requests.Session()
        self.http.headers["Authorization"] = f"token {token}"

    def create_kernel(self, name: Optional[str] = None, timeout: float = 120.0) -> str:
        body = {"name": name} if name else {}
        response = self.http.post(f"{self.base_url}/api/kernels", json=body, timeout=timeout)
        if response.status_code not in (200, 201):
            raise RuntimeError(f"{self.label}: POST /api/kernels: {response.status_code} {response.text[:200]}")
        return response.json()["id"]

    def delete_kernel(self, kernel_id: str, timeout: float = 60.0) -> None:
        try:
            self.http.delete(f"{self.base_url}/api/kernels/{kernel_id}", timeout=timeout)
        except Exception:  # noqa: BLE001 - cleanup is best effort; the server is stopped afterwards anyway
            pass

    def list_kernels(self) -> list[dict]:
        return self.http.get(f"{self.base_url}/api/kernels", timeout=30).json()

    def connect(self, kernel_id: str, timeout: float = 60.0) -> "WebSocketKernel":
        return WebSocketKernel(f"{self.base_url.replace('http', 'ws', 1)}/api/kernels/{kernel_id}/channels",
                               self.token, timeout)

    def stop(self) -> None:
        self.http.close()
        self.server.stop()


class WebSocketKernel:
    """The Jupyter JSON-over-WebSocket protocol with websocket-client (which sets TCP_NODELAY on its socket)."""

    def __init__(self, url: str, token: str, timeout: float = 60.0):
        import uuid
        import websocket
        self.session_id = uuid.uuid4().hex
        # websocket-client validates UTF-8 in pure Python (~0.7 s per MiB of text) unless told not to: that would
        # measure the client, not the server. json.loads still rejects anything malformed.
        self.ws = websocket.create_connection(f"{url}?session_id={self.session_id}",
                                              header=[f"Authorization: token {token}"], timeout=timeout,
                                              skip_utf8_validation=True)

    def send(self, msg_type: str, content: dict, channel: str = "shell") -> str:
        import datetime
        import json
        import uuid
        msg_id = uuid.uuid4().hex
        header = {"msg_id": msg_id, "msg_type": msg_type, "username": "bench", "session": self.session_id,
                  "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "version": "5.3"}
        self.ws.send(json.dumps({"header": header, "parent_header": {}, "metadata": {}, "content": content,
                                 "channel": channel, "buffers": []}))
        return msg_id

    def receive(self) -> dict:
        import json
        return json.loads(self.ws.recv())

    def kernel_info(self, timeout: float = 60.0) -> dict:
        """Sends kernel_info_request until a reply comes (Jupyter Server may drop the very first one)."""
        import websocket
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            msg_id = self.send("kernel_info_request", {})
            self.ws.settimeout(2.0)
            try:
                while True:
                    message = self.receive()
                    if message.get("parent_header", {}).get("msg_id") == msg_id and \
                            message.get("msg_type") == "kernel_info_reply":
                        return message
            except websocket.WebSocketTimeoutException:
                continue
            finally:
                self.ws.settimeout(timeout)
        raise TimeoutError("no kernel_info_reply over the WebSocket")

    def execute(self, code: str, timeout: float = 60.0) -> tuple[float, list[dict]]:
        """Milliseconds from sending execute_request to its `status: idle`; then waits for the execute_reply."""
        self.ws.settimeout(timeout)
        start = time.perf_counter()
        msg_id = self.send("execute_request", {"code": code, "silent": False, "store_history": True,
                                               "user_expressions": {}, "allow_stdin": False, "stop_on_error": True})
        messages, elapsed, reply = [], None, None
        while elapsed is None or reply is None:
            message = self.receive()
            if message.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            if message.get("msg_type") == "status" and message["content"].get("execution_state") == "idle":
                elapsed = (time.perf_counter() - start) * 1000.0
            elif message.get("msg_type") == "execute_reply":
                reply = message
            else:
                messages.append(message)
        if reply["content"].get("status") != "ok":
            raise RuntimeError(f"{code[:30]!r}: {reply['content'].get('ename')}: {reply['content'].get('evalue')}")
        return elapsed, messages

    def close(self) -> None:
        try:
            self.ws.close()
        except Exception:  # noqa: BLE001
            pass


# Makes Jupyter Server's kernel WebSocket handler set TCP_NODELAY (it does not by default: Nagle + delayed ACK cost
# ~40 ms per message). Loaded as jupyter_server_config.py from a private JUPYTER_CONFIG_DIR.
_JUPYTER_SERVER_NODELAY_CONFIG = '''
from jupyter_server.services.kernels.handlers import ZMQChannelsHandler as _Handler
_original_open = _Handler.open
def _open_with_nodelay(self, kernel_id):
    self.set_nodelay(True)
    return _original_open(self, kernel_id)
_Handler.open = _open_with_nodelay
'''


# Jupyter Server 2.x (PyPI) serves kernel WebSockets from another handler.
_JUPYTER_SERVER_2_NODELAY_CONFIG = '''
from jupyter_server.services.kernels.websocket import KernelWebsocketHandler as _Handler
_original_open = _Handler.open
async def _open_with_nodelay(self, kernel_id):
    self.set_nodelay(True)
    return await _original_open(self, kernel_id)
_Handler.open = _open_with_nodelay
'''


def _pypi_peer_env(workdir: Path) -> dict:
    """The environment of a PyPI peer: its own venv's kernelspecs (ipykernel 7.x as `python3`), not Debian's."""
    env = {k: v for k, v in os.environ.items() if k != "JUPYTER_PATH"}
    return dict(env, JUPYTER_CONFIG_DIR=str(workdir / "config"), JUPYTER_RUNTIME_DIR=str(workdir / "runtime"),
                JUPYTER_DATA_DIR=str(workdir / "data"))


def start_jupyter_server(workdir: Path, nodelay: bool, extra_env: Optional[dict] = None,
                         timeout: float = 90.0, pypi: bool = False) -> KernelServer:
    """Jupyter Server on a free port with a private config/runtime dir under `workdir` (caller removes it): Debian's
    1.23 with ipykernel 6.17, or with `pypi` the 2.x of the peers' venv with its ipykernel 7.x."""
    import secrets
    workdir.mkdir(parents=True, exist_ok=True)
    config_dir = workdir / "config"
    config_dir.mkdir(parents=True, exist_ok=True)
    nodelay_config = _JUPYTER_SERVER_2_NODELAY_CONFIG if pypi else _JUPYTER_SERVER_NODELAY_CONFIG
    (config_dir / "jupyter_server_config.py").write_text(nodelay_config if nodelay else "")
    port, token = free_port(), secrets.token_hex(16)
    if pypi:
        env, python = dict(_pypi_peer_env(workdir), **(extra_env or {})), str(peers_venv() / "bin" / "python")
    else:
        env = dict(os.environ, JUPYTER_CONFIG_DIR=str(config_dir), JUPYTER_RUNTIME_DIR=str(workdir / "runtime"),
                   JUPYTER_DATA_DIR=str(workdir / "data"), **(extra_env or {}))
        python = DEBIAN_PYTHON
    argv = [python, "-m", "jupyter_server", "--no-browser", "--allow-root", "--ip=127.0.0.1",
            f"--port={port}", f"--ServerApp.token={token}", f"--ServerApp.root_dir={workdir}",
            "--ServerApp.port_retries=0", "--log-level=WARN"]
    name = f"jupyter server {peer_version('jupyter_server') if pypi else '1.23'}{' (nodelay)' if nodelay else ''}"
    server = ServerProcess(name, argv, env, workdir / f"jupyter-server-{port}.log")
    try:
        server.wait_http(f"http://127.0.0.1:{port}/api/status", timeout, {"Authorization": f"token {token}"})
    except Exception:
        server.stop()
        raise
    return KernelServer(server.name, f"http://127.0.0.1:{port}", token, server)


def start_kernel_gateway(workdir: Path, timeout: float = 90.0, port: Optional[int] = None,
                         token: Optional[str] = None, extra_args: Optional[list[str]] = None) -> KernelServer:
    """The Jupyter Kernel Gateway (PyPI, the peers' venv) on a free port (or `port`), its default kernel the venv's
    ipykernel; the token (random unless given) travels in KG_AUTH_TOKEN, as its documentation says."""
    import secrets
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config").mkdir(exist_ok=True)
    port, token = port or free_port(), token or secrets.token_hex(16)
    env = dict(_pypi_peer_env(workdir), KG_AUTH_TOKEN=token)
    argv = [str(peers_venv() / "bin" / "jupyter-kernelgateway"), "--KernelGatewayApp.ip=127.0.0.1",
            f"--KernelGatewayApp.port={port}", "--KernelGatewayApp.port_retries=0", "--log-level=WARN",
            *(extra_args or [])]
    server = ServerProcess(f"kernel gateway {peer_version('jupyter_kernel_gateway')}", argv, env,
                           workdir / f"kernel-gateway-{port}.log")
    try:
        server.wait_http(f"http://127.0.0.1:{port}/api", timeout, {"Authorization": f"token {token}"})
    except Exception:
        server.stop()
        raise
    return KernelServer(server.name, f"http://127.0.0.1:{port}", token, server)


def gateway_binary() -> Path:
    return cellblock_prefix() / "bin" / "cellblock-gateway"


def start_gateway(workdir: Path, extra_args: Optional[list[str]] = None, extra_env: Optional[dict] = None,
                  timeout: float = 90.0, port: Optional[int] = None, token: Optional[str] = None) -> KernelServer:
    """The installed cellblock-gateway on a free port (or `port`, e.g. to restart on a state directory), runtime
    and workspaces under `workdir` (caller removes it); a random token unless `token`."""
    import secrets
    workdir.mkdir(parents=True, exist_ok=True)
    port, token = port or free_port(), token or secrets.token_hex(16)
    env = dict(os.environ, **(extra_env or {}))
    argv = [str(gateway_binary()), "--ip", "127.0.0.1", "--port", str(port), "--token", token,
            "--state-dir", str(workdir / "state"), "--shutdown-kernels-on-exit",
            "--runtime-dir", str(workdir / "runtime"), "--workspace-root", str(workdir / "workspaces"),
            *(extra_args or [])]
    server = ServerProcess("cellblock-gateway", argv, env, workdir / f"gateway-{port}.log")
    try:
        server.wait_http(f"http://127.0.0.1:{port}/api", timeout, {"Authorization": f"token {token}"})
    except Exception:
        server.stop()
        raise
    return KernelServer("cellblock-gateway", f"http://127.0.0.1:{port}", token, server)
