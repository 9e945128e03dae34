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
_thread_id = threading.get_ident


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
        self._main_thread_id = self._main_thread.ident
        self._frame_depth = 0  # > 0 while the main thread is inside a frame read/write
        self._deferred = False
        self._user_code_depth = 0  # > 0 while user code runs (nested: user code may run a cell itself)
        self._handler = self._on_sigint  # one bound method, so it can be recognised later
        self._user_handler = None  # a SIGINT handler installed by user code, kept for later requests
        self._request_in_hand = False
        self._early = False  # an interrupt for the request in hand arrived before its code started
        self._request_waiting = lambda: False  # set by the channel: unread request bytes?
        self._deferred_interrupts = _DeferredInterrupts(self)
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
        """frame_io for stream frames, which are many and small: always the deferral alone, without the two
        sigprocmask calls even under a SIGINT handler the user installed, which is then not held back (as with
        frame_io when another thread receives the signal)."""
        return self._deferred_interrupts

    def frame_io(self):
        """Context manager: keep SIGINT out of a frame read/write.

        Under our handler (outside user code always, and in user code that installed none) the deferral is
        enough: a SIGINT during the read or write runs our handler, which only remembers it (an interrupted
        call is retried, PEP 475), and it is raised when the frame is complete. Under a handler the user
        installed, which would run mid-frame, SIGINT is also blocked for this thread; that costs two
        sigprocmask calls, about 12 us a frame on a VM, so only then."""
        if _get_handler(_SIGINT) is self._handler:
            return self._deferred_interrupts
        return self._masked_interrupts()

    @contextlib.contextmanager
    def _masked_interrupts(self):
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
        # Unblocking may deliver a pending SIGINT right here (the handler then decides, at depth 0 again); one
        # that a user thread received during the frame was deferred and is decided now.
        self._decide_deferred(raise_allowed=True)

    def _decide_deferred(self, raise_allowed):
        """A SIGINT deferred during a frame, now that the frame is complete: what our handler would have done
        had it come now (raise in user code, else keep it for the request in hand or waiting, else drop it)."""
        if self._frame_depth != 0 or not self._deferred:
            return
        self._deferred = False
        if self._user_code_depth > 0:
            if raise_allowed:
                raise KeyboardInterrupt
        elif self._request_in_hand or self._request_waiting():
            self._early = True


class _DeferredInterrupts:
    """The main thread's frame depth without signal masking (InterruptGate.frame_io under our handler)."""

    def __init__(self, gate):
        self._gate = gate

    # One instance serves every thread, and a user thread may enter while the main thread is inside: the thread
    # is asked again on exit rather than remembered.
    def __enter__(self):
        gate = self._gate
        if _thread_id() == gate._main_thread_id:
            gate._frame_depth += 1

    def __exit__(self, *exc_info):
        gate = self._gate
        if _thread_id() != gate._main_thread_id:
            return False
        gate._frame_depth -= 1
        gate._decide_deferred(raise_allowed=exc_info[0] is None)
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
