#!/usr/bin/env python3
"""The project's gateway client conformance suites against cellblock-gateway and the Jupyter Kernel Gateway 3.0
(issue 40): the same tests, unchanged, against each server, each suite on a fresh server in a temporary directory.

    /usr/bin/python3 tests/bench/conformance_peers.py [--suites lab-services,gateway-api] [--json PATH] [--keep]

Suites (tests/gateway/clients/README.md and tests/gateway/README.md say what each test checks):
  lab-services            tests/gateway/clients/lab-services.test.js: @jupyterlab/services 7.6, node --test
  lab-services-reconnect  tests/gateway/clients/lab-services-reconnect.test.js: the same library across a kill -9 of
                          the server and a new one on the same port (and, for cellblock, the same state directory)
  classic-notebook        tests/gateway/clients/classic-notebook.test.js: Debian's Notebook 6.4 with --gateway-url,
                          in headless Chromium
  gateway-api             tests/gateway/test_{rest,websocket,agent_frameworks,jupyter_server,security}.py, the tests
                          that need only a running server (conformance_target.py points the harness at it)
  kernel-conformance      jupyter_kernel_test's 12 checks through the server's WebSocket (conformance_kernel_ws.py)
Not run: jupyterlab.test.js and live-page.test.js test the agent API (/agent/v1), which is cellblock's own.

The Kernel Gateway is the peers' venv's (tests/requirements-peers.txt) with its default kernelspec, the venv's
ipykernel; cellblock-gateway is $CELLBLOCK_PREFIX's with its default, cellblock-python. Both run with their
defaults and the token the tests/gateway harness uses. Prints the scores as a table and as JSON (stdout), and for
every test whose outcome differs between the servers the first line of its failure; EXPLAINED says why, for those
read so far. Every process started is stopped, every temporary directory removed (unless --keep).
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
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import benchlib
from benchlib import progress

HERE = Path(__file__).resolve().parent
CLIENTS_DIR = HERE.parent / "gateway" / "clients"
GATEWAY_TESTS = HERE.parent / "gateway"
# tests/gateway's tests compare against the harness's token constant (gateway_harness.TOKEN), not only the
# gateway's: every server here gets that token, so those comparisons mean the same on both.
TOKEN = "test-token"
SUITE_TIMEOUT_S = 1200
GATEWAY_API_FILES = ["test_rest.py", "test_websocket.py", "test_agent_frameworks.py", "test_jupyter_server.py",
                     "test_security.py"]
SUITES = ["lab-services", "lab-services-reconnect", "classic-notebook", "gateway-api", "kernel-conformance"]

# Why a test's outcome differs between the servers, from reading its failure (REPORT.md's conformance section).
# "extension": what the test checks is cellblock's own, not the Kernel Gateway API; KG failing it is no
# conformance failure of KG. "kg": a Kernel Gateway 3.0 behaviour that a client of the API can notice.
# "kernel": the kernel behind the gateway (ipykernel 7.4 / cellblock-python), not the gateway.
EXPLAINED: dict[str, tuple[str, str]] = {}


@dataclass
class Target:
    label: str
    start: Callable[[Path, Optional[int]], benchlib.KernelServer]


def targets() -> list[Target]:
    return [
        Target("cellblock-gateway",
               lambda workdir, port: benchlib.start_gateway(workdir, port=port, token=TOKEN)),
        Target(f"kernel gateway {benchlib.peer_version('jupyter_kernel_gateway')}",
               lambda workdir, port: benchlib.start_kernel_gateway(workdir, port=port, token=TOKEN)),
    ]


# ------------------------------------------------------------------------------------------ processes
def process_identities(pids: list[int]) -> list[tuple[int, str]]:
    """(pid, start time) of each process: what a later kill checks, so a reused pid is never signalled."""
    found = []
    for pid in pids:
        try:
            found.append((pid, Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]))
        except (OSError, IndexError):
            pass
    return found


def kill_survivors(identities: list[tuple[int, str]]) -> None:
    """SIGKILL the processes of `identities` still running: kernels run in sessions of their own (both servers
    start them so), so a server that died or lingered can leave them outside its process group."""
    for pid, started in identities:
        if process_identities([pid]) == [(pid, started)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def kill_group(pgid: int) -> None:
    """What a finished suite left in its process group (a browser its test did not close)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def stop_server(server: benchlib.KernelServer) -> None:
    kernels = process_identities(benchlib.descendants(server.server.pid))
    server.stop()
    kill_survivors(kernels)


# ------------------------------------------------------------------------------------------ results
def junit_outcomes(path: Path) -> dict[str, dict]:
    """test name -> {"outcome": passed|failed|skipped, "message": first line of the failure} from pytest's
    --junitxml file."""
    outcomes = {}
    if not path.exists():
        return outcomes
    for case in ElementTree.parse(path).iter("testcase"):
        # The classname is the module (and class) path: its last part names the file or class.
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        failure = case.find("failure")
        if failure is None:
            failure = case.find("error")
        if failure is not None:
            message = (failure.get("message") or failure.text or "").strip().splitlines()
            outcomes[name] = {"outcome": "failed", "message": message[0][:300] if message else ""}
        elif case.find("skipped") is not None:
            outcomes[name] = {"outcome": "skipped", "message": (case.find("skipped").get("message") or "")[:300]}
        else:
            outcomes[name] = {"outcome": "passed", "message": ""}
    return outcomes


TAP_RESULT = re.compile(r"^(not ok|ok) \d+ - (.*?)(?: # (SKIP|TODO)\b.*)?$")


def tap_outcomes(path: Path) -> dict[str, dict]:
    """The same from node's TAP reporter (its JUnit reporter writes its file at the end, which --test-force-exit
    cuts off; TAP streams). Only top-level tests: these files have no nested ones."""
    outcomes, current = {}, None
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    for index, line in enumerate(lines):
        if match := TAP_RESULT.match(line):
            failed = match.group(1) == "not ok" and not match.group(3)
            current = match.group(2).replace("\\#", "#")
            outcomes[current] = {"outcome": "skipped" if match.group(3) else "failed" if failed else "passed",
                                 "message": ""}
        elif current and outcomes[current]["outcome"] == "failed" and line.startswith("  error: "):
            message = line[len("  error: "):].strip()
            if message in ("|-", "|", ">-") and index + 1 < len(lines):  # a multi-line message: its first line
                message = lines[index + 1].strip()
            outcomes[current]["message"] = message.strip("'\"")[:300]
    return outcomes


def suite_result(tests: dict[str, dict], returncode: Optional[int], seconds: float, log: Path) -> dict:
    counts = {kind: sum(1 for t in tests.values() if t["outcome"] == kind) for kind in ("passed", "failed", "skipped")}
    result = dict(counts, total=len(tests), seconds=round(seconds, 1), exit_status=returncode, tests=tests,
                  log=str(log))
    if not tests:
        result["error"] = f"no test results (exit status {returncode}); see {log}"
    return result


# ------------------------------------------------------------------------------------------ suites
def node_command(node: Path, script: str) -> list[str]:
    # --test-force-exit as tests/gateway/test_real_clients.py runs them: a socket left open must not hang the run.
    return [str(node), "--test", "--test-force-exit", "--test-reporter=tap", script]


def run_logged(argv: list[str], cwd: Path, env: dict, log: Path) -> Optional[int]:
    """Runs a suite to completion with its output in `log`; None if it outlived SUITE_TIMEOUT_S (then its process
    group is killed)."""
    with open(log, "wb") as output:
        process = subprocess.Popen(argv, cwd=cwd, env=env, stdout=output, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            return process.wait(timeout=SUITE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return None
        finally:
            benchlib.stop_process(process, 5.0)
            kill_group(process.pid)


def gateway_env(server: benchlib.KernelServer) -> dict:
    return dict(os.environ, GATEWAY_URL=server.base_url, GATEWAY_TOKEN=server.token,
                CONFORMANCE_GATEWAY_URL=server.base_url, CONFORMANCE_GATEWAY_TOKEN=server.token)


def run_lab_services(target: Target, workdir: Path, node: Path) -> dict:
    server = target.start(workdir / "server", None)
    try:
        started = time.monotonic()
        status = run_logged(node_command(node, "lab-services.test.js"), CLIENTS_DIR,
                            gateway_env(server), workdir / "node.log")
        return suite_result(tap_outcomes(workdir / "node.log"), status, time.monotonic() - started,
                            workdir / "node.log")
    finally:
        stop_server(server)


def run_reconnect(target: Target, workdir: Path, node: Path) -> dict:
    """As tests/gateway/test_real_clients.py drives it: the client defines `secret` and writes SYNC_DIR/ready; the
    server is SIGKILLed (alone) and a new one started on the same port and directory; SYNC_DIR/restarted tells the
    client, whose own reconnect must find the kernel with `secret`."""
    port, sync = benchlib.free_port(), workdir / "sync"
    sync.mkdir(parents=True)
    first = target.start(workdir / "server", port)
    second, orphans = None, []
    env = dict(gateway_env(first), SYNC_DIR=str(sync))
    log = open(workdir / "node.log", "wb")
    started = time.monotonic()
    client = subprocess.Popen(node_command(node, "lab-services-reconnect.test.js"),
                              cwd=CLIENTS_DIR, env=env, stdout=log, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + SUITE_TIMEOUT_S
        while not (sync / "ready").exists() and client.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)  # polls the client's own signal; the kill must come after `secret` exists
        if (sync / "ready").exists():
            orphans = process_identities(benchlib.descendants(first.server.pid))
            first.server.process.kill()
            first.server.process.wait()
            second = target.start(workdir / "server", port)
            (sync / "restarted").write_text("")
        status = client.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        status = None
    finally:
        benchlib.stop_process(client, 5.0)
        kill_group(client.pid)
        log.close()
        if second is not None:
            stop_server(second)
        stop_server(first)
        kill_survivors(orphans)
    return suite_result(tap_outcomes(workdir / "node.log"), status, time.monotonic() - started,
                            workdir / "node.log")


def start_classic_notebook(workdir: Path, server: benchlib.KernelServer) -> benchlib.ServerProcess:
    """Debian's Notebook 6.4 with --gateway-url, as tests/gateway/test_real_clients.py's notebook_server fixture:
    private config and runtime dirs, one empty notebook whose kernelspec is the gateway's default."""
    import nbformat
    specs = server.http.get(f"{server.base_url}/api/kernelspecs", timeout=30).json()
    spec = specs["kernelspecs"][specs["default"]]["spec"]
    root = workdir / "notebooks"
    root.mkdir(parents=True)
    notebook = nbformat.v4.new_notebook()
    notebook.cells.append(nbformat.v4.new_code_cell(""))
    notebook.metadata["kernelspec"] = {"name": specs["default"], "display_name": spec["display_name"],
                                       "language": spec["language"]}
    nbformat.write(notebook, root / "hello.ipynb")
    port = benchlib.free_port()
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(workdir / "config"), JUPYTER_RUNTIME_DIR=str(workdir / "runtime"))
    notebook_server = benchlib.ServerProcess("jupyter notebook", [
        benchlib.DEBIAN_PYTHON, "-m", "notebook", "--no-browser", "--allow-root", "--ip=127.0.0.1", f"--port={port}",
        "--port-retries=0", f"--NotebookApp.token={TOKEN}", f"--notebook-dir={root}",
        f"--gateway-url={server.base_url}", f"--GatewayClient.auth_token={server.token}"], env,
        workdir / "notebook.log")
    try:
        notebook_server.wait_http(f"http://127.0.0.1:{port}/api/status", 90, {"Authorization": f"token {TOKEN}"})
    except Exception:
        notebook_server.stop()
        raise
    notebook_server.url = f"http://127.0.0.1:{port}"
    return notebook_server


def run_classic_notebook(target: Target, workdir: Path, node: Path) -> dict:
    server = target.start(workdir / "server", None)
    notebook_server = None
    try:
        notebook_server = start_classic_notebook(workdir / "notebook", server)
        env = dict(gateway_env(server), NOTEBOOK_URL=notebook_server.url, NOTEBOOK_TOKEN=TOKEN,
                   NOTEBOOK_PATH="hello.ipynb", SCREENSHOT_PATH=str(workdir / "notebook.png"))
        started = time.monotonic()
        status = run_logged(node_command(node, "classic-notebook.test.js"), CLIENTS_DIR,
                            env, workdir / "node.log")
        return suite_result(tap_outcomes(workdir / "node.log"), status, time.monotonic() - started,
                            workdir / "node.log")
    finally:
        if notebook_server is not None:
            notebook_server.stop()
        stop_server(server)


def run_pytest(target: Target, workdir: Path, paths: list[Path], plugins: list[str]) -> dict:
    server = target.start(workdir / "server", None)
    try:
        env = gateway_env(server)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH", "")]))
        argv = [benchlib.DEBIAN_PYTHON, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider",
                f"--basetemp={workdir / 'pytest'}", f"--junitxml={workdir / 'junit.xml'}"]
        for plugin in plugins:
            argv += ["-p", plugin]
        started = time.monotonic()
        status = run_logged(argv + [str(p) for p in paths], benchlib.REPO_ROOT, env, workdir / "pytest.log")
        return suite_result(junit_outcomes(workdir / "junit.xml"), status, time.monotonic() - started,
                            workdir / "pytest.log")
    finally:
        stop_server(server)


def run_suite(suite: str, target: Target, workdir: Path, node: Optional[Path]) -> dict:
    workdir.mkdir(parents=True)
    if suite == "lab-services":
        return run_lab_services(target, workdir, node)
    if suite == "lab-services-reconnect":
        return run_reconnect(target, workdir, node)
    if suite == "classic-notebook":
        return run_classic_notebook(target, workdir, node)
    if suite == "gateway-api":
        return run_pytest(target, workdir, [GATEWAY_TESTS / name for name in GATEWAY_API_FILES],
                          ["conformance_target"])
    if suite == "kernel-conformance":
        return run_pytest(target, workdir, [HERE / "conformance_kernel_ws.py"], [])
    raise ValueError(f"unknown suite {suite}")


# ------------------------------------------------------------------------------------------ report
def differences(results: dict, labels: list[str]) -> list[dict]:
    """Every test whose outcome is not the same on all servers, with each side's failure and EXPLAINED's why."""
    found = []
    for suite, by_target in results.items():
        names = sorted({name for label in labels for name in by_target.get(label, {}).get("tests", {})})
        for name in names:
            seen = {label: by_target.get(label, {}).get("tests", {}).get(name, {"outcome": "not run", "message": ""})
                    for label in labels}
            if len({s["outcome"] for s in seen.values()}) > 1:
                kind, why = EXPLAINED.get(f"{suite}::{name}", ("", ""))
                found.append({"suite": suite, "test": name, "kind": kind, "why": why,
                              **{label: seen[label] for label in labels}})
    return found


def score(result: dict, exclude: set[str] = frozenset()) -> str:
    if "error" in result:
        return f"error: {result['error']}"
    tests = {n: t for n, t in result["tests"].items() if n not in exclude}
    passed = sum(1 for t in tests.values() if t["outcome"] == "passed")
    failed = sum(1 for t in tests.values() if t["outcome"] == "failed")
    skipped = len(tests) - passed - failed
    return f"{passed} / {failed} / {len(tests)}" + (f" ({skipped} skipped)" if skipped else "")


def markdown(results: dict, labels: list[str], found: list[dict]) -> str:
    lines = ["| suite | " + " | ".join(f"{label}: passed / failed / total" for label in labels) + " |",
             "|---|" + "---|" * len(labels)]
    extensions = {suite: {d["test"] for d in found if d["suite"] == suite and d["kind"] == "extension"}
                  for suite in results}
    for suite, by_target in results.items():
        lines.append(f"| {suite} | " + " | ".join(score(by_target[label]) for label in labels) + " |")
        if extensions[suite]:
            lines.append(f"| {suite} without cellblock's extensions | " +
                         " | ".join(score(by_target[label], extensions[suite]) for label in labels) + " |")
    lines += ["", "| suite | test | " + " | ".join(labels) + " | why |", "|---|---|" + "---|" * len(labels) + "---|"]
    for d in found:
        cells = [f"{d[label]['outcome']}" + (f": {d[label]['message'][:120]}" if d[label]["message"] else "")
                 for label in labels]
        why = f"{d['kind']}: {d['why']}" if d["kind"] else "(not yet explained)"
        lines.append(f"| {d['suite']} | `{d['test']}` | " + " | ".join(c.replace("|", "\\|") for c in cells) +
                     f" | {why} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suites", default=",".join(SUITES), help=f"comma-separated, of {', '.join(SUITES)}")
    parser.add_argument("--json", type=Path, help="also write the JSON to this file")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (logs, JUnit files)")
    args = parser.parse_args()
    suites = [s.strip() for s in args.suites.split(",") if s.strip()]
    if unknown := set(suites) - set(SUITES):
        parser.error(f"unknown suites: {', '.join(sorted(unknown))}")
    benchlib.use_installed_kernelspecs()
    node = None
    if any(s in ("lab-services", "lab-services-reconnect", "classic-notebook") for s in suites):
        from bench_live_page import node_clients_ready
        node = node_clients_ready()
    all_targets = targets()
    labels = [t.label for t in all_targets]
    scratch = Path(tempfile.mkdtemp(prefix="conformance-peers-"))
    # IPython's history database and profile of the KG's ipykernel go here, not to the user's ~/.ipython.
    os.environ["IPYTHONDIR"] = str(scratch / "ipython")
    began = datetime.datetime.now(datetime.timezone.utc)
    results: dict[str, dict] = {}
    try:
        for suite in suites:
            results[suite] = {}
            for target in all_targets:
                progress(f"conformance: {suite} against {target.label}")
                try:
                    results[suite][target.label] = run_suite(suite, target, scratch / suite / target.label, node)
                except Exception as failure:  # noqa: BLE001 - a server that would not start is that suite's result
                    results[suite][target.label] = {"error": f"{type(failure).__name__}: {failure}", "tests": {}}
                progress(f"conformance: {suite} against {target.label}: {score(results[suite][target.label])}")
    finally:
        if args.keep:
            progress(f"conformance: logs and JUnit files kept in {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    found = differences(results, labels)
    report = {"started_utc": began.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join([sys.executable] + sys.argv),
              "targets": labels, "kernels": {labels[0]: "cellblock-python (the gateway's default kernelspec)",
                                              labels[1]: f"ipykernel {benchlib.peer_version('ipykernel')} (the "
                                                         "peers' venv, the Kernel Gateway's default kernelspec)"},
              "suites": results, "differences": found}
    print(markdown(results, labels, found))
    # The counts on stdout; every test's outcome and failure line in --json.
    print(json.dumps({suite: {label: {k: r.get(k) for k in ("passed", "failed", "skipped", "total", "error")
                                      if k in r} for label, r in by_target.items()}
                      for suite, by_target in results.items()}, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 1 if any("error" in r for by_target in results.values() for r in by_target.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
