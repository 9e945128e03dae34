"""The asyncio client: the synchronous one run in worker threads (``asyncio.to_thread``), so calls on one
gateway share its connection pool. Callbacks given to ``run`` are called in that worker thread."""
from __future__ import annotations

import asyncio
from types import TracebackType
from typing import Any, Dict, Generator, List, Mapping, Optional, Type, Union

from ._client import (ApprovalCallback, DisplayCallback, EventCallback, Gateway, NetworkPolicy, Session,
                      TextCallback)
from ._models import Approval, Execution, FileInfo
from . import errors

__all__ = ["AsyncGateway", "AsyncSession", "AsyncFiles", "AsyncApprovals"]


class AsyncGateway:
    """:class:`~cellblock.Gateway` with coroutine methods; the same arguments."""

    def __init__(self, url: Optional[str] = None, token: Optional[str] = None, **options: Any) -> None:
        self.sync = Gateway(url, token, **options)

    def __repr__(self) -> str:
        return f"AsyncGateway({self.sync.url!r})"

    async def __aenter__(self) -> "AsyncGateway":
        return self

    async def __aexit__(self, kind: Optional[Type[BaseException]], value: Optional[BaseException],
                        traceback: Optional[TracebackType]) -> None:
        await self.close()

    async def close(self) -> None:
        await asyncio.to_thread(self.sync.close)

    def session(self, name: Optional[str] = None, *, limits: Optional[Mapping[str, float]] = None,
                network: Optional[NetworkPolicy] = None, keep: bool = False) -> "_SessionCreation":
        """``await gw.session(...)`` or ``async with gw.session(...) as s:`` (deleted on exit unless ``keep``)."""
        return _SessionCreation(self, name, limits, network, keep)

    async def attach(self, id_or_name: str, *, keep: bool = True) -> "AsyncSession":
        return AsyncSession(await asyncio.to_thread(self.sync.attach, id_or_name, keep=keep))

    async def sessions(self) -> List["AsyncSession"]:
        return [AsyncSession(session) for session in await asyncio.to_thread(self.sync.sessions)]


class _SessionCreation:
    """Awaitable and async context manager at once, so both ways of creating a session read naturally."""

    def __init__(self, gateway: AsyncGateway, name: Optional[str], limits: Optional[Mapping[str, float]],
                 network: Optional[NetworkPolicy], keep: bool) -> None:
        self._gateway, self._name, self._limits, self._network, self._keep = gateway, name, limits, network, keep
        self._session: Optional[AsyncSession] = None

    async def _create(self) -> "AsyncSession":
        session = await asyncio.to_thread(self._gateway.sync.session, self._name, limits=self._limits,
                                          network=self._network, keep=self._keep)
        return AsyncSession(session)

    def __await__(self) -> Generator[Any, None, "AsyncSession"]:
        return self._create().__await__()

    async def __aenter__(self) -> "AsyncSession":
        self._session = await self._create()
        return self._session

    async def __aexit__(self, kind: Optional[Type[BaseException]], value: Optional[BaseException],
                        traceback: Optional[TracebackType]) -> None:
        if self._session is not None:
            await self._session.__aexit__(kind, value, traceback)


class AsyncSession:
    """:class:`~cellblock.Session` with coroutine methods."""

    def __init__(self, session: Session) -> None:
        self.sync = session
        self.files = AsyncFiles(session)
        self.approvals = AsyncApprovals(session)

    def __repr__(self) -> str:
        return f"AsyncSession(id={self.id!r}, name={self.name!r})"

    async def __aenter__(self) -> "AsyncSession":
        return self

    async def __aexit__(self, kind: Optional[Type[BaseException]], value: Optional[BaseException],
                        traceback: Optional[TracebackType]) -> None:
        if not self.sync.keep:
            try:
                await self.delete()
            except errors.SessionNotFound:
                pass

    @property
    def id(self) -> str:
        return self.sync.id

    @property
    def name(self) -> str:
        return self.sync.name

    @property
    def keep(self) -> bool:
        return self.sync.keep

    @keep.setter
    def keep(self, value: bool) -> None:
        self.sync.keep = value

    async def refresh(self) -> Dict[str, Any]:
        return await asyncio.to_thread(self.sync.refresh)

    async def delete(self) -> None:
        await asyncio.to_thread(self.sync.delete)

    async def run(self, code: str, *, timeout: Optional[float] = None, on_stdout: Optional[TextCallback] = None,
                  on_stderr: Optional[TextCallback] = None, on_display: Optional[DisplayCallback] = None,
                  on_approval: Optional[ApprovalCallback] = None,
                  on_event: Optional[EventCallback] = None) -> Execution:
        return await asyncio.to_thread(self.sync.run, code, timeout=timeout, on_stdout=on_stdout,
                                       on_stderr=on_stderr, on_display=on_display, on_approval=on_approval,
                                       on_event=on_event)

    async def interrupt(self) -> None:
        await asyncio.to_thread(self.sync.interrupt)

    async def reset(self) -> None:
        await asyncio.to_thread(self.sync.reset)

    async def notebook(self) -> Dict[str, Any]:
        return await asyncio.to_thread(self.sync.notebook)

    async def audit(self, *, event: Optional[str] = None, since: Optional[str] = None,
                    until: Optional[str] = None) -> List[Dict[str, Any]]:
        return await asyncio.to_thread(self.sync.audit, event=event, since=since, until=until)


class AsyncFiles:
    def __init__(self, session: Session) -> None:
        self._files = session.files

    async def write(self, path: str, data: Union[bytes, str]) -> int:
        return await asyncio.to_thread(self._files.write, path, data)

    async def read(self, path: str) -> bytes:
        return await asyncio.to_thread(self._files.read, path)

    async def read_text(self, path: str, encoding: str = "utf-8") -> str:
        return await asyncio.to_thread(self._files.read_text, path, encoding)

    async def list(self) -> List[FileInfo]:
        return await asyncio.to_thread(self._files.list)

    async def delete(self, path: str) -> None:
        await asyncio.to_thread(self._files.delete, path)


class AsyncApprovals:
    def __init__(self, session: Session) -> None:
        self._approvals = session.approvals

    async def list(self) -> List[Approval]:
        return await asyncio.to_thread(self._approvals.list)

    async def pending(self) -> List[Approval]:
        return await asyncio.to_thread(self._approvals.pending)

    async def get(self, approval_id: str) -> Approval:
        return await asyncio.to_thread(self._approvals.get, approval_id)

    async def decide(self, approval_id: str, decision: str) -> Approval:
        return await asyncio.to_thread(self._approvals.decide, approval_id, decision)
