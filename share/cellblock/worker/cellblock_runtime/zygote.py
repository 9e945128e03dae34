"""The Python half of a worker zygote (issue 11; the launch half is not built yet, see sandbox/README.md).

A template runs `make_template()` once: the worker's start up to its channel (main.prepare: streams, IPython,
the InteractiveShell), the preload list, a collection and `gc.freeze()`, so the heap its forks share stays
unwritten. It never runs user code. Each worker is a fork of it that, after its confinement and before anything
of the user's, calls `serve_forked()`: redraws what must differ between sessions and attaches the shell to fd 3.

What a fork cannot redraw: the interpreter's hash secret (every string and dict in the inherited heap holds
hashes made with it) and the address-space layout. Workers forked from one template share both.
"""

import gc
import importlib
import os
import signal
import sys
import threading

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


def make_template(worker_dir, preload=DEFAULT_PRELOAD):
    """Prepares the worker, imports `preload`, and freezes the heap. Returns main.Prepared for the forks."""
    occupy_worker_fds()
    prepared = main.prepare(worker_dir)
    for name in preload:
        importlib.import_module(name)
    gc.collect()
    gc.freeze()
    return prepared


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
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()  # the legacy global RandomState, drawn once at import
    process = sys.modules.get("multiprocessing.process")
    if process is not None:
        # The authkey of the main process is drawn at import; a session must not know another's.
        process.current_process().authkey = os.urandom(32)


def restore_signal_dispositions():
    """Confinement after the fork resets every disposition to the default in the kernel, while Python's own
    table still shows the template's (SIGPIPE and SIGXFSZ ignored, SIGINT handled): make them agree again,
    so that a closed pipe raises BrokenPipeError and a file size limit OSError, as in an exec'd worker."""
    for signo in signal.valid_signals():
        if signo in (signal.SIGKILL, signal.SIGSTOP):
            continue
        handler = signal.getsignal(signo)
        if handler is not None:
            signal.signal(signo, handler)


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


def recreate_start_directories(shell):
    """The fork's /tmp is a fresh tmpfs, without what the template's start made there: IPython's profile
    directory (IPYTHONDIR) and matplotlib's config directory. Make them again, as an exec'd worker's start does."""
    profile = getattr(shell, "profile_dir", None)
    if profile is not None:
        os.makedirs(profile.location, exist_ok=True)
        profile.check_dirs()
    config_dir = os.environ.get("MPLCONFIGDIR")
    if config_dir and "matplotlib" in sys.modules:
        os.makedirs(config_dir, exist_ok=True)


def serve_forked(prepared):
    """Runs in a confined fork of the template with fds 0-3 in place and every other fd closed (the
    confinement's close_range), before any code of the user's. Returns the exit status."""
    reopen_inherited_devnull()
    restore_signal_dispositions()
    redraw_session_state()
    recreate_start_directories(prepared.shell)
    return main.serve(*main.attach(prepared))
