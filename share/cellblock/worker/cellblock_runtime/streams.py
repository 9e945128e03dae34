"""sys.stdout / sys.stderr as UTF-8 write-through text streams: on the kernel channel once the worker has one,
on fds 1 and 2 before that (start-up, a template) and in processes the user's code forks.

Every write() reaches the kernel immediately, as a stream frame on the channel (PROTOCOL.md), so output
streams while a cell runs and is ordered with displays and results by the channel itself. Unencodable
characters (lone surrogates) become U+FFFD rather than raising inside user code.
"""

import io
import os
import sys

from .framing import REPLACE_SURROGATES, STDERR_CHANNEL, STDOUT_CHANNEL


class _FdWriter(io.RawIOBase):
    """Raw binary writer that never drops the tail of a partial write."""

    def __init__(self, fd):
        super().__init__()
        self._fd = fd

    def writable(self):
        return True

    def fileno(self):
        return self._fd

    def isatty(self):
        return False

    def write(self, data):
        view = memoryview(data).cast("B")
        total = len(view)
        while view:
            view = view[os.write(self._fd, view):]
        return total

    def close(self):
        # The fd belongs to the process; closing sys.stdout must not close fd 1 under subprocesses.
        super().close()


_CHILD_PROCESS_EVENTS = frozenset({"os.system", "subprocess.Popen", "os.posix_spawn", "os.spawn", "os.exec",
                                   "os.fork", "os.forkpty"})


class _ChannelWriter(_FdWriter):
    """Raw binary writer that sends each write as stream frames; in a forked child (multiprocessing, os.fork),
    where the channel's lock and framing are not the child's to use, it writes to the fd instead."""

    def __init__(self, fd, channel, channel_byte):
        super().__init__(fd)
        self._channel = channel
        self._channel_byte = channel_byte
        self.forked = False

    def write(self, data):
        if self.forked:
            return super().write(data)
        data = bytes(data) if not isinstance(data, bytes) else data
        self._channel.write_text(self._channel_byte, data)
        return len(data)

    def flush(self):
        if not self.forked:
            self._channel.flush_text()


def open_channel_text_streams(channel):
    """(stdout, stderr) writing stream frames on `channel`; fileno() is still 1 and 2 for code that wants
    the fd (subprocess, faulthandler), whose output the kernel reads from the pipes."""
    writers = [_ChannelWriter(1, channel, STDOUT_CHANNEL), _ChannelWriter(2, channel, STDERR_CHANNEL)]

    def in_forked_child():
        for writer in writers:
            writer.forked = True
        channel.forget_text()

    def before_child_process(event, args):
        # Text of an unfinished line goes first, so it comes before what the child writes to fds 1/2.
        if event in _CHILD_PROCESS_EVENTS and not writers[0].forked:
            channel.flush_text()

    os.register_at_fork(after_in_child=in_forked_child)
    sys.addaudithook(before_child_process)
    return tuple(io.TextIOWrapper(writer, encoding="utf-8", errors=REPLACE_SURROGATES, newline="\n",
                                  line_buffering=False, write_through=True) for writer in writers)


def open_fd_text_stream(fd):
    return io.TextIOWrapper(_FdWriter(fd), encoding="utf-8", errors=REPLACE_SURROGATES,
                            newline="\n", line_buffering=False, write_through=True)


class DiscardingTextStream(io.TextIOBase):
    """Where Python-level output goes during a silent execute."""

    encoding = "utf-8"

    def writable(self):
        return True

    def write(self, text):
        return len(text)
