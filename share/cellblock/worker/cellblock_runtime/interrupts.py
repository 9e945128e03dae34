"""SIGINT disposition for a worker that must never lose protocol framing to an interrupt.

While a request runs, SIGINT raises KeyboardInterrupt in the main thread, except while the main thread is
in the middle of a frame read or write: then the interrupt is remembered and raised right after the frame
is complete. Outside user code the handler never raises: a SIGINT that arrives while a request is in hand
(received, not yet answered) or already waiting on the channel belongs to that request and is raised as
soon as its code starts; one that arrives while nothing is pending (a late interrupt for a request that
was just answered) is dropped. Blocking SIGINT with pthread_sigmask alone is
not enough, because a signal delivered to another (user) thread still trips CPython's pending flag and
the handler would run between two partial writes of one frame.
"""

import _signal
import contextlib
import signal
import threading

# The C functions behind signal.signal / getsignal / pthread_sigmask: the wrappers in signal.py convert every
# argument and result to enums, which cost more than the syscalls themselves on each request (four handler
# switches and four mask changes per `1+1`). Handlers and results compare the same (`is`) either way.
_set_handler = _signal.signal
_get_handler = _signal.getsignal
_set_mask = _signal.pthread_sigmask
_SIGINT = int(signal.SIGINT)
_SIGINT_ONLY = (_SIGINT,)


class InterruptGate:
    """Owns the worker's SIGINT handler, whether user code is running, and the 'frame in progress' deferral.

    One handler stays installed and decides from that state, rather than a raising handler being swapped in
    for user code and out again: CPython runs a handler at the next check of its eval loop, which can be at
    the end of the very call that installed it or at the entry of the function meant to remove it, so a
    swapped-in handler could raise outside user code and outlive it (the worker then died of the next
    interrupt while waiting for a request). The state it reads, how deep in user code the main thread is, is
    changed first thing on every way into and out of user code, before any point where a handler could run,
    and reset in request_finished(), which runs with SIGINT held back.
    """

    def __init__(self):
        self._main_thread = threading.main_thread()
        self._frame_depth = 0  # > 0 while the main thread is inside a frame read/write
        self._deferred = False
        self._user_code_depth = 0  # > 0 while user code runs (nested: user code may run a cell itself)
        self._handler = self._on_sigint  # one bound method, so it can be recognised later
        self._user_handler = None  # a SIGINT handler installed by user code, kept for later requests
        self._request_in_hand = False
        self._early = False  # an interrupt for the request in hand arrived before its code started
        self._request_waiting = lambda: False  # set by the channel: unread request bytes?
        self._stream_frame_io = _DeferredInterrupts(self)
        self._user_code = _UserCode(self)

    def _on_sigint(self, signum, frame):
        if self._frame_depth > 0:
            self._deferred = True
        elif self._user_code_depth > 0:
            signal.default_int_handler(signum, frame)
        elif self._request_in_hand or self._request_waiting():
            self._early = True
        # else: a late interrupt for a request already answered, dropped

    def watch_requests(self, request_waiting):
        """`request_waiting()` says whether request bytes are buffered or readable on the channel."""
        self._request_waiting = request_waiting

    def frame_taken(self):
        """A frame left the channel's buffer: until request_finished(), an interrupt belongs to it."""
        self._request_in_hand = True

    def request_finished(self):
        """The reply is being sent: an interrupt that comes now was meant for it, not for the next request."""
        self._user_code_depth = 0  # also ends a user-code state that an interrupt kept from being left normally
        self._request_in_hand = False
        self._early = False

    def ignore_interrupts(self):
        """Outside user code: SIGINT never raises (see the module docstring)."""
        self._user_code_depth = 0
        _set_handler(_SIGINT, self._handler)

    def interruptible(self):
        """Context manager: its body is user code, where SIGINT raises KeyboardInterrupt."""
        return self._user_code

    def _leave_user_code(self):
        """Back to our handler after the outermost user code (the depth is already 0)."""
        current = _get_handler(_SIGINT)
        if current is self._handler:
            self._user_handler = None
            return
        # User code installed its own disposition: it applies whenever user code runs, ours outside it.
        is_users = current is not signal.default_int_handler and current is not None
        self._user_handler = current if is_users else None
        _set_handler(_SIGINT, self._handler)

    def stream_frame_io(self):
        """frame_io for stream frames, which are many and small: the deferral without the two sigmask calls
        (about 12 us a frame on a VM). A SIGINT during the write still runs our handler, which defers it
        (an interrupted write is retried, PEP 475); only a SIGINT handler the user installed is not held back
        (as with frame_io when another thread receives the signal)."""
        return self._stream_frame_io

    @contextlib.contextmanager
    def frame_io(self):
        """Keep SIGINT out of a frame read/write (blocked for this thread, deferred if another thread gets it)."""
        if threading.current_thread() is not self._main_thread:
            # Only the main thread runs Python signal handlers, so a user thread needs no deferral.
            yield
            return
        previous_mask = _set_mask(signal.SIG_BLOCK, _SIGINT_ONLY)
        self._frame_depth += 1
        try:
            yield
        finally:
            self._frame_depth -= 1
            _set_mask(signal.SIG_SETMASK, previous_mask)
        # Unblocking may deliver a pending SIGINT right here (in user code the handler raises: depth is 0 again);
        # one that a user thread received during the frame was deferred and is raised now.
        if self._frame_depth == 0 and self._deferred:
            self._deferred = False
            if self._user_code_depth > 0:
                raise KeyboardInterrupt


class _DeferredInterrupts:
    """The main thread's frame depth without signal masking (InterruptGate.stream_frame_io)."""

    def __init__(self, gate):
        self._gate = gate

    def __enter__(self):
        gate = self._gate
        self._in_main_thread = threading.current_thread() is gate._main_thread
        if self._in_main_thread:
            gate._frame_depth += 1

    def __exit__(self, *exc_info):
        gate = self._gate
        if not self._in_main_thread:
            return False
        gate._frame_depth -= 1
        if gate._frame_depth == 0 and gate._deferred:
            gate._deferred = False
            if gate._user_code_depth > 0 and exc_info[0] is None:
                raise KeyboardInterrupt
        return False


class _UserCode:
    """InterruptGate.interruptible(). A class rather than a generator, and the state changes inline, so that no
    call (where CPython may run a handler) sits between them and the try that undoes them. The one place left,
    the entry of __exit__, is covered by request_finished(). Nested use (user code that runs a cell itself,
    `%%capture`) counts: only the outermost exit ends user code."""

    __slots__ = ("_gate",)

    def __init__(self, gate):
        self._gate = gate

    def __enter__(self):
        gate = self._gate
        try:
            gate._user_code_depth += 1
            if gate._user_code_depth == 1:
                gate._deferred = False
                if gate._user_handler is not None:
                    _set_handler(_SIGINT, gate._user_handler)
            if gate._early:
                gate._early = False
                raise KeyboardInterrupt
        except BaseException:
            gate._user_code_depth -= 1
            if gate._user_code_depth == 0:
                gate._leave_user_code()
            raise

    def __exit__(self, *exc_info):
        gate = self._gate
        gate._user_code_depth -= 1
        if gate._user_code_depth == 0:
            gate._leave_user_code()
        return False
