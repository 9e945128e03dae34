"""An AutoGen (``autogen-core`` 0.7) code executor that runs every code block in one cellblock session.

    from autogen_ext.agents... import CodeExecutorAgent
    from cellblock import Gateway
    from cellblock.integrations.autogen import CellblockCodeExecutor

    async with CellblockCodeExecutor(Gateway(url, token)) as executor:
        agent = CodeExecutorAgent("runner", code_executor=executor)

State is kept between ``execute_code_blocks`` calls (one persistent kernel); images and HTML the code displays are
written to ``output_dir`` and listed in ``output_files``, as AutoGen's Jupyter executor does; ``restart`` gives a
fresh interpreter (files stay); ``stop`` deletes the session unless ``keep`` was given.
"""
from __future__ import annotations

import asyncio
import re
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Union

from autogen_core import CancellationToken
from autogen_core.code_executor import CodeBlock, CodeExecutor, CodeResult

from .._client import Gateway, Session
from .._models import Execution, MimeBundle

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_PYTHON = {"python", "py", "python3", "ipython", ""}
TIMEOUT_EXIT_CODE = 124  # what AutoGen's command-line executors answer for a block that ran out of time


@dataclass
class CellblockCodeResult(CodeResult):
    """A ``CodeResult`` with the files the code's images and HTML were saved to."""

    output_files: List[Path] = field(default_factory=list)


class CellblockCodeExecutor(CodeExecutor):
    """Runs Python code blocks in a cellblock agent session (``name``, created on ``start``, or attached when
    ``attach`` is true). ``timeout`` is each block's limit in seconds."""

    def __init__(self, gateway: Gateway, *, name: Optional[str] = None, attach: bool = False,
                 keep: bool = False, timeout: Optional[float] = 60.0,
                 output_dir: Union[Path, str, None] = None) -> None:
        self._gateway = gateway
        self._name = name or f"autogen-{uuid.uuid4().hex[:12]}"
        self._attach = attach
        self._keep = keep or attach
        self._timeout = timeout
        self._output_dir = Path(output_dir) if output_dir is not None else Path(tempfile.mkdtemp(prefix="cellblock-"))
        self._session: Optional[Session] = None

    @property
    def session(self) -> Session:
        if self._session is None:
            raise RuntimeError("the executor is not started: call start() or use it as an async context manager")
        return self._session

    @property
    def output_dir(self) -> Path:
        return self._output_dir

    async def start(self) -> None:
        if self._session is not None:
            return
        if self._attach:
            self._session = await asyncio.to_thread(self._gateway.attach, self._name, keep=True)
        else:
            self._session = await asyncio.to_thread(self._gateway.session, self._name, keep=self._keep)

    async def stop(self) -> None:
        session, self._session = self._session, None
        if session is not None and not self._keep:
            await asyncio.to_thread(session.delete)

    async def restart(self) -> None:
        await asyncio.to_thread(self.session.reset)

    async def execute_code_blocks(self, code_blocks: List[CodeBlock],
                                  cancellation_token: CancellationToken) -> CellblockCodeResult:
        outputs: List[str] = []
        files: List[Path] = []
        for block in code_blocks:
            if block.language.lower() not in _PYTHON:
                outputs.append(f"unsupported language {block.language!r}: cellblock runs Python")
                return CellblockCodeResult(exit_code=1, output="\n".join(outputs), output_files=files)
            execution = await self._run(block.code, cancellation_token)
            outputs.extend(self._texts(execution, files))
            if execution.status == "timeout":
                outputs.append(f"Timeout: the block ran longer than {self._timeout} s and was interrupted")
                return CellblockCodeResult(exit_code=TIMEOUT_EXIT_CODE, output="\n".join(outputs), output_files=files)
            if execution.error is not None:
                return CellblockCodeResult(exit_code=1, output="\n".join(outputs), output_files=files)
        return CellblockCodeResult(exit_code=0, output="\n".join(outputs), output_files=files)

    async def _run(self, code: str, cancellation_token: CancellationToken) -> Execution:
        session = self.session
        task = asyncio.ensure_future(asyncio.to_thread(session.run, code, timeout=self._timeout))
        cancellation_token.link_future(task)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            # The caller gave up: the code must not run on behind its back.
            await asyncio.to_thread(session.interrupt)
            raise

    def _texts(self, execution: Execution, files: List[Path]) -> List[str]:
        texts = [text for text in (execution.stdout, execution.stderr) if text]
        for bundle in [*execution.displays, *([execution.result] if execution.result is not None else [])]:
            texts.extend(self._bundle(bundle, files))
        if execution.error is not None:
            texts.append(_ANSI.sub("", execution.error.traceback) or f"{execution.error.ename}: {execution.error.evalue}")
        return texts

    def _bundle(self, bundle: MimeBundle, files: List[Path]) -> List[str]:
        if bundle.png is not None:
            files.append(self._save(bundle.png, ".png"))
            return []
        if bundle.html is not None:
            files.append(self._save(bundle.html.encode(), ".html"))
            return []
        return [bundle.text] if bundle.text is not None else []

    def _save(self, data: bytes, suffix: str) -> Path:
        path = self._output_dir / f"{uuid.uuid4().hex}{suffix}"
        path.write_bytes(data)
        return path.absolute()
