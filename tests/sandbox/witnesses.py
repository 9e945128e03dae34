"""Host-side witnesses for the hostile battery, for attacks whose own report proves nothing.

- The installed seccomp filter, read from the host (PTRACE_SECCOMP_GET_FILTER) and evaluated for a syscall
  and its arguments: proves the rule itself exists, where the kernel's own capability check would give the
  same EPERM without it.
- Held attacks: the attack code calls hold(name) where its effect must be visible, and the host looks at the
  sandboxed process (/proc/<pid>/...) before releasing it.
- A host canary process of the session's own host uid, which records every signal it receives and keeps a
  secret in its memory: nothing but the sandbox stands between the attack and it.
- Positive controls: the same attack code run unconfined on the host (as a dedicated unprivileged uid where
  it could do harm), to show that each witness fires when the protection is missing.

Fixtures defined here are imported by the test modules (conftest.py belongs to the shared harness).
"""
import ctypes
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest

from conftest import PRELUDE, UID_COUNT, UID_FIRST, Run, Sandbox, assert_no_session_process, session_processes

PYTHON = "/usr/bin/python3"

# ---------------------------------------------------------------------------------------------------------
# Held attacks
# ---------------------------------------------------------------------------------------------------------

# Appended to the battery's PRELUDE. In the sandbox the hold directory is the workspace; an unconfined
# positive control gets a host directory through CELLBLOCK_HOLD_DIR (the sandbox's environment is the
# policy's, so the variable never reaches a sandboxed attack).
HOLD_PRELUDE = textwrap.dedent(
    """
    import time as _hold_time
    HOLD_DIR = os.environ.get("CELLBLOCK_HOLD_DIR", "/workspace")
    def hold(name):
        print("HOLD " + name, flush=True)
        while not os.path.exists(os.path.join(HOLD_DIR, "release-" + name)):
            _hold_time.sleep(0.02)
    def target():
        path = os.path.join(HOLD_DIR, "target.json")
        while not os.path.exists(path):
            _hold_time.sleep(0.02)
        with open(path) as handle:
            return json.load(handle)
    """
)

HOLD_TIMEOUT = 120  # generous: the test machine may be heavily loaded


class HeldAttack:
    """A background attack (sandboxed or not) whose hold points the host waits for and releases."""

    def __init__(self, argv, hold_dir, *, env=None, user=None):
        self.hold_dir = Path(hold_dir)
        self.started = time.monotonic()
        self.process = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
            errors="replace", env=env if env is not None else os.environ.copy(), cwd="/",
            **({"user": user, "group": user, "extra_groups": []} if user is not None else {}))
        self.stdout_lines, self.stderr_chunks = [], []
        self.changed = threading.Condition()
        self.readers = [threading.Thread(target=self._read_stdout, daemon=True),
                        threading.Thread(target=self._read_stderr, daemon=True)]
        for reader in self.readers:
            reader.start()

    def _read_stdout(self):
        for line in self.process.stdout:
            with self.changed:
                self.stdout_lines.append(line)
                self.changed.notify_all()
        with self.changed:
            self.changed.notify_all()

    def _read_stderr(self):
        self.stderr_chunks.append(self.process.stderr.read())

    @property
    def stdout(self):
        with self.changed:
            return "".join(self.stdout_lines)

    def wait_hold(self, name):
        deadline = time.monotonic() + HOLD_TIMEOUT
        with self.changed:
            while f"HOLD {name}\n" not in self.stdout_lines:
                if self.process.poll() is not None and not self.readers[0].is_alive():
                    raise AssertionError(f"the attack ended before hold {name!r}: rc={self.process.returncode}\n"
                                         f"stdout={''.join(self.stdout_lines)[-2000:]}")
                if time.monotonic() > deadline:
                    raise AssertionError(f"the attack never reached hold {name!r}")
                self.changed.wait(0.2)

    def provide(self, **values):
        """Writes target.json for the attack's target() (atomically: the attack may poll for it)."""
        staging = self.hold_dir / ".target.json.tmp"
        staging.write_text(json.dumps(values))
        staging.chmod(0o644)
        staging.rename(self.hold_dir / "target.json")

    def release(self, name):
        marker = self.hold_dir / f"release-{name}"
        marker.write_text("")
        marker.chmod(0o644)

    def finish(self):
        try:
            self.process.wait(timeout=HOLD_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise
        for reader in self.readers:
            reader.join()
        return self.process.returncode, self.stdout, "".join(self.stderr_chunks)


class SandboxedAttack(HeldAttack):
    def __init__(self, sandbox: Sandbox, code, **options):
        self.workspace = sandbox.workspace()
        argv = sandbox.command([PYTHON, "-c", PRELUDE + HOLD_PRELUDE + textwrap.dedent(code)],
                               workspace=self.workspace, **options)
        super().__init__(argv, self.workspace)

    @property
    def uid(self):
        """The session's host uid (the launcher hands it the workspace before the program starts)."""
        uid = self.workspace.stat().st_uid
        assert UID_FIRST <= uid < UID_FIRST + UID_COUNT, f"workspace not owned by a session uid: {uid}"
        return uid

    def pids(self):
        """Host pids of the session's processes."""
        return [pid for pid, _ in session_processes(self.uid)]

    def program_pid(self):
        """Host pid of the sandboxed program (pid 1 inside), while it holds."""
        for pid in self.pids():
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("NSpid:") and line.split()[-1] == "1":
                    return pid
        raise AssertionError(f"no pid 1 of the sandbox among the session's processes {self.pids()}")

    def run(self, after_exit=None):
        """Waits for the end; `after_exit()` runs before the leftover check (e.g. to stop a canary of the
        session uid, which a tracing attack may hold until it exits)."""
        returncode, stdout, stderr = self.finish()
        if after_exit:
            after_exit()
        uid = self.uid
        assert_no_session_process(uid)
        return Run(returncode, stdout, stderr, uid, self.workspace, time.monotonic() - self.started)


class UnconfinedAttack(HeldAttack):
    """The same attack code on the host, without the sandbox: the positive control of a witness."""

    def __init__(self, code, *, user=None, wrapper=()):
        """`wrapper` is an argv prefix the python command is appended to (e.g. a private mount namespace)."""
        self.directory = Path(tempfile.mkdtemp(prefix="cellblock-control-"))
        self.directory.chmod(0o755)
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "CELLBLOCK_HOLD_DIR": str(self.directory)}
        super().__init__([*wrapper, PYTHON, "-c", PRELUDE + HOLD_PRELUDE + textwrap.dedent(code)], self.directory,
                         env=env, user=user)

    def run(self, after_exit=None):
        try:
            returncode, stdout, stderr = self.finish()
            if after_exit:
                after_exit()
        finally:
            shutil.rmtree(self.directory, ignore_errors=True)
        return Run(returncode, stdout, stderr, -1, self.directory, time.monotonic() - self.started)


# Runs a command and reports, from the host, what the kernel accounted for it and every descendant it reaped
# (the CLI reaps the sandboxed program, which reaps its own children): peak RSS and CPU time.
MEASURE = textwrap.dedent(
    """
    import resource, subprocess, sys, time
    started = time.monotonic()
    code = subprocess.run(sys.argv[1:], stdin=subprocess.DEVNULL).returncode
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    print("MEASURED", usage.ru_maxrss, usage.ru_utime + usage.ru_stime, time.monotonic() - started, file=sys.stderr)
    sys.exit(code if code >= 0 else 128 - code)
    """
)


class Measured:
    def __init__(self, argv, limit=300):
        completed = subprocess.run([PYTHON, "-c", MEASURE, *argv], capture_output=True, text=True, errors="replace",
                                   stdin=subprocess.DEVNULL, timeout=limit)
        self.returncode, self.stdout = completed.returncode, completed.stdout
        self.stderr, _, last = completed.stderr.rpartition("MEASURED ")
        maxrss_kib, cpu, wall = last.split()
        self.max_rss_mib, self.cpu_seconds, self.wall_seconds = int(maxrss_kib) / 1024, float(cpu), float(wall)


def cgroup_dirs(pid):
    """Host directories of a process's cgroups: {controller: path} for v1 hierarchies, {"": path} for v2's."""
    paths = {}
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for each in controllers.split(",") if controllers else [""]:
            paths[each] = path
    dirs = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        kind, options = fields[fields.index("-") + 1], fields[fields.index("-") + 3].split(",")
        if kind == "cgroup":
            dirs.update({each: Path(fields[4] + paths[each]) for each in options if each in paths})
        elif kind == "cgroup2" and "" in paths:
            dirs[""] = Path(fields[4] + paths[""])
    return dirs


def cgroup_file(pid, controller, name):
    """The content of a cgroup control file of a host process: the v1 hierarchy with `controller`, else v2."""
    dirs = cgroup_dirs(pid)
    for hierarchy in (controller, ""):
        if hierarchy in dirs:
            return (dirs[hierarchy] / name).read_text().strip()
    raise AssertionError(f"no cgroup hierarchy with {controller} for pid {pid}")


def unused_uid():
    """A host uid with no process, for unconfined controls that must only be able to reach their canary."""
    for candidate in range(UID_FIRST + UID_COUNT + 1000, UID_FIRST + UID_COUNT + 2000):
        if not session_processes(candidate):
            return candidate
    raise AssertionError("no free uid for an unconfined control")


def unconfined(code, **options):
    """Runs attack code unconfined to completion (no hold points); returns its Run."""
    return UnconfinedAttack(code, **options).run()


# ---------------------------------------------------------------------------------------------------------
# Network
# ---------------------------------------------------------------------------------------------------------

class PacketWitness:
    """Every frame on every host interface (AF_PACKET, ETH_P_ALL: sent and received, loopback included) that
    carries a given byte string: sees a packet whatever its destination."""

    def __init__(self, needle: bytes):
        self.needle = needle
        self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
        self.sock.setsockopt(socket.SOL_SOCKET, 33, 16 << 20)   # SO_RCVBUFFORCE: keep up on a busy host
        self.sock.settimeout(0.2)
        self.hits = []
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._capture, daemon=True)
        self.thread.start()

    def _capture(self):
        while not self.stopped.is_set():
            try:
                frame, address = self.sock.recvfrom(65536)
            except (socket.timeout, OSError):
                continue
            if self.needle in frame:
                self.hits.append((address[0], frame))

    def close(self):
        self.stopped.set()
        self.thread.join()
        self.sock.close()


@pytest.fixture
def packet_witness():
    opened = []

    def open_witness(needle):
        witness = PacketWitness(needle)
        opened.append(witness)
        return witness

    yield open_witness
    for witness in opened:
        witness.close()


# ---------------------------------------------------------------------------------------------------------
# Host canary
# ---------------------------------------------------------------------------------------------------------

CANARY_CODE = textwrap.dedent(
    """
    import ctypes, json, os, signal, sys
    secret = ctypes.create_string_buffer(sys.argv[1].encode())
    def note(number, frame):
        os.write(1, b"SIGNAL %d\\n" % number)
    for number in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGHUP, signal.SIGINT, signal.SIGALRM,
                   signal.SIGCONT, signal.SIGWINCH):
        signal.signal(number, note)
    os.write(1, (json.dumps({"address": ctypes.addressof(secret), "length": len(secret.value)}) + "\\n").encode())
    while True:
        signal.pause()
    """
)
# The host's own marker: once the canary reports it, every signal sent before it has been handled too.
MARKER = signal.SIGWINCH


class HostCanary:
    """A host process of a given uid that records each signal it handles and keeps a secret in memory."""

    def __init__(self, uid):
        self.secret = "CANARYSECRET-" + secrets.token_hex(16)
        self.process = subprocess.Popen([PYTHON, "-c", CANARY_CODE, self.secret], stdout=subprocess.PIPE,
                                        stdin=subprocess.DEVNULL, cwd="/", user=uid, group=uid, extra_groups=[])
        self.pid = self.process.pid
        self.memory = json.loads(self.process.stdout.readline())
        self.signals = []
        self.changed = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.process.stdout:
            with self.changed:
                self.signals.append(int(line.split()[1]))
                self.changed.notify_all()

    def status(self, field):
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return line.split(":", 1)[1].strip()
        raise AssertionError(f"no {field} in /proc/{self.pid}/status")

    def tracer(self):
        return int(self.status("TracerPid"))

    def handled_signals(self):
        """The signals handled so far, excluding the host's marker, or None when the canary is dead. Waiting for
        the marker proves the canary runs (not stopped) and has handled every signal sent before it."""
        with self.changed:
            before = self.signals.count(MARKER)
        try:
            os.kill(self.pid, MARKER)
        except ProcessLookupError:
            return None
        deadline = time.monotonic() + 30
        with self.changed:
            while self.signals.count(MARKER) <= before:
                if self.process.poll() is not None:
                    return None
                assert time.monotonic() < deadline, f"the canary handled no marker (state {self.status('State')})"
                self.changed.wait(0.1)
            return [number for number in self.signals if number != MARKER]

    def stop(self):
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.reader.join()
        self.process.stdout.close()


# ---------------------------------------------------------------------------------------------------------
# The installed seccomp filter
# ---------------------------------------------------------------------------------------------------------

AUDIT_ARCH_X86_64 = 0xC000003E
AUDIT_ARCH_I386 = 0x40000003
PTRACE_DETACH, PTRACE_SEIZE, PTRACE_INTERRUPT, PTRACE_SECCOMP_GET_FILTER = 17, 0x4206, 0x4207, 0x420C
SYS_PTRACE = 101
WALL = 0x40000000

ACTIONS = {0x80000000: "KILL_PROCESS", 0x00000000: "KILL_THREAD", 0x00030000: "TRAP", 0x00050000: "ERRNO",
           0x7FC00000: "USER_NOTIF", 0x7FF00000: "TRACE", 0x7FFC0000: "LOG", 0x7FFF0000: "ALLOW"}


class SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


_libc = ctypes.CDLL(None, use_errno=True)


def _ptrace(request, pid, addr=0, data=0):
    result = _libc.syscall(ctypes.c_long(SYS_PTRACE), ctypes.c_long(request), ctypes.c_long(pid),
                           ctypes.c_void_p(addr), ctypes.c_void_p(data))
    if result < 0:
        number = ctypes.get_errno()
        raise OSError(number, f"ptrace({request:#x}, {pid}): {os.strerror(number)}")
    return result


def installed_filter(pid):
    """The newest seccomp filter of a host process, as (code, jt, jf, k) tuples. The process is stopped with
    PTRACE_SEIZE + PTRACE_INTERRUPT (no signal reaches it) and detached again."""
    _ptrace(PTRACE_SEIZE, pid)
    try:
        _ptrace(PTRACE_INTERRUPT, pid)
        os.waitpid(pid, WALL)
        count = _ptrace(PTRACE_SECCOMP_GET_FILTER, pid, 0, 0)
        program = (SockFilter * count)()
        assert _ptrace(PTRACE_SECCOMP_GET_FILTER, pid, 0, ctypes.addressof(program)) == count
        return [(insn.code, insn.jt, insn.jf, insn.k) for insn in program]
    finally:
        _ptrace(PTRACE_DETACH, pid)


def verdict(program, nr, args=(), arch=AUDIT_ARCH_X86_64):
    """Runs a classic-BPF seccomp program on struct seccomp_data {nr, arch, ip, args[6]}; returns
    (action name, data), e.g. ("ERRNO", errno.EPERM) or ("ALLOW", 0). Unknown instructions fail loudly."""
    args = list(args) + [0] * (6 - len(args))
    words = {0: nr & 0xFFFFFFFF, 4: arch, 8: 0, 12: 0}
    for index, value in enumerate(args):
        value &= 0xFFFFFFFFFFFFFFFF
        words[16 + 8 * index] = value & 0xFFFFFFFF          # little endian: low half first
        words[20 + 8 * index] = value >> 32
    a = x = 0
    memory = [0] * 16
    pc = 0
    mask = 0xFFFFFFFF
    while True:
        assert 0 <= pc < len(program), f"the filter ran off its end at {pc}"
        code, jt, jf, k = program[pc]
        pc += 1
        kind = code & 0x07
        if kind == 0x00:                                    # BPF_LD
            mode = code & 0xE0
            if code == 0x20:                                # LD W ABS
                assert k in words, f"load of seccomp_data offset {k}"
                a = words[k]
            elif mode == 0x00:                              # LD IMM
                a = k
            elif mode == 0x60:                              # LD MEM
                a = memory[k]
            elif mode == 0x80:                              # LD LEN
                a = 64
            else:
                raise AssertionError(f"unknown load {code:#x}")
        elif kind == 0x01:                                  # BPF_LDX
            mode = code & 0xE0
            x = {0x00: lambda: k, 0x60: lambda: memory[k], 0x80: lambda: 64}[mode]()
        elif kind == 0x02:                                  # BPF_ST
            memory[k] = a
        elif kind == 0x03:                                  # BPF_STX
            memory[k] = x
        elif kind == 0x04:                                  # BPF_ALU
            operand = x if code & 0x08 else k
            op = code & 0xF0
            a = {0x00: lambda: a + operand, 0x10: lambda: a - operand, 0x20: lambda: a * operand,
                 0x30: lambda: a // operand, 0x40: lambda: a | operand, 0x50: lambda: a & operand,
                 0x60: lambda: a << operand, 0x70: lambda: a >> operand, 0x80: lambda: -a,
                 0x90: lambda: a % operand, 0xA0: lambda: a ^ operand}[op]() & mask
        elif kind == 0x05:                                  # BPF_JMP
            op = code & 0xF0
            if op == 0x00:
                pc += k
                continue
            operand = x if code & 0x08 else k
            taken = {0x10: a == operand, 0x20: a > operand, 0x30: a >= operand, 0x40: bool(a & operand)}[op]
            pc += jt if taken else jf
        elif kind == 0x06:                                  # BPF_RET
            value = a if code & 0x18 == 0x10 else k
            action = value & 0xFFFF0000
            if action & 0x80000000:
                action = 0x80000000
            return ACTIONS[action], value & 0xFFFF
        elif kind == 0x07:                                  # BPF_MISC
            if code & 0xF8 == 0x00:
                x = a
            else:
                a = x
        else:
            raise AssertionError(f"unknown instruction {code:#x}")


FILTER_PROBE = """
    hold("filter")
    report(ok=True)
"""


def read_sandbox_filter(sandbox):
    """Starts a sandbox under the given Sandbox's default policy and returns the filter its program runs
    under, read from the host."""
    attack = SandboxedAttack(sandbox, FILTER_PROBE)
    try:
        attack.wait_hold("filter")
        pid = attack.program_pid()
        status = Path(f"/proc/{pid}/status").read_text()
        program = installed_filter(pid)
    finally:
        attack.release("filter")
    run = attack.run()
    assert run.result() == {"ok": True}
    assert "Seccomp:\t2" in status, status
    return program


@pytest.fixture(scope="module")
def sandbox_filter(tmp_path_factory, default_policy):
    """The seccomp filter of a sandbox started with the default policy (one per test module)."""
    return read_sandbox_filter(Sandbox(tmp_path_factory.mktemp("filter"), default_policy))


@pytest.fixture
def same_uid_canary():
    """Starts host canaries on demand (HostCanary(uid)) and stops them at the end."""
    started = []

    def start(uid):
        canary = HostCanary(uid)
        started.append(canary)
        return canary

    yield start
    for canary in started:
        canary.stop()
