#!/usr/bin/env python3
"""Where the milliseconds of one kernel cold start go: process start -> first `1+1` execute_reply with a ready
worker, the default configuration (the worker forked from the tenant's running zygote template).

    /usr/bin/python3 tests/bench/start_timeline.py [--quick] [--starts N] [--template-traces N]

Each kernel is started as bench_kernel.py starts its zygote kind (its LaunchedKernel and LeanClient: the
kernelspec argv with a fresh connection file, kernel_info_request queued before the kernel binds, then a first
`1+1`), with bench_memory.py's kernelspec for the run's tenant and its template warmed before the timed starts.
Three kinds of start, interleaved round by round so that the shared machine's load hits all alike:

- plain: nothing added, the total only (what bench_kernel.py's "zygote worker" row measures);
- log: CELLBLOCK_LOG=debug, stderr to a file. The kernel's own log lines carry `ts` (system clock, the same clock
  as the client's time.time() and strace -ttt): `kernel_started` (kernel/src/launch/main.cpp: every socket bound,
  the worker's launch already begun, just before xeus starts serving), `message_in` per shell request
  (kernel/src/server/kernel_server_io.cpp), `worker_ready` with the launch's duration `ms`
  (kernel/src/worker/worker_supervisor.cpp; ts - ms is when the launcher thread began the launch);
- strace: the kernel run under `strace -f -ttt --seccomp-bpf -e trace=...` (only the listed syscalls stop the
  kernel, the rest run untraced) plus the same debug log. The points of the main table come from it:
  exec = the kernel's execve; main = main()'s first call, sched_setscheduler(SCHED_BATCH)
  (kernel/src/launch/scheduling.cpp); config read = the openat of the connection file (after the kernel config);
  sockets bound = the last AF_INET bind (the five public ZMQ sockets, bound before xeus and the worker start);
  launch requested = the launcher thread's first syscall (its openat of the sandbox policy); plan sent = its
  sendmsg of the launch plan to the template's socket (sandbox/src/zygote_client.cpp), after the policy, uid
  lease, workspace, root skeleton and cgroups were prepared; template answered = its recvmsg of `{"pid": ...}`
  and the pidfd (the template's clone is done); id maps written = its write of the release byte on the sync
  pipe after /proc/PID/uid_map and gid_map (sandbox/src/launcher.cpp); child confined = EOF on the error pipe
  (the forked child has joined its cgroups, mounted its root, pivot_root, dropped credentials, loaded seccomp
  and closed the pipe: sandbox/src/child.cpp); worker ready = the `worker_ready` log line (the worker's "ready"
  frame, sent by the template's Python code after the fork); execute_reply sent = the sendto whose frames carry
  `execute_reply`; the client's points are time.time() at Popen and at each reply's arrival.
- one more start (--template-traces, default 1) with `strace -f -ttt -p TEMPLATE` attached to the template
  (the kernel itself not traced), for the fork's own steps in the template and its child: clone, cgroup join
  (writes to the v1 `tasks` files or cgroup.procs), mounts up to pivot_root, hostname and loopback, the wait for
  the id maps, setsid/fds/rlimits, credentials and capabilities, seccomp, then the template's Python code after
  the fork until "ready". A process attached with -p stops at EVERY syscall (--seccomp-bpf cannot be used on
  it), and the child makes ~250 of them, each costing a round trip through strace (milliseconds each on a
  loaded 2-core machine): those figures are inflated many times and are reported with their syscall counts, to
  be read as shares, never as times.

strace's overhead: the traced kernel stops at ~300 syscalls of the listed kinds in a start (the untraced ones
run free), each a context switch to strace and back, and strace itself (fork, exec, ptrace setup) runs between
Popen and the kernel's execve, which the "Popen -> exec" row shows. The log-only and plain starts give the
totals without strace; the difference of the medians is strace's cost. /proc/PID/stat's start time was not
used: its resolution is a clock tick (10 ms), coarser than most phases.
Run alone, not part of run.py (whose glob takes bench_*.py) nor ctest: it needs root (strace of the root-owned
template) and strace, and a traced kernel is no smoke test.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import zmq

import benchlib
from benchlib import Stats, progress
from bench_kernel import LaunchedKernel, LeanClient
from bench_memory import ZYGOTE_KIND, cellblock_zygote, install_zygote_kernelspec, warm_template

EXECUTE = {"code": "1+1", "silent": False, "store_history": True, "user_expressions": {}, "allow_stdin": False,
           "stop_on_error": True}
KERNEL_SYSCALLS = ("execve,sched_setscheduler,openat,bind,connect,sendmsg,recvmsg,write,sendto,read,clone,clone3,"
                   "exit_group")
LINE = re.compile(r"^(\d+)\s+(\d+\.\d+)\s+(.*)$")

# The critical path of a start, in order: (key, phase name ending at that point).
CRITICAL_PATH = [
    ("exec", "Popen → kernel execve (fork + exec; under strace also strace's own start)"),
    ("main", "exec → main() (dynamic loading, static initialisers)"),
    ("config", "main → config read (kernel config + connection file parsed)"),
    ("bound", "config → ZMQ/xeus sockets bound (workspace, runtime dir, python probe started, 5 binds)"),
    ("launch", "sockets bound → worker launch requested (xeus kernel built, launcher thread started)"),
    ("plan_sent", "launch → plan sent to the template (policy, uid lease, workspace, root skeleton, cgroups)"),
    ("forked", "plan sent → template answered (its clone with new namespaces, pidfd back)"),
    ("released", "template answered → id maps written, child released"),
    ("confined", "child released → child confined (cgroup join, mounts, pivot_root, credentials, seccomp)"),
    ("ready", "child confined → worker ready (the template's Python after the fork, 'ready' frame)"),
    ("go", "worker ready → first execute_request received (0 unless the request comes later)"),
    ("reply_sent", "worker ready and request in → execute_reply sent (the `1+1` runs)"),
    ("reply_client", "execute_reply sent → at the client"),
]
OFF_PATH = [
    ("probed", "`python3 --version` probe exited (kernel_info_reply waits for it while no worker is ready)"),
    ("info_in", "kernel_info_request received (log)"),
    ("info_sent", "kernel_info_reply sent"),
    ("info_client", "kernel_info_reply at the client"),
    ("execute_in", "first execute_request received (log)"),
]


def log_points(path: Path) -> dict[str, float]:
    """The kernel's debug log: ts of kernel_started, the first kernel_info and execute requests, worker_ready
    (and the launch's start, ts - ms)."""
    points: dict[str, float] = {}
    for line in path.read_text(errors="replace").splitlines():
        if not line.startswith("{"):
            continue
        try:
            event = json.loads(line)
        except ValueError:
            continue
        name = event.get("event")
        if name == "kernel_started":
            points.setdefault("started_log", event["ts"])
        elif name == "message_in" and event.get("msg_type") == "kernel_info_request":
            points.setdefault("info_in", event["ts"])
        elif name == "message_in" and event.get("msg_type") == "execute_request":
            points.setdefault("execute_in", event["ts"])
        elif name == "worker_ready":
            points.setdefault("ready", event["ts"])
            points.setdefault("launch_log", event["ts"] - event["ms"] / 1000.0)
    return points


def strace_points(path: Path, connection_file: str, policy_file: str) -> dict[str, float]:
    """The kernel-side points of the critical path from `strace -f -ttt` output (see the module docstring)."""
    lines = []
    for raw in path.read_text(errors="replace").splitlines():
        match = LINE.match(raw)
        if match:
            lines.append((int(match.group(1)), float(match.group(2)), match.group(3)))
    if not lines:
        raise RuntimeError(f"empty strace output {path}")
    main_tid = lines[0][0]
    points = {"exec": lines[0][1]}
    launcher = None
    released = False
    probe = None
    for tid, ts, text in lines:
        if probe is None and text.startswith("execve(") and '"--version"' in text:
            probe = tid  # main.cpp's probe_python_version, run while the kernel starts
        elif tid == probe and text.startswith("exit_group("):
            points.setdefault("probed", ts)
        if "main" not in points and tid == main_tid and text.startswith("sched_setscheduler(0, SCHED_BATCH"):
            points["main"] = ts
        elif "config" not in points and text.startswith("openat(") and connection_file in text:
            points["config"] = ts
        elif tid == main_tid and text.startswith("bind(") and "AF_INET" in text and "launch" not in points:
            points["bound"] = ts
        elif launcher is None and text.startswith("openat(") and policy_file in text:
            launcher = tid
            points["launch"] = next(t for i, t, _ in lines if i == tid)
        elif tid == launcher and "plan_sent" not in points and text.startswith("sendmsg(") and "CBZ1" in text:
            points["plan_sent"] = ts
        elif tid == launcher and "forked" not in points and "recvmsg(" in text and '\\"pid\\"' in text:
            points["forked"] = ts
        elif tid == launcher and "forked" in points and re.match(r'write\(\d+, "\\1", 1\) = 1', text):
            points.setdefault("released", ts)
            released = True
        elif tid == launcher and released and "confined" not in points and re.search(r'read\(\d+, "", 8\) = 0|'
                                                                                   r'read resumed>"", 8\) = 0',
                                                                                   text):
            points["confined"] = ts
        elif "sendto(" in text and "info_sent" not in points and "kernel_info_reply" in text:
            points["info_sent"] = ts
        elif "sendto(" in text and "reply_sent" not in points and "execute_reply" in text:
            points["reply_sent"] = ts
    return points


def template_phases(path: Path) -> dict[str, tuple[float, int]]:
    """The fork's steps in the template's trace (strace -f -p TEMPLATE): {phase: (ms, syscalls in it)}."""
    lines = []
    for raw in path.read_text(errors="replace").splitlines():
        match = LINE.match(raw)
        if match:
            lines.append((int(match.group(1)), float(match.group(2)), match.group(3)))
    template = lines[0][0]
    received = next(ts for tid, ts, text in lines if tid == template and text.startswith("recvmsg(")
                    and "CBZ1" in text)
    child_lines = [(ts, text) for tid, ts, text in lines if tid != template and ts >= received]
    if not child_lines:
        raise RuntimeError("no forked child in the template's trace")
    child = next(tid for tid, ts, _ in lines if tid != template and ts >= received)
    child_lines = [(ts, text) for tid, ts, text in lines if tid == child]

    def first(predicate, after: float) -> float:
        return next(ts for ts, text in child_lines if ts >= after and predicate(text))

    # Each mark names the span from it to the next one.
    marks = [("clone (the template: plan received → the child's first syscall)", received),
             ("signal handlers reset", child_lines[0][0])]
    start = child_lines[0][0]
    steps = [
        ("cgroup join (tasks / cgroup.procs writes)", lambda t: t.startswith("openat(") and
         ("/tasks" in t or "cgroup.procs" in t)),
        ("mounts, pivot_root", lambda t: t.startswith("mount(")),
        ("hostname, loopback up, wait for the id maps", lambda t: t.startswith("sethostname(")),
        ("cgroup namespace, setsid, fds, rlimits", lambda t: re.match(r'read\(\d+, "\\1", 1\) = 1', t) is not None),
        ("credentials, capabilities, no_new_privs", lambda t: t.startswith("setgroups(")),
        ("seccomp, signal mask; Python after the fork until 'ready'", lambda t: t.startswith("seccomp(")),
    ]
    for name, predicate in steps:
        start = first(predicate, start)
        marks.append((name, start))
    ready = first(lambda t: "\\\"type\\\":\\\"ready\\\"" in t, start)
    marks.append(("end", ready))
    phases = {}
    for (name, begin), (_, end) in zip(marks, marks[1:]):
        count = sum(1 for ts, _ in child_lines if begin <= ts < end)
        phases[name] = ((end - begin) * 1000.0, count)
    return phases


def one_start(context: zmq.Context, workdir: Path, mode: str, policy_file: str) -> dict[str, float]:
    """One cold start; returns its points in ms after Popen (mode: plain, log, strace)."""
    env = {} if mode == "plain" else {"CELLBLOCK_LOG": "debug"}
    kernel = LaunchedKernel(ZYGOTE_KIND[1], workdir, env=env)
    trace = workdir / "kernel.strace"
    log = workdir / "kernel.log"
    argv = kernel.argv
    if mode == "strace":
        argv = ["strace", "-f", "-ttt", "-s", "400", "--seccomp-bpf", "-e", f"trace={KERNEL_SYSCALLS}",
                "-o", str(trace), "--", *argv]
    client = LeanClient(context, kernel.info)
    try:
        with open(log, "w") as stderr:
            started = time.time()
            kernel.process = subprocess.Popen(argv, env=kernel.env, start_new_session=True,
                                              stdout=subprocess.DEVNULL, stderr=stderr)
            client.wait_reply(client.send("kernel_info_request", {}), timeout=60)
            info_client = time.time()
            reply = client.wait_reply(client.send("execute_request", EXECUTE), timeout=60)
            reply_client = time.time()
        if reply.get("status") != "ok":
            raise RuntimeError(f"first execute failed: {reply}")
    finally:
        client.close()
        kernel.stop()
    points = {"info_client": info_client, "reply_client": reply_client}
    if mode != "plain":
        points.update(log_points(log))
    if mode == "strace":
        points.update(strace_points(trace, kernel.connection_file, policy_file))
        trace.unlink()
    if "ready" in points and "execute_in" in points:
        points["go"] = max(points["ready"], points["execute_in"])
    return {key: (value - started) * 1000.0 for key, value in points.items()}


def template_traced_start(context: zmq.Context, workdir: Path, policy_file: str, template: int) -> dict:
    """One start (kernel untraced, debug log) with strace attached to the template; its fork's phases."""
    trace = workdir / "template.strace"
    tracer = subprocess.Popen(["strace", "-f", "-ttt", "-s", "200", "-o", str(trace), "-p", str(template)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not (trace.exists() and trace.stat().st_size > 0):
            time.sleep(0.05)  # strace writes the template's current (blocked) syscall once it is attached
        points = one_start(context, workdir, "log", policy_file)
    finally:
        tracer.send_signal(signal.SIGINT)  # detaches; the template goes on
        try:
            tracer.wait(10)
        except subprocess.TimeoutExpired:
            tracer.kill()
            tracer.wait()
    try:
        return {"points": points, "phases": template_phases(trace)}
    except (RuntimeError, StopIteration, IndexError) as error:  # a step missing from the trace: say so
        progress(f"the template's trace has not every step: {error!r}")
        return {"points": points, "phases": {}}


def fmt(stats: Stats) -> tuple[str, str]:
    return f"{stats.median:.1f}", f"{stats.quantile(0.9):.1f}"


def phase_table(starts: list[dict[str, float]], total: Stats) -> list[str]:
    lines = ["| phase (critical path, strace) | median ms | p90 ms | share of the total |", "|---|---|---|---|"]
    previous = None
    for key, name in CRITICAL_PATH:
        values = [s[key] - (s[previous] if previous else 0.0) for s in starts if key in s
                  and (previous is None or previous in s)]
        previous = key
        if not values:
            lines.append(f"| {name} | – | – | – |")
            continue
        stats = Stats(values)
        median, p90 = fmt(stats)
        lines.append(f"| {name} | {median} | {p90} | {100.0 * stats.median / total.median:.0f} % |")
    median, p90 = fmt(total)
    lines.append(f"| **total, Popen → execute_reply at the client (strace)** | **{median}** | {p90} | 100 % |")
    return lines


def points_table(starts: list[dict[str, float]]) -> list[str]:
    # In the order the points come in a start (the medians of a noisy run need not be in that order).
    keys = ["exec", "main", "config", "bound", "launch", "probed", "started_log", "info_in", "plan_sent", "info_sent",
            "info_client", "execute_in", "forked", "released", "confined", "ready", "reply_sent", "reply_client"]
    names = {"exec": "kernel execve", "main": "main()", "config": "config read", "bound": "sockets bound",
             "launch": "worker launch requested", "plan_sent": "launch plan sent to the template",
             "forked": "template's fork answered (pidfd)", "released": "id maps written, child released",
             "confined": "child confined (error pipe closed)", "ready": "worker ready",
             "reply_sent": "execute_reply sent", "reply_client": "execute_reply at the client"}
    names.update(dict(OFF_PATH))
    names["started_log"] = "kernel_started logged (runtime dir marked, /tmp/cbk-* swept; xeus starts serving)"
    lines = ["| point (strace run) | ms after Popen, median | p90 |", "|---|---|---|"]
    for key in keys:
        values = [s[key] for s in starts if key in s]
        if values:
            median, p90 = fmt(Stats(values))
            lines.append(f"| {names[key]} | {median} | {p90} |")
    return lines


def log_table(starts: list[dict[str, float]], plain: list[dict[str, float]]) -> list[str]:
    """The coarse timeline from the debug log alone (no strace), and the plain totals."""
    spans = [
        ("Popen → worker launch begun (exec, main, config, sockets, xeus, launcher thread)",
         lambda s: s["launch_log"]),
        ("launch begun → worker ready (plan, template fork, confinement, Python after the fork)",
         lambda s: s["ready"] - s["launch_log"]),
        ("worker ready → first execute_request received (0 unless the request comes later)",
         lambda s: s["go"] - s["ready"]),
        ("worker ready and request in → execute_reply at the client", lambda s: s["reply_client"] - s["go"]),
        ("total, Popen → execute_reply at the client (debug log on)", lambda s: s["reply_client"]),
        ("(off the path) Popen → kernel_started logged", lambda s: s["started_log"]),
        ("(off the path) Popen → kernel_info_reply at the client", lambda s: s["info_client"]),
    ]
    lines = ["| phase (no strace; kernel debug log) | median ms | p90 ms |", "|---|---|---|"]
    for name, value in spans:
        samples = []
        for s in starts:
            try:
                samples.append(value(s))
            except KeyError:
                continue
        if samples:
            median, p90 = fmt(Stats(samples))
            lines.append(f"| {name} | {median} | {p90} |")
    for name, key in (("total, Popen → execute_reply at the client (plain: no log, no strace)", "reply_client"),
                      ("Popen → kernel_info_reply at the client (plain)", "info_client")):
        median, p90 = fmt(Stats([s[key] for s in plain]))
        lines.append(f"| **{name}** | **{median}** | {p90} |")
    return lines


def template_table(traced: list[dict]) -> list[str]:
    lines = ["| the fork's steps (strace -p on the template: every syscall stops; inflated) | ms | syscalls |"
             " share |", "|---|---|---|---|"]
    for run in traced:
        total = sum(ms for ms, _ in run["phases"].values())
        if not total:
            lines.append("| (the trace had not every step) | – | – | – |")
            continue
        for name, (ms, count) in run["phases"].items():
            lines.append(f"| {name} | {ms:.1f} | {count} | {100.0 * ms / total:.0f} % |")
        lines.append(f"| template's plan received → 'ready' sent | {total:.1f} | "
                     f"{sum(c for _, c in run['phases'].values())} | 100 % |")
    return lines


def commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(benchlib.REPO_ROOT), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 starts of each kind")
    parser.add_argument("--starts", type=int, help="starts of each kind (default 10, quick 3)")
    parser.add_argument("--template-traces", type=int, default=1,
                        help="extra starts with strace attached to the template (default 1; 0: none)")
    args = parser.parse_args()
    starts = args.starts or (3 if args.quick else 10)
    if shutil.which("strace") is None:
        progress("strace is not installed")
        return 1
    load_before = os.getloadavg()
    benchlib.use_installed_kernelspecs()
    context = zmq.Context()
    results: dict[str, list[dict[str, float]]] = {"plain": [], "log": [], "strace": []}
    traced: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench-start-timeline-") as tmp:
        workdir = Path(tmp)
        policy = install_zygote_kernelspec(workdir)
        try:
            template = warm_template(policy)
            one_start(context, workdir, "plain", str(policy))  # warm-up: page cache, the template's first fork
            for index in range(starts):
                for mode in results:  # interleaved: the machine's load hits every kind alike
                    results[mode].append(one_start(context, workdir, mode, str(policy)))
                progress(f"round {index + 1}/{starts}: plain {results['plain'][-1]['reply_client']:.1f} ms, "
                         f"log {results['log'][-1]['reply_client']:.1f}, "
                         f"strace {results['strace'][-1]['reply_client']:.1f}")
            for _ in range(args.template_traces):
                traced.append(template_traced_start(context, workdir, str(policy), template))
        finally:
            cellblock_zygote.stop_templates(policy)
    context.term()
    load_after = os.getloadavg()

    strace_total = Stats([s["reply_client"] for s in results["strace"]])
    plain_total = Stats([s["reply_client"] for s in results["plain"]])
    log_total = Stats([s["reply_client"] for s in results["log"]])
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    out = [f"### Cold start timeline ({starts} starts of each kind, {now}, commit {commit()})", "",
           f"Load average {load_before[0]:.1f} / {load_before[1]:.1f} / {load_before[2]:.1f} (1/5/15 min) before, "
           f"{load_after[0]:.1f} / {load_after[1]:.1f} / {load_after[2]:.1f} after. Totals, Popen → first `1+1` "
           f"execute_reply at the client, median (p90): plain {plain_total.median:.1f} ms "
           f"({plain_total.quantile(0.9):.1f}), debug log {log_total.median:.1f} "
           f"({log_total.quantile(0.9):.1f}), strace {strace_total.median:.1f} ({strace_total.quantile(0.9):.1f}); "
           f"strace median − plain median: {strace_total.median - plain_total.median:.1f} ms. Shares are of the "
           f"strace total; each phase is a median of its own, so the phases need not add up to the total.", ""]
    out += phase_table(results["strace"], strace_total) + [""]
    out += points_table(results["strace"]) + [""]
    out += log_table(results["log"], results["plain"]) + [""]
    if traced:
        out += template_table(traced) + [""]
        ready = [run["points"].get("ready", float("nan")) - run["points"].get("launch_log", float("nan"))
                 for run in traced]
        out.append("With strace on the template, launch begun → worker ready took "
                   + ", ".join(f"{value:.1f}" for value in ready)
                   + " ms (kernel's log) against the untraced median "
                   + f"{Stats([s['ready'] - s['launch_log'] for s in results['log']]).median:.1f} ms.")
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
