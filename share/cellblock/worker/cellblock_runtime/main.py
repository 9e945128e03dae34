"""Worker start-up and request loop. See ../PROTOCOL.md for the frames."""

import json
import os
import sys
import traceback

CHANNEL_FD = 3


def _internal_error_content(error):
    """An exception in the worker's own code becomes an error reply instead of a dead worker."""
    return {
        "status": "error",
        "ename": "WorkerInternalError",
        "evalue": f"{type(error).__name__}: {error}",
        "traceback": traceback.format_exception(error),
    }


class Prepared:
    """A worker started up to, but not including, its channel: what a template can do once for many workers."""

    def __init__(self, worker_dir, gate, route, shell, reaper):
        self.worker_dir = worker_dir
        self.gate = gate
        self.route = route
        self.shell = shell
        self.reaper = reaper


def prepare(worker_dir):
    """Everything of the start that does not need fd 3: streams, IPython, the shell, the zombie reaper."""
    from .interrupts import InterruptGate
    from .ipython_boot import apply_environment_defaults, install_lazy_ipython_package
    from .streams import open_fd_text_stream

    gate = InterruptGate()
    gate.ignore_interrupts()
    sys.stdout = sys.__stdout__ = open_fd_text_stream(1)
    sys.stderr = sys.__stderr__ = open_fd_text_stream(2)
    apply_environment_defaults()
    install_lazy_ipython_package()

    from .children import ZombieReaper
    from .shell import OutputRoute, create_shell

    route = OutputRoute(None)
    shell = create_shell(route, gate)
    reaper = ZombieReaper()
    reaper.track_popen_objects()
    return Prepared(worker_dir, gate, route, shell, reaper)


def attach(prepared):
    """Connects a prepared worker to its channel on fd 3; after this it can serve requests."""
    from .framing import FrameChannel
    from .requests import RequestHandlers
    from .stdin import StdinForwarder

    gate = prepared.gate
    # Again, for a forked worker: the confinement between fork and here reset every signal disposition.
    gate.ignore_interrupts()
    from .streams import open_channel_text_streams

    channel = FrameChannel(CHANNEL_FD, gate)
    gate.watch_requests(channel.request_waiting)
    # Python-level output in band from here on (PROTOCOL.md, "Ordering rule"); what was written before is on
    # the pipes already.
    sys.stdout.flush()
    sys.stderr.flush()
    sys.stdout, sys.stderr = open_channel_text_streams(channel)
    sys.__stdout__, sys.__stderr__ = sys.stdout, sys.stderr
    prepared.route.attach(channel)
    stdin_forwarder = StdinForwarder(channel)
    stdin_forwarder.install()
    handlers = RequestHandlers(prepared.shell, gate, stdin_forwarder)

    # User code imports from the current directory (as in ipykernel), not from the worker's own folder;
    # every runtime module is imported by now.
    sys.path[:] = ["" if entry == prepared.worker_dir else entry for entry in sys.path]
    sys.argv = [""]
    return channel, handlers, prepared.reaper, gate


def _start(worker_dir):
    return attach(prepare(worker_dir))


def _error_content(ename, evalue):
    return {"status": "error", "ename": ename, "evalue": evalue, "traceback": []}


def _log(event, **fields):
    # Structured, and only for events that end the worker: normal operation logs nothing. On fd 2, not in
    # band: the channel is what just failed.
    line = json.dumps({"component": "cellblock-worker", "event": event, **fields}) + "\n"
    try:
        os.write(2, line.encode("utf-8", "replace"))
    except OSError:
        pass


def _answer(handlers, request):
    """The reply content for one request; never raises (except for an interrupt outside any handler)."""
    from .requests import RequestError

    handler = handlers.handler_for(request.get("type"))
    if handler is None:
        return _error_content("ProtocolError", f"unknown request type {request.get('type')!r}")
    try:
        return handler(request)
    except KeyboardInterrupt:
        return _error_content("KeyboardInterrupt", "")
    except RequestError as error:
        return _error_content("RequestError", str(error))
    except (Exception, SystemExit) as error:
        return _internal_error_content(error)


def _serve(channel, handlers, reaper, gate):
    from IPython.core.release import version as ipython_version

    from .framing import ChannelClosed, FrameTooLarge, ProtocolError

    python_version = "%d.%d.%d" % sys.version_info[:3]
    channel.send({"type": "ready", "python": python_version, "ipython": ipython_version, "pid": os.getpid()})
    while True:
        try:
            request = channel.receive()
        except ChannelClosed:
            return 0
        except ProtocolError as error:
            # The stream can no longer be trusted to be in sync; the kernel will start a new worker.
            _log("protocol_error", detail=str(error))
            return 2
        if request.get("type") == "shutdown":
            return 0
        request_id = request.get("id")
        if request.get("type") == "input_reply" or request_id is None:
            gate.request_finished()  # nothing in hand after all: a late interrupt must not hit the next request
            continue  # a late answer to an interrupted prompt, or nothing that could be answered
        content = _answer(handlers, request)
        try:
            channel.send({"type": "reply", "id": request_id, "content": content}, finishes_request=True)
        except FrameTooLarge as error:
            channel.send({"type": "reply", "id": request_id, "content": _error_content("FrameTooLarge", str(error))},
                         finishes_request=True)
        try:
            reaper.reap()
        except OSError:
            pass  # fds 1/2 belong to the user's output; a failed reap is retried after the next request


def serve(channel, handlers, reaper, gate):
    try:
        return _serve(channel, handlers, reaper, gate)
    except (BrokenPipeError, ConnectionResetError):
        return 0  # the kernel went away while we were writing


def is_listening_socket(fd):
    """True when `fd` is a socket in the listening state: a template's fd 3 (cellblock_runtime/zygote.py); a
    worker's is its connected channel."""
    import socket

    try:
        probe = socket.socket(fileno=fd)
    except OSError:
        return False
    try:
        return probe.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) != 0
    except OSError:
        return False
    finally:
        probe.detach()


def keep_large_blocks_on_the_heap():
    """Blocks under 4 MiB come from the heap and up to 8 MiB of free heap stays mapped: with glibc's defaults a
    large output's blocks are unmapped after each cell and faulted in again by the next, which on a VM costs more
    than copying them (README, "Large outputs"). Set here rather than with GLIBC_TUNABLES, which the user's
    subprocesses would inherit; a template's forks inherit it from the template."""
    import ctypes

    libc = ctypes.CDLL(None)
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 4 * 1024 * 1024)
    libc.mallopt(m_trim_threshold, 8 * 1024 * 1024)


def main(worker_dir):
    keep_large_blocks_on_the_heap()
    if is_listening_socket(CHANNEL_FD):
        from . import zygote

        return zygote.serve_template(worker_dir)  # forks workers; never runs user code
    return serve(*_start(worker_dir))
