"""SIGINT disposition for a worker that must never lose protocol framing to an interrupt.

While idle the worker ignores SIGINT. While a request runs, SIGINT raises KeyboardInterrupt in the main
thread, except while the main thread is in the middle of a frame read or write: then the interrupt is
remembered and raised right after the frame is complete. Blocking SIGINT with pthread_sigmask alone is
not enough, because a signal delivered to another (user) thread still trips CPython's pending flag and
the handler would run between two partial writes of one frame.
"""

import contextlib
import signal
import threading

_SIGINT_ONLY = frozenset({signal.SIGINT})


class InterruptGate:
    """Owns the worker's SIGINT handler and the 'frame in progress' deferral."""

    def __init__(self):
        self._main_thread = threading.main_thread()
        self._frame_depth = 0  # > 0 while the main thread is inside a frame read/write
        self._deferred = False
        self._accepting = False
        self._handler = self._on_sigint  # one bound method, so it can be recognised later
        self._user_handler = None  # a SIGINT handler installed by user code, kept for later requests

    def _on_sigint(self, signum, frame):
        if self._frame_depth > 0:
            self._deferred = True
            return
        signal.default_int_handler(signum, frame)

    def ignore_interrupts(self):
        self._accepting = False
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    @contextlib.contextmanager
    def interruptible(self):
        """Run the body with SIGINT raising KeyboardInterrupt; back to ignoring afterwards."""
        self._deferred = False
        self._accepting = True
        signal.signal(signal.SIGINT, self._user_handler or self._handler)
        try:
            yield
        finally:
            # Once SIG_IGN is installed CPython drops a still-pending SIGINT instead of running the handler.
            current = signal.getsignal(signal.SIGINT)
            self.ignore_interrupts()
            if current is self._handler or current is signal.default_int_handler or current is None:
                self._user_handler = None
            else:
                # User code installed its own disposition: it applies whenever user code runs.
                self._user_handler = current

    @contextlib.contextmanager
    def frame_io(self):
        """Keep SIGINT out of a frame read/write (blocked for this thread, deferred if another thread gets it)."""
        if threading.current_thread() is not self._main_thread:
            # Only the main thread runs Python signal handlers, so a user thread needs no deferral.
            yield
            return
        previous_mask = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGINT_ONLY)
        self._frame_depth += 1
        try:
            yield
        finally:
            self._frame_depth -= 1
            signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)
        # Unblocking may deliver a pending SIGINT right here (the handler raises since depth is 0 again);
        # one that a user thread received during the frame was deferred and is raised now.
        if self._frame_depth == 0 and self._deferred:
            self._deferred = False
            if self._accepting:
                raise KeyboardInterrupt
