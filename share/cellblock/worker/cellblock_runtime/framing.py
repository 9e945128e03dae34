"""Frames on the kernel channel (fd 3): a 4-byte big-endian length, then that many bytes of UTF-8 JSON, or of
a stream frame (a channel byte, 0x01 stdout or 0x02 stderr, then the text's UTF-8 bytes, not JSON-encoded).

See ../PROTOCOL.md. The kernel is the trusted side; this module makes sure the untrusted worker never
emits a frame the kernel would have to treat as a protocol error (oversized, invalid UTF-8, NaN, lone
surrogates), because a protocol error costs the user the whole worker.
"""

import codecs
import fcntl
import json
import math
import os
import select
import signal
import struct
import sys
import termios
import threading
import time

MAX_FRAME_BYTES = 64 * 1024 * 1024
_HEADER = struct.Struct(">I")
STDOUT_CHANNEL = b"\x01"
STDERR_CHANNEL = b"\x02"
# A stream frame's body is the channel byte and at most this many bytes of text: a larger write is split.
MAX_STREAM_CHUNK = MAX_FRAME_BYTES - 1
# Stream text is sent when a line ends (at most one frame of whole lines per TEXT_DELAY_SECONDS), when this
# much is pending, or this long after it was written (the kernel batches stream text for 3 ms anyway).
TEXT_AT_ONCE_BYTES = 64 * 1024
TEXT_DELAY_SECONDS = 0.002
# An unfinished line is held back (for the rest of its line, at most TEXT_DELAY_SECONDS) up to this size.
TEXT_HOLD_BYTES = 8 * 1024 * 1024
_MAX_IOVECS = 64
_READ_CHUNK = 1024 * 1024
STREAM_FDS = (1, 2)
# How long a frame may wait for the kernel to read fds 1/2 before it is sent anyway (the kernel is busy,
# or a background process keeps writing). Only text written at the fd level (subprocesses, C code) is in the
# pipes: Python-level sys.stdout/sys.stderr travel on the channel itself, ordered with the frames by
# construction.
STREAM_CATCH_UP_SECONDS = 0.1
_STALL_SECONDS = 0.02

# Lone surrogates (from surrogateescape-decoded bytes or broken user strings) cannot be encoded as UTF-8;
# they become U+FFFD both in frames and in stream text, instead of raising in the middle of user code.
REPLACE_SURROGATES = "cellblock.replace_surrogates"


def _replace_unencodable(error):
    if isinstance(error, UnicodeEncodeError):
        # Bytes, because CPython's UTF-8 encoder only accepts ASCII str replacements.
        return b"\xef\xbf\xbd" * (error.end - error.start), error.end
    raise error


codecs.register_error(REPLACE_SURROGATES, _replace_unencodable)


class ProtocolError(Exception):
    """The kernel sent something that is not a frame this worker understands."""


class FrameTooLarge(ValueError):
    """An outgoing message would exceed the kernel's frame limit."""


class ChannelClosed(Exception):
    """The kernel closed its end of the channel."""


def _json_fallback(value):
    # Display data should already be JSON-able; anything else degrades to its repr instead of failing.
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).decode("utf-8", "replace")
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    try:
        return repr(value)
    except Exception:
        return f"<unrepresentable {type(value).__name__}>"


def _strictly_json(value, depth=0):
    """Slow path: a copy of value without NaN/Infinity, non-string keys or reference cycles."""
    if depth > 200:
        return "<nested too deeply>"
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (str, int, bool)):
        return value
    if isinstance(value, dict):
        return {str(key): _strictly_json(item, depth + 1) for key, item in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_strictly_json(item, depth + 1) for item in value]
    return _json_fallback(value)


def encode_frame_payload(message):
    try:
        text = json.dumps(message, ensure_ascii=False, allow_nan=False, default=_json_fallback,
                          separators=(",", ":"))
    except (ValueError, TypeError, RecursionError):
        text = json.dumps(_strictly_json(message), ensure_ascii=False, separators=(",", ":"))
    return text.encode("utf-8", REPLACE_SURROGATES)


class FrameChannel:
    """The worker's end of the kernel channel. Thread-safe; interrupt-safe through the InterruptGate."""

    def __init__(self, fd, interrupt_gate):
        self._fd = fd
        self._gate = interrupt_gate
        self._send_lock = threading.Lock()
        self._receive_lock = threading.Lock()
        self._received = bytearray()
        self._pipe_fds = list(STREAM_FDS)
        self._pipes_lagging = False
        # Stream text not sent yet: the pieces of one stream's unfinished line (see write_text).
        self._pending = []
        self._pending_channel = None
        self._pending_bytes = 0
        self._last_text_sent = 0.0
        self._text_due = threading.Condition(self._send_lock)
        self._flusher = None

    def fileno(self):
        return self._fd

    def request_waiting(self):
        """Bytes of a frame are buffered or readable (called from the SIGINT handler: never raises)."""
        if self._received:
            return True
        try:
            return struct.unpack("i", fcntl.ioctl(self._fd, termios.FIONREAD, b"\0\0\0\0"))[0] > 0
        except OSError:
            return False

    def send(self, message, finishes_request=False):
        payload = encode_frame_payload(message)
        if len(payload) > MAX_FRAME_BYTES:
            raise FrameTooLarge(
                f"{message.get('type', 'message')} of {len(payload)} bytes exceeds the "
                f"{MAX_FRAME_BYTES}-byte frame limit of the kernel channel")
        frame = _HEADER.pack(len(payload)) + payload
        # A sys.stdout/sys.stderr the user installed may buffer.
        _flush_standard_streams()
        with self._send_lock:
            # Ordering rule for fd-level text (subprocesses, C code): the kernel must have read what reached
            # fds 1/2 before this frame, so text written after the frame can never overtake it.
            self._wait_until_streams_are_read()
            with self._gate.frame_io():
                if finishes_request:
                    # Before the reply can reach the kernel (which may answer it with the next request and an
                    # interrupt for that one at once), and with SIGINT held back: an interrupt that arrives
                    # from here on is a late one for this request, unless the next request is already waiting.
                    self._gate.request_finished()
                self._write_pending_text()  # stream text written before this frame goes before it
                self._write_all([frame])

    def write_text(self, channel_byte, data):
        """Python-level stdout (STDOUT_CHANNEL) or stderr text, sent in band as stream frames, so ordered with
        the other frames by the channel itself. `data` is UTF-8 bytes (or anything the kernel then repairs).

        Sent at once: a write that ends a line (print's last write) unless the last stream frame went less
        than TEXT_DELAY_SECONDS ago and less than TEXT_AT_ONCE_BYTES are pending, more than TEXT_HOLD_BYTES,
        and the text before any other frame or a child process.
        Otherwise the text waits at most TEXT_DELAY_SECONDS (a progress dot still shows live). So `print(x)`
        is one frame, not two, and a loop of prints one frame per TEXT_DELAY_SECONDS, not one per line."""
        if not data:
            return
        with self._send_lock:
            if self._pending_channel != channel_byte and self._pending:
                self._flush_pending_locked()
            # In this order, so a KeyboardInterrupt between two of these lines leaves nothing inconsistent.
            self._pending_channel = channel_byte
            self._pending.append(data)
            self._pending_bytes += len(data)
            if data[-1:] == b"\n" and (self._pending_bytes >= TEXT_AT_ONCE_BYTES
                                       or time.monotonic() - self._last_text_sent >= TEXT_DELAY_SECONDS):
                self._flush_pending_locked()
            elif self._pending_bytes >= TEXT_HOLD_BYTES:
                self._flush_pending_locked()
            elif len(self._pending) == 1:
                self._start_flusher_locked()
                self._text_due.notify()

    def flush_text(self):
        """Sends the unfinished line now (sys.stdout.flush(), before a child process starts)."""
        with self._send_lock:
            self._flush_pending_locked()

    def forget_text(self):
        """In a forked child: the pending text is the parent's to send."""
        self._pending = []
        self._pending_channel = None
        self._pending_bytes = 0
        self._send_lock = threading.Lock()
        self._text_due = threading.Condition(self._send_lock)
        self._flusher = None

    def _flush_pending_locked(self):
        if not self._pending:
            return
        self._wait_until_streams_are_read()
        with self._gate.stream_frame_io():
            self._write_pending_text()

    def _write_pending_text(self):
        """The pending text as stream frames (the caller holds the send lock with SIGINT held back)."""
        if not self._pending:
            return
        pieces, channel_byte = self._pending, self._pending_channel
        self._pending, self._pending_channel, self._pending_bytes = [], None, 0
        self._last_text_sent = time.monotonic()
        total = sum(len(piece) for piece in pieces)
        if total <= MAX_STREAM_CHUNK and len(pieces) <= _MAX_IOVECS:
            # One frame, the pieces as they are (a 1 MiB print and its "\n": no copy).
            self._write_all([_HEADER.pack(total + 1) + channel_byte, *pieces])
            return
        view = memoryview(b"".join(pieces)).cast("B")
        while view:
            chunk = view[:MAX_STREAM_CHUNK]
            view = view[len(chunk):]
            self._write_all([_HEADER.pack(len(chunk) + 1) + channel_byte, chunk])

    def _start_flusher_locked(self):
        if self._flusher is None:
            # Started on first use: a zygote template's forks must not inherit a thread.
            self._flusher = threading.Thread(target=self._flush_after_delay, name="cellblock-output", daemon=True)
            self._flusher.start()

    def _flush_after_delay(self):
        # SIGINT is for the main thread (InterruptGate): a process-directed signal goes to a thread that does not
        # block it, and taken here it would reach the main thread's handler only when this thread next runs.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        while True:
            with self._send_lock:
                while not self._pending:
                    self._text_due.wait()
            time.sleep(TEXT_DELAY_SECONDS)
            try:
                self.flush_text()
            except OSError:
                return  # the kernel is gone

    def _write_all(self, parts):
        """One frame's bytes, whole (the caller holds the send lock with SIGINT held back)."""
        while parts:
            written = os.writev(self._fd, parts)
            while parts and written >= len(parts[0]):
                written -= len(parts[0])
                parts.pop(0)
            if parts and written:
                parts[0] = memoryview(parts[0])[written:]

    def _unread_stream_bytes(self):
        unread = 0
        for fd in list(self._pipe_fds):
            try:
                unread += struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]
            except OSError:
                self._pipe_fds.remove(fd)  # not a pipe (a file or a terminal when run by hand): nothing to wait for
        return unread

    def _wait_until_streams_are_read(self):
        unread = self._unread_stream_bytes()
        if unread == 0:
            self._pipes_lagging = False
            return
        if self._pipes_lagging:
            # The last wait gave up (a background process keeps writing, or the kernel is busy) and the
            # pipes have not been empty since: waiting again would cost every print up to 100 ms.
            return
        start = last_progress = time.monotonic()
        while unread:
            time.sleep(0.0002)
            now = time.monotonic()
            remaining = self._unread_stream_bytes()
            if remaining < unread:
                last_progress = now
            unread = remaining
            if now - start > STREAM_CATCH_UP_SECONDS or now - last_progress > _STALL_SECONDS:
                self._pipes_lagging = True
                return

    def _complete_frame(self):
        if len(self._received) < _HEADER.size:
            return None
        (length,) = _HEADER.unpack_from(self._received)
        if length > MAX_FRAME_BYTES:
            raise ProtocolError(f"incoming frame of {length} bytes exceeds {MAX_FRAME_BYTES}")
        end = _HEADER.size + length
        if len(self._received) < end:
            return None
        payload = bytes(self._received[_HEADER.size:end])
        # Before the bytes leave the buffer: at every moment either they are waiting or a frame is in hand,
        # so a SIGINT that arrives in between is kept for the request (InterruptGate).
        self._gate.frame_taken()
        del self._received[:end]
        try:
            message = json.loads(payload)
        except ValueError as error:
            raise ProtocolError(f"frame is not UTF-8 JSON: {error}") from None
        if not isinstance(message, dict):
            raise ProtocolError("frame is not a JSON object")
        return message

    def receive(self, interruptible=False):
        """Block until a whole frame has arrived and return it as a dict.

        With interruptible=True a SIGINT may abort the wait (KeyboardInterrupt) but never a partial read:
        the wait happens in select(), and bytes are only consumed with SIGINT held back.
        """
        with self._receive_lock:
            while True:
                if self._received:  # else there is no frame to complete (and no signal mask to change)
                    with self._gate.frame_io():
                        message = self._complete_frame()
                    if message is not None:
                        return message
                # Wait with SIGINT deliverable (outside user code its handler never raises), then read and
                # decode with it held back: a SIGINT is either seen while nothing is waiting (a late one,
                # dropped) or while bytes or a frame are in hand (kept for that request).
                select.select([self._fd], [], [])
                with self._gate.frame_io():
                    chunk = os.read(self._fd, _READ_CHUNK)
                    if not chunk:
                        raise ChannelClosed()
                    self._received += chunk
                    message = self._complete_frame()
                if message is not None:
                    return message

    def poll_frame(self):
        """Return a frame that is already readable without blocking, else None."""
        with self._receive_lock, self._gate.frame_io():
            message = self._complete_frame()
            if message is not None:
                return message
            while select.select([self._fd], [], [], 0)[0]:
                chunk = os.read(self._fd, _READ_CHUNK)
                if not chunk:
                    raise ChannelClosed()
                self._received += chunk
                message = self._complete_frame()
                if message is not None:
                    return message
            return None


def _flush_standard_streams():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            # A user-replaced stream that cannot flush must not stop the event itself.
            pass
