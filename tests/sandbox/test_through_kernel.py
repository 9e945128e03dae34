"""Hostile cells through the real kernel: each attack is sent as a Jupyter execute_request to a live
cellblock-kernel (started by jupyter_client from the installed kernelspec), and each test proves on the host
side that nothing leaked (the HMAC key in no output and no workspace file, listeners that saw nothing, host
file hashes unchanged, host processes alive, no process of the session uid left) and that the kernel still
serves afterwards (state intact, or a WorkerDied naming the cause and the same kernel pid).

The kernels run the installed binary, worker and policy; the only change is the policy's uid range (a range
of this file's own), so that "no process of the session uid is left" can never be confused by a kernel of
another test suite leasing the same uid right after ours.
"""
from __future__ import annotations

import ctypes
import glob
import json
import os
import re
import secrets
import socket
import stat
import subprocess
import textwrap
import threading
import time
import uuid
from pathlib import Path

import cellblock_zygote
import pytest
from jupyter_client import KernelManager
from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

from conftest import DEFAULT_POLICY, PRELUDE, PREFIX, assert_no_session_process, host_ip, session_processes, sha256

INSTALLED_KERNEL = "cellblock-python"
HOSTILE_KERNEL = "cellblock-hostile"
KERNEL_CONFIG = PREFIX / "share" / "cellblock" / "kernel-config.json"
UID_FIRST, UID_COUNT = 270000, 200
START_TIMEOUT = 60


# ---------------------------------------------------------------------------------------------------------
# Harness: kernels, executes, host-side views of the kernel and its worker
# ---------------------------------------------------------------------------------------------------------

def hostile_kernelspec(root: Path, zygote: bool = cellblock_zygote.ENABLED, tenant: str = cellblock_zygote.TENANT):
    """A kernelspec that is the installed one with a config whose policy leases uids from our own range (and
    the worker zygote switched on or off: tests/plugins/cellblock_zygote.py). Returns JUPYTER kernel dirs."""
    try:
        installed = KernelSpecManager().get_kernel_spec(INSTALLED_KERNEL)
    except NoSuchKernel:
        pytest.fail(f"kernelspec {INSTALLED_KERNEL!r} not found; JUPYTER_PATH={os.environ.get('JUPYTER_PATH')!r}")
    policy = json.loads(DEFAULT_POLICY.read_text())
    policy["uid_range"] = {"first": UID_FIRST, "count": UID_COUNT}
    (root / "policy.json").write_text(json.dumps(policy))
    config = cellblock_zygote.switch_config(cellblock_zygote.resolved_config(KERNEL_CONFIG), zygote, tenant)
    config["sandbox_policy"] = str(root / "policy.json")
    (root / "kernel-config.json").write_text(json.dumps(config))
    argv = list(installed.argv)
    assert "--config" in argv, argv
    argv[argv.index("--config") + 1] = str(root / "kernel-config.json")
    spec_dir = root / "kernels" / HOSTILE_KERNEL
    spec_dir.mkdir(parents=True)
    spec = installed.to_dict()
    spec["argv"] = argv
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    return [str(root / "kernels")]


@pytest.fixture(scope="module")
def kernel_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile-kernelspec")
    dirs = hostile_kernelspec(root)
    if cellblock_zygote.ENABLED:
        # The tenant's first launch starts the template and goes by exec: warm it up, so that the module's
        # workers are forks.
        warm = LiveKernel(dirs, root / "warm-up" / "workspace")
        try:
            cellblock_zygote.template_serving(root / "policy.json", timeout=240)
        finally:
            warm.shutdown()
    return dirs


class Cell:
    """The reply and every IOPub message of one execute."""

    def __init__(self, reply, messages):
        self.reply = reply
        self.messages = messages

    @property
    def content(self):
        return self.reply["content"]

    def stream(self, name="stdout"):
        return "".join(m["content"]["text"] for m in self.messages
                       if m["msg_type"] == "stream" and m["content"]["name"] == name)

    @property
    def everything(self):
        """All the client saw, as one string (for secret searches)."""
        return json.dumps([self.reply["content"]] + [m["content"] for m in self.messages])

    def result(self):
        for line in self.stream().splitlines():
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT "):])
        raise AssertionError(f"no RESULT line; reply={self.content}\nstdout={self.stream()[-3000:]}\n"
                             f"stderr={self.stream('stderr')[-3000:]}")

    def value(self):
        results = [m for m in self.messages if m["msg_type"] == "execute_result"]
        assert results, f"no execute_result: {self.content}"
        return results[0]["content"]["data"]["text/plain"]


class LiveKernel:
    """A cellblock kernel started from the hostile kernelspec, with its own workspace."""

    def __init__(self, kernel_dirs, workspace: Path, **env):
        self.workspace = workspace
        self.manager = KernelManager(kernel_name=HOSTILE_KERNEL,
                                     kernel_spec_manager=KernelSpecManager(kernel_dirs=kernel_dirs))
        # Named like a Jupyter server names it (runtime/kernel-<id>.json), so that the attacks' searches for
        # that pattern would find it if it were reachable.
        runtime = workspace.parent / "jupyter-runtime"
        runtime.mkdir(parents=True, exist_ok=True)
        kernel_id = uuid.uuid4()
        self.manager.connection_file = str(runtime / f"kernel-{kernel_id}.json")
        environment = dict(os.environ, CELLBLOCK_WORKSPACE=str(workspace))
        environment.update({name: str(value) for name, value in env.items()})
        # The kernel's structured log (stderr): a witness of what reached its public sockets.
        self.log_path = runtime / f"kernel-{kernel_id}.log"
        self.log = open(self.log_path, "ab")
        try:
            self.manager.start_kernel(env=environment, stderr=self.log)
            self.client = self.manager.blocking_client()
            self.client.start_channels()
            self.client.wait_for_ready(timeout=START_TIMEOUT)
        except Exception as error:
            if self.manager.has_kernel:
                self.manager.shutdown_kernel(now=True)
            self.log.close()
            raise AssertionError(f"kernel did not start: {error}\n{self.log_path.read_text()[-3000:]}") from error
        self.pid = self.manager.provisioner.process.pid

    def execute(self, code, timeout=90):
        messages = []
        reply = self.client.execute_interactive(code, timeout=timeout, output_hook=messages.append)
        return Cell(reply, messages)

    def attack(self, code, timeout=90):
        """Runs attack code with the battery's prelude (syscall(), report())."""
        return self.execute(PRELUDE + textwrap.dedent(code), timeout=timeout)

    def alive(self):
        return self.manager.is_alive() and process_state(self.pid) not in (None, "Z")

    def connection_key(self):
        """The HMAC key, found the way an attacker on the host would: the kernel's argv names the file."""
        argv = Path(f"/proc/{self.pid}/cmdline").read_bytes().split(b"\0")
        connection_file = argv[argv.index(b"-f") + 1].decode()
        assert connection_file == self.manager.connection_file
        info = json.loads(Path(connection_file).read_text())
        assert len(info["key"]) >= 32, "the kernel should run with a real key"
        return connection_file, info

    def worker_pid(self):
        """Host pid of the confined worker: the kernel's child that runs as a session uid, or the process the
        kernel holds a pidfd of when a zygote template forked it (tests/plugins/cellblock_zygote.py)."""
        for pid in children(self.pid) + cellblock_zygote.pidfd_targets(self.pid):
            uid = process_uid(pid)
            if uid is not None and UID_FIRST <= uid < UID_FIRST + UID_COUNT:
                return pid
        raise AssertionError(f"no confined worker under kernel {self.pid}: children {children(self.pid)}")

    def session_uid(self):
        uid = self.workspace.stat().st_uid
        assert UID_FIRST <= uid < UID_FIRST + UID_COUNT, f"workspace not owned by a session uid: {uid}"
        return uid

    def runtime_dir(self):
        """The kernel's runtime directory (/tmp/cbk-*), found through its owner marker."""
        for owner in glob.glob("/tmp/cbk-*/owner.json"):
            try:
                if json.loads(Path(owner).read_text()).get("pid") == self.pid:
                    return Path(owner).parent
            except (OSError, ValueError):
                continue
        raise AssertionError(f"no runtime directory for kernel {self.pid}")

    def assert_serving(self, **expected):
        """The kernel answers an ordinary execute, from the same process, with the given variables intact."""
        assert self.alive(), "the kernel process died"
        assert self.manager.provisioner.process.pid == self.pid
        for name, value in expected.items():
            cell = self.execute(name)
            assert cell.content["status"] == "ok", cell.content
            assert cell.value() == repr(value), f"{name} changed: {cell.value()}"
        cell = self.execute("6 * 7")
        assert cell.content["status"] == "ok" and cell.value() == "42", cell.content

    def log_events(self):
        events = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            try:
                events.append(json.loads(line))
            except ValueError:
                events.append({"event": "unstructured", "line": line})
        return events

    def shutdown(self):
        if cellblock_zygote.ENABLED and self.manager.has_kernel:
            cellblock_zygote.TALLY.note(self.pid)
        try:
            self.client.stop_channels()
        finally:
            try:
                if self.manager.has_kernel:
                    self.manager.shutdown_kernel(now=False)
            finally:
                self.log.close()


def process_state(pid):
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("State:"):
                return line.split()[1]
    except OSError:
        return None
    return None


def process_uid(pid):
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Uid:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def process_status(pid):
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        fields[name] = value.strip()
    return fields


def children(pid):
    found = []
    for task in glob.glob(f"/proc/{pid}/task/*/children"):
        try:
            found += [int(child) for child in Path(task).read_text().split()]
        except OSError:
            continue
    return found


class WorkerNamespace:
    """The pid namespace of a worker, held open while we look for processes left in it: namespace inode
    numbers are recycled, and a namespace that stays referenced cannot hand its number to a newer one."""

    def __init__(self, pid):
        self.fd = os.open(f"/proc/{pid}/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
        self.name = os.readlink(f"/proc/self/fd/{self.fd}")

    def __enter__(self):
        return self

    def __exit__(self, *_):
        os.close(self.fd)

    def processes(self):
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    if os.readlink(entry / "ns" / "pid") == self.name:
                        found.append(int(entry.name))
                except OSError:
                    continue
        return found

    def assert_emptied(self):
        """Everything that ran in the namespace is gone (allowing a moment for reaping)."""
        for _ in range(100):
            left = self.processes()
            if not left:
                return
            time.sleep(0.1)
        raise AssertionError(f"processes of a finished worker's pid namespace are still running: {left}")


def files_under(directory: Path):
    """Contents of every regular file below directory (symlinks are not followed)."""
    contents = {}
    for root, _, names in os.walk(directory):
        for name in names:
            path = Path(root) / name
            if stat.S_ISREG(path.lstat().st_mode):
                contents[str(path)] = path.read_bytes()
    return contents


def assert_worker_died(cell, *causes):
    """A WorkerDied error whose message names one of the causes."""
    assert cell.content["status"] == "error", cell.content
    assert cell.content["ename"] == "WorkerDied", cell.content
    assert any(cause in cell.content["evalue"] for cause in causes), cell.content["evalue"]


HOST_SECRET_ENV = "CELLBLOCK_HOSTILE_HOST_SECRET"


@pytest.fixture(scope="module")
def kernel(kernel_dirs, tmp_path_factory):
    """One kernel shared by the attacks that leave its worker alive; `survivor` must outlive every one."""
    secret = "HOSTENV-" + secrets.token_hex(16)
    k = LiveKernel(kernel_dirs, tmp_path_factory.mktemp("shared") / "workspace", **{HOST_SECRET_ENV: secret})
    k.host_env_secret = secret
    k.survivor = "alive-" + secrets.token_hex(4)
    assert k.execute(f"survivor = {k.survivor!r}").content["status"] == "ok"
    k.first_worker = k.worker_pid()
    yield k
    k.shutdown()


@pytest.fixture(autouse=True)
def shared_kernel_keeps_its_worker(request):
    """Every test that used the shared kernel leaves it serving, with the same worker and its state."""
    yield
    if "kernel" in request.fixturenames:
        k = request.getfixturevalue("kernel")
        k.assert_serving(survivor=k.survivor)
        assert k.worker_pid() == k.first_worker, "the shared kernel's worker was replaced"


@pytest.fixture(scope="module")
def limited(kernel_dirs, tmp_path_factory):
    """A kernel with small limits, for attacks that end in a kill; each test checks the kernel pid stays."""
    k = LiveKernel(kernel_dirs, tmp_path_factory.mktemp("limited") / "workspace",
                   CELLBLOCK_MEMORY_MB=256, CELLBLOCK_TIMEOUT_S=5, CELLBLOCK_OUTPUT_BYTES=65536)
    yield k
    k.shutdown()


@pytest.fixture
def own_kernel(kernel_dirs, tmp_path):
    started = []

    def start(name="own", **env):
        k = LiveKernel(kernel_dirs, tmp_path / name, **env)
        started.append(k)
        return k

    yield start
    for k in started:
        try:
            k.shutdown()
        except Exception:
            pass


@pytest.fixture
def canaries():
    """Host processes that must survive: one as root, one as an unprivileged host user."""
    as_root = subprocess.Popen(["/usr/bin/sleep", "300"])
    as_nobody = subprocess.Popen(["/usr/bin/sleep", "300"], user=65534, group=65534, extra_groups=[])
    yield as_root, as_nobody
    for process in (as_root, as_nobody):
        process.kill()
        process.wait()


# ---------------------------------------------------------------------------------------------------------
# Secrets: the HMAC key, the connection file, the kernel's environment, inherited fds
# ---------------------------------------------------------------------------------------------------------

def test_hmac_key_is_in_no_proc_file_environment_or_output(kernel):
    connection_file, info = kernel.connection_key()
    key = info["key"]
    cell = kernel.attack(f"""
        loot = []
        def grab(path, limit=1 << 20):
            try:
                with open(path, "rb") as handle:
                    loot.append(path.encode() + b"\\n" + handle.read(limit))
                return "read"
            except OSError as error:
                return errno.errorcode.get(error.errno, str(error.errno))
        outcomes = {{}}
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
        for pid in pids:
            for part in ("cmdline", "environ"):
                outcomes[pid + "/" + part] = grab("/proc/" + pid + "/" + part)
            for task in os.listdir("/proc/" + pid + "/task"):
                grab("/proc/" + pid + "/task/" + task + "/environ")
        for name in os.listdir("/proc/1"):
            path = "/proc/1/" + name
            if name not in ("mem", "pagemap", "clear_refs") and not os.path.isdir(path):
                grab(path)
        loot.append(repr(dict(os.environ)).encode())
        outcomes["direct"] = grab({connection_file!r})
        outcomes["pids"] = pids
        with open("/workspace/loot.bin", "wb") as handle:
            handle.write(b"\\n".join(loot))
        report(**outcomes)
    """)
    result = cell.result()
    assert result["direct"] == "ENOENT"
    assert result["pids"] == ["1"], "the worker should be alone in its pid namespace"
    assert result["1/environ"] == "read" and result["1/cmdline"] == "read"
    loot = (kernel.workspace / "loot.bin").read_bytes()
    assert b"PATH=" in loot and b"python3" in loot, "the scan should have read the worker's own /proc"
    assert key not in cell.everything
    for path, content in files_under(kernel.workspace).items():
        assert key.encode() not in content, f"the HMAC key is in {path}"
    # Host side: the worker's real environment and argv hold no key either.
    worker = kernel.worker_pid()
    for part in ("environ", "cmdline"):
        assert key.encode() not in Path(f"/proc/{worker}/{part}").read_bytes()
    assert connection_file.encode() not in Path(f"/proc/{worker}/cmdline").read_bytes()
    # ... nor anywhere in its memory (read from the host, which may: it is root).
    scanned, control_found = 0, False
    with open(f"/proc/{worker}/maps") as maps, open(f"/proc/{worker}/mem", "rb", buffering=0) as memory:
        for line in maps:
            addresses, permissions = line.split()[:2]
            if not permissions.startswith("r") or line.rstrip().endswith(("[vvar]", "[vsyscall]")):
                continue
            start, end = (int(part, 16) for part in addresses.split("-"))
            try:
                memory.seek(start)
                region = memory.read(end - start)
            except OSError:
                continue
            scanned += len(region)
            control_found = control_found or kernel.survivor.encode() in region
            assert key.encode() not in region, f"the HMAC key is in the worker's memory at {addresses}"
    # Control: a string the worker does hold (a variable set by an earlier cell) is found by the same scan.
    assert control_found and scanned > 10 << 20, f"the scan of {scanned} bytes missed the worker's own data"


# What the attack searches for: Jupyter connection files (kernel-<uuid>.json, never the installed
# share/cellblock/kernel-config.json that a /usr/local install makes visible through the read-only /usr) and the
# kernels' private runtime directories (/tmp/cbk-*).
CONNECTION_FILE_NAME = r"kernel-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\.json"


def test_connection_file_cannot_be_found_or_opened(kernel):
    connection_file, info = kernel.connection_key()
    runtime = kernel.runtime_dir()
    jupyter_runtime = str(Path(connection_file).parent)
    # Host side: the search below would find this kernel's own files if they were visible.
    assert re.fullmatch(CONNECTION_FILE_NAME, Path(connection_file).name), connection_file
    assert runtime.name.startswith("cbk-"), runtime
    cell = kernel.attack(f"""
        import glob, subprocess
        found = subprocess.run(["find", "/", "-regextype", "posix-extended",
                                "(", "-regex", ".*/" + {CONNECTION_FILE_NAME!r}, "-o", "-name", "cbk-*", ")", "-print"],
                               capture_output=True, text=True)
        walked = []
        for top in ["/", "/tmp", "/dev/shm", "/workspace", "/var", "/run", "/root"]:
            for directory, dirs, files in os.walk(top):
                if directory == "/":
                    dirs[:] = [d for d in dirs if d not in ("proc", "usr")]
                walked += [os.path.join(directory, name) for name in files if name.endswith(".json")]
        outcomes = {{}}
        for path in [{connection_file!r}, {jupyter_runtime!r}, {str(runtime)!r}, {str(runtime / "owner.json")!r},
                     "/root/.local/share/jupyter/runtime", "/run/user/0/jupyter"]:
            try:
                outcomes[path] = os.listdir(path) if os.path.isdir(path) else open(path).read()
            except OSError as error:
                outcomes[path] = errno.errorcode.get(error.errno)
        report(find=found.stdout.split(), find_rc=found.returncode, walked=walked, cbk=glob.glob("/tmp/cbk-*"),
               outcomes=outcomes)
    """, timeout=180)
    result = cell.result()
    assert result["find"] == [], result["find"]
    assert result["walked"] == [] and result["cbk"] == []
    assert all(outcome == "ENOENT" for outcome in result["outcomes"].values()), result["outcomes"]
    assert info["key"] not in cell.everything
    # The things the attack looked for do exist on the host: the test would see them if they leaked in.
    assert Path(connection_file).is_file() and (runtime / "owner.json").is_file()


def test_kernel_environment_does_not_reach_the_worker(kernel):
    secret = kernel.host_env_secret
    # Host side first: the secret really is in the kernel's environment.
    assert f"{HOST_SECRET_ENV}={secret}".encode() in Path(f"/proc/{kernel.pid}/environ").read_bytes()
    cell = kernel.attack("""
        import subprocess
        child = subprocess.run(["/usr/bin/env"], capture_output=True, text=True).stdout
        report(environ=dict(os.environ), child=child)
    """)
    result = cell.result()
    assert HOST_SECRET_ENV not in result["environ"] and HOST_SECRET_ENV not in result["child"]
    assert not any(name.startswith(("JPY_", "JUPYTER", "CELLBLOCK")) for name in result["environ"]), result["environ"]
    assert secret not in cell.everything
    assert secret.encode() not in Path(f"/proc/{kernel.worker_pid()}/environ").read_bytes()


def test_ipython_and_jupyter_helpers_reveal_no_connection_info(kernel):
    connection_file, info = kernel.connection_key()
    cell = kernel.attack("""
        outcomes = {}
        shell = get_ipython()
        probes = {
            "connect_info": lambda: shell.run_line_magic("connect_info", ""),
            "shell.kernel": lambda: repr(shell.kernel.session.key),
            "shell.config": lambda: repr(shell.config),
            "find_connection_file": lambda: __import__("jupyter_client").find_connection_file(),
            "runtime_dir": lambda: os.listdir(__import__("jupyter_core.paths").paths.jupyter_runtime_dir()),
            "ipykernel": lambda: repr(__import__("ipykernel.connect").connect.get_connection_info()),
        }
        for name, probe in probes.items():
            try:
                outcomes[name] = repr(probe())
            except BaseException as error:
                outcomes[name] = type(error).__name__
        report(**outcomes)
    """)
    result = cell.result()
    assert result["shell.kernel"] == "AttributeError", result
    assert result["find_connection_file"] in ("OSError", "FileNotFoundError", "ModuleNotFoundError"), result
    assert result["runtime_dir"] in ("FileNotFoundError", "ModuleNotFoundError"), result
    assert info["key"] not in cell.everything
    assert Path(connection_file).name not in cell.everything


def test_fd_walk_finds_only_the_worker_channel(kernel):
    connection_file, info = kernel.connection_key()
    cell = kernel.attack("""
        import stat
        walked = {}
        for fd in range(1024):
            try:
                mode = os.fstat(fd).st_mode
            except OSError:
                continue
            try:
                target = os.readlink("/proc/self/fd/%d" % fd)
            except OSError as error:
                target = "readlink:" + errno.errorcode.get(error.errno)
            walked[fd] = [stat.S_IFMT(mode), target]
        listing = sorted(int(fd) for fd in os.listdir("/proc/self/fd"))
        import IPython.utils.io
        report(walked=walked, listing=listing, ipython_devnull=IPython.utils.io.devnull.fileno())
    """)
    result = cell.result()
    walked = {int(fd): value for fd, value in result["walked"].items()}
    # IPython opens os.devnull for writing when it is imported (IPython.utils.io.devnull); that fd is the
    # worker's own, not inherited. Everything else is the protocol's 0, 1, 2, 3.
    own = result["ipython_devnull"]
    assert own > 3 and walked.pop(own) == [stat.S_IFCHR, "/dev/null"]
    assert sorted(walked) == [0, 1, 2, 3], walked
    assert walked[0] == [stat.S_IFCHR, "/dev/null"]
    assert walked[1][1].startswith("pipe:") and walked[2][1].startswith("pipe:")
    assert walked[3][0] == stat.S_IFSOCK and walked[3][1].startswith("socket:")
    listing = [fd for fd in result["listing"] if fd != own]
    assert listing[:4] == [0, 1, 2, 3] and len(listing) == 5, f"only the listing's own fd may be extra: {listing}"
    assert info["key"] not in cell.everything
    # Host side: the worker's fd table, as the host sees it, holds nothing of the kernel's files.
    worker = kernel.worker_pid()
    targets = {int(fd): os.readlink(f"/proc/{worker}/fd/{fd}") for fd in os.listdir(f"/proc/{worker}/fd")}
    assert sorted(targets) == sorted([0, 1, 2, 3, own]), targets
    assert targets[0] == targets[own] == "/dev/null"
    assert not any(connection_file in t or "/tmp/cbk-" in t or t.startswith("/work") for t in targets.values())


# ---------------------------------------------------------------------------------------------------------
# Network: the kernel's own ports, host listeners, DNS
# ---------------------------------------------------------------------------------------------------------

def test_kernel_zmq_ports_are_unreachable_and_there_is_no_private_endpoint(kernel):
    _, info = kernel.connection_key()
    ports = {name: info[name] for name in ("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port")}
    runtime = kernel.runtime_dir()
    ipc_paths = sorted(str(path) for path in runtime.iterdir() if stat.S_ISSOCK(path.lstat().st_mode))
    # The kernel serves only its public, signed sockets: no unsigned private endpoint exists to be reached.
    assert ipc_paths == [], f"the kernel has private sockets: {ipc_paths}"
    cell = kernel.attack(f"""
        outcomes = {{}}
        for name, port in {ports!r}.items():
            for family, address in [(socket.AF_INET, ("127.0.0.1", port)), (socket.AF_INET6, ("::1", port)),
                                    (socket.AF_INET, ({info["ip"]!r}, port))]:
                try:
                    with socket.socket(family, socket.SOCK_STREAM) as s:
                        s.settimeout(2)
                        s.connect(address)
                        s.sendall(b"\\xff" + b"\\0" * 8 + b"\\x7f")
                    outcomes[name + "@" + address[0]] = "connected"
                except OSError as error:
                    outcomes[name + "@" + address[0]] = errno.errorcode.get(error.errno, str(error))
        # What a client library would do: a ZMQ DEALER with a forged kernel_info_request, waiting for a reply.
        try:
            import zmq
            context = zmq.Context()
            dealer = context.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect("tcp://127.0.0.1:%d" % {ports["shell_port"]})
            header = json.dumps({{"msg_id": "x", "msg_type": "kernel_info_request", "session": "s",
                                  "username": "u", "date": "", "version": "5.3"}}).encode()
            dealer.send_multipart([b"<IDS|MSG>", b"", header, b"{{}}", b"{{}}", b"{{}}"], zmq.NOBLOCK)
            outcomes["zmq"] = "reply" if dealer.poll(1500) else "no reply"
            dealer.close()
            context.term()
        except Exception as error:
            outcomes["zmq"] = type(error).__name__
        report(**outcomes)
    """)
    result = cell.result()
    for name in ports:
        for address in ("127.0.0.1", "::1", info["ip"]):
            assert result[f"{name}@{address}"] == "EAFNOSUPPORT", (name, address, result)
    assert result["zmq"] in ("no reply", "ZMQError"), result["zmq"]
    # The kernel's public ports still serve the real client (kernel_info and execute, checked by the fixture).
    assert kernel.client.kernel_info(reply=True, timeout=30)["content"]["status"] == "ok"
    # The kernel server logs the first refused message of each kind: nothing of the forged request arrived.
    assert not [e for e in kernel.log_events() if e.get("event") == "message_refused"], kernel.log_events()
    # Control: the same forged request sent from the host does arrive and is refused (the witness works).
    import zmq
    context = zmq.Context()
    try:
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(f"tcp://{info['ip']}:{ports['shell_port']}")
        header = json.dumps({"msg_id": "x", "msg_type": "kernel_info_request", "session": "s", "username": "u",
                             "date": "", "version": "5.3"}).encode()
        dealer.send_multipart([b"<IDS|MSG>", b"", header, b"{}", b"{}", b"{}"])
        deadline = time.monotonic() + 30
        while not [e for e in kernel.log_events() if e.get("event") == "message_refused"]:
            assert time.monotonic() < deadline, "the kernel did not log the host's forged message"
            time.sleep(0.1)
        dealer.close()
    finally:
        context.term()


def assert_listener_records_a_control(listener):
    """Positive control for a host listener that saw nothing: a connection (or datagram) the host sends now is
    recorded, so the listener was up and recording the whole time; and it is the only thing recorded."""
    with socket.socket(listener.sock.family, listener.kind) as probe:
        if listener.kind == socket.SOCK_STREAM:
            probe.connect(listener.address)
        else:
            probe.sendto(b"host control", listener.address)
        deadline = time.monotonic() + 30
        while not listener.events and time.monotonic() < deadline:
            time.sleep(0.05)
    assert len(listener.events) == 1, f"host listener {listener.address}: {listener.events} (expected the control only)"


def test_network_egress_reaches_no_host_listener(kernel, listeners):
    tcp_loopback = listeners(socket.AF_INET, socket.SOCK_STREAM, ("127.0.0.1", 0))
    tcp_external = listeners(socket.AF_INET, socket.SOCK_STREAM, (host_ip(), 0))
    udp_loopback = listeners(socket.AF_INET, socket.SOCK_DGRAM, ("127.0.0.1", 0))
    targets = {"tcp-lo": list(tcp_loopback.address), "tcp-ext": list(tcp_external.address),
               "udp-lo": list(udp_loopback.address)}
    cell = kernel.attack(f"""
        import subprocess
        outcomes = {{}}
        for name, (host, port) in {targets!r}.items():
            kind = socket.SOCK_DGRAM if name.startswith("udp") else socket.SOCK_STREAM
            try:
                with socket.socket(socket.AF_INET, kind) as s:
                    s.settimeout(2)
                    if kind == socket.SOCK_DGRAM:
                        s.sendto(b"exfiltrated", (host, port))
                    else:
                        s.connect((host, port))
                outcomes[name] = "sent"
            except OSError as error:
                outcomes[name] = errno.errorcode.get(error.errno, str(error))
        for label, family, kind in [("inet6", socket.AF_INET6, socket.SOCK_STREAM),
                                    ("raw", socket.AF_INET, socket.SOCK_RAW),
                                    ("packet", socket.AF_PACKET, socket.SOCK_RAW),
                                    ("netlink", socket.AF_NETLINK, socket.SOCK_RAW)]:
            try:
                socket.socket(family, kind).close()
                outcomes[label] = "created"
            except OSError as error:
                outcomes[label] = errno.errorcode.get(error.errno, str(error))
        # The same from a child process (a tool an agent might shell out to).
        tcp_host, tcp_port = {targets["tcp-lo"]!r}
        child = subprocess.run(["/usr/bin/python3", "-c",
                                "import socket; socket.create_connection((%r, %d), 2)" % (tcp_host, tcp_port)],
                               capture_output=True, text=True)
        outcomes["child"] = child.stderr.strip().splitlines()[-1] if child.returncode else "connected"
        report(**outcomes)
    """)
    result = cell.result()
    for name in ("tcp-lo", "tcp-ext", "udp-lo", "inet6", "raw", "packet", "netlink"):
        assert result[name] == "EAFNOSUPPORT", (name, result)
    assert "Address family not supported" in result["child"], result["child"]
    time.sleep(0.5)  # let a datagram in flight arrive
    for listener in (tcp_loopback, tcp_external, udp_loopback):
        assert listener.events == [], f"host listener {listener.address} saw {listener.events}"
        assert_listener_records_a_control(listener)


def test_host_unix_sockets_and_ipc_objects_are_unreachable(kernel, listeners, tmp_path):
    token = secrets.token_hex(6)
    abstract = listeners(socket.AF_UNIX, socket.SOCK_STREAM, f"\0cellblock-host-{token}")
    pathname = listeners(socket.AF_UNIX, socket.SOCK_STREAM, str(tmp_path / "host.sock"))
    os.chmod(tmp_path / "host.sock", 0o777)
    # A SysV shared memory segment on the host, holding a secret.
    libc = ctypes.CDLL(None, use_errno=True)
    ipc_key = 0x0CE11000 + secrets.randbelow(0xFFF)
    segment = libc.shmget(ipc_key, 4096, 0o1000 | 0o666)   # IPC_CREAT
    assert segment >= 0, f"host shmget failed: errno {ctypes.get_errno()}"
    try:
        cell = kernel.attack(f"""
            outcomes = {{}}
            for name, address in [("abstract", "\\0cellblock-host-{token}"),
                                  ("pathname", {str(tmp_path / "host.sock")!r}),
                                  ("docker", "/var/run/docker.sock"), ("dbus", "/run/dbus/system_bus_socket")]:
                try:
                    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                        s.connect(address)
                    outcomes[name] = "connected"
                except OSError as error:
                    outcomes[name] = errno.errorcode.get(error.errno)
            libc.shmget.restype = ctypes.c_int
            found = libc.shmget({ipc_key}, 0, 0) >= 0
            outcomes["shmget"] = "found" if found else errno.errorcode.get(ctypes.get_errno())
            outcomes["shm_listing"] = open("/proc/sysvipc/shm").read().count("\\n")
            report(**outcomes)
        """)
    finally:
        libc.shmctl(segment, 0, None)   # IPC_RMID
    result = cell.result()
    assert result["abstract"] == "ECONNREFUSED", result   # another network namespace: not the host's name
    assert result["pathname"] == result["docker"] == result["dbus"] == "ENOENT", result
    assert result["shmget"] == "ENOENT" and result["shm_listing"] == 1, result   # header line only
    time.sleep(0.3)
    assert abstract.events == [] and pathname.events == []
    assert_listener_records_a_control(abstract)
    assert_listener_records_a_control(pathname)


def test_dns_lookup_fails(kernel):
    cell = kernel.attack("""
        outcomes = {}
        for name in ["example.com", "pypi.org", "metadata.google.internal"]:
            try:
                outcomes[name] = socket.getaddrinfo(name, 443)[0][4][0]
            except socket.gaierror as error:
                outcomes[name] = "gaierror"
        try:
            outcomes["resolv.conf"] = open("/etc/resolv.conf").read()
        except OSError as error:
            outcomes["resolv.conf"] = errno.errorcode.get(error.errno)
        outcomes["localhost"] = socket.gethostbyname("localhost")
        report(**outcomes)
    """)
    result = cell.result()
    assert result["example.com"] == result["pypi.org"] == result["metadata.google.internal"] == "gaierror", result
    assert result["resolv.conf"] == "ENOENT"
    assert result["localhost"] == "127.0.0.1", "lookups fail for lack of network, not a broken resolver"


# ---------------------------------------------------------------------------------------------------------
# Processes: signals, host /proc, privileges
# ---------------------------------------------------------------------------------------------------------

def test_signal_storm_spares_the_kernel_and_host_processes(kernel, canaries):
    as_root, as_nobody = canaries
    host_pids = [kernel.pid, as_root.pid, as_nobody.pid, os.getpid(), 1]
    cell = kernel.attack(f"""
        me = os.getpid()
        own_threads = {{int(tid) for tid in os.listdir("/proc/self/task")}}
        delivered, denied = [], []
        for pid in list(range(1, 65536)) + {host_pids!r}:
            if pid == me or pid in own_threads:
                continue
            try:
                os.kill(pid, 9)
                delivered.append(pid)
            except ProcessLookupError:
                pass
            except PermissionError:
                denied.append(pid)
        try:
            os.kill(-1, 9)
            everyone = "sent"
        except OSError as error:
            everyone = errno.errorcode.get(error.errno)
        try:
            os.kill(-{kernel.pid}, 9)
            group = "sent"
        except OSError as error:
            group = errno.errorcode.get(error.errno)
        report(me=me, delivered=delivered, denied=denied, everyone=everyone, group=group)
    """)
    result = cell.result()
    assert result["me"] == 1
    assert result["delivered"] == [] and result["denied"] == [], result
    assert result["everyone"] in ("ESRCH", "sent") and result["group"] == "ESRCH", result
    time.sleep(0.3)
    assert as_root.poll() is None and as_nobody.poll() is None, "a host canary was killed"
    assert kernel.alive()


def test_host_proc_and_kernel_memory_are_out_of_reach(kernel):
    connection_file, info = kernel.connection_key()
    kernel_pid = kernel.pid
    cell = kernel.attack(f"""
        outcomes = {{}}
        for pid in [{kernel_pid}, {os.getpid()}]:
            for part in ["environ", "cmdline", "mem", "maps", "root{connection_file}", "cwd", "fd"]:
                path = "/proc/%d/%s" % (pid, part)
                try:
                    outcomes[path] = os.listdir(path) if os.path.isdir(path) else open(path, "rb").read(64).hex()
                except OSError as error:
                    outcomes[path] = errno.errorcode.get(error.errno)
            PTRACE_ATTACH, PROCESS_VM_READV = 16, 310
            outcomes["ptrace %d" % pid] = syscall(101, PTRACE_ATTACH, pid, 0, 0)[1]
            buffer = ctypes.create_string_buffer(64)
            local = (ctypes.c_void_p * 2)(ctypes.addressof(buffer), 64)
            remote = (ctypes.c_void_p * 2)(0x400000, 64)
            outcomes["vm_readv %d" % pid] = syscall(PROCESS_VM_READV, pid, ctypes.addressof(local), 1,
                                                     ctypes.addressof(remote), 1, 0)[1]
        outcomes["pidfd_open"] = syscall(434, {kernel_pid}, 0)[1]
        report(**outcomes)
    """)
    result = cell.result()
    for name, outcome in result.items():
        if name.startswith("/proc/"):
            assert outcome == "ENOENT", (name, outcome)
        else:
            assert outcome in ("ESRCH", "EPERM"), (name, outcome)
    assert info["key"] not in cell.everything and kernel.host_env_secret not in cell.everything


def test_privilege_escalation_fails_and_the_worker_is_unprivileged_on_the_host(kernel):
    cell = kernel.attack("""
        outcomes = {}
        for name, call in [("setuid0", lambda: os.setuid(0)), ("setgid0", lambda: os.setgid(0)),
                           ("setgroups", lambda: os.setgroups([0])), ("chroot", lambda: os.chroot("/tmp"))]:
            try:
                call()
                outcomes[name] = "OK"
            except OSError as error:
                outcomes[name] = errno.errorcode.get(error.errno)
        CLONE_NEWUSER, CLONE_NEWNS = 0x10000000, 0x00020000
        outcomes["unshare-user"] = syscall(272, CLONE_NEWUSER)[1]
        outcomes["unshare-mount"] = syscall(272, CLONE_NEWNS)[1]
        outcomes["mount"] = "OK" if libc.mount(b"none", b"/tmp", b"tmpfs", 0, None) == 0 else \\
            errno.errorcode.get(ctypes.get_errno())
        outcomes["caps"] = [line for line in open("/proc/self/status") if line.startswith("CapEff")][0].split()[1]
        report(**outcomes)
    """)
    result = cell.result()
    assert result.pop("caps") == "0000000000000000"
    for name, outcome in result.items():
        assert outcome in ("EPERM", "EINVAL", "ENOSPC"), (name, outcome)
    # Host side: the worker runs as an unprivileged session uid with no capabilities and no_new_privs.
    status = process_status(kernel.worker_pid())
    uid = kernel.session_uid()
    assert status["Uid"].split() == [str(uid)] * 4 and status["Gid"].split()[0] == str(uid)
    assert status["CapEff"] == status["CapPrm"] == status["CapBnd"] == "0000000000000000"
    assert status["NoNewPrivs"] == "1" and status["Seccomp"] == "2"


def test_children_killing_everyone_cannot_take_down_the_worker(kernel, canaries):
    cell = kernel.attack("""
        import subprocess
        outcomes = {}
        for name, code in [("kill(-1)", "import os; os.kill(-1, 9)"), ("kill(1)", "import os; os.kill(1, 9)"),
                           ("kill(parent)", "import os; os.kill(os.getppid(), 9)")]:
            child = subprocess.run(["/usr/bin/python3", "-c", code], capture_output=True, text=True)
            outcomes[name] = [child.returncode, (child.stderr.strip().splitlines() or [""])[-1]]
        outcomes["shell"] = subprocess.run(["/bin/sh", "-c", "kill -9 -1; kill -9 1; echo done"],
                                           capture_output=True, text=True).stdout.strip()
        report(**outcomes)
    """)
    result = cell.result()
    # The worker is its namespace's init: kill(-1) from inside spares it (nobody else to hit: ESRCH), and
    # a SIGKILL aimed at it from inside its namespace is delivered but has no effect. The fixture then
    # checks that the same worker answers with its state.
    assert result["kill(-1)"][0] == 1 and result["kill(-1)"][1].startswith("ProcessLookupError"), result
    assert result["kill(1)"] == result["kill(parent)"] == [0, ""], result
    assert result["shell"] == "done"
    assert all(process.poll() is None for process in canaries)


def test_kernel_attack_surface_syscalls_are_refused(kernel):
    cell = kernel.attack("""
        import fcntl, termios
        ADDR_NO_RANDOMIZE, READ_IMPLIES_EXEC = 0x0040000, 0x0400000
        calls = {"io_uring_setup": (425, 8, 0), "bpf": (321, 0, 0, 0), "keyctl": (250, 0, -3, 1),
                 "add_key": (248, 0, 0, 0, 0, -3), "perf_event_open": (298, 0, 0, -1, -1, 0),
                 "userfaultfd": (323, 0), "kexec_load": (246, 0, 0, 0, 0), "init_module": (175, 0, 0, 0),
                 "setns": (308, 0, 0), "pidfd_getfd": (438, 0, 3, 0), "open_tree": (428, -100, 0, 1),
                 "personality no-aslr": (135, ADDR_NO_RANDOMIZE), "personality exec": (135, READ_IMPLIES_EXEC)}
        outcomes = {name: syscall(*args)[1] for name, args in calls.items()}
        try:
            fcntl.ioctl(0, termios.TIOCSTI, b"x")
            outcomes["TIOCSTI"] = "OK"
        except OSError as error:
            outcomes["TIOCSTI"] = errno.errorcode.get(error.errno)
        report(**outcomes)
    """)
    result = cell.result()
    assert result.pop("io_uring_setup") == "ENOSYS"
    assert result.pop("TIOCSTI") in ("EPERM", "ENOTTY")
    for name, outcome in result.items():
        assert outcome == "EPERM", (name, outcome)
    # Host side: the worker still runs with full address-space randomisation.
    assert Path(f"/proc/{kernel.worker_pid()}/personality").read_text().strip() == "00000000"


def test_file_size_fd_and_thread_exhaustion_fail_cleanly(kernel):
    policy_limits = json.loads(DEFAULT_POLICY.read_text())["limits"]
    cell = kernel.attack("""
        import threading
        outcomes = {}
        # A file beyond RLIMIT_FSIZE in the host-backed workspace (sparse, so the attempt itself is cheap).
        huge = os.open("/workspace/huge.bin", os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            os.pwrite(huge, b"x", 300 * 1024 * 1024)
            outcomes["huge"] = "written"
        except OSError as error:
            outcomes["huge"] = errno.errorcode.get(error.errno)
        finally:
            os.close(huge)
        held = []
        try:
            while len(held) < 100000:
                held.append(os.open("/dev/null", os.O_RDONLY))
            outcomes["fds"] = "unbounded"
        except OSError as error:
            outcomes["fds"] = [errno.errorcode.get(error.errno), len(held)]
        for fd in held:
            os.close(fd)
        release, threads = threading.Event(), []
        try:
            while len(threads) < 5000:
                thread = threading.Thread(target=release.wait)
                thread.start()
                threads.append(thread)
            outcomes["threads"] = "unbounded"
        except RuntimeError as error:
            outcomes["threads"] = ["RuntimeError", len(threads)]
        release.set()
        for thread in threads:
            thread.join()
        report(**outcomes)
    """)
    result = cell.result()
    assert result["huge"] == "EFBIG"
    assert result["fds"][0] == "EMFILE" and result["fds"][1] < policy_limits["open_files"]
    assert result["threads"][0] == "RuntimeError" and result["threads"][1] < policy_limits["pids"]
    # Host side: the workspace file stayed within the limit.
    huge = kernel.workspace / "huge.bin"
    assert huge.stat().st_size <= 256 * 1024 * 1024
    huge.unlink()


# ---------------------------------------------------------------------------------------------------------
# Filesystem: writes outside the workspace, symlinks planted in it
# ---------------------------------------------------------------------------------------------------------

def test_writes_outside_the_workspace_do_not_reach_the_host(kernel):
    token = "cellblock-hostile-" + secrets.token_hex(6)
    host_tmp_file = Path("/tmp") / token
    host_tmp_file.write_text("host original\n")
    guarded = {path: sha256(path) for path in ["/etc/passwd", "/etc/hosts", "/usr/bin/python3", str(host_tmp_file)]}
    new_paths = [f"/usr/{token}", f"/etc/{token}", f"/{token}", f"/var/{token}", f"/root/{token}"]
    hostname = socket.gethostname()
    try:
        cell = kernel.attack(f"""
            outcomes = {{}}
            for path, mode in [("/usr/bin/python3", "ab"), ("/etc/passwd", "ab"), ("/etc/hosts", "wb"),
                               ("/workspace/../{token}", "wb")] + [(p, "wb") for p in {new_paths!r}] + \\
                              [("/tmp/{token}", "wb"), ("/proc/sys/kernel/hostname", "wb")]:
                try:
                    with open(path, mode) as handle:
                        handle.write(b"pwned\\n")
                    outcomes[path] = "written"
                except OSError as error:
                    outcomes[path] = errno.errorcode.get(error.errno)
            for name, call in [("chmod", lambda: os.chmod("/usr/bin/python3", 0o777)),
                               ("rename", lambda: os.rename("/etc/passwd", "/etc/passwd.old")),
                               ("unlink", lambda: os.unlink("/etc/hosts"))]:
                try:
                    call()
                    outcomes[name] = "done"
                except OSError as error:
                    outcomes[name] = errno.errorcode.get(error.errno)
            report(**outcomes)
        """)
        result = cell.result()
        # /tmp is private to the session: the write succeeds there and nowhere else.
        assert result.pop(f"/tmp/{token}") == "written"
        for path, outcome in result.items():
            assert outcome in ("EROFS", "EACCES", "EPERM", "ENOENT", "EBUSY"), (path, outcome)
        for path, digest in guarded.items():
            assert sha256(path) == digest, f"host file {path} changed"
        assert host_tmp_file.read_text() == "host original\n"
        for path in new_paths:
            assert not os.path.lexists(path), f"{path} appeared on the host"
        assert socket.gethostname() == hostname
    finally:
        host_tmp_file.unlink()


def test_symlink_planted_in_the_workspace_does_not_write_the_host_target(kernel, host_secret):
    value, secret_path = host_secret
    before = sha256(secret_path)
    cell = kernel.attack(f"""
        target = {str(secret_path)!r}
        outcomes = {{}}
        os.symlink(target, "/workspace/planted")
        os.symlink("../../../../../../.." + target, "/workspace/planted-relative")
        for name in ["planted", "planted-relative"]:
            try:
                outcomes["read " + name] = open("/workspace/" + name).read()
            except OSError as error:
                outcomes["read " + name] = errno.errorcode.get(error.errno)
        try:
            os.link(target, "/workspace/hardlink")
            outcomes["hardlink"] = "linked"
        except OSError as error:
            outcomes["hardlink"] = errno.errorcode.get(error.errno)
        # Make the path exist inside (in the private /tmp), then write through the symlink.
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open("/workspace/planted", "w") as handle:
            handle.write("pwned\\n")
        outcomes["inside"] = open(target).read()
        report(**outcomes)
    """)
    result = cell.result()
    assert result["read planted"] == result["read planted-relative"] == "ENOENT", result
    assert result["hardlink"] == "ENOENT"
    assert result["inside"] == "pwned\n", "the write landed in the worker's private /tmp"
    assert value not in cell.everything
    assert sha256(secret_path) == before, "the host file behind the planted symlink changed"
    planted = kernel.workspace / "planted"
    assert planted.is_symlink() and os.readlink(planted) == str(secret_path)
    planted.unlink()
    (kernel.workspace / "planted-relative").unlink()


# ---------------------------------------------------------------------------------------------------------
# Persistence and resources (these kill workers or kernels)
# ---------------------------------------------------------------------------------------------------------

def test_background_processes_do_not_outlive_the_kernel(own_kernel):
    k = own_kernel("persistence")
    cell = k.attack("""
        import signal, subprocess, time
        sleeper = subprocess.Popen(["sleep", "1000"], start_new_session=True)
        if os.fork() == 0:
            os.setsid()
            signal.signal(signal.SIGHUP, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            if os.fork() == 0:
                os.closerange(0, 1024)
                while True:
                    with open("/workspace/heartbeat", "a") as handle:
                        handle.write("beat\\n")
                    time.sleep(0.05)
            os._exit(0)
        time.sleep(0.5)
        report(sleeper=sleeper.pid)
    """)
    assert cell.result()["sleeper"] > 1
    uid = k.session_uid()
    heartbeat = k.workspace / "heartbeat"
    deadline = time.monotonic() + 30
    while not heartbeat.exists():
        assert time.monotonic() < deadline, "the daemon never wrote its heartbeat"
        time.sleep(0.1)
    assert heartbeat.stat().st_uid == uid, "the daemon's files belong to the session uid"
    names = [name for _, name in session_processes(uid)]
    assert any("sleep" in name for name in names) and len(names) >= 3, f"the attack should be running: {names}"
    with WorkerNamespace(k.worker_pid()) as namespace:
        k.shutdown()
        assert not k.alive()
        assert_no_session_process(uid)
        namespace.assert_emptied()
    size = heartbeat.stat().st_size
    time.sleep(0.5)
    assert heartbeat.stat().st_size == size, "the daemon kept writing after its kernel shut down"


def test_memory_bomb_kills_only_the_worker(own_kernel):
    # The memory limit of `limited`, not its 5 s time limit: on a loaded VM faulting in 256 MB can take longer,
    # and then the time limit, not the memory limit, ended the cell.
    bombed = own_kernel("bombed", CELLBLOCK_MEMORY_MB=256, CELLBLOCK_TIMEOUT_S=120)
    assert bombed.execute("doomed = 1").content["status"] == "ok"
    with WorkerNamespace(bombed.worker_pid()) as namespace:
        cell = bombed.execute("blocks = []\nwhile True:\n    blocks.append(bytearray(32 * 1024 * 1024))",
                              timeout=180)
        assert_worker_died(cell, "memory limit")
        namespace.assert_emptied()
    after = bombed.execute("'doomed' in dir()")
    assert after.value() == "False" and "restarted" in after.stream("stderr")
    bombed.assert_serving()


def test_fork_bomb_is_contained_and_the_next_cell_gets_a_fresh_worker(limited, canaries):
    pids_limit = json.loads(DEFAULT_POLICY.read_text())["limits"]["pids"]
    with WorkerNamespace(limited.worker_pid()) as namespace:
        # Host side, while the bomb runs: how many processes its namespace ever holds.
        counts, stop = [], threading.Event()

        def sample():
            while not stop.is_set():
                counts.append(len(namespace.processes()))
                time.sleep(0.05)

        sampler = threading.Thread(target=sample)
        sampler.start()
        started = time.monotonic()
        try:
            cell = limited.execute(textwrap.dedent("""
                import os, signal
                signal.signal(signal.SIGINT, signal.SIG_IGN)   # ignore the kernel's interrupt: it must kill
                while True:
                    try:
                        os.fork()
                    except OSError:
                        pass
            """), timeout=120)
        finally:
            stop.set()
            sampler.join()
        # The pids limit stops the bomb; the time limit (or, when the copies' private pages fill the
        # cgroup first, the memory limit) ends the worker, which ignores the interrupt.
        assert_worker_died(cell, "time limit", "memory limit")
        assert time.monotonic() - started < 60
        assert 32 <= max(counts) <= pids_limit, f"processes in the bomb's namespace: max {max(counts)}"
        namespace.assert_emptied()
    # The host can still start processes and its canaries live.
    assert subprocess.run(["/usr/bin/true"], timeout=30).returncode == 0
    assert all(process.poll() is None for process in canaries)
    after = limited.execute("import os; os.getpid()")
    assert after.value() == "1" and "restarted" in after.stream("stderr")
    limited.assert_serving()


def test_infinite_output_is_capped_and_the_kernel_keeps_serving(limited):
    assert limited.execute("kept = 'still here'").content["status"] == "ok"
    cell = limited.execute("while True:\n    print('x' * 4096)", timeout=120)
    assert cell.content["ename"] == "TimeoutError", cell.content
    assert len(cell.stream().encode()) <= 65536
    # Head and tail of the stream, with the kernel's note of what was left out between them.
    assert "Output truncated" in cell.stream() and cell.stream().rstrip().endswith("xxxx")
    limited.assert_serving(kept="still here")
    # The same through a child writing straight to fd 1 while os.system() makes the worker ignore SIGINT.
    with WorkerNamespace(limited.worker_pid()) as namespace:
        cell = limited.execute("import os\nos.system('trap \"\" INT; yes')", timeout=120)
        assert_worker_died(cell, "time limit")
        assert len(cell.stream().encode()) <= 65536
        namespace.assert_emptied()
    limited.assert_serving()


def test_forged_frame_on_the_worker_channel_kills_only_the_worker(limited):
    with WorkerNamespace(limited.worker_pid()) as namespace:
        # A frame header claiming 4 GiB, then a forged reply: the kernel must not wait for (or believe) it.
        cell = limited.execute("import os, time\nos.write(3, b'\\xff\\xff\\xff\\xff{\"type\": \"reply\"}')\n"
                               "time.sleep(30)", timeout=60)
        assert_worker_died(cell, "protocol error")
        namespace.assert_emptied()
    limited.assert_serving()


def test_channel_flood_does_not_grow_the_kernel(kernel):
    """Large display frames (each under the 64 MiB frame cap) parsed by the unconfined kernel: its memory
    stays bounded by one frame's worth, not the total sent, and the output cap holds."""
    before = int(process_status(kernel.pid)["VmRSS"].split()[0]) * 1024
    frame_mib, count = 16, 24
    cell = kernel.execute(textwrap.dedent(f"""
        import json, os, struct
        payload = json.dumps({{"type": "display_data", "data": {{"text/plain": "x" * ({frame_mib} << 20)}},
                              "metadata": {{}}, "transient": {{}}}}).encode()
        frame = memoryview(struct.pack(">I", len(payload)) + payload)
        for _ in range({count}):
            view = frame
            while view:
                view = view[os.write(3, view):]
        print("sent")
    """), timeout=180)
    assert cell.content["status"] == "ok", cell.content
    assert "Output truncated" in cell.stream("stderr")
    assert not [m for m in cell.messages if m["msg_type"] == "display_data"], "a 16 MiB display passed a 64 KiB cap"
    peak = int(process_status(kernel.pid)["VmHWM"].split()[0]) * 1024
    assert peak - before < (count * frame_mib << 20) // 2, f"kernel peak RSS grew by {(peak - before) >> 20} MiB"
    kernel.assert_serving()


def test_planted_links_do_not_make_a_worker_restart_touch_host_files(limited, tmp_path):
    """A restart gives the workspace to the new session uid (as root, on the host): links planted by the
    old session must not redirect that to host files."""
    host_dir = tmp_path / "host-private"
    host_dir.mkdir(mode=0o700)
    host_file = host_dir / "secret.txt"
    host_file.write_text("root only\n")
    host_file.chmod(0o600)
    before = {path: (path.stat().st_uid, path.stat().st_mode, sha256(path) if path.is_file() else None)
              for path in (host_dir, host_file)}
    cell = limited.execute(textwrap.dedent(f"""
        import os
        os.makedirs("/workspace/nested", exist_ok=True)
        for name, target in [("link-file", {str(host_file)!r}), ("link-dir", {str(host_dir)!r}),
                             ("nested/link-file", {str(host_file)!r}), ("link-etc", "/etc/shadow")]:
            if os.path.lexists("/workspace/" + name):
                os.unlink("/workspace/" + name)
            os.symlink(target, "/workspace/" + name)
        os.mkfifo("/workspace/fifo")
        os._exit(7)
    """))
    assert_worker_died(cell, "exited with status 7")
    # The next cell starts a new session, which adopts the workspace.
    cell = limited.execute("import os; sorted(os.listdir('/workspace'))")
    assert cell.content["status"] == "ok" and "link-file" in cell.value(), cell.content
    uid = limited.session_uid()
    assert (limited.workspace / "nested").stat().st_uid == uid
    assert os.lstat(limited.workspace / "link-file").st_uid == uid
    for path, (owner, mode, digest) in before.items():
        info = path.stat()
        assert (info.st_uid, info.st_mode) == (owner, mode), f"{path} changed owner or mode"
        assert digest is None or sha256(path) == digest
    assert os.stat("/etc/shadow").st_uid == 0
    for name in ("link-file", "link-dir", "nested/link-file", "link-etc", "fifo"):
        (limited.workspace / name).unlink()
    limited.assert_serving()


# ---------------------------------------------------------------------------------------------------------
# Two kernels attacking each other
# ---------------------------------------------------------------------------------------------------------

def test_two_kernels_cannot_reach_each_other(kernel, own_kernel):
    marker_text = "A-PRIVATE-" + secrets.token_hex(8)
    setup = kernel.execute(textwrap.dedent(f"""
        import socket
        with open("/workspace/a-marker.txt", "w") as handle:
            handle.write({marker_text!r})
        a_listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        a_listener.bind("\\0cellblock-kernel-a")
        a_listener.listen(1)
        a_state = "untouched"
    """))
    assert setup.content["status"] == "ok", setup.content
    marker = kernel.workspace / "a-marker.txt"
    before = sha256(marker)
    a_worker = kernel.worker_pid()
    b = own_kernel("kernel-b")
    assert b.session_uid() != kernel.session_uid()
    cell = b.attack(f"""
        outcomes = {{}}
        guesses = [{str(marker)!r}, {str(kernel.workspace)!r}, "/proc/{a_worker}/root/workspace/a-marker.txt",
                   "/proc/{a_worker}/cwd/a-marker.txt", "/proc/{kernel.pid}/root{marker}",
                   "/var/lib/cellblock/workspaces", "/tmp/a-marker.txt", "/workspace/../a-marker.txt"]
        walked = []  # before the writes below, which may create a-marker.txt in the own /tmp
        for directory, dirs, files in os.walk("/"):
            if directory == "/":
                dirs[:] = [d for d in dirs if d not in ("usr", "workspace")]
            walked += [os.path.join(directory, f) for f in files if f == "a-marker.txt"]
        outcomes["walked"] = walked
        for path in guesses:
            try:
                outcomes[path] = os.listdir(path) if os.path.isdir(path) else open(path).read()
            except OSError as error:
                outcomes[path] = errno.errorcode.get(error.errno)
            try:
                with open(path, "a") as handle:
                    handle.write("tampered")
                outcomes["write " + path] = "written"
            except OSError as error:
                outcomes["write " + path] = errno.errorcode.get(error.errno)
        delivered = []
        own_threads = {{int(tid) for tid in os.listdir("/proc/self/task")}}
        for pid in [p for p in list(range(2, 65536)) + [{a_worker}, {kernel.pid}] if p not in own_threads]:
            try:
                os.kill(pid, 9)
                delivered.append(pid)
            except OSError:
                pass
        outcomes["delivered"] = delivered
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect("\\0cellblock-kernel-a")
            outcomes["abstract"] = "connected"
        except OSError as error:
            outcomes["abstract"] = errno.errorcode.get(error.errno)
        report(**outcomes)
    """)
    result = cell.result()
    assert result.pop("walked") == [] and result.pop("delivered") == []
    assert result.pop("abstract") == "ECONNREFUSED"
    for path, outcome in result.items():
        if path.startswith("write /tmp/") or path == "write /workspace/../a-marker.txt":
            continue  # B's own private /tmp and root: allowed to fail or land there, never in A's workspace
        assert outcome in ("ENOENT", "EROFS", "EACCES"), (path, outcome)
    assert marker_text not in cell.everything
    assert sha256(marker) == before and marker.read_text() == marker_text
    # A's worker was not signalled: same process, same state, its socket still listening.
    assert kernel.worker_pid() == a_worker
    kernel.assert_serving(a_state="untouched")
    check = kernel.execute("a_listener.getsockname()")
    assert check.content["status"] == "ok" and "cellblock-kernel-a" in check.value()
    kernel.execute("a_listener.close()")
