"""Shared pieces of the cellblock benchmarks: sample statistics, the side-by-side table, process hygiene.

Every benchmark measures cellblock and the peer a user would pick instead (ipykernel, Jupyter Server, a plain
interpreter) in the same run, on the same machine, and reports medians, p99 and the ratio peer/ours.
"""
from __future__ import annotations

import math
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
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
    return f"{stats.median:.1f} {unit}" if stats.n == 1 else f"{stats.median:.1f} ({stats.p99:.1f}) {unit}"


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


def pss_kib(pid: int) -> int:
    """Proportional set size of one process in KiB (smaps_rollup), 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def descendants(pid: int) -> list[int]:
    """pid and every process below it (via /proc/*/stat ppid links)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
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
