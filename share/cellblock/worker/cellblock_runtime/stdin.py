"""input() and getpass.getpass() answered by the client through the kernel (input_request frames)."""

import builtins
import getpass
import os
import sys

from IPython.core.error import StdinNotImplementedError

from .framing import ChannelClosed


class StdinForwarder:
    """Replaces builtins.input and getpass.getpass for the lifetime of the worker.

    Whether a prompt may be sent depends on the request being executed (allow_stdin); the kernel only
    answers input_request while that request runs.
    """

    def __init__(self, channel):
        self._channel = channel
        self.allowed = False

    def install(self):
        builtins.input = self.input
        getpass.getpass = self.getpass

    def input(self, prompt=""):
        if not self.allowed:
            raise StdinNotImplementedError(
                "input was called, but this frontend does not support input requests.")
        return self._request(str(prompt), password=False)

    def getpass(self, prompt="Password: ", stream=None):
        if not self.allowed:
            raise StdinNotImplementedError(
                "getpass was called, but this frontend does not support input requests.")
        return self._request(str(prompt), password=True)

    def _request(self, prompt, password):
        # A reply to an earlier, interrupted prompt must not answer this one.
        while (stale := self._channel.poll_frame()) is not None:
            _exit_if_shutdown(stale)
        self._channel.send({"type": "input_request", "prompt": prompt, "password": password})
        while True:
            try:
                message = self._channel.receive(interruptible=True)
            except ChannelClosed:
                raise EOFError("the kernel closed the channel while waiting for input") from None
            _exit_if_shutdown(message)
            if message.get("type") != "input_reply":
                continue
            if "error" in message:
                raise EOFError(str(message.get("error") or "no input available"))
            value = message.get("value", "")
            if not isinstance(value, str):
                value = str(value)
            if value == "\x04":
                # Ctrl-D in a frontend means end of input, as in a terminal.
                raise EOFError("EOF when reading a line")
            return value


def _exit_if_shutdown(message):
    if message.get("type") == "shutdown":
        # SystemExit would be caught by IPython as a user error; the kernel wants the process gone.
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(0)
