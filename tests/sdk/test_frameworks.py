"""Agent frameworks' own executor interfaces against a real gateway, driven without a model: the SDK's adapters
(`cellblock.integrations.autogen`, `cellblock.integrations.smolagents`), AutoGen's own Jupyter executor pointed at
the Kernel Gateway API unchanged, and MCP's official Python SDK on /mcp. The frameworks are the versions pinned in
tests/requirements-pypi.txt; ctest runs this file with that venv's python (`sdk_frameworks`)."""
import asyncio
import logging
import uuid

import pytest

PLOT = ("import matplotlib\nmatplotlib.use('module://matplotlib_inline.backend_inline')\n"
        "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [4, 1, 9])\nplt.show()")


# ------------------------------------------------------------------------------------------------ AutoGen


def test_autogen_executor_keeps_state_returns_images_as_files_and_restarts(gw, tmp_path):
    from autogen_core import CancellationToken
    from autogen_core.code_executor import CodeBlock, CodeExecutor

    from cellblock.integrations.autogen import CellblockCodeExecutor

    async def scenario():
        async with CellblockCodeExecutor(gw, output_dir=tmp_path, timeout=30) as executor:
            assert isinstance(executor, CodeExecutor)
            token = CancellationToken()
            first = await executor.execute_code_blocks(
                [CodeBlock("import pandas as pd\nframe = pd.DataFrame({'x': [1, 2, 3]})", "python"),
                 CodeBlock("print(frame.x.sum() * 7)", "python")], token)
            state = await executor.execute_code_blocks([CodeBlock("frame.x.max()", "python")], token)
            plot = await executor.execute_code_blocks([CodeBlock(PLOT, "python")], token)
            failed = await executor.execute_code_blocks(
                [CodeBlock("1/0", "python"), CodeBlock("print('not reached')", "python")], token)
            shell = await executor.execute_code_blocks([CodeBlock("ls", "bash")], token)
            await executor.restart()
            after = await executor.execute_code_blocks([CodeBlock("'frame' in globals()", "python")], token)
            name = executor.session.name
            return first, state, plot, failed, shell, after, name

    first, state, plot, failed, shell, after, name = asyncio.run(scenario())
    assert (first.exit_code, first.output.strip()) == (0, "42")
    assert (state.exit_code, state.output.strip()) == (0, "3")
    assert plot.exit_code == 0 and len(plot.output_files) == 1, plot
    assert plot.output_files[0].read_bytes().startswith(b"\x89PNG"), "the plot is not a PNG file"
    assert plot.output_files[0].parent == tmp_path
    assert failed.exit_code == 1 and "ZeroDivisionError" in failed.output and "not reached" not in failed.output
    assert "\x1b[" not in failed.output, "the traceback keeps its ANSI colours"
    assert shell.exit_code == 1 and "unsupported language" in shell.output
    assert (after.exit_code, after.output.strip()) == (0, "False"), "restart kept the variables"
    assert name not in {s.name for s in gw.sessions()}, "stop() left the session behind"


def test_autogen_executor_interrupts_code_when_cancelled(gw):
    from autogen_core import CancellationToken
    from autogen_core.code_executor import CodeBlock

    from cellblock.integrations.autogen import CellblockCodeExecutor

    async def scenario():
        async with CellblockCodeExecutor(gw, timeout=60) as executor:
            token = CancellationToken()
            running = asyncio.ensure_future(executor.execute_code_blocks(
                [CodeBlock("import time\nprint('started', flush=True)\ntime.sleep(50)\nslept = True", "python")],
                token))
            # Cancel once the code runs (the session says so), not after a guessed delay.
            while executor.session.refresh().get("state") != "busy":
                await asyncio.sleep(0.05)
            token.cancel()
            with pytest.raises(asyncio.CancelledError):
                await running
            started = asyncio.get_running_loop().time()
            after = await executor.execute_code_blocks([CodeBlock("'slept' in globals()", "python")],
                                                       CancellationToken())
            return after, asyncio.get_running_loop().time() - started

    after, waited = asyncio.run(scenario())
    assert (after.exit_code, after.output.strip()) == (0, "False"), "the cancelled block ran to its end"
    assert waited < 20, f"the next block waited {waited:.1f} s: the cancelled one was not interrupted"


def test_autogens_own_jupyter_executor_runs_on_the_kernel_gateway_api_unchanged(gateway_process, tmp_path):
    from autogen_core import CancellationToken
    from autogen_core.code_executor import CodeBlock
    from autogen_ext.code_executors.docker_jupyter import DockerJupyterCodeExecutor
    from autogen_ext.code_executors.docker_jupyter._jupyter_server import JupyterConnectionInfo

    host, port = gateway_process.url.split("//", 1)[1].rsplit(":", 1)
    info = JupyterConnectionInfo(host=host, use_https=False, port=int(port), token=gateway_process.token)

    async def scenario():
        executor = DockerJupyterCodeExecutor(info, kernel_name="python3", timeout=60, output_dir=tmp_path)
        await executor.start()
        try:
            token = CancellationToken()
            first = await executor.execute_code_blocks([CodeBlock("x = 6\nprint(x * 7)", "python")], token)
            state = await executor.execute_code_blocks([CodeBlock("x + 1", "python")], token)
            plot = await executor.execute_code_blocks([CodeBlock(PLOT, "python")], token)
            failed = await executor.execute_code_blocks([CodeBlock("undefined_name", "python")], token)
            return first, state, plot, failed
        finally:
            await executor.stop()

    first, state, plot, failed = asyncio.run(scenario())
    assert (first.exit_code, first.output.strip()) == (0, "42")
    assert (state.exit_code, state.output.strip()) == (0, "7")
    assert plot.exit_code == 0 and plot.output_files, plot
    assert failed.exit_code == 1 and "NameError" in failed.output


# ------------------------------------------------------------------------------------------------ smolagents


def test_smolagents_executor_runs_tools_and_detects_the_final_answer(gw):
    from smolagents import Tool
    from smolagents.default_tools import FinalAnswerTool
    from smolagents.monitoring import AgentLogger, LogLevel
    from smolagents.utils import AgentError

    from cellblock.integrations.smolagents import CellblockExecutor

    class Multiply(Tool):
        name = "multiply"
        description = "Multiplies two integers."
        inputs = {"a": {"type": "integer", "description": "first"}, "b": {"type": "integer", "description": "second"}}
        output_type = "integer"

        def forward(self, a: int, b: int) -> int:
            return a * b

    executor = CellblockExecutor([], AgentLogger(LogLevel.OFF), gateway=gw, name=f"smol-{uuid.uuid4().hex[:8]}")
    try:
        executor.send_tools({"multiply": Multiply(), "final_answer": FinalAnswerTool()})
        step = executor("product = multiply(6, 7)\nprint('product is', product)")
        assert (step.logs, step.is_final_answer, step.output) == ("product is 42\n", False, None)
        value = executor("product + 1")
        assert (value.output, value.is_final_answer) == ("43", False)
        with pytest.raises(AgentError, match="ZeroDivisionError"):
            executor("product / 0")
        final = executor("final_answer({'answer': product, 'unit': 'apples'})")
        assert final.is_final_answer and final.output == {"answer": 42, "unit": "apples"}
        name = executor.session.name
    finally:
        executor.cleanup()
    assert name not in {s.name for s in gw.sessions()}, "cleanup left the session behind"


def test_a_smolagents_code_agent_reaches_its_answer_through_cellblock(gw):
    """A CodeAgent with a scripted model (two fixed replies, no LLM): its steps run in the session."""
    from smolagents import CodeAgent
    from smolagents.models import ChatMessage, MessageRole, Model

    from cellblock.integrations.smolagents import CellblockExecutor

    replies = iter(["Thought: compute.\n<code>\nvalues = [3, 4, 5]\nprint(sum(values))\n</code>",
                    "Thought: answer.\n<code>\nfinal_answer(sum(v * v for v in values))\n</code>"])

    class Scripted(Model):
        def generate(self, messages, **kwargs):
            return ChatMessage(role=MessageRole.ASSISTANT, content=next(replies))

    agent = CodeAgent(tools=[], model=Scripted(model_id="scripted"), max_steps=3, verbosity_level=0)
    agent.python_executor = CellblockExecutor([], agent.logger, gateway=gw)  # run() sends it the tools
    try:
        assert agent.run("sum of squares of 3, 4, 5") == 50
        assert "12" in agent.memory.steps[1].observations
    finally:
        agent.python_executor.cleanup()


# ------------------------------------------------------------------------------------------------ MCP


def test_the_official_mcp_python_sdk_runs_code_on_the_mcp_endpoint(gateway_process):
    import httpx
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    session_name = f"mcp-py-{uuid.uuid4().hex[:8]}"

    async def scenario():
        headers = {"Authorization": f"token {gateway_process.token}"}
        async with httpx.AsyncClient(headers=headers, timeout=120) as http:
            async with streamable_http_client(f"{gateway_process.url}/mcp", http_client=http) as (read, write, _):
                async with ClientSession(read, write) as client:
                    await client.initialize()
                    tools = {tool.name for tool in (await client.list_tools()).tools}
                    ran = await client.call_tool("run_python", {"session": session_name, "code": "x = 6 * 7\nx"})
                    state = await client.call_tool("run_python", {"session": session_name, "code": "x + 1"})
                    error = await client.call_tool("run_python", {"session": session_name, "code": "1/0"})
                    return tools, ran, state, error

    logging.getLogger("httpx").setLevel(logging.WARNING)
    tools, ran, state, error = asyncio.run(scenario())
    assert {"run_python", "list_files", "upload_file", "read_file", "reset_session"} <= tools

    def text(result):
        return "\n".join(part.text for part in result.content if part.type == "text")

    assert not ran.isError and "42" in text(ran)
    assert not state.isError and "43" in text(state)
    assert "ZeroDivisionError" in text(error)


# ------------------------------------------------------------------------------------------------ typing


def test_the_sdk_passes_mypy_strict():
    import subprocess
    import sys
    from pathlib import Path

    package = Path(__file__).resolve().parents[2] / "clients" / "python"
    checked = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--cache-dir=/dev/null", "src/cellblock"],
                             cwd=package, capture_output=True, text=True, timeout=300)
    assert checked.returncode == 0, checked.stdout + checked.stderr
