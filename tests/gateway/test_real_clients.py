"""Real Jupyter clients against cellblock-gateway.

Starts the installed `$CELLBLOCK_PREFIX/bin/cellblock-gateway` on a free port with a random token, then runs
  * tests/gateway/clients/lab-services.test.js: @jupyterlab/services (JupyterLab's client library) over the
    v1 WebSocket subprotocol: start, execute, streaming, interrupt, restart, legacy format, shutdown;
  * tests/gateway/clients/lab-services-reconnect.test.js: the same library across a gateway kill -9 and restart:
    its reconnect gets the kernel it had, with its variables;
  * tests/gateway/clients/classic-notebook.test.js: Debian's classic Notebook 6.4 with --gateway-url pointing at the
    gateway, in headless Chromium: open a notebook, type and run cells, see 42; screenshot in
    tests/artifacts/notebook.png;
  * tests/gateway/clients/jupyterlab.test.js: JupyterLab 4 (PyPI, in the peers' venv) with --gateway-url, attached to
    an agent session's kernel in headless Chromium: it sees the agent's variables, the agent sees its cells, and the
    agent's executes show as busy/idle; screenshot in tests/artifacts/jupyterlab.png.
The Node clients take any KG-compatible base URL and token. To run them against another server that speaks the
Kernel Gateway API (e.g. Jupyter Server 1.23 as a stand-in), set CELLBLOCK_TEST_GATEWAY_URL and
CELLBLOCK_TEST_GATEWAY_TOKEN; then no gateway is started.
"""
import hashlib
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
import requests

CLIENTS_DIR = Path(__file__).resolve().parent / "clients"
SOURCE_DIR = Path(os.environ.get("CELLBLOCK_SOURCE_DIR") or Path(__file__).resolve().parents[2])
ARTIFACTS_DIR = SOURCE_DIR / "tests" / "artifacts"
PREFIX = Path(os.environ["CELLBLOCK_PREFIX"]) if os.environ.get("CELLBLOCK_PREFIX") else None
GATEWAY_BINARY = PREFIX / "bin" / "cellblock-gateway" if PREFIX else None
EXTERNAL_GATEWAY_URL = os.environ.get("CELLBLOCK_TEST_GATEWAY_URL", "").rstrip("/")
EXTERNAL_GATEWAY_TOKEN = os.environ.get("CELLBLOCK_TEST_GATEWAY_TOKEN", "")
PYTHON = "/usr/bin/python3"  # Debian's, with notebook 6.4 (the pyenv python3 on PATH lacks it)
# JupyterLab 4 from PyPI (tests/requirements-peers.txt), in the venv share/scripts/test-venv.sh makes.
PEERS_VENV = Path(os.environ["CELLBLOCK_PEERS_VENV"]) if os.environ.get("CELLBLOCK_PEERS_VENV") else None

# Generous limits: CI is a loaded 2-core machine; none of these is a speed assertion.
STARTUP_TIMEOUT_S = 60
NODE_CLIENT_TIMEOUT_S = 300
NPM_CI_TIMEOUT_S = 600


def gateway_absent_reason() -> str | None:
    if EXTERNAL_GATEWAY_URL:
        return None
    if GATEWAY_BINARY is None:
        return "CELLBLOCK_PREFIX is not set, so there is no installed cellblock-gateway to test"
    if not os.access(GATEWAY_BINARY, os.X_OK):
        return f"cellblock-gateway is not installed at {GATEWAY_BINARY}"
    return None


@pytest.fixture(scope="module", autouse=True)
def gateway_installed():
    # Not a skip: real clients that did not run must not look green (tests/README.md, skip policy).
    reason = gateway_absent_reason()
    if reason is not None:
        pytest.fail(reason)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class ServerProcess:
    """A server child process whose combined output goes to a log file, stopped on exit."""

    def __init__(self, name: str, argv: list[str], log_path: Path, env: dict[str, str] | None = None):
        self.name = name
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.process = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, env=env, start_new_session=True)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def wait_until(self, ready, what: str, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"{self.name} exited with {self.process.returncode} before {what}:\n{self.log_tail()}")
            if ready():
                return
            time.sleep(0.1)
        pytest.fail(f"{self.name}: no {what} within {timeout_s} s:\n{self.log_tail()}")

    def assert_alive(self) -> None:
        assert self.process.poll() is None, \
            f"{self.name} died (exit {self.process.returncode}):\n{self.log_tail()}"

    def stop(self, grace_s: float = 20) -> int | None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._log.close()
        return self.process.returncode


class Gateway:
    def __init__(self, url: str, token: str, server: ServerProcess | None):
        self.url = url
        self.token = token
        self.server = server

    def assert_alive(self) -> None:
        if self.server:
            self.server.assert_alive()

    def log_tail(self) -> str:
        return self.server.log_tail() if self.server else "(external gateway: no log)"

    def get(self, path: str) -> requests.Response:
        return requests.get(f"{self.url}{path}", headers={"Authorization": f"token {self.token}"}, timeout=30)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    if EXTERNAL_GATEWAY_URL:
        yield Gateway(EXTERNAL_GATEWAY_URL, EXTERNAL_GATEWAY_TOKEN, None)
        return
    port = free_port()
    token = secrets.token_hex(16)
    directory = tmp_path_factory.mktemp("gateway")
    server = start_gateway(port, token, directory / "state", directory / "gateway.log")
    try:
        yield Gateway(f"http://127.0.0.1:{port}", token, server)
    finally:
        server.stop()


def start_gateway(port: int, token: str, state_dir: Path, log_path: Path, keep_kernels: bool = False) -> ServerProcess:
    """The installed gateway on `port`, once it printed its URL. Kernels stop with it unless `keep_kernels`."""
    assert GATEWAY_BINARY is not None, "this test starts its own gateway: CELLBLOCK_PREFIX must name an install"
    # As ctest does: the installed tree's kernelspecs (cellblock-python) are the ones the gateway serves.
    env = dict(os.environ)
    env.setdefault("JUPYTER_PATH", str(PREFIX / "share" / "jupyter"))
    argv = [str(GATEWAY_BINARY), "--ip", "127.0.0.1", "--port", str(port), "--token", token,
            "--state-dir", str(state_dir)]
    if not keep_kernels:
        argv.append("--shutdown-kernels-on-exit")
    server = ServerProcess("cellblock-gateway", argv, log_path, env)
    ready_line = re.compile(rf"is available at http://127\.0\.0\.1:{port}\b")
    try:
        server.wait_until(lambda: ready_line.search(server.log_text()) is not None,
                          f'"is available at http://127.0.0.1:{port}" line')
    except BaseException:
        server.stop()
        raise
    return server


@pytest.fixture(scope="module")
def node_clients():
    """Installs the Node clients exactly as locked (npm ci), skipping the install when the lock is unchanged."""
    npm = shutil.which("npm")
    node = shutil.which("node")
    if not npm or not node:
        pytest.fail("node and npm are required (share/scripts/install-deps.sh --with-test-tools installs them)")
    lock = CLIENTS_DIR / "package-lock.json"
    lock_digest = hashlib.sha256(lock.read_bytes()).hexdigest()
    stamp = CLIENTS_DIR / "node_modules" / ".cellblock-lock-sha256"
    # npm writes node_modules/.package-lock.json on every install; newer than the lock means an `npm ci` already ran
    # (share/scripts/test.sh does one before ctest).
    hidden_lock = CLIENTS_DIR / "node_modules" / ".package-lock.json"
    installed = (stamp.is_file() and stamp.read_text() == lock_digest) or \
        (hidden_lock.is_file() and hidden_lock.stat().st_mtime >= lock.stat().st_mtime)
    if not installed:
        print(f"[clients] npm ci in {CLIENTS_DIR}", file=sys.stderr, flush=True)
        started = time.monotonic()
        result = subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"], cwd=CLIENTS_DIR,
                                capture_output=True, text=True, timeout=NPM_CI_TIMEOUT_S)
        assert result.returncode == 0, f"npm ci failed:\n{result.stdout}\n{result.stderr}"
        stamp.write_text(lock_digest)
        print(f"[clients] npm ci done in {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    return node


def run_node_test(node: str, script: str, env_overrides: dict[str, str]) -> str:
    env = dict(os.environ, **env_overrides)
    result = subprocess.run([node, "--test", "--test-force-exit", "--test-reporter=spec", script],
                            cwd=CLIENTS_DIR, env=env, capture_output=True, text=True, timeout=NODE_CLIENT_TIMEOUT_S)
    return check_node_output(script, result.returncode, f"{result.stdout}\n{result.stderr}")


def check_node_output(script: str, returncode: int, output: str) -> str:
    assert returncode == 0, f"{script} failed (exit {returncode}):\n{output}"
    # A run that skipped or never reached its tests must not pass silently.
    assert re.search(r"^\S*\s*fail 0\b", output, re.M), f"{script}: no test summary:\n{output}"
    assert not re.search(r"^\S*\s*pass 0\b", output, re.M), f"{script}: no test passed:\n{output}"
    for kind in ("skipped", "todo", "cancelled"):
        assert re.search(rf"^\S*\s*{kind} 0\b", output, re.M), f"{script}: a {kind} test is a failure:\n{output}"
    return output


def test_jupyterlab_services_start_execute_interrupt_restart_shutdown(gateway, node_clients):
    try:
        run_node_test(node_clients, "lab-services.test.js",
                      {"GATEWAY_URL": gateway.url, "GATEWAY_TOKEN": gateway.token})
    except AssertionError as failure:
        raise AssertionError(f"{failure}\n--- gateway log ---\n{gateway.log_tail()}") from None
    gateway.assert_alive()


def test_jupyterlab_services_connection_gets_its_kernel_back_after_a_gateway_kill_9(node_clients, tmp_path):
    """A JupyterLab client keeps its kernel object while the gateway is SIGKILLed and started again on the same
    state directory and port: its own reconnect lands on the same kernel, whose variables are still there."""
    port, token, state = free_port(), secrets.token_hex(16), tmp_path / "state"
    sync = tmp_path / "sync"
    sync.mkdir()
    first = start_gateway(port, token, state, tmp_path / "first.log", keep_kernels=True)
    second = None
    client = subprocess.Popen([node_clients, "--test", "--test-force-exit", "--test-reporter=spec",
                               "lab-services-reconnect.test.js"], cwd=CLIENTS_DIR, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True,
                              env=dict(os.environ, GATEWAY_URL=f"http://127.0.0.1:{port}", GATEWAY_TOKEN=token,
                                       SYNC_DIR=str(sync)))
    try:
        deadline = time.monotonic() + NODE_CLIENT_TIMEOUT_S
        while not (sync / "ready").exists() and client.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (sync / "ready").exists(), f"the client never got its kernel:\n{client.communicate()[0]}"
        kernel_id = (sync / "ready").read_text()
        first.process.kill()  # SIGKILL, the gateway alone: its kernels run in sessions of their own
        first.process.wait()
        first.stop()
        second = start_gateway(port, token, state, tmp_path / "second.log")
        (sync / "restarted").write_text("")
        output, _ = client.communicate(timeout=NODE_CLIENT_TIMEOUT_S)
        check_node_output("lab-services-reconnect.test.js", client.returncode,
                          f"{output}\n--- restarted gateway log ---\n{second.log_tail()}")
        assert second.process.poll() is None, second.log_tail()
        assert f"re-adopted {kernel_id}" in output, output
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()
        first.stop()
        if second is not None:
            second.stop()


@pytest.fixture
def notebook_server(gateway, tmp_path):
    """Classic Notebook 6.4 whose kernels are managed by the gateway, with one empty notebook to open."""
    specs = gateway.get("/api/kernelspecs")
    assert specs.status_code == 200, f"GET /api/kernelspecs: {specs.status_code} {specs.text}"
    default_spec = specs.json()["default"]
    notebook_dir = tmp_path / "notebooks"
    notebook_dir.mkdir()
    notebook = nbformat.v4.new_notebook()
    notebook.cells.append(nbformat.v4.new_code_cell(""))
    spec = specs.json()["kernelspecs"][default_spec]["spec"]
    notebook.metadata["kernelspec"] = {"name": default_spec, "display_name": spec["display_name"],
                                       "language": spec["language"]}
    nbformat.write(notebook, notebook_dir / "hello.ipynb")

    port = free_port()
    token = secrets.token_hex(16)
    # Private config and runtime dirs: no user config leaks in, nothing is left in ~/.local/share/jupyter/runtime.
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(tmp_path / "config"), JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"))
    server = ServerProcess("jupyter notebook", [
        PYTHON, "-m", "notebook", "--no-browser", "--allow-root", "--ip=127.0.0.1", f"--port={port}",
        "--port-retries=0", f"--NotebookApp.token={token}", f"--notebook-dir={notebook_dir}",
        f"--gateway-url={gateway.url}", f"--GatewayClient.auth_token={gateway.token}",
    ], tmp_path / "notebook.log", env)

    def answers() -> bool:
        try:
            return requests.get(f"http://127.0.0.1:{port}/api/status", params={"token": token},
                                timeout=5).status_code == 200
        except requests.ConnectionError:
            return False

    try:
        server.wait_until(answers, "answer on /api/status")
        yield {"url": f"http://127.0.0.1:{port}", "token": token, "notebook": "hello.ipynb", "server": server}
    finally:
        server.stop()


def test_classic_notebook_in_chromium_runs_a_cell_through_the_gateway(gateway, node_clients, notebook_server):
    screenshot = ARTIFACTS_DIR / "notebook.png"
    screenshot.unlink(missing_ok=True)
    try:
        run_node_test(node_clients, "classic-notebook.test.js", {
            "NOTEBOOK_URL": notebook_server["url"], "NOTEBOOK_TOKEN": notebook_server["token"],
            "NOTEBOOK_PATH": notebook_server["notebook"], "SCREENSHOT_PATH": str(screenshot),
            "GATEWAY_URL": gateway.url, "GATEWAY_TOKEN": gateway.token,
        })
    except AssertionError as failure:
        raise AssertionError(f"{failure}\n--- notebook server log ---\n{notebook_server['server'].log_tail()}"
                             f"\n--- gateway log ---\n{gateway.log_tail()}") from None
    assert screenshot.is_file(), "the screenshot artifact was written"
    gateway.assert_alive()


@pytest.fixture
def jupyterlab_server(gateway, tmp_path):
    """JupyterLab 4 whose kernels are managed by the gateway, with one empty notebook to attach to an agent's kernel.
    Both tokens travel in the environment, not argv (JUPYTER_TOKEN, JUPYTER_GATEWAY_AUTH_TOKEN)."""
    jupyter = PEERS_VENV / "bin" / "jupyter" if PEERS_VENV else None
    if jupyter is None or not os.access(jupyter, os.X_OK):
        # Not a skip: a client that did not run must not look green (tests/README.md, skip policy).
        pytest.fail(f"JupyterLab is not installed in CELLBLOCK_PEERS_VENV={PEERS_VENV}: "
                    "share/scripts/test-venv.sh <build>/peers-venv tests/requirements-peers.txt")
    root = tmp_path / "lab-root"
    root.mkdir()
    notebook = nbformat.v4.new_notebook()
    notebook.cells.append(nbformat.v4.new_code_cell(""))
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(notebook, root / "agent.ipynb")
    # Private Jupyter and Lab directories: no user config leaks in, nothing is left in the home directory. Lab's news
    # and update checks are off (the machine may have no internet, and their toasts would cover the notebook).
    settings = tmp_path / "lab-settings"
    (settings / "@jupyterlab" / "apputils-extension").mkdir(parents=True)
    (settings / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings").write_text(
        '{"fetchNews": "false", "checkForUpdates": false}')
    port = free_port()
    token = secrets.token_hex(16)
    env = dict(os.environ, JUPYTER_TOKEN=token, JUPYTER_GATEWAY_AUTH_TOKEN=gateway.token,
               JUPYTER_CONFIG_DIR=str(tmp_path / "config"), JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
               JUPYTER_DATA_DIR=str(tmp_path / "data"), JUPYTERLAB_SETTINGS_DIR=str(settings),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "lab-workspaces"))
    env.pop("JUPYTER_PATH", None)  # Lab finds its extensions in its venv only; kernelspecs come from the gateway
    server = ServerProcess("jupyter lab", [
        str(jupyter), "lab", "--no-browser", "--allow-root", "--ip=127.0.0.1", f"--port={port}", "--port-retries=0",
        f"--ServerApp.root_dir={root}", f"--gateway-url={gateway.url}",
    ], tmp_path / "jupyterlab.log", env)

    def answers() -> bool:
        try:
            return requests.get(f"http://127.0.0.1:{port}/api/status", headers={"Authorization": f"token {token}"},
                                timeout=5).status_code == 200
        except requests.ConnectionError:
            return False

    try:
        server.wait_until(answers, "answer on /api/status")
        yield {"url": f"http://127.0.0.1:{port}", "token": token, "notebook": "agent.ipynb", "server": server}
    finally:
        server.stop()


def test_jupyterlab_4_in_chromium_watches_and_shares_an_agent_kernel(gateway, node_clients, jupyterlab_server):
    screenshot = ARTIFACTS_DIR / "jupyterlab.png"
    screenshot.unlink(missing_ok=True)
    started = time.monotonic()
    try:
        run_node_test(node_clients, "jupyterlab.test.js", {
            "LAB_URL": jupyterlab_server["url"], "LAB_TOKEN": jupyterlab_server["token"],
            "NOTEBOOK_PATH": jupyterlab_server["notebook"], "SCREENSHOT_PATH": str(screenshot),
            "GATEWAY_URL": gateway.url, "GATEWAY_TOKEN": gateway.token,
        })
    except AssertionError as failure:
        raise AssertionError(f"{failure}\n--- jupyter lab log ---\n{jupyterlab_server['server'].log_tail()}"
                             f"\n--- gateway log ---\n{gateway.log_tail()}") from None
    print(f"[clients] jupyterlab.test.js took {time.monotonic() - started:.1f} s", file=sys.stderr)
    assert screenshot.is_file(), "the screenshot artifact was written"
    assert "GatewayKernelManager using existing kernel" in jupyterlab_server["server"].log_text(), \
        "Jupyter Server adopted the agent's kernel rather than starting one"
    gateway.assert_alive()


def test_live_page_in_chromium_follows_an_agent_session(gateway, node_clients):
    """The gateway's own live page of an agent session (share/cellblock/view/) in headless Chromium: a print in the
    DOM within 1 s of its stdout event, a plot as an image (screenshot), a coloured traceback, hostile HTML, SVG
    (onload, script) and JavaScript outputs that read and send nothing, a DataFrame as a table whose rows show inside
    its frame, a reconnect that shows each missed cell once, a 10 MB print that leaves the page
    responsive and ends with its head, tail and saved file, 1,000 cells opening within 1 s, a state-lost notice
    when a cell kills its Python worker (and the next cell runs), following the newest cell until the reader
    scrolls up (the follow button takes the page back), a viewer link's page that cannot execute (nothing runs),
    an approval shown pending and then decided (on a second gateway the node test starts with a network
    ceiling), and pages in hidden tabs letting their streams go so a seventh tab of the gateway loads."""
    screenshot = ARTIFACTS_DIR / "live-page.png"
    screenshot.unlink(missing_ok=True)
    try:
        output = run_node_test(node_clients, "live-page.test.js", {
            "GATEWAY_URL": gateway.url, "GATEWAY_TOKEN": gateway.token, "SCREENSHOT_PATH": str(screenshot),
        })
    except AssertionError as failure:
        raise AssertionError(f"{failure}\n--- gateway log ---\n{gateway.log_tail()}") from None
    for line in output.splitlines():
        if "[live-page]" in line:
            print(line.strip(), file=sys.stderr)
    assert screenshot.is_file(), "the screenshot artifact was written"
    gateway.assert_alive()
