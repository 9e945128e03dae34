"""Worker start-up and request loop. See ../PROTOCOL.md for the frames."""

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


def _start(worker_dir):
    from .framing import FrameChannel
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
    from .requests import RequestHandlers
    from .shell import OutputRoute, create_shell
    from .stdin import StdinForwarder

    channel = FrameChannel(CHANNEL_FD, gate)
    shell = create_shell(OutputRoute(channel))
    stdin_forwarder = StdinForwarder(channel)
    stdin_forwarder.install()
    reaper = ZombieReaper()
    reaper.track_popen_objects()
    handlers = RequestHandlers(shell, gate, stdin_forwarder)

    # User code imports from the current directory (as in ipykernel), not from the worker's own folder;
    # every runtime module is imported by now.
    sys.path[:] = ["" if entry == worker_dir else entry for entry in sys.path]
    sys.argv = [""]
    return channel, handlers, reaper


def _serve(channel, handlers, reaper):
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
            print(f"cellblock worker: protocol error: {error}", file=sys.__stderr__)
            return 2
        kind = request.get("type")
        if kind == "shutdown":
            return 0
        request_id = request.get("id")
        if kind == "input_reply" or request_id is None:
            continue  # a late answer to an interrupted prompt, or nothing that could be answered
        handler = handlers.handler_for(kind)
        try:
            if handler is None:
                content = {"status": "error", "ename": "ProtocolError",
                           "evalue": f"unknown request type {kind!r}", "traceback": []}
            else:
                content = handler(request)
        except KeyboardInterrupt:
            content = {"status": "error", "ename": "KeyboardInterrupt", "evalue": "", "traceback": []}
        except Exception as error:
            from .requests import RequestError
            if isinstance(error, RequestError):
                content = {"status": "error", "ename": "RequestError", "evalue": str(error), "traceback": []}
            else:
                content = _internal_error_content(error)
        try:
            channel.send({"type": "reply", "id": request_id, "content": content})
        except FrameTooLarge as error:
            channel.send({"type": "reply", "id": request_id,
                          "content": {"status": "error", "ename": "FrameTooLarge", "evalue": str(error),
                                      "traceback": []}})
        try:
            reaper.reap()
        except OSError:
            pass


def main(worker_dir):
    channel, handlers, reaper = _start(worker_dir)
    try:
        return _serve(channel, handlers, reaper)
    except (BrokenPipeError, ConnectionResetError):
        return 0  # the kernel went away while we were writing
