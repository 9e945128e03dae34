"""Values the agent API answers with, as typed Python objects. Each keeps the gateway's JSON in ``raw``, so a field
a newer gateway adds is still reachable."""
from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Mapping, Optional


class MimeBundle(Mapping[str, Any]):
    """One result or display: MIME type → data, as Jupyter sends it (binary types base64-encoded)."""

    def __init__(self, data: Mapping[str, Any]) -> None:
        self._data: Dict[str, Any] = dict(data)

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        return f"MimeBundle({sorted(self._data)})"

    def _text_of(self, mime: str) -> Optional[str]:
        value = self._data.get(mime)
        if value is None:
            return None
        # nbformat allows multi-line strings as lists of lines.
        return "".join(value) if isinstance(value, list) else str(value)

    @property
    def text(self) -> Optional[str]:
        """``text/plain`` (the repr), or None."""
        return self._text_of("text/plain")

    @property
    def html(self) -> Optional[str]:
        """``text/html``, or None."""
        return self._text_of("text/html")

    @property
    def markdown(self) -> Optional[str]:
        """``text/markdown``, or None."""
        return self._text_of("text/markdown")

    @property
    def png(self) -> Optional[bytes]:
        """``image/png`` decoded to bytes, or None."""
        return self._binary("image/png")

    @property
    def jpeg(self) -> Optional[bytes]:
        """``image/jpeg`` decoded to bytes, or None."""
        return self._binary("image/jpeg")

    @property
    def svg(self) -> Optional[str]:
        """``image/svg+xml``, or None."""
        return self._text_of("image/svg+xml")

    @property
    def json(self) -> Any:
        """``application/json`` (already parsed), or None."""
        return self._data.get("application/json")

    def _binary(self, mime: str) -> Optional[bytes]:
        encoded = self._text_of(mime)
        if encoded is None:
            return None
        try:
            return base64.b64decode("".join(encoded.split()), validate=True)
        except (binascii.Error, ValueError):
            return None


@dataclass(frozen=True)
class ExecutionError:
    """The exception the code raised (or the gateway's own, e.g. ``KernelDied``)."""

    ename: str
    evalue: str
    traceback: str

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> "ExecutionError":
        traceback = value.get("traceback", "")
        if isinstance(traceback, list):
            traceback = "\n".join(str(line) for line in traceback)
        return cls(str(value.get("ename", "")), str(value.get("evalue", "")), str(traceback))


@dataclass
class Execution:
    """Everything one ``run`` produced. ``status`` is ``"ok"``, ``"error"`` or ``"timeout"`` (the gateway's
    word); ``state_lost`` means the session's kernel was replaced and its variables are gone; ``truncated`` that
    output was cut to head and tail inline, and ``saved`` names the workspace files (``"stdout"`` / ``"stderr"``
    → path) that hold it in full."""

    status: str
    stdout: str = ""
    stderr: str = ""
    result: Optional[MimeBundle] = None
    displays: List[MimeBundle] = field(default_factory=list)
    error: Optional[ExecutionError] = None
    execution_count: Optional[int] = None
    duration_ms: float = 0.0
    truncated: bool = False
    state_lost: bool = False
    saved: Dict[str, str] = field(default_factory=dict)
    notice: Optional[str] = None
    raw: Dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @classmethod
    def from_json(cls, answer: Mapping[str, Any]) -> "Execution":
        result = answer.get("result")
        error = answer.get("error")
        count = answer.get("execution_count")
        saved = answer.get("saved") or {}
        notice = answer.get("notice")
        return cls(
            status=str(answer.get("status", "")),
            stdout=str(answer.get("stdout") or ""),
            stderr=str(answer.get("stderr") or ""),
            result=MimeBundle(result) if isinstance(result, dict) else None,
            displays=[MimeBundle(d) for d in answer.get("displays") or [] if isinstance(d, dict)],
            error=ExecutionError.from_json(error) if isinstance(error, dict) else None,
            execution_count=count if isinstance(count, int) else None,
            duration_ms=float(answer.get("duration_ms") or 0.0),
            truncated=bool(answer.get("truncated", False)),
            state_lost=bool(answer.get("state_lost", False)),
            saved={str(k): str(v) for k, v in saved.items()} if isinstance(saved, dict) else {},
            notice=str(notice) if notice is not None else None,
            raw=dict(answer),
        )


@dataclass(frozen=True)
class FileInfo:
    """One file of a session's workspace."""

    path: str
    size: int


@dataclass
class Approval:
    """A network request held for a decision (sessions created with ``network={"ask": True, ...}``)."""

    id: str
    host: str
    port: int
    method: str
    state: str
    timeout_s: Optional[float] = None
    requested: Optional[str] = None
    decided: Optional[str] = None
    decision: Optional[str] = None
    decided_by: Optional[str] = None
    raw: Dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> "Approval":
        def optional_str(key: str) -> Optional[str]:
            item = value.get(key)
            return None if item is None else str(item)

        timeout = value.get("timeout_s")
        return cls(
            id=str(value.get("id", "")), host=str(value.get("host", "")), port=int(value.get("port") or 0),
            method=str(value.get("method", "")), state=str(value.get("state", "")),
            timeout_s=float(timeout) if isinstance(timeout, (int, float)) else None,
            requested=optional_str("requested"), decided=optional_str("decided"),
            decision=optional_str("decision"), decided_by=optional_str("decided_by"), raw=dict(value))
