"""IPython's InteractiveShell, with displays, results, errors and payloads sent as frames.

This mirrors what ipykernel's ZMQInteractiveShell does, minus ZMQ: the display publisher and display
hook turn IPython's mime bundles into display_data / update_display_data / clear_output /
execute_result frames, tracebacks become one error frame, the pager and set_next_input become execute
reply payloads, and `!cmd` runs through /bin/sh with fds 1/2 inherited so its output reaches the kernel
directly (no pty: pexpect's pseudo-terminals may not exist inside the sandbox).
"""

import io
import os
import subprocess
import sys
import tokenize

from IPython.core import page
from IPython.core.displayhook import DisplayHook
from IPython.core.displaypub import DisplayPublisher
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell, InteractiveShellABC
from IPython.lib.pretty import _repr_pprint
from IPython.utils.text import LSString, SList
from traitlets import Any, Type
from traitlets.config import Config


_RUNTIME_DIR = os.path.dirname(os.path.abspath(__file__))


def _without_runtime_tail(tb):
    """The traceback minus trailing frames of this runtime (the SIGINT gate that raised KeyboardInterrupt):
    the user should see the line of *their* code that was interrupted, not our handler."""
    nodes = []
    while tb is not None:
        nodes.append(tb)
        tb = tb.tb_next
    keep = len(nodes)
    while keep > 1 and os.path.dirname(os.path.abspath(nodes[keep - 1].tb_frame.f_code.co_filename)) == _RUNTIME_DIR:
        keep -= 1
    if keep < len(nodes):
        nodes[keep - 1].tb_next = None
    return nodes[0] if nodes else None


class OutputRoute:
    """Where a request's events go: to the kernel, or nowhere during a silent execute."""

    def __init__(self, channel):
        self._channel = channel
        self.silent = False

    def attach(self, channel):
        """The channel, once the worker has one (a template builds the shell before it does)."""
        self._channel = channel

    def publish(self, message):
        if not self.silent:
            self._channel.send(message)


def safe_text(value):
    try:
        return str(value)
    except Exception:
        return f"<{type(value).__name__} object: str() failed>"


def safe_repr(value):
    try:
        return repr(value)
    except Exception:
        return f"<{type(value).__name__} object: repr() failed>"


class FrameDisplayPublisher(DisplayPublisher):
    """display(), update_display() and clear_output() as frames."""

    def publish(self, data, metadata=None, source=None, *, transient=None, update=False, **kwargs):
        self._validate_data(data, metadata)
        self.shell.output_route.publish({
            "type": "update_display_data" if update else "display_data",
            "data": data,
            "metadata": metadata or {},
            "transient": transient or {},
        })

    def clear_output(self, wait=False):
        self.shell.output_route.publish({"type": "clear_output", "wait": bool(wait)})


_PLAIN_ONLY_TYPES = frozenset({int, float, complex, bool, str, bytes, type(None)})
# Types whose text/plain is their repr() while the plain-text formatter keeps IPython's printer for them.
_REPR_TYPES = frozenset({int, float, str})


def _trait(owner, name):
    """A trait's value without the descriptor (about 1 us per read, and the per-cell checks read dozens)."""
    try:
        return owner._trait_values[name]
    except (AttributeError, KeyError):
        return getattr(owner, name)  # a lazy default not computed yet


class FrameDisplayHook(DisplayHook):
    """The last expression's value as an execute_result frame (`_`, `__`, `Out` and `_N` kept by IPython)."""

    _pending = None

    def quiet(self):
        # IPython looks at the last *stored* history entry, which is stale for store_history=False cells.
        cell = self.shell.current_cell
        if ";" not in cell:
            return False  # no `;` token can end it (tokenizing costs more than the rest of this hook)
        try:
            tokens = list(tokenize.generate_tokens(io.StringIO(cell).readline))
        except (tokenize.TokenError, SyntaxError):
            return False
        for token in reversed(tokens):
            if token.type in (tokenize.ENDMARKER, tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT):
                continue
            return token.type == tokenize.OP and token.string == ";"
        return False

    def start_displayhook(self):
        self._pending = None

    def write_output_prompt(self):
        pass

    def compute_format_data(self, result):
        if type(result) in _PLAIN_ONLY_TYPES and self._only_plain_text_applies(type(result)):
            # Fast path (about 80 us of a 1+1 cell): running all twelve formatters on an int or a str can
            # only produce text/plain, unless the user registered a formatter for the type.
            plain = _trait(self.shell.display_formatter, "formatters")["text/plain"]
            return {"text/plain": self._plain_text(plain, result)}, {}
        data, metadata = super().compute_format_data(result)
        if "text/plain" not in data:
            # Clients that render only text (agents) must always get something.
            data = dict(data)
            data["text/plain"] = safe_repr(result)
        return data, metadata

    @staticmethod
    def _plain_text(plain, result):
        """What the plain-text formatter makes of an int, float or str it has IPython's printer for: repr(), as
        IPython's _repr_pprint writes it (the repr of these types has no line break), without the formatter's
        pretty-printer set-up and error-catching decorator (about 12 us). Anything else goes to the formatter."""
        if type(result) in _REPR_TYPES and id(result) not in _trait(plain, "singleton_printers") and (
                not _trait(plain, "pprint") or _trait(plain, "type_printers").get(type(result)) is _repr_pprint):
            try:
                return repr(result)
            except Exception:
                pass  # e.g. an int too long for str(): the formatter reports it as IPython does
        return plain(result)

    def _only_plain_text_applies(self, result_type):
        display_formatter = self.shell.display_formatter
        formatters = _trait(display_formatter, "formatters")
        plain = formatters.get("text/plain")
        if plain is None or not _trait(plain, "enabled"):
            return False
        mro = result_type.__mro__
        for mime, formatter in formatters.items():
            if mime == "text/plain" or not _trait(formatter, "enabled"):
                continue
            if _trait(formatter, "deferred_printers"):
                return False
            type_printers = _trait(formatter, "type_printers")
            if type_printers and any(cls in type_printers for cls in mro):
                return False
        for formatter in (_trait(display_formatter, "ipython_display_formatter"),
                          _trait(display_formatter, "mimebundle_formatter")):
            if _trait(formatter, "type_printers") or _trait(formatter, "deferred_printers"):
                return False
        return True

    def write_format_data(self, format_dict, md_dict=None):
        self._pending = (format_dict, md_dict or {})

    def finish_displayhook(self):
        if self._pending is None:
            return
        data, metadata = self._pending
        self._pending = None
        self.shell.output_route.publish({
            "type": "execute_result",
            "execution_count": self.prompt_count,
            "data": data,
            "metadata": metadata,
        })


def _page_as_payload(shell):
    def page_to_payload(strng, start=0, screen_lines=0, pager_cmd=None):
        data = strng if isinstance(strng, dict) else {"text/plain": strng}
        # Same choice as ipykernel without enable_html_pager: the pager payload carries plain text.
        text = data.get("text/plain", "")
        shell.payload_manager.write_payload({"source": "page", "data": {"text/plain": text},
                                             "start": max(0, int(start or 0))})
    return page_to_payload


class CellblockShell(InteractiveShell):
    """InteractiveShell for a headless, confined worker."""

    displayhook_class = Type(FrameDisplayHook)
    display_pub_class = Type(FrameDisplayPublisher)
    output_route = Any(None, help="OutputRoute for frames (set by the worker before any request)")
    interrupt_gate = Any(None, help="InterruptGate: SIGINT raises only while the user's code runs")

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.current_cell = ""
        self.last_error = None
        self.set_hook("show_in_pager", page.as_hook(_page_as_payload(self)), 99)

    # -- errors ---------------------------------------------------------------------------------
    def _get_exc_info(self, exc_tuple=None):
        etype, evalue, tb = super()._get_exc_info(exc_tuple)
        return etype, evalue, _without_runtime_tail(tb)

    def _showtraceback(self, etype, evalue, stb):
        error = {
            "ename": getattr(etype, "__name__", safe_text(etype)),
            "evalue": safe_text(evalue),
            "traceback": [safe_text(line) for line in (stb or [])],
        }
        self.last_error = error
        self.output_route.publish({"type": "error", **error})

    # -- interrupts -----------------------------------------------------------------------------
    async def run_code(self, code_obj, result=None, *, async_=False):
        """Only the user's code is interruptible, not IPython's bookkeeping around it: a KeyboardInterrupt
        inside IPython (between taking and releasing its history's lock, say) could break every later cell.
        An interrupt that arrives in between is kept by the gate and raised here, before the code starts."""
        finished = None
        try:
            with self.interrupt_gate.interruptible():
                finished = await super().run_code(code_obj, result, async_=async_)
        except KeyboardInterrupt as error:
            if finished is not None:
                return finished  # a late interrupt, after the code had finished: its outcome stands
            if result is not None:
                result.error_in_exec = error
            self._showtraceback(KeyboardInterrupt, error,
                                ["KeyboardInterrupt: interrupted before the code started"])
            return True
        return finished

    # -- payloads -------------------------------------------------------------------------------
    def set_next_input(self, s, replace=False):
        self.payload_manager.write_payload({"source": "set_next_input", "text": s, "replace": bool(replace)})

    def ask_exit(self):
        # exit()/quit(): the kernel decides what to do; the worker keeps serving.
        self.exit_now = True
        self.payload_manager.write_payload({"source": "ask_exit", "keepkernel": False})

    # -- GUI ------------------------------------------------------------------------------------
    def enable_gui(self, gui=None):
        if gui not in (None, "inline"):
            raise UsageError(f"GUI event loop {gui!r} is not available in cellblock (no display); "
                             "use %matplotlib inline")

    # -- shell commands -------------------------------------------------------------------------
    # `!cmd`: /bin/sh (or $SHELL) with the worker's fds, so output streams straight to the kernel.
    system = InteractiveShell.system_raw

    def getoutput(self, cmd, split=True, depth=0):
        """`x = !cmd` and %sx without pexpect: stdout and stderr captured together, stdin empty."""
        if cmd.rstrip().endswith("&"):
            raise OSError("Background processes not supported.")
        command = self.var_expand(cmd, depth=depth + 1)
        completed = subprocess.run(command, shell=True, executable=os.environ.get("SHELL") or None,
                                   stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, check=False)
        out = completed.stdout.decode("utf-8", "replace")
        return SList(out.splitlines()) if split else LSString(out)


InteractiveShellABC.register(CellblockShell)


def shell_config():
    config = Config()
    # Plain-text tracebacks and inspector output: agents read raw text, where ANSI colour codes are
    # noise (several tokens per line) and easy to misquote. `%colors linux` turns them back on.
    config.InteractiveShell.colors = "NoColor"
    # The kernel keeps the session history; IPython's copy lives in memory (no sqlite file in the sandbox,
    # no history-saving thread).
    config.HistoryManager.hist_file = ":memory:"
    return config


def create_shell(output_route, interrupt_gate):
    shell = CellblockShell.instance(config=shell_config(), output_route=output_route, interrupt_gate=interrupt_gate)
    jedi = sys.modules.get("jedi")
    if jedi is not None:
        # Jedi pickles parsed stubs under ~/.cache; HOME is the agent's workspace, so keep them in /tmp.
        jedi.settings.cache_directory = os.path.join(os.environ.get("IPYTHONDIR", "/tmp/ipython"), "jedi-cache")
    return shell
