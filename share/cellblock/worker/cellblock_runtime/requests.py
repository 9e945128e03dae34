"""The four request kinds the kernel forwards: execute, complete, inspect, is_complete.

Each handler returns the `content` of the reply frame. Behaviour follows ipykernel 6.17 (do_execute,
_experimental_do_complete, do_inspect, do_is_complete) so clients see what they are used to.
"""

import sys

from IPython.core.completer import provisionalcompleter, rectify_completions
from IPython.utils.tokenutil import token_at_cursor

from .shell import safe_text
from .streams import DiscardingTextStream


_HISTORY_CACHE_LIMIT = 100


class RequestError(Exception):
    """A malformed request: answered with an error reply, the worker keeps serving."""


def _field(request, name, kind, default):
    value = request.get(name, default)
    if value is None:
        return default
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise RequestError(f"{request.get('type')}: field {name!r} must be {kind.__name__}, "
                           f"got {type(value).__name__}")
    return value


def _cursor(request, code):
    cursor_pos = _field(request, "cursor_pos", int, len(code))
    # Jupyter counts Unicode code points, which is exactly a Python str index.
    return min(max(cursor_pos, 0), len(code))


class RequestHandlers:
    def __init__(self, shell, interrupt_gate, stdin_forwarder):
        self._shell = shell
        self._gate = interrupt_gate
        self._stdin = stdin_forwarder

    def handler_for(self, kind):
        return {
            "execute": self.execute,
            "complete": self.complete,
            "inspect": self.inspect,
            "is_complete": self.is_complete,
            "sync": self.sync,
        }.get(kind)

    @staticmethod
    def sync(request):
        """Nothing to do: the kernel sends it after the reply to a request it interrupted, so that a SIGINT
        still on its way is taken (and dropped at this reply) before the next request (PROTOCOL.md)."""
        return {"status": "ok"}

    # -- execute --------------------------------------------------------------------------------
    def execute(self, request):
        shell = self._shell
        code = _field(request, "code", str, "")
        silent = bool(request.get("silent", False))
        store_history = bool(request.get("store_history", True)) and not silent
        user_expressions = _field(request, "user_expressions", dict, {})
        if not all(isinstance(key, str) and isinstance(value, str) for key, value in user_expressions.items()):
            raise RequestError("execute: user_expressions must map names to expression strings")
        execution_count = _field(request, "execution_count", int, shell.execution_count)
        if execution_count > 0:
            shell.execution_count = execution_count
            if store_history:
                self._align_input_history(execution_count)

        shell.current_cell = code
        shell.last_error = None
        shell.payload_manager.clear_payload()
        self._stdin.allowed = bool(request.get("allow_stdin", False))
        shell.output_route.silent = silent
        saved_streams = (sys.stdout, sys.stderr)
        if silent:
            sys.stdout = sys.stderr = DiscardingTextStream()
        try:
            # Interruptible where the user's code runs (CellblockShell.run_code), not around IPython's work.
            result = shell.run_cell(code, store_history=store_history, silent=silent)
            if result.success:
                expressions = {}
                if user_expressions:  # usually none
                    try:
                        with self._gate.interruptible():
                            expressions = shell.user_expressions(user_expressions)
                    except KeyboardInterrupt:
                        pass  # the cell itself succeeded; an interrupted expression evaluation yields none
                return {"status": "ok", "user_expressions": expressions,
                        "payload": shell.payload_manager.read_payload()}
            return self._error_content(result)
        finally:
            if silent:
                # Put back our streams unless the silent code deliberately installed its own.
                if isinstance(sys.stdout, DiscardingTextStream):
                    sys.stdout = saved_streams[0]
                if isinstance(sys.stderr, DiscardingTextStream):
                    sys.stderr = saved_streams[1]
            shell.output_route.silent = False
            self._stdin.allowed = False
            shell.payload_manager.clear_payload()
            self._bound_history_cache()

    def _align_input_history(self, execution_count):
        # `In[n]`/`_in` are list positions: pad if the kernel's counter ran ahead (e.g. a fresh worker).
        history = self._shell.history_manager
        while len(history.input_hist_parsed) < execution_count:
            history.input_hist_parsed.append("")
            history.input_hist_raw.append("")

    def _bound_history_cache(self):
        # Without IPython's history-saving thread (in-memory history), stored cells pile up in a write cache;
        # move them into the (in-memory) database now and then, as the thread would.
        history = self._shell.history_manager
        if len(history.db_input_cache) >= _HISTORY_CACHE_LIMIT:
            history.writeout_cache()

    def _error_content(self, result):
        error = self._shell.last_error
        if error is None:
            exception = result.error_before_exec or result.error_in_exec
            if exception is not None:
                error = {"ename": type(exception).__name__, "evalue": safe_text(exception), "traceback": []}
        if error is None:
            error = {"ename": "UnknownError", "evalue": "the cell failed without an exception", "traceback": []}
        return {"status": "error", **error}

    # -- complete -------------------------------------------------------------------------------
    def complete(self, request):
        code = _field(request, "code", str, "")
        cursor_pos = _cursor(request, code)
        with self._gate.interruptible(), provisionalcompleter():
            completions = list(rectify_completions(code, self._shell.Completer.completions(code, cursor_pos)))
        if completions:
            cursor_start, cursor_end = completions[0].start, completions[0].end
        else:
            cursor_start = cursor_end = cursor_pos
        return {
            "status": "ok",
            "matches": [completion.text for completion in completions],
            "cursor_start": cursor_start,
            "cursor_end": cursor_end,
            "metadata": {"_jupyter_types_experimental": [
                {"start": c.start, "end": c.end, "text": c.text, "type": c.type, "signature": c.signature}
                for c in completions]},
        }

    # -- inspect --------------------------------------------------------------------------------
    def inspect(self, request):
        code = _field(request, "code", str, "")
        cursor_pos = _cursor(request, code)
        detail_level = 1 if _field(request, "detail_level", int, 0) else 0
        name = token_at_cursor(code, cursor_pos)
        content = {"status": "ok", "found": False, "data": {}, "metadata": {}}
        if not name:
            return content
        try:
            with self._gate.interruptible():
                bundle = self._shell.object_inspect_mime(name, detail_level=detail_level)
        except KeyError:
            return content
        if not self._shell.enable_html_pager:
            bundle.pop("text/html", None)
        content["data"] = bundle
        content["found"] = True
        return content

    # -- is_complete ----------------------------------------------------------------------------
    def is_complete(self, request):
        code = _field(request, "code", str, "")
        status, indent_spaces = self._shell.input_transformer_manager.check_complete(code)
        content = {"status": status}
        if status == "incomplete":
            content["indent"] = " " * (indent_spaces or 0)
        return content
