"""Python client for the cellblock gateway's agent API (``/agent/v1``)."""
from . import errors
from ._async import AsyncApprovals, AsyncFiles, AsyncGateway, AsyncSession
from ._client import Approvals, Files, Gateway, NetworkPolicy, Session
from ._models import Approval, Execution, ExecutionError, FileInfo, MimeBundle
from .errors import (CellblockError, GatewayUnavailable, NetworkNotAllowed, QuotaExceeded, SessionNotFound)

__version__ = "0.1.0"

__all__ = [
    "Gateway", "Session", "Files", "Approvals", "NetworkPolicy",
    "AsyncGateway", "AsyncSession", "AsyncFiles", "AsyncApprovals",
    "Execution", "ExecutionError", "MimeBundle", "FileInfo", "Approval",
    "errors", "CellblockError", "SessionNotFound", "QuotaExceeded", "NetworkNotAllowed", "GatewayUnavailable",
]
