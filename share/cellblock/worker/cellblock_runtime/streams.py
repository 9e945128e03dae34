"""sys.stdout / sys.stderr as UTF-8, write-through text streams on fds 1 and 2.

Every write() reaches the pipe immediately, so output streams while a cell runs and interleaves
correctly with subprocesses and C code writing to the same fds. Unencodable characters (lone
surrogates) become U+FFFD rather than raising inside user code.
"""

import io
import os

from .framing import REPLACE_SURROGATES


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
