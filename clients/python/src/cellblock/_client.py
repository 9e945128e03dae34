"""The synchronous client: :class:`Gateway`, :class:`Session`, :class:`Files`, :class:`Approvals`."""
from __future__ import annotations

import json
import os
import socket
import time
from types import TracebackType
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Type, Union
from urllib.parse import quote

import requests

from . import errors
from ._models import Approval, Execution, FileInfo, MimeBundle

__all__ = ["Gateway", "Session", "Files", "Approvals", "NetworkPolicy"]

# A policy as the gateway takes it ({"allow": [...], "ask": bool}), or just the list of host patterns.
NetworkPolicy = Union[Mapping[str, Any], Sequence[str]]
TextCallback = Callable[[str], None]
DisplayCallback = Callable[[MimeBundle], None]
ApprovalCallback = Callable[[Approval], None]
EventCallback = Callable[[Dict[str, Any]], None]

_API = "/agent/v1"
_DECISIONS = ("allow_once", "allow_session", "deny")


class Gateway:
    """A connection to one cellblock gateway.

    ``url`` and ``token`` default to ``$CELLBLOCK_URL`` and ``$CELLBLOCK_TOKEN``. ``timeout`` bounds every call
    that does not run code (connect and each read); ``connect_timeout`` the TCP connect of every call, ``run``
    included; ``stream_idle_timeout`` the silence ``run`` accepts between two lines of the execute stream (the
    gateway writes a keepalive every 10 s while code runs). Calls that change nothing (GET, PUT of a file,
    DELETE) are retried ``retries`` times on connection errors; creating a session, ``run``, ``reset`` and
    deciding an approval never are, so code never runs twice. One HTTP connection pool serves every call; close
    it with :meth:`close` or use the gateway as a context manager.
    """

    def __init__(self, url: Optional[str] = None, token: Optional[str] = None, *, timeout: float = 60.0,
                 connect_timeout: float = 10.0, stream_idle_timeout: float = 60.0, retries: int = 3,
                 retry_backoff: float = 0.2) -> None:
        resolved_url = url if url is not None else os.environ.get("CELLBLOCK_URL")
        if not resolved_url:
            raise ValueError("no gateway URL: pass url= or set CELLBLOCK_URL")
        resolved_token = token if token is not None else os.environ.get("CELLBLOCK_TOKEN")
        self.url = resolved_url.rstrip("/")
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.stream_idle_timeout = stream_idle_timeout
        self.retries = max(0, retries)
        self.retry_backoff = retry_backoff
        self._http = requests.Session()
        self._http.trust_env = False  # a gateway is addressed directly; proxies from the environment do not apply
        if resolved_token:
            self._http.headers["Authorization"] = f"token {resolved_token}"

    def __repr__(self) -> str:
        return f"Gateway({self.url!r})"  # never the token

    def __enter__(self) -> "Gateway":
        return self

    def __exit__(self, kind: Optional[Type[BaseException]], value: Optional[BaseException],
                 traceback: Optional[TracebackType]) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    # -------------------------------------------------------------------------------------------- sessions

    def session(self, name: Optional[str] = None, *, limits: Optional[Mapping[str, float]] = None,
                network: Optional[NetworkPolicy] = None, keep: bool = False) -> "Session":
        """Creates a session (``limits``: ``timeout_s``, ``memory_mb``, ``output_bytes``; ``network``: host
        patterns, or ``{"allow": [...], "ask": bool}``). As a context manager it deletes the session on exit
        unless ``keep``."""
        body: Dict[str, Any] = {}
        if name is not None:
            body["name"] = name
        if limits is not None:
            body["limits"] = dict(limits)
        if network is not None:
            body["network"] = dict(network) if isinstance(network, Mapping) else {"allow": list(network)}
        model = self._json("POST", f"{_API}/sessions", json_body=body, idempotent=False)
        return Session(self, model, keep=keep)

    def attach(self, id_or_name: str, *, keep: bool = True) -> "Session":
        """An existing session by id or name; raises :class:`~cellblock.errors.SessionNotFound`. Attached
        sessions are kept on a context manager's exit unless ``keep=False``."""
        return Session(self, self._json("GET", self._session_path(id_or_name)), keep=keep)

    def sessions(self) -> List["Session"]:
        """Every live session of the gateway (kept on a context manager's exit)."""
        answer = self._json("GET", f"{_API}/sessions")
        return [Session(self, model, keep=True) for model in answer.get("sessions", [])]

    # ---------------------------------------------------------------------------------------------- HTTP

    @staticmethod
    def _session_path(id_or_name: str) -> str:
        return f"{_API}/sessions/{quote(id_or_name, safe='')}"

    def _request(self, method: str, path: str, *, json_body: Any = None, data: Optional[bytes] = None,
                 params: Optional[Mapping[str, str]] = None, headers: Optional[Mapping[str, str]] = None,
                 idempotent: Optional[bool] = None, stream: bool = False,
                 timeout: Optional[Tuple[float, float]] = None) -> requests.Response:
        if idempotent is None:
            idempotent = method in ("GET", "HEAD", "PUT", "DELETE", "OPTIONS")
        attempts = 1 + (self.retries if idempotent else 0)
        request_timeout = timeout or (self.connect_timeout, self.timeout)
        for attempt in range(attempts):
            try:
                response = self._http.request(method, self.url + path, json=json_body, data=data, params=params,
                                              headers=dict(headers) if headers else None, stream=stream,
                                              timeout=request_timeout)
            except requests.Timeout as failure:
                # A read timeout may have happened after the gateway acted: not retried.
                if isinstance(failure, requests.ConnectTimeout) and attempt + 1 < attempts:
                    time.sleep(self.retry_backoff * (2 ** attempt))
                    continue
                raise errors.GatewayUnavailable(f"{method} {path}: no answer in time ({type(failure).__name__})",
                                                reason="timeout") from None
            except requests.ConnectionError as failure:
                if attempt + 1 < attempts:
                    time.sleep(self.retry_backoff * (2 ** attempt))
                    continue
                raise errors.GatewayUnavailable(f"{method} {path}: connection failed ({type(failure).__name__})",
                                                reason="connection_failed") from None
            if response.status_code >= 400:
                try:
                    text = response.text
                    try:
                        body: Any = json.loads(text)
                    except ValueError:
                        body = None
                finally:
                    response.close()
                raise errors.error_from_response(response.status_code, body, text[:500])
            return response
        raise AssertionError("unreachable")  # the loop always returns or raises

    def _json(self, method: str, path: str, **kwargs: Any) -> Dict[str, Any]:
        response = self._request(method, path, **kwargs)
        try:
            value = response.json()
        except ValueError:
            raise errors.ProtocolError(f"{method} {path}: the answer is not JSON",
                                       status=response.status_code) from None
        if not isinstance(value, dict):
            raise errors.ProtocolError(f"{method} {path}: the answer is not a JSON object",
                                       status=response.status_code)
        return value


class Session:
    """One agent session: a persistent Python kernel with a workspace, history and audit trail."""

    def __init__(self, gateway: Gateway, model: Mapping[str, Any], *, keep: bool = False) -> None:
        self.gateway = gateway
        self.keep = keep
        self.info: Dict[str, Any] = dict(model)
        self.files = Files(self)
        self.approvals = Approvals(self)

    def __repr__(self) -> str:
        return f"Session(id={self.id!r}, name={self.name!r})"

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, kind: Optional[Type[BaseException]], value: Optional[BaseException],
                 traceback: Optional[TracebackType]) -> None:
        if not self.keep:
            try:
                self.delete()
            except errors.SessionNotFound:
                pass  # deleted already: the goal of the exit is reached

    @property
    def id(self) -> str:
        return str(self.info["id"])

    @property
    def name(self) -> str:
        return str(self.info.get("name", ""))

    @property
    def kernel_id(self) -> Optional[str]:
        value = self.info.get("kernel_id")
        return None if value is None else str(value)

    @property
    def limits(self) -> Dict[str, Any]:
        return dict(self.info.get("limits") or {})

    @property
    def _path(self) -> str:
        return self.gateway._session_path(self.id)

    def refresh(self) -> Dict[str, Any]:
        """Reloads the session's model (state, kernel, cells, queued) and returns it."""
        self.info = self.gateway._json("GET", self._path)
        return dict(self.info)

    def delete(self) -> None:
        """Deletes the session and its kernel and workspace."""
        self.gateway._request("DELETE", self._path).close()

    def run(self, code: str, *, timeout: Optional[float] = None, on_stdout: Optional[TextCallback] = None,
            on_stderr: Optional[TextCallback] = None, on_display: Optional[DisplayCallback] = None,
            on_approval: Optional[ApprovalCallback] = None,
            on_event: Optional[EventCallback] = None) -> Execution:
        """Runs ``code`` in the session and returns what it produced. ``timeout`` (seconds) is this call's limit,
        at most the session's ``limits.timeout_s``; code that outlives it is interrupted and the answer's
        ``status`` says ``timeout``. The callbacks are called in this thread as the output arrives:
        ``on_stdout``/``on_stderr`` with each piece of text, ``on_display`` with each display bundle,
        ``on_approval`` with a network request held for a decision (and again once it is decided), ``on_event``
        with every raw NDJSON event. Never retried. Errors in the code are not exceptions: see
        ``Execution.error``."""
        body: Dict[str, Any] = {"code": code}
        if timeout is not None:
            body["timeout_s"] = timeout
        response = self.gateway._request(
            "POST", f"{self._path}/execute", json_body=body, headers={"Accept": "application/x-ndjson"},
            idempotent=False, stream=True,
            timeout=(self.gateway.connect_timeout, self.gateway.stream_idle_timeout))
        try:
            for event in _events(response):
                if on_event is not None:
                    on_event(event)
                kind = event.get("type")
                if kind == "stdout" and on_stdout is not None:
                    on_stdout(str(event.get("text", "")))
                elif kind == "stderr" and on_stderr is not None:
                    on_stderr(str(event.get("text", "")))
                elif kind == "display" and on_display is not None:
                    on_display(MimeBundle(event.get("data") or {}))
                elif kind == "approval" and on_approval is not None:
                    on_approval(Approval.from_json(event))
                elif kind == "end":
                    return Execution.from_json(event)
        finally:
            response.close()
        raise errors.ProtocolError("the execute stream ended without its end event", reason="stream_ended")

    def interrupt(self) -> None:
        """Interrupts the code running in the session (a ``KeyboardInterrupt`` in it); its ``run`` returns with
        that error."""
        kernel_id = self.refresh().get("kernel_id")
        if not kernel_id:
            return  # no kernel: nothing runs
        self.gateway._request("POST", f"/api/kernels/{quote(str(kernel_id), safe='')}/interrupt",
                              json_body={}, idempotent=False).close()

    def reset(self) -> None:
        """Restarts the session's kernel: every variable is gone, files stay."""
        self.info = self.gateway._json("POST", f"{self._path}/reset", json_body={}, idempotent=False)

    def notebook(self) -> Dict[str, Any]:
        """The session's history as an nbformat 4 notebook (a dict; ``json.dump`` it to an .ipynb)."""
        return self.gateway._json("GET", f"{self._path}/notebook")

    def audit(self, *, event: Optional[str] = None, since: Optional[str] = None,
              until: Optional[str] = None) -> List[Dict[str, Any]]:
        """The session's audit trail, oldest first; ``event`` filters by kind (``execute``, ``file_put``, ...),
        ``since``/``until`` are ISO 8601 times."""
        params = {key: value for key, value in (("event", event), ("since", since), ("until", until))
                  if value is not None}
        answer = self.gateway._json("GET", f"{self._path}/audit", params=params)
        return [dict(entry) for entry in answer.get("entries", []) if isinstance(entry, dict)]


def _events(response: requests.Response) -> Iterator[Dict[str, Any]]:
    try:
        for line in response.iter_lines():
            if not line:
                continue
            try:
                event = json.loads(line)
            except ValueError:
                raise errors.ProtocolError("the execute stream carried a line that is not JSON") from None
            if isinstance(event, dict):
                yield event
    except requests.RequestException as failure:
        # requests reports a read that timed out while streaming as a ConnectionError wrapping urllib3's
        # ReadTimeoutError, itself raised from the socket's timeout: silence is told apart by that cause.
        if isinstance(failure, requests.Timeout) or _caused_by_timeout(failure):
            raise errors.GatewayUnavailable("the execute stream went silent (no keepalive in time)",
                                            reason="timeout") from None
        raise errors.GatewayUnavailable(f"the execute stream broke ({type(failure).__name__})",
                                        reason="connection_failed") from None


def _caused_by_timeout(failure: BaseException) -> bool:
    seen = 0
    cause: Optional[BaseException] = failure
    while cause is not None and seen < 16:
        if isinstance(cause, (socket.timeout, TimeoutError)):
            return True
        cause = cause.__cause__ or cause.__context__
        seen += 1
    return False


class Files:
    """The session's workspace (the code's current directory). Paths are relative to it."""

    def __init__(self, session: Session) -> None:
        self._session = session

    def _path(self, path: str) -> str:
        # "." and ".." segments are encoded so that they reach the gateway, which refuses them (bad_path),
        # instead of being resolved away by URL normalisation into another request.
        segments = [quote(part, safe="") if part not in (".", "..") else part.replace(".", "%2E")
                    for part in path.split("/")]
        return f"{self._session._path}/files/{'/'.join(segments)}"

    def write(self, path: str, data: Union[bytes, str]) -> int:
        """Writes (creates or replaces) a file, making its directories; returns its size."""
        payload = data.encode("utf-8") if isinstance(data, str) else bytes(data)
        answer = self._session.gateway._json("PUT", self._path(path), data=payload,
                                             headers={"Content-Type": "application/octet-stream"})
        return int(answer.get("size", len(payload)))

    def read(self, path: str) -> bytes:
        """A file's bytes; raises :class:`~cellblock.errors.FileNotFound`."""
        response = self._session.gateway._request("GET", self._path(path))
        try:
            return response.content
        finally:
            response.close()

    def read_text(self, path: str, encoding: str = "utf-8") -> str:
        return self.read(path).decode(encoding)

    def list(self) -> List[FileInfo]:
        """Every file of the workspace, recursively."""
        answer = self._session.gateway._json("GET", f"{self._session._path}/files")
        return [FileInfo(str(item["path"]), int(item.get("size", 0)))
                for item in answer.get("files", []) if isinstance(item, dict) and "path" in item]

    def delete(self, path: str) -> None:
        self._session.gateway._request("DELETE", self._path(path)).close()


class Approvals:
    """Network requests of the session's code held for a decision."""

    def __init__(self, session: Session) -> None:
        self._session = session

    def list(self) -> List[Approval]:
        """Every approval the session keeps (pending and decided), oldest first."""
        answer = self._session.gateway._json("GET", f"{self._session._path}/approvals")
        return [Approval.from_json(item) for item in answer.get("approvals", []) if isinstance(item, dict)]

    def pending(self) -> List[Approval]:
        return [approval for approval in self.list() if approval.state == "pending"]

    def get(self, approval_id: str) -> Approval:
        return Approval.from_json(self._session.gateway._json(
            "GET", f"{self._session._path}/approvals/{quote(approval_id, safe='')}"))

    def decide(self, approval_id: str, decision: str) -> Approval:
        """``decision``: ``allow_once``, ``allow_session`` or ``deny``. Returns the decided approval."""
        if decision not in _DECISIONS:
            raise ValueError(f"decision must be one of {', '.join(_DECISIONS)}")
        return Approval.from_json(self._session.gateway._json(
            "POST", f"{self._session._path}/approvals/{quote(approval_id, safe='')}",
            json_body={"decision": decision}, idempotent=False))
