"""The Python half of a worker zygote (sandbox/README.md "Worker zygote", which also gives the wire protocol).

A worker started with a listening socket as fd 3 (SO_ACCEPTCONN) is a template: `serve_template()`. It runs
`make_template()` once: the worker's start up to its channel (main.prepare: streams, IPython,
the InteractiveShell), the preload list, a collection and `gc.freeze()`, so the heap its forks share stays
unwritten. It never runs user code. Each worker is a fork of it that, after its confinement and before anything
of the user's, calls `serve_forked()`: redraws what must differ between sessions and attaches the shell to fd 3.

What a fork cannot redraw: the interpreter's hash secret (every string and dict in the inherited heap holds
hashes made with it) and the address-space layout. Workers forked from one template share both.
"""

import _signal
import array
import ctypes
import errno
import fcntl
import gc
import importlib
import json
import os
import select
import signal
import socket
import stat
import sys
import threading
import time

from . import main

DEFAULT_PRELOAD = ("IPython.core.interactiveshell", "numpy", "pandas", "matplotlib", "matplotlib.pyplot",
                   "matplotlib_inline.backend_inline")


class NotForkable(RuntimeError):
    """The template is in a state a fork must not copy (another thread runs)."""


def occupy_worker_fds():
    """Fds 0-3 are the worker's (PROTOCOL.md): hold them with /dev/null in the template, so that a file a
    library opens at import (IPython's devnull) gets a number above them, as in an exec'd worker."""
    for number in range(4):
        try:
            os.fstat(number)
        except OSError:
            fresh = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
            if fresh != number:
                os.dup2(fresh, number, inheritable=False)
                os.close(fresh)


def make_template(worker_dir, preload=DEFAULT_PRELOAD, warm_up_rounds=None):
    """Prepares the worker, imports `preload`, warms the execute path up, works out what a fork replays before
    its first request (Template), and freezes the heap."""
    occupy_worker_fds()
    prepared = main.prepare(worker_dir)
    for name in preload:
        importlib.import_module(name)
    warm_up(prepared, WARM_UP_ROUNDS if warm_up_rounds is None else warm_up_rounds)
    # What every fork runs once before its first request, run once here too, so that what it builds lazily (the
    # libc handle, numpy's state setter) is in the shared heap; the template's own random state is never a
    # session's (each fork draws its own in serve_forked).
    redraw_session_state()
    _process_control()
    template = Template(prepared)
    gc.collect()
    gc.freeze()
    return template


class Template:
    """A prepared worker (main.Prepared) and what each of its forks replays before the first request.

    A fork pays a copy-on-write fault for every inherited page it writes (11-30 us each on the VMs measured in
    tests/bench/README.md), and general code (signal.valid_signals, IPython's ProfileDir.check_dirs) writes
    many. So the template works out once what that code would find, and a fork only replays the result:
    - the Python-level signal dispositions that are not the default (the confinement reset all of them in the
      kernel; a default one already agrees);
    - the files and directories the template's start made under IPYTHONDIR, which a fork's fresh /tmp lacks.
    """

    MAX_START_FILE_BYTES = 1 << 16
    MAX_START_ENTRIES = 64

    def __init__(self, prepared):
        self.prepared = prepared
        # _signal's own objects: its signal() takes SIG_IGN only as the very object its getsignal() returns.
        self.dispositions = tuple(
            (signo, handler) for signo in signal.valid_signals() if signo not in (signal.SIGKILL, signal.SIGSTOP)
            for handler in (_signal.getsignal(signo),) if handler is not None and handler != _signal.SIG_DFL)
        profile = getattr(prepared.shell, "profile_dir", None)
        self.start_tree = self._snapshot(profile.location) if profile is not None else ()
        self.matplotlib_config_dir = os.environ.get("MPLCONFIGDIR") if "matplotlib" in sys.modules else None

    @classmethod
    def _snapshot(cls, profile_location):
        """(path, mode, bytes or None for a directory), parents first: IPYTHONDIR itself and, under the profile
        directory, the directories and small regular files (the startup README). In a template's private /tmp
        that is all its start made; anything else found there (other users' files in a shared /tmp, a cache) is
        not the start's, and is not replayed."""
        root = os.path.dirname(profile_location)
        entries = [(root, os.stat(root).st_mode & 0o7777, None)]
        for directory, subdirectories, files in os.walk(profile_location):
            subdirectories.sort()
            entries.append((directory, os.stat(directory).st_mode & 0o7777, None))
            for name in sorted(files):
                path = os.path.join(directory, name)
                status = os.lstat(path)
                if stat.S_ISREG(status.st_mode) and status.st_size <= cls.MAX_START_FILE_BYTES:
                    with open(path, "rb") as made:
                        entries.append((path, status.st_mode & 0o7777, made.read()))
            if len(entries) > cls.MAX_START_ENTRIES:
                raise NotForkable(f"{profile_location}: more than {cls.MAX_START_ENTRIES} entries to replay")
        return tuple(entries)

    def restore_signal_dispositions(self):
        """The confinement after the fork reset every disposition to the default in the kernel, while Python's
        own table still shows the template's (SIGPIPE and SIGXFSZ ignored, SIGINT handled): set those again, so
        that a closed pipe raises BrokenPipeError and a file size limit OSError, as in an exec'd worker."""
        for signo, handler in self.dispositions:
            _set_signal_handler(signo, handler)

    def recreate_start_directories(self):
        """The fork's /tmp is a fresh tmpfs, without what the template's start made there: IPython's profile
        directory (IPYTHONDIR) and matplotlib's config directory. Make them again, as an exec'd worker's start
        does (what already exists is left as it is)."""
        for path, mode, content in self.start_tree:
            if content is None:
                _make_directory(path, mode)
                continue
            try:
                made = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
            except FileExistsError:
                continue
            try:
                unwritten = memoryview(content)
                while unwritten:
                    unwritten = unwritten[os.write(made, unwritten):]
            finally:
                os.close(made)
        if self.matplotlib_config_dir:
            _make_directory(self.matplotlib_config_dir, 0o777)


# signal.signal without its enum conversions (about 60 us a call in a fresh fork).
_set_signal_handler = _signal.signal


def _make_directory(path, mode):
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        pass
    except FileNotFoundError:
        os.makedirs(path, mode, exist_ok=True)


# A fork's memory of its own is mostly the pages of inherited objects it writes to. What every session's first
# `execute` would write once (the runtime modules main.attach imports, IPython's lazily built caches, CPython
# 3.11's specialised bytecode, written in place into code objects after a few calls) the template writes before
# it forks, so those pages stay shared. Eight calls quicken a 3.11 function; a few more specialise its branches.
WARM_UP_CELL = "1+1"
WARM_UP_ROUNDS = 12


class WarmUpChangedState(RuntimeError):
    """The warm-up left something a session could see (a fork must look like an exec'd worker)."""


_MISSING = object()


class _DiscardingChannel:
    """Where a warm-up's frames go: nowhere (the template has no channel, and nothing of it may leave)."""

    def send(self, message, finishes_request=False):
        pass


def visible_shell_state(shell):
    """What a session can see of its shell and interpreter that running a cell may change: the user namespace
    (names and the objects they hold), the hidden names, the history and output caches, the execution count, the
    result and error of the last cell, IPython's cell-source cache, our own per-request fields, and the
    interpreter hooks a request touches (streams, input, SIGINT)."""
    import builtins
    import getpass
    import linecache

    history = shell.history_manager
    displayhook = shell.displayhook
    return {
        "user_ns": {name: id(value) for name, value in shell.user_ns.items()},
        "user_ns_hidden": {name: id(value) for name, value in shell.user_ns_hidden.items()},
        "execution_count": shell.execution_count,
        "In": list(history.input_hist_parsed), "In_raw": list(history.input_hist_raw),
        "Out": {key: id(value) for key, value in history.output_hist.items()},
        "Out_reprs": dict(history.output_hist_reprs),
        "history_caches": (list(history.db_input_cache), list(history.db_output_cache)),
        "displayhook": (id(displayhook._), id(displayhook.__), id(displayhook.___), displayhook.exec_result),
        "last_execution": (id(shell.last_execution_result), shell.last_execution_succeeded),
        "cells": (sorted(linecache.cache), sorted(getattr(linecache, "_ipython_cache", {})),
                  dict(shell.compile._filename_map)),
        "request": (shell.current_cell, shell.last_error, shell.payload_manager.read_payload(),
                    shell.output_route.silent),
        "hooks": (id(sys.stdout), id(sys.stderr), id(builtins.input), id(getpass.getpass),
                  signal.getsignal(signal.SIGINT), id(sys.displayhook), id(sys.excepthook)),
        "last_exception": tuple(hasattr(sys, name) for name in ("last_type", "last_value", "last_traceback")),
    }


def warm_up(prepared, rounds):
    """Runs WARM_UP_CELL `rounds` times through the worker's own execute path (RequestHandlers.execute, the
    displayhook's formatting, the frames) with nothing stored in the history, then puts back everything the
    execute changed, and checks that nothing a session could see differs from before."""
    if rounds <= 0:
        return
    import linecache

    from .requests import RequestHandlers
    from .stdin import StdinForwarder

    shell = prepared.shell
    history = shell.history_manager
    displayhook = shell.displayhook
    before = visible_shell_state(shell)
    saved_user_ns, saved_hidden = dict(shell.user_ns), dict(shell.user_ns_hidden)
    saved_output = (dict(history.output_hist), dict(history.output_hist_reprs))
    saved_displayhook = (displayhook._, displayhook.__, displayhook.___)
    saved_last = (shell.last_execution_result, shell.last_execution_succeeded)
    saved_request = (shell.current_cell, shell.last_error)
    saved_cells = (set(linecache.cache), set(getattr(linecache, "_ipython_cache", {})),
                   set(shell.compile._filename_map))
    saved_count = shell.execution_count

    channel = _DiscardingChannel()
    prepared.route.attach(channel)
    # Never installed (that replaces builtins.input): the execute path only reads its `allowed`.
    handlers = RequestHandlers(shell, prepared.gate, StdinForwarder(channel))
    try:
        for _ in range(rounds):
            content = handlers.execute({"type": "execute", "code": WARM_UP_CELL, "store_history": False})
            if content.get("status") != "ok":
                raise WarmUpChangedState(f"the warm-up cell failed: {content}")
    finally:
        prepared.route.attach(None)
        shell.execution_count = saved_count
        displayhook._, displayhook.__, displayhook.___ = saved_displayhook
        for namespace, saved in ((shell.user_ns, saved_user_ns), (shell.user_ns_hidden, saved_hidden)):
            for name in [name for name in namespace if name not in saved]:
                del namespace[name]
            for name, value in saved.items():
                if namespace.get(name, _MISSING) is not value:
                    namespace[name] = value
        for live, saved in zip((history.output_hist, history.output_hist_reprs), saved_output):
            live.clear()
            live.update(saved)
        shell.last_execution_result, shell.last_execution_succeeded = saved_last
        shell.current_cell, shell.last_error = saved_request
        for live, saved in zip((linecache.cache, getattr(linecache, "_ipython_cache", {}),
                                shell.compile._filename_map), saved_cells):
            for name in [name for name in live if name not in saved]:
                del live[name]
        for name in ("last_type", "last_value", "last_traceback"):
            if before["last_exception"] == (False, False, False) and hasattr(sys, name):
                delattr(sys, name)
    after = visible_shell_state(shell)
    if after != before:
        changed = sorted(key for key in before if before[key] != after[key])
        raise WarmUpChangedState(f"the warm-up changed what a session sees: {', '.join(changed)}")


def check_forkable():
    """A fork copies only the calling thread: a template with another thread (a library's pool, a timer)
    would hand its workers locks held by a thread that does not exist in them."""
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1 or threading.active_count() != 1:
        raise NotForkable(f"the template runs {threads} threads; a fork needs exactly one")


def redraw_session_state():
    """Everything a fork inherits that must differ between sessions and can be redrawn."""
    import random

    random.seed()  # also done by random's own at-fork hook; explicit, so it does not depend on how we forked
    numpy = sys.modules.get("numpy")
    if numpy is not None and "numpy.random" in sys.modules:
        # The legacy global RandomState, drawn once at import: its whole MT19937 state straight from the OS (as
        # many words as random.seed() reads); numpy.random.seed() derives one through SeedSequence, which takes
        # twice the time in a fork.
        words = numpy.frombuffer(os.urandom(MT19937_STATE_WORDS * 4), dtype=numpy.uint32)
        numpy.random.set_state(("MT19937", words, MT19937_STATE_WORDS))
    process = sys.modules.get("multiprocessing.process")
    if process is not None:
        # The authkey of the main process is drawn at import; a session must not know another's.
        process.current_process().authkey = os.urandom(32)


MT19937_STATE_WORDS = 624  # also the position that makes the next draw regenerate the whole state


def reopen_inherited_devnull():
    """IPython opens os.devnull at import and keeps it (IPython.utils.io.devnull). The confinement closed every
    fd above 3, so that object names a closed number that the next open() would reuse: put /dev/null back at
    that number, as an exec'd worker has it."""
    io_module = sys.modules.get("IPython.utils.io")
    devnull = getattr(io_module, "devnull", None)
    if devnull is None or devnull.closed:
        return
    number = devnull.fileno()
    if number <= 3:
        raise RuntimeError(f"the template left IPython's devnull at fd {number}, one of the worker's own")
    fresh = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
    if fresh != number:
        os.dup2(fresh, number, inheritable=False)
        os.close(fresh)


PR_SET_DUMPABLE = 4


_PRCTL = []


def _process_control():
    """libc's prctl, looked up once (in the template, so that a fork does not build a ctypes library of its own)."""
    if not _PRCTL:
        _PRCTL.append(ctypes.CDLL(None, use_errno=True).prctl)
    return _PRCTL[0]


def make_dumpable_again():
    """The confinement changed a root process's credentials, which makes the kernel mark it not dumpable (execve
    would reset that): its /proc/PID files then belong to root and the worker cannot read its own
    /proc/self/environ, nor can its tools (ps, a debugger) look at it. Be what an exec'd worker is."""
    if _process_control()(PR_SET_DUMPABLE, 1, 0, 0, 0) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"prctl(PR_SET_DUMPABLE): {os.strerror(error)}")


def serve_forked(template):
    """Runs in a confined fork of the template with fds 0-3 in place and every other fd closed (the
    confinement's close_range), before any code of the user's. Returns the exit status."""
    make_dumpable_again()
    reopen_inherited_devnull()
    template.restore_signal_dispositions()
    redraw_session_state()
    template.recreate_start_directories()
    return main.serve(*main.attach(template.prepared))


# ---------------------------------------------------------------------------------------------------------------
# The template's service (sandbox/README.md, "Worker zygote")
# ---------------------------------------------------------------------------------------------------------------

LISTENER_FD = 3          # as the launcher hands it over; moved above the worker's fds before anything is imported
HOST_MOUNT_NAMESPACE_FD = 4
SETTINGS_FD = 5          # the settings across the template's re-exec (shed_settings_environment)
SETTINGS_PREFIX = "CELLBLOCK_ZYGOTE_"
SETTINGS_MEMFD_NAME = "cellblock-zygote-settings"
MAGIC = b"CBZ1"
RETIRE_MAGIC = b"CBZR"  # a request of these 4 bytes alone, no fds: retire (TemplateService._serve_request)
MAX_FDS = 16
MAX_REQUEST_BYTES = 1 << 20
FIRST_MESSAGE_SECONDS = 10.0
DEFAULT_GENERATION_FORKS = 200
DEFAULT_GENERATION_SECONDS = 3600.0


class Settings:
    """What the kernel tells a template (env CELLBLOCK_ZYGOTE_*): the spawn library, the preload list, and the
    generation's size and age after which the template stops accepting."""

    def __init__(self, values):
        self.library = values.get("CELLBLOCK_ZYGOTE_LIBRARY", "")
        preload = values.get("CELLBLOCK_ZYGOTE_PRELOAD")
        self.preload = DEFAULT_PRELOAD if preload is None else tuple(
            name.strip() for name in preload.split(",") if name.strip())
        self.generation_forks = int(values.get("CELLBLOCK_ZYGOTE_GENERATION_FORKS", DEFAULT_GENERATION_FORKS))
        self.generation_seconds = float(values.get("CELLBLOCK_ZYGOTE_GENERATION_SECONDS",
                                                   DEFAULT_GENERATION_SECONDS))
        if not self.library:
            raise ValueError("CELLBLOCK_ZYGOTE_LIBRARY is not set")
        if self.generation_forks < 1 or self.generation_seconds <= 0:
            raise ValueError("a generation needs at least one fork and a positive age")


def shed_settings_environment():
    """Returns the template's Settings, re-executing the template once without its CELLBLOCK_ZYGOTE_* variables.

    A fork shows its template's start environment in /proc/PID/environ (the kernel's env block is inherited with
    the memory), and that must be exactly an exec'd worker's. So the first start takes the settings out of the
    environment into a memfd at SETTINGS_FD and execs the same argv with the rest; the second start reads them."""
    values = {name: value for name, value in os.environ.items() if name.startswith(SETTINGS_PREFIX)}
    if values:
        settings = Settings(values)  # refuse bad settings before the re-exec
        memfd = os.memfd_create(SETTINGS_MEMFD_NAME, 0)
        os.write(memfd, json.dumps(values).encode())
        os.lseek(memfd, 0, os.SEEK_SET)
        if memfd != SETTINGS_FD:
            os.dup2(memfd, SETTINGS_FD, inheritable=True)
            os.close(memfd)
        else:
            os.set_inheritable(memfd, True)
        for fd in (LISTENER_FD, HOST_MOUNT_NAMESPACE_FD):
            os.set_inheritable(fd, True)
        environment = {name: value for name, value in os.environ.items() if not name.startswith(SETTINGS_PREFIX)}
        os.execve(sys.executable, sys.orig_argv, environment)
        return settings  # not reached
    try:
        target = os.readlink(f"/proc/self/fd/{SETTINGS_FD}")
    except OSError:
        target = ""
    if not target.startswith(f"/memfd:{SETTINGS_MEMFD_NAME}"):
        raise ValueError("a template needs CELLBLOCK_ZYGOTE_LIBRARY in its environment")
    with os.fdopen(SETTINGS_FD, "rb") as settings_file:
        return Settings(json.loads(settings_file.read()))


class SpawnFailed(OSError):
    """Nothing was started (the plan could not be decoded, setns or clone failed)."""


class ForkedChild:
    """Returned up the template's stack in the new worker, once it is confined."""


FORKED_CHILD = ForkedChild()


class LibrarySpawner:
    """cellblock_zygote_spawn from libcellblock_zygote.so (sandbox/README.md, "Worker zygote"), called through
    ctypes.PyDLL with the GIL held and wrapped in the interpreter's own fork hooks, as os.fork() wraps fork()."""

    def __init__(self, path):
        library = ctypes.PyDLL(path, use_errno=True)
        self._spawn = library.cellblock_zygote_spawn
        self._spawn.restype = ctypes.c_long
        self._spawn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_int), ctypes.c_size_t,
                                ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
        self._hooks = {}
        for name in ("PyOS_BeforeFork", "PyOS_AfterFork_Parent", "PyOS_AfterFork_Child"):
            hook = getattr(ctypes.pythonapi, name)
            hook.restype = None
            hook.argtypes = []
            self._hooks[name] = hook
        self.library = library

    def spawn(self, plan, fds, host_mount_namespace_fd, own_mount_namespace_fd, own_cwd_fd):
        """(pid, pidfd) in the template; FORKED_CHILD in the confined child; raises SpawnFailed."""
        plan_bytes = (ctypes.c_ubyte * len(plan)).from_buffer(plan)
        fd_array = (ctypes.c_int * max(len(fds), 1))(*fds)
        pidfd = ctypes.c_int(-1)
        self._hooks["PyOS_BeforeFork"]()
        result = self._spawn(ctypes.addressof(plan_bytes), len(plan), fd_array, len(fds), host_mount_namespace_fd,
                             own_mount_namespace_fd, own_cwd_fd, ctypes.byref(pidfd))
        if result == 0:
            self._hooks["PyOS_AfterFork_Child"]()
            return FORKED_CHILD
        self._hooks["PyOS_AfterFork_Parent"]()
        del plan_bytes  # the export of the plan buffer
        if result < 0:
            raise SpawnFailed(-result, f"cellblock_zygote_spawn: {os.strerror(-result)}")
        return result, pidfd.value


def _log(event, **fields):
    # One line per event that changes the template's life (its stderr is the launcher's log); none per fork.
    try:
        print(json.dumps({"component": "cellblock-zygote", "event": event, "pid": os.getpid(), **fields}),
              file=sys.__stderr__, flush=True)
    except OSError:
        pass


class Worker:
    """A live fork: its pid, the template's own pidfd of it, and the kernel's connection (None once closed)."""

    def __init__(self, pid, pidfd, connection):
        self.pid = pid
        self.pidfd = pidfd
        self.connection = connection


class TemplateService:
    """One poll loop: the listener, connections that have not sent their request yet, and per live worker its
    connection and its pidfd. Single-threaded by design: a fork copies only the calling thread."""

    def __init__(self, listener_fd, spawner, host_mount_namespace_fd, own_mount_namespace_fd, own_cwd_fd,
                 generation_forks=DEFAULT_GENERATION_FORKS, generation_seconds=DEFAULT_GENERATION_SECONDS):
        self.listener = socket.socket(fileno=listener_fd)
        self.listener.setblocking(False)
        self.spawner = spawner
        self.namespace_fds = (host_mount_namespace_fd, own_mount_namespace_fd, own_cwd_fd)
        self.generation_forks = generation_forks
        self.retire_at = time.monotonic() + generation_seconds
        self.poller = select.poll()
        self.poller.register(self.listener.fileno(), select.POLLIN)
        self.accepting = True
        self.forks = 0
        self.pending = {}     # connection fd -> (socket, deadline)
        self.connections = {}  # connection fd -> Worker
        self.pidfds = {}       # pidfd -> Worker
        # The one buffer every request is read into, cleared after each: the template's heap never keeps a plan,
        # so a fork inherits no other session's plan (only its own, cleared below too).
        self.request_buffer = bytearray(MAX_REQUEST_BYTES)

    # -- the loop ----------------------------------------------------------------------------------------------
    def run(self):
        """Serves until retired and every worker is reaped (returns None), or returns FORKED_CHILD in a fork."""
        while self.accepting or self.pidfds:
            for fd, _ in self.poller.poll(self._poll_timeout_ms()):
                if self._dispatch(fd) is FORKED_CHILD:
                    return FORKED_CHILD
            now = time.monotonic()
            for fd, (connection, deadline) in list(self.pending.items()):
                if now >= deadline:
                    self._drop_pending(fd)
            if self.accepting and now >= self.retire_at:
                self.retire("age")
        return None

    def _poll_timeout_ms(self):
        deadlines = [deadline for _, deadline in self.pending.values()]
        if self.accepting:
            deadlines.append(self.retire_at)
        if not deadlines:
            return None
        return max(0, int((min(deadlines) - time.monotonic()) * 1000) + 1)

    def _dispatch(self, fd):
        try:
            if fd == self.listener.fileno() and self.accepting:
                self._accept()
            elif fd in self.pending:
                return self._serve_request(fd)
            elif fd in self.pidfds:
                self._reap(self.pidfds[fd])
            elif fd in self.connections:
                self._connection_event(self.connections[fd])
        except OSError as error:
            _log("service_error", detail=f"{type(error).__name__}: {error}")
        return None

    def _accept(self):
        while self.accepting:
            try:
                connection, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            connection.setblocking(False)
            self.pending[connection.fileno()] = (connection, time.monotonic() + FIRST_MESSAGE_SECONDS)
            self.poller.register(connection.fileno(), select.POLLIN)

    def _drop_pending(self, fd):
        connection, _ = self.pending.pop(fd)
        self.poller.unregister(fd)
        connection.close()

    # -- one request -------------------------------------------------------------------------------------------
    def _serve_request(self, fd):
        connection, _ = self.pending[fd]
        view = memoryview(self.request_buffer)
        try:
            size, ancillary, flags, _ = connection.recvmsg_into(
                [view], socket.CMSG_SPACE((MAX_FDS + 1) * array.array("i").itemsize))
        except (BlockingIOError, InterruptedError):
            return None
        except OSError:
            self._drop_pending(fd)
            return None
        received = array.array("i")
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                received.frombytes(data[:len(data) - len(data) % received.itemsize])
        fds = list(received)
        del self.pending[fd]
        self.poller.unregister(fd)
        if size == len(RETIRE_MAGIC) and not fds and bytes(self.request_buffer[:size]) == RETIRE_MAGIC:
            # The template service's typed stop (kernel/src/launch/template_service.cpp): no more forks; the
            # live workers go on, and the template exits after the last one.
            self.retire("requested")
            view[:size] = bytes(size)
            self._answer_and_close(connection, {"retired": True, "workers": len(self.pidfds)})
            return None
        refusal, outcome = self._refusal(size, flags, fds), None
        if refusal is None:
            try:
                outcome = self.spawner.spawn(view[len(MAGIC):size], fds, *self.namespace_fds)
            except SpawnFailed as error:
                refusal, outcome = str(error), error
            except Exception as error:  # noqa: BLE001 - a template bug must not take the received fds with it
                refusal = f"spawn: {type(error).__name__}: {error}"
        if outcome is FORKED_CHILD:
            connection.detach()
            self._forget_after_fork(view, size)
            return FORKED_CHILD
        # Before any answer: the kernel learns that a worker started from the end of file on its error pipe,
        # which needs the template's copy closed, and a refused request's fds are not kept.
        view[:size] = bytes(size)
        del view
        for received_fd in fds:
            os.close(received_fd)
        if refusal is not None:
            self._answer_and_close(connection, {"error": refusal})
            if isinstance(outcome, SpawnFailed) and outcome.errno == errno.ENOTRECOVERABLE:
                # The library could not bring the template back into its own mount namespace or cwd: it sees
                # the host's now, and must not run anything more (its workers go on without it; their kernels
                # read the exit status from the pidfd).
                _log("unrecoverable", detail=refusal)
                os._exit(70)
            return None
        self._started(connection, *outcome)
        return None

    def _refusal(self, size, flags, fds):
        if flags & socket.MSG_CTRUNC or len(fds) > MAX_FDS:
            return f"at most {MAX_FDS} fds in a request"
        if flags & socket.MSG_TRUNC:
            return f"a request is at most {MAX_REQUEST_BYTES} bytes"
        if size == 0 and not fds:
            return "empty request"
        if bytes(self.request_buffer[:len(MAGIC)]) != MAGIC or size < len(MAGIC):
            return "not a CBZ1 request"
        if not self.accepting:
            return "this template is retired"
        try:
            check_forkable()
        except NotForkable as error:
            self.retire("threads")
            return str(error)
        return None

    def _answer_and_close(self, connection, message):
        try:
            connection.send(json.dumps(message).encode())
        except OSError:
            pass
        connection.close()

    def _started(self, connection, pid, pidfd):
        worker = Worker(pid, pidfd, connection)
        self.pidfds[pidfd] = worker
        self.poller.register(pidfd, select.POLLIN)
        self.forks += 1
        try:
            connection.sendmsg([json.dumps({"pid": pid}).encode()],
                               [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [pidfd]))])
        except OSError:
            self._connection_closed(worker)  # the kernel went away: nobody supervises this worker
        else:
            self.connections[connection.fileno()] = worker
            self.poller.register(connection.fileno(), select.POLLIN)
        if self.accepting and self.forks >= self.generation_forks:
            self.retire("forks")

    # -- live workers ------------------------------------------------------------------------------------------
    def _connection_event(self, worker):
        # The kernel sends nothing after its request: anything else, like the close, ends that worker.
        try:
            worker.connection.recv(1)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            pass
        self._connection_closed(worker)

    def _connection_closed(self, worker):
        try:
            signal.pidfd_send_signal(worker.pidfd, signal.SIGKILL)
        except ProcessLookupError:
            pass  # exited already; reaped when its pidfd is read
        if worker.connection is not None:
            self.connections.pop(worker.connection.fileno(), None)
            try:
                self.poller.unregister(worker.connection.fileno())
            except KeyError:
                pass
            worker.connection.close()
            worker.connection = None

    def _reap(self, worker):
        pid, status, usage = os.wait4(worker.pid, os.WNOHANG)
        if pid == 0:
            return
        self.poller.unregister(worker.pidfd)
        del self.pidfds[worker.pidfd]
        os.close(worker.pidfd)
        if worker.connection is not None:
            report = {"exit": {"status": status, "utime_us": round(usage.ru_utime * 1e6),
                               "stime_us": round(usage.ru_stime * 1e6), "maxrss_kib": usage.ru_maxrss}}
            connection = worker.connection
            self.connections.pop(connection.fileno(), None)
            self.poller.unregister(connection.fileno())
            worker.connection = None
            self._answer_and_close(connection, report)

    # -- generations -------------------------------------------------------------------------------------------
    def retire(self, reason):
        """Stops accepting (a connecting kernel finds the socket dead and starts the next generation); the live
        workers are still reaped and reported, and the template exits after the last one. The "retired" line comes
        first: a kernel that finds the socket dead reads it to tell a generation's end, after which it starts the
        next template at once, from a template's death, after which it waits (kernel/README.md)."""
        if not self.accepting:
            return
        _log("retired", reason=reason, forks=self.forks, workers=len(self.pidfds))
        self.accepting = False
        self.poller.unregister(self.listener.fileno())
        self.listener.close()
        for fd in list(self.pending):
            self._drop_pending(fd)

    # -- in the fork -------------------------------------------------------------------------------------------
    def _forget_after_fork(self, view, size):
        """In the confined fork every fd but 0-3 is closed already (close_range): forget the numbers without
        closing them (they may be reused by now), and clear this fork's copy of its plan."""
        for connection in [self.listener] + [c for c, _ in self.pending.values()] + \
                [w.connection for w in self.pidfds.values() if w.connection is not None]:
            connection.detach()
        self.pending.clear()
        self.connections.clear()
        self.pidfds.clear()
        view[:size] = bytes(size)


def serve_template(worker_dir):
    """The template's life (its fd 3 is a listening socket). Returns an exit status in the template; in a fork,
    serves that worker and returns its exit status."""
    try:
        settings = shed_settings_environment()
    except (OSError, ValueError) as error:
        _log("template_failed", detail=f"{type(error).__name__}: {error}")
        return 1
    listener_fd = fcntl.fcntl(LISTENER_FD, fcntl.F_DUPFD_CLOEXEC, 10)
    host_mount_namespace_fd = fcntl.fcntl(HOST_MOUNT_NAMESPACE_FD, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(LISTENER_FD)
    os.close(HOST_MOUNT_NAMESPACE_FD)
    occupy_worker_fds()  # before any other open: nothing of the template's at the worker's numbers
    own_mount_namespace_fd = os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    own_cwd_fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        spawner = LibrarySpawner(settings.library)
        template = make_template(worker_dir, settings.preload)
        check_forkable()
    except (OSError, ImportError, NotForkable, WarmUpChangedState) as error:
        _log("template_failed", detail=f"{type(error).__name__}: {error}")
        return 1
    service = TemplateService(listener_fd, spawner, host_mount_namespace_fd, own_mount_namespace_fd, own_cwd_fd,
                              settings.generation_forks, settings.generation_seconds)
    _log("serving", preload=list(settings.preload), generation_forks=settings.generation_forks,
         generation_seconds=settings.generation_seconds)
    if service.run() is FORKED_CHILD:
        del service
        return serve_forked(template)
    _log("exited", forks=service.forks)
    return 0
