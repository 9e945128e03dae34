"""A smolagents (1.26) executor for ``CodeAgent`` that runs the agent's code in one cellblock session.

    from smolagents import CodeAgent
    from cellblock import Gateway
    from cellblock.integrations.smolagents import CellblockExecutor

    agent = CodeAgent(tools=[], model=model)
    agent.python_executor = CellblockExecutor([], agent.logger, gateway=Gateway(url, token))

It is a ``RemotePythonExecutor``: tools are sent to the session as code (``send_tools``), ``final_answer`` raises
smolagents' ``FinalAnswerException`` in the session and is returned as the final answer, and what the code prints
is the step's logs. The session is deleted by ``cleanup`` unless ``keep`` was given.
"""
from __future__ import annotations

from io import BytesIO
from typing import Any, List, Optional

from smolagents.local_python_executor import CodeOutput
from smolagents.monitoring import LogLevel
from smolagents.remote_executors import RemotePythonExecutor
from smolagents.utils import AgentError

from .._client import Gateway, Session
from .._models import Execution


class CellblockExecutor(RemotePythonExecutor):
    """``additional_imports`` are pip-installed in the session (which needs a network policy that allows the
    package index). ``name`` names the session; ``timeout`` is each step's limit in seconds."""

    def __init__(self, additional_imports: List[str], logger: Any, *, gateway: Gateway,
                 name: Optional[str] = None, keep: bool = False, timeout: Optional[float] = 60.0,
                 allow_pickle: bool = False) -> None:
        super().__init__(additional_imports, logger, allow_pickle)
        self.timeout = timeout
        self.session: Optional[Session] = gateway.session(name, keep=keep)
        self.installed_packages = self.install_packages(additional_imports)
        self.logger.log(f"cellblock session {self.session.id} is running", level=LogLevel.INFO)

    def run_code_raise_errors(self, code: str) -> CodeOutput:
        if self.session is None:
            raise AgentError("the cellblock session was cleaned up", self.logger)
        execution = self.session.run(code, timeout=self.timeout)
        logs = execution.stdout
        if execution.error is not None:
            if execution.error.ename == self.FINAL_ANSWER_EXCEPTION:
                answer = self._deserialize_final_answer(execution.error.evalue, self.allow_pickle)
                return CodeOutput(output=answer, logs=logs, is_final_answer=True)
            raise AgentError(f"{logs}\nExecuting code yielded an error:\n{execution.error.ename}\n"
                             f"{execution.error.evalue}\n{execution.error.traceback}", self.logger)
        if execution.status == "timeout":
            raise AgentError(f"{logs}\nThe code ran longer than {self.timeout} s and was interrupted", self.logger)
        return CodeOutput(output=_main_result(execution), logs=logs, is_final_answer=False)

    def cleanup(self) -> None:
        session, self.session = self.session, None
        if session is not None and not session.keep:
            session.delete()

    def delete(self) -> None:
        self.cleanup()


def _main_result(execution: Execution) -> Any:
    """The value of the step's last expression as smolagents' executors give it: an image as a PIL image, else
    the richest text form."""
    result = execution.result
    if result is None:
        return None
    for image in (result.png, result.jpeg):
        if image is not None:
            import PIL.Image

            return PIL.Image.open(BytesIO(image))
    for value in (result.html, result.markdown, result.svg, result.text):
        if value is not None:
            return value
    return dict(result)
