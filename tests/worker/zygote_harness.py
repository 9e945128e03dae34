"""A zygote template for the worker tests (cellblock_runtime/zygote.py), without the C++ library.

The template is started as the kernel starts it: the worker's argv (`python3 cellblock_worker.py`) with a
listening SOCK_SEQPACKET socket as fd 3, an fd of the host mount namespace as fd 4, and the settings in
CELLBLOCK_ZYGOTE_*. CELLBLOCK_ZYGOTE_LIBRARY names a test-only stand-in for libcellblock_zygote.so built from
zygote_standin.c: the same C ABI, the same path through ctypes.PyDLL and the interpreter's fork hooks, but no
confinement (no namespaces, no uid, no seccomp). The test process plays the kernel.
"""
import array
import json
import os
import pathlib
import select
import signal
import socket
import subprocess

HERE = pathlib.Path(__file__).resolve().parent
GENEROUS = 120.0  # a template imports numpy before it answers; the test machine is shared and loaded
ENABLED = os.environ.get("CELLBLOCK_TEST_ZYGOTE", "") == "1"


def build_standin_library(directory):
    library = pathlib.Path(directory) / "libzygote_standin.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-Wall", "-Werror", "-o", str(library),
                    str(HERE / "zygote_standin.c")], check=True)
    return library


def receive(connection, timeout=GENEROUS):
    readable, _, _ = select.select([connection], [], [], timeout)
    assert readable, f"no answer within {timeout} s"
    data, ancillary, _, _ = connection.recvmsg(65536, socket.CMSG_SPACE(16 * 4))
    fds = array.array("i")
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[:len(payload) - len(payload) % 4])
    return (json.loads(data) if data else None), list(fds)


class PidfdProcess:
    """What WorkerProcess needs of a process it did not start (Popen's pid, poll, wait, kill, stdout, stderr):
    the template is the parent and reports the exit on the connection."""

    def __init__(self, pid, pidfd, connection):
        self.pid = pid
        self.pidfd = pidfd
        self.connection = connection
        self.exit = None
        self.stdout = self.stderr = None

    def exited(self, timeout):
        return bool(select.select([self.pidfd], [], [], timeout)[0])

    def report(self, timeout=GENEROUS):
        """The template's exit message (wait status and usage), then its close of the connection."""
        if self.exit is None:
            answer, _ = receive(self.connection, timeout)
            assert answer is not None and "exit" in answer, answer
            self.exit = answer["exit"]
            assert receive(self.connection, timeout) == (None, []), "the connection stays open after the exit"
        return self.exit

    def poll(self):
        if self.exit is None and not self.exited(0):
            return None
        return os.waitstatus_to_exitcode(self.report()["status"])

    def wait(self, timeout=None):
        if self.exit is None and not self.exited(GENEROUS if timeout is None else timeout):
            raise subprocess.TimeoutExpired("forked worker", timeout)
        return os.waitstatus_to_exitcode(self.report()["status"])

    def kill(self):
        try:
            signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def close(self):
        self.connection.close()
        os.close(self.pidfd)


class Template:
    def __init__(self, directory, library, environment, **settings):
        self.path = pathlib.Path(directory) / "zygote.sock"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind(str(self.path))
        listener.listen(64)
        host_namespace = os.open("/proc/self/ns/mnt", os.O_RDONLY)
        environment = dict(environment, CELLBLOCK_ZYGOTE_LIBRARY=str(library), CELLBLOCK_ZYGOTE_PRELOAD="numpy")
        environment.update({f"CELLBLOCK_ZYGOTE_{name.upper()}": str(value) for name, value in settings.items()})
        self.start_environment = {name: value for name, value in environment.items()
                                  if not name.startswith("CELLBLOCK_ZYGOTE_")}
        self.log_path = pathlib.Path(directory) / "template.log"

        def fds_in_place():
            os.dup2(listener.fileno(), 3)
            os.dup2(host_namespace, 4)

        from conftest import worker_script
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(["/usr/bin/python3", str(worker_script())], stdin=subprocess.DEVNULL,
                                            stdout=log, stderr=log, pass_fds=(3, 4), preexec_fn=fds_in_place,
                                            cwd=directory, env=environment, start_new_session=True)
        listener.close()
        os.close(host_namespace)

    @property
    def pid(self):
        return self.process.pid

    def fds(self):
        return sorted(int(fd) for fd in os.listdir(f"/proc/{self.pid}/fd"))

    def log(self):
        return self.log_path.read_text(errors="replace")

    def connect(self):
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        connection.connect(str(self.path))
        return connection

    def request(self, message, fds):
        """Sends one request; returns (connection, answer, received fds)."""
        connection = self.connect()
        connection.sendmsg([message], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else [])
        return (connection, *receive(connection))

    def fork(self, cwd, subreaper=False, plan=None):
        """A worker forked by the template, as the kernel asks for one: (channel, stdout read end, stderr read
        end, PidfdProcess, the template's answer)."""
        kernel_end, worker_end = socket.socketpair()
        stdout_read, stdout_write = os.pipe()
        stderr_read, stderr_write = os.pipe()
        devnull = os.open(os.devnull, os.O_RDONLY)
        if plan is None:
            plan = b"\0\1\2\3" + bytes([1 if subreaper else 0]) + os.fsencode(str(cwd))
        try:
            connection, answer, received = self.request(b"CBZ1" + plan,
                                                        [devnull, stdout_write, stderr_write, worker_end.fileno()])
        finally:
            for fd in (devnull, stdout_write, stderr_write):
                os.close(fd)
            worker_end.close()
        assert answer is not None and "pid" in answer, (answer, self.log()[-3000:])
        assert len(received) == 1, received
        return kernel_end, stdout_read, stderr_read, PidfdProcess(answer["pid"], received[0], connection), answer

    def stop(self):
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
