"""Exceptions raised by the cellblock client.

Every error the gateway answers is JSON ``{"reason", "message", ...}``; the exception class is chosen by its
``reason`` (a stable identifier), falling back to the HTTP status for reasons this client does not know, so a
newer gateway's reason still lands under the right base class.
"""
from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Type

__all__ = [
    "CellblockError", "ProtocolError", "InvalidRequest", "Unauthorized", "Forbidden", "NotFound", "Conflict",
    "Gone", "PayloadTooLarge", "QuotaExceeded", "GatewayUnavailable", "GatewayError",
    "BadJson", "MissingArgument", "BadType", "BadLimit", "BadName", "BadPath", "BadNetwork", "NetworkNotAllowed",
    "BadDecision", "NotARegularFile", "RoleForbidden", "OperatorOnly", "SessionNotFound", "FileNotFound",
    "ApprovalNotFound", "NameTaken", "NetworkFixed", "ApprovalDecided", "SessionDeleted", "FileTooLarge",
    "SessionBusy", "TooManySessions", "KernelUnavailable", "WorkspaceError", "AuditUnreadable", "REASONS",
    "error_from_response",
]


class CellblockError(Exception):
    """Base of every error this package raises. ``reason`` is the gateway's reason (or a client-side one such as
    ``connection_failed``), ``status`` the HTTP status (None when no answer came), ``body`` the whole JSON error."""

    def __init__(self, message: str, *, reason: str = "", status: Optional[int] = None,
                 body: Optional[Mapping[str, Any]] = None) -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason
        self.status = status
        self.body: Dict[str, Any] = dict(body) if body is not None else {}

    def __str__(self) -> str:
        return f"{self.message} ({self.reason})" if self.reason else self.message


class ProtocolError(CellblockError):
    """The gateway answered something this client cannot read (not JSON, a stream without its end event)."""


# Base classes, one per HTTP status the agent API answers with.
class InvalidRequest(CellblockError):
    """400: an argument was malformed or refused."""


class Unauthorized(CellblockError):
    """401: missing or wrong token."""


class Forbidden(CellblockError):
    """403: a valid token that may not do this (a tenant's token on the operator's routes, or outside its
    role)."""


class NotFound(CellblockError):
    """404."""


class Conflict(CellblockError):
    """409."""


class Gone(CellblockError):
    """410."""


class PayloadTooLarge(CellblockError):
    """413."""


class QuotaExceeded(CellblockError):
    """429: a tenant's quota is used up (``quota_exceeded``: its sessions, memory or executes, the gateway's
    message says which), too many sessions on the gateway (``too_many_sessions``), or too many executes queued
    in one session (``session_busy``, raised as its subclass :class:`SessionBusy`)."""


class GatewayUnavailable(CellblockError):
    """503, or the gateway could not be reached at all (``reason`` ``connection_failed`` / ``timeout``)."""


class GatewayError(CellblockError):
    """500 and other unexpected statuses: a fault on the gateway's side."""


# One class per reason the agent API emits.
class BadJson(InvalidRequest):
    """``bad_json``: the request body was not a JSON object."""


class MissingArgument(InvalidRequest):
    """``missing_code``, ``missing_decision``."""


class BadType(InvalidRequest):
    """``bad_type``: an argument of the wrong type or range."""


class BadLimit(InvalidRequest):
    """``bad_limit``: a limit above the gateway's maximum or the session's own."""


class BadName(InvalidRequest):
    """``bad_name``: a session name that is not allowed."""


class BadPath(InvalidRequest):
    """``bad_path``: a file path that leaves the workspace or is empty."""


class BadNetwork(InvalidRequest):
    """``bad_network``: a malformed network policy."""


class NetworkNotAllowed(InvalidRequest):
    """``network_not_allowed``: a host pattern outside the gateway's ceiling (``body["ceiling"]``)."""


class BadDecision(InvalidRequest):
    """``bad_decision``: an approval decision other than allow_once, allow_session or deny."""


class NotARegularFile(InvalidRequest):
    """``not_a_regular_file``."""


class RoleForbidden(Forbidden):
    """``role_forbidden``: the token's role may not do this (an approver's token runs no code; an agent's token
    decides approvals only if its tenant may approve its own)."""


class OperatorOnly(Forbidden):
    """``operator_only``: a route only the operator's token may use (tenants, metrics, ...)."""


class SessionNotFound(NotFound):
    """``unknown_session``."""


class FileNotFound(NotFound):
    """``file_not_found``."""


class ApprovalNotFound(NotFound):
    """``unknown_approval``."""


class NameTaken(Conflict):
    """``name_taken``: a session with that name exists."""


class NetworkFixed(Conflict):
    """``network_fixed``: a session's network policy cannot change."""


class ApprovalDecided(Conflict):
    """``approval_decided``: decided already, or timed out."""


class SessionDeleted(Gone):
    """``session_deleted``: deleted while it was being created."""


class FileTooLarge(PayloadTooLarge):
    """``file_too_large``."""


class TooManySessions(QuotaExceeded):
    """``too_many_sessions``."""


class SessionBusy(QuotaExceeded):
    """``session_busy``: 64 executes already wait in the session."""


class KernelUnavailable(GatewayUnavailable):
    """``kernel_unavailable``: no kernel could be started (or reached) for the session."""


class WorkspaceError(GatewayError):
    """``workspace_error``."""


class AuditUnreadable(GatewayError):
    """``audit_unreadable``."""


REASONS: Dict[str, Type[CellblockError]] = {
    "bad_json": BadJson,
    "missing_code": MissingArgument,
    "missing_decision": MissingArgument,
    "bad_type": BadType,
    "bad_limit": BadLimit,
    "bad_name": BadName,
    "bad_path": BadPath,
    "bad_network": BadNetwork,
    "network_not_allowed": NetworkNotAllowed,
    "bad_decision": BadDecision,
    "not_a_regular_file": NotARegularFile,
    "role_forbidden": RoleForbidden,
    "operator_only": OperatorOnly,
    "unknown_session": SessionNotFound,
    "file_not_found": FileNotFound,
    "unknown_approval": ApprovalNotFound,
    "name_taken": NameTaken,
    "network_fixed": NetworkFixed,
    "approval_decided": ApprovalDecided,
    "session_deleted": SessionDeleted,
    "file_too_large": FileTooLarge,
    "quota_exceeded": QuotaExceeded,
    "too_many_sessions": TooManySessions,
    "session_busy": SessionBusy,
    "kernel_unavailable": KernelUnavailable,
    "workspace_error": WorkspaceError,
    "audit_unreadable": AuditUnreadable,
    "internal_error": GatewayError,
    "request_unanswered": GatewayError,
}

_BY_STATUS: Dict[int, Type[CellblockError]] = {
    400: InvalidRequest, 401: Unauthorized, 403: Forbidden, 404: NotFound, 409: Conflict, 410: Gone,
    413: PayloadTooLarge, 429: QuotaExceeded, 502: GatewayUnavailable, 503: GatewayUnavailable,
    504: GatewayUnavailable,
}


def error_from_response(status: int, body: Any, text: str = "") -> CellblockError:
    """The exception for an error answer: by ``reason`` first, then by HTTP status."""
    if isinstance(body, dict):
        reason = str(body.get("reason", ""))
        message = str(body.get("message", "")) or text or f"HTTP {status}"
        mapping: Optional[Mapping[str, Any]] = body
    else:
        reason, message, mapping = "", text or f"HTTP {status}", None
    cls = REASONS.get(reason) or _BY_STATUS.get(status) or (
        InvalidRequest if 400 <= status < 500 else GatewayError)
    return cls(message, reason=reason, status=status, body=mapping)
