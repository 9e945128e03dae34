#!/usr/bin/env python3
"""The project's gateway client conformance suites against cellblock-gateway and the Jupyter Kernel Gateway 3.0:
the same tests, unchanged, against each server, each suite on a fresh server in a temporary directory.

    /usr/bin/python3 tests/bench/conformance_peers.py [--suites lab-services,gateway-api] [--targets 0,1,2]
                                                      [--json PATH] [--keep]
    /usr/bin/python3 tests/bench/conformance_peers.py --report PATH   # the tables of a saved --json again

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

Targets: 0 cellblock-gateway ($CELLBLOCK_PREFIX's, its default kernelspec cellblock-python); 1 the Jupyter Kernel
Gateway of the peers' venv (tests/requirements-peers.txt) as shipped, its default kernelspec the venv's ipykernel;
2 the same with list_kernels on. All with their defaults otherwise and the token the tests/gateway harness uses;
readiness is each server's HTTP API answering (polled). Prints the scores as a table and as JSON (stdout, every
test's outcome with --json), and every test whose outcome differs between the servers with the first line of its
failure and EXPLAINED's why. Every process started is stopped, every temporary directory removed (unless --keep).
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
# "setting": KG as shipped refuses GET /api/kernels (list_kernels); the test passes with that setting on.
BEARER = ("extension", "`Authorization: Bearer <token>` (Jupyter Server 2's form) is refused with 401: KG takes "
          "`?token=` and `Authorization: token <token>` only, as its API documents")
HEAD_401 = ("extension", "cellblock answers a request without the token from its head; KG reads the announced "
            "8 MB body first (no answer within 5 s): hardening, not KG's API")
EXPLAINED: dict[str, tuple[str, str]] = {
    "lab-services::a wrong token is refused with 401 and the server keeps serving":
        ("setting", "the wrong token does get 401; the same listing with the right token is 403"),
    "lab-services::shutdown removes the kernel from the server":
        ("setting", "the kernel is gone (404); the listing that checks it is 403"),
    "lab-services-reconnect::the kernel connection survives a gateway kill -9 and restart with its state":
        ("extension", "re-adopting kernels after the gateway was killed is cellblock's; a new KG knows none of "
                      "the old one's kernels, so the client never reconnects"),
    "kernel-conformance::GatewayKernelConformance::test_history":
        ("kernel", "ipykernel answers a history `range` request for the current session with session number 0 "
                   "(IPython's in-memory history); ipykernel 7.4 and Debian's 6.17 do the same over ZeroMQ without "
                   "a gateway"),
    "gateway-api::test_rest::test_api_root_and_status":
        ("extension", "`/api/status` is Jupyter Server's; KG's API has no such endpoint (404)"),
    "gateway-api::test_rest::test_token_is_required_and_accepted_in_every_form": BEARER,
    "gateway-api::test_websocket::test_websocket_upgrade_requires_token": BEARER,
    "gateway-api::test_rest::test_kernelspecs_models":
        ("extension", "`/api/kernelspecs/python` as an alias of `python3` is cellblock's; KG answers 404"),
    "gateway-api::test_rest::test_kernel_lifecycle":
        ("extension", "as shipped the listing is 403 (setting); with it on, KG answers the restart at once with "
                      "`execution_state: starting`, where cellblock answers once the new kernel does (`idle`); "
                      "KG's API promises no state. Later steps not reached"),
    "gateway-api::test_rest::test_post_errors":
        ("kg", "an unknown kernelspec, a non-string env value, invalid UTF-8 and a JSON array all get 500 "
               "`Unknown server error` with a Python traceback in the body (cellblock: 500 naming NoSuchKernel, "
               "400 for the rest)"),
    "gateway-api::test_rest::test_unknown_and_malformed_ids":
        ("extension", "400 `bad_path` for a percent-encoded NUL or `/` in a kernel id is cellblock's; KG answers "
                      "404, as for an unknown id"),
    "gateway-api::test_rest::test_oversized_body_is_413_and_gateway_keeps_serving":
        ("extension", "cellblock's request body cap (413); KG (Tornado's 100 MB default) accepts the 9 MiB body "
                      "and starts a kernel"),
    "gateway-api::test_rest::test_a_body_without_a_token_is_refused_before_it_is_read": HEAD_401,
    "gateway-api::test_security::test_requests_without_the_token_are_answered_from_their_head_without_reading_the_"
    "body": HEAD_401,
    "gateway-api::test_rest::test_sessions_crud_in_jupyter_server_shape":
        ("kg", "KG 3.0 answers sessions as `{id, notebook: {path}, kernel}`, not the `{id, path, name, type, "
               "kernel}` its own swagger.yaml documents (and Jupyter Server serves)"),
    "gateway-api::test_rest::test_no_cors_headers_by_default":
        ("kg", "KG sends an empty `Access-Control-Allow-Origin:` on every response; harmless (it allows no "
               "origin)"),
    "gateway-api::test_websocket::test_client_quirks_are_accepted[no_msg_id]":
        ("extension", "a client message without `header.msg_id` gets no reply from KG (KeyError in its channel "
                      "handler); cellblock fills one in. Tolerance of a malformed message"),
    "gateway-api::test_websocket::test_outputs_arrive_before_the_reply_even_when_large":
        ("extension", "KG relays shell and IOPub independently, so `execute_reply` overtakes outputs of 100-450 KB; "
                      "the protocol does not order the two channels, cellblock does. A client that stops at the "
                      "reply (OpenHands) misses output on KG"),
    "gateway-api::test_websocket::test_bad_frames_get_clear_errors_and_do_not_disturb_others":
        ("extension", "cellblock answers a malformed frame with a `rejected` note and keeps the connection; KG "
                      "closes the WebSocket (JSONDecodeError in its handler)"),
    "gateway-api::test_websocket::test_the_kernels_own_cellblock_requests_are_refused_from_clients":
        ("extension", "the `cellblock_*` control messages are cellblock's; KG forwards them to the kernel, which "
                      "ignores them"),
    "gateway-api::test_websocket::test_kernel_death_is_reported_and_kernel_restarted":
        ("extension", "after an automatic restart cellblock publishes `idle` once the new kernel is up; KG sends "
                      "`restarting` and then nothing until asked, though its new kernel answers the same "
                      "WebSocket 3 s after the kill, state fresh (checked by hand)"),
    "gateway-api::test_websocket::test_rest_restart_keeps_websocket_attached":
        ("kg", "intermittent: KG answers the restart before its new kernel is connected (`starting`), and the "
               "execute sent at once on the open WebSocket got no reply within 60 s in 3 of 7 full runs against "
               "KG (either configuration; 0 of 9 when run alone)"),
    "gateway-api::test_websocket::test_kernel_environment":
        ("extension", "`KERNEL_ID` and `CELLBLOCK_WORKSPACE` in the kernel's environment are cellblock's; KG passes "
                      "KERNEL_* and sets KERNEL_GATEWAY=1 (and keeps its token and other variables out)"),
    "gateway-api::test_jupyter_server::test_jupyter_server_gateway_mode_creates_and_executes":
        ("setting", "the test checks the kernel through GET /api/kernels (403)"),
}


@dataclass
class Target:
    label: str
    kernel: str
    start: Callable[[Path, Optional[int]], benchlib.KernelServer]


# KG's default refuses GET /api/kernels and /api/sessions with 403 (JupyterWebsocketPersonality.list_kernels,
# KG_LIST_KERNELS: "Jupyter Notebook allows this by default but kernel gateway does not"); Jupyter Server and
# JupyterLab as its clients list kernels, so KG is measured as shipped and with that one setting on.
KG_LIST_KERNELS = "--JupyterWebsocketPersonality.list_kernels=True"


def start_kg_listing(workdir: Path, port: Optional[int]) -> benchlib.KernelServer:
    server = benchlib.start_kernel_gateway(workdir, port=port, token=TOKEN, extra_args=[KG_LIST_KERNELS])
    listing = server.http.get(f"{server.base_url}/api/kernels", timeout=30)
    if listing.status_code != 200:  # KG only warns about a setting it does not know: make sure this one took
        stop_server(server)
        raise RuntimeError(f"{KG_LIST_KERNELS} did not enable GET /api/kernels: {listing.status_code}")
    return server


def targets() -> list[Target]:
    kg = f"kernel gateway {benchlib.peer_version('jupyter_kernel_gateway')}"
    ipykernel = f"ipykernel {benchlib.peer_version('ipykernel')} (the peers' venv; KG's default kernelspec)"
    return [
        Target("cellblock-gateway", "cellblock-python (the gateway's default kernelspec)",
               lambda workdir, port: benchlib.start_gateway(workdir, port=port, token=TOKEN)),
        Target(kg, ipykernel, lambda workdir, port: benchlib.start_kernel_gateway(workdir, port=port, token=TOKEN)),
        Target(f"{kg}, list_kernels on", ipykernel, start_kg_listing),
    ]


def installed_gateway() -> str:
    """Which cellblock-gateway ran: its path and modification time (the staged install may be newer than HEAD)."""
    binary = benchlib.gateway_binary()
    stamp = datetime.datetime.fromtimestamp(binary.stat().st_mtime, datetime.timezone.utc)
    head = subprocess.run(["git", "-C", str(benchlib.REPO_ROOT), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip()
    return f"{binary}, installed {stamp:%Y-%m-%d %H:%M} UTC, repository at {head or 'unknown'}"


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
        return f"error: {result['error'].splitlines()[0][:200]}"
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
        if extensions[suite] and any(set(by_target[label]["tests"]) - extensions[suite] for label in labels):
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
    parser.add_argument("--targets", default="0,1,2", help="comma-separated indices: 0 cellblock-gateway, 1 the "
                        "Kernel Gateway as shipped, 2 the Kernel Gateway with list_kernels on (default: all)")
    parser.add_argument("--json", type=Path, help="also write the JSON to this file")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (logs, JUnit files)")
    parser.add_argument("--report", type=Path, help="run nothing: print the tables of a saved --json file with "
                        "this file's EXPLAINED (after reading new failures)")
    args = parser.parse_args()
    if args.report:
        saved = json.loads(args.report.read_text())
        labels = list(saved["targets"])
        print(markdown(saved["suites"], labels, differences(saved["suites"], labels)))
        return 0
    suites = [s.strip() for s in args.suites.split(",") if s.strip()]
    if unknown := set(suites) - set(SUITES):
        parser.error(f"unknown suites: {', '.join(sorted(unknown))}")
    benchlib.use_installed_kernelspecs()
    node = None
    if any(s in ("lab-services", "lab-services-reconnect", "classic-notebook") for s in suites):
        from bench_live_page import node_clients_ready
        node = node_clients_ready()
    every_target = targets()
    chosen = [t for index, t in enumerate(every_target) if str(index) in args.targets.split(",")]
    labels = [t.label for t in chosen]
    scratch = Path(tempfile.mkdtemp(prefix="conformance-peers-"))
    # IPython's history database and profile of the KG's ipykernel go here, not to the user's ~/.ipython.
    os.environ["IPYTHONDIR"] = str(scratch / "ipython")
    began = datetime.datetime.now(datetime.timezone.utc)
    # Others may reinstall the staged tree while this runs: a change is reported, since cellblock's suites would
    # then have met two builds.
    gateway_before = installed_gateway()
    results: dict[str, dict] = {}
    try:
        for suite in suites:
            results[suite] = {}
            for target in chosen:
                progress(f"conformance: {suite} against {target.label}")
                # Short names: cellblock's ipc socket paths under its runtime dir must fit in 107 bytes.
                workdir = scratch / f"{SUITES.index(suite)}{every_target.index(target)}"
                try:
                    results[suite][target.label] = run_suite(suite, target, workdir, node)
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
              "targets": {t.label: t.kernel for t in chosen}, "cellblock_gateway": gateway_before,
              "suites": results, "differences": found}
    if (gateway_after := installed_gateway()) != gateway_before:
        report["cellblock_gateway_at_the_end"] = gateway_after
        progress(f"conformance: cellblock-gateway changed during the run: {gateway_before} -> {gateway_after}")
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
