"""Kernel and worker lifecycle: crashes, limits, shutdown, restart, kill."""
import contextlib
import json
import os
import queue
import signal
import time
from pathlib import Path

import cellblock_zygote
import pytest


def _descendants(pid: int) -> set:
    """Everything below the kernel, and its worker when the template forked it (tests/plugins/cellblock_zygote.py)."""
    return set(cellblock_zygote.kernel_tree(pid)) - {pid}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _wait_gone(pids, timeout: float) -> set:
    deadline = time.monotonic() + timeout
    left = {p for p in pids if _alive(p)}
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = {p for p in left if _alive(p)}
    return left


def _owner_pid(runtime_dir: str):
    try:
        with open(os.path.join(runtime_dir, "owner.json")) as f:
            return json.load(f)["pid"]
    except (OSError, ValueError, KeyError):
        return None


def _result(run) -> str:
    return run.of_type("execute_result")[0]["content"]["data"]["text/plain"]


@pytest.mark.parametrize("crash, reason", [
    ("import os; os._exit(3)", "exited with status 3"),
    ("import ctypes; ctypes.string_at(0)", "signal 11"),
])
def test_worker_crash_is_reported_and_the_next_cell_gets_a_fresh_worker(fresh_kernel, crash, reason):
    k = fresh_kernel()
    kernel_pid = k.pid
    k.execute("doomed = 1")
    run = k.execute(crash)
    assert run.content["status"] == "error"
    assert run.content["ename"] == "WorkerDied"
    assert reason in run.content["evalue"], run.content["evalue"]
    assert run.of_type("error")[0]["content"]["ename"] == "WorkerDied"
    assert run.reply["metadata"]["cellblock"]["outcome"] == "worker_died"
    assert run.reply["metadata"]["cellblock"]["state_lost"] is True

    after = k.execute("'doomed' in dir()")
    assert "state" in after.stream_text("stderr") and "gone" in after.stream_text("stderr")
    assert _result(after) == "False"
    assert k.pid == kernel_pid and k.manager.is_alive()


def test_memory_bomb_names_the_memory_limit(fresh_kernel):
    k = fresh_kernel(CELLBLOCK_MEMORY_MB=256)
    run = k.execute("blocks = []\nwhile True:\n    blocks.append(bytearray(64 * 1024 * 1024))", timeout=120)
    assert run.content["status"] == "error"
    assert run.content["ename"] == "WorkerDied", run.content
    assert "memory limit" in run.content["evalue"], run.content
    assert run.outcome == {"outcome": "memory_limit", "state_lost": True,
                          "output_truncated": False}
    assert k.execute("1 + 1").content["status"] == "ok"


def test_timeout_interrupts_then_kills(fresh_kernel):
    k = fresh_kernel(CELLBLOCK_TIMEOUT_S=1)
    run = k.execute("import time; time.sleep(30)", timeout=60)
    assert run.content["status"] == "error"
    assert run.content["ename"] == "TimeoutError"
    assert "time limit" in run.content["evalue"]
    assert run.outcome == {"outcome": "time_limit", "state_lost": False,
                          "output_truncated": False}
    assert k.execute("survivor = 1").content["status"] == "ok"

    # A prompt nobody answers is bound by the same limit.
    msg_id = k.client.execute("input('nobody answers: ')", allow_stdin=True)
    assert k.client.get_stdin_msg(timeout=30)["content"]["prompt"] == "nobody answers: "
    run = k.collect(msg_id, timeout=30)
    assert run.content["ename"] == "TimeoutError", run.content
    assert k.execute("survivor").of_type("execute_result")[0]["content"]["data"]["text/plain"] == "1"

    stubborn = "import time\nwhile True:\n    try:\n        time.sleep(10)\n    except KeyboardInterrupt:\n        pass"
    started = time.monotonic()
    run = k.execute(stubborn, timeout=60)
    assert run.content["ename"] == "WorkerDied"
    assert "time limit" in run.content["evalue"]
    assert run.outcome == {"outcome": "time_limit", "state_lost": True,
                          "output_truncated": False}
    assert time.monotonic() - started < 20
    assert k.execute("1 + 1").content["status"] == "ok"


def test_shutdown_while_busy_does_not_wait_for_the_cell(fresh_kernel):
    k = fresh_kernel()
    workers = _descendants(k.pid)
    assert workers, "the worker should be running under the kernel"
    msg_id = k.client.execute("import time\nprint('sleeping', flush=True)\ntime.sleep(600)")
    k.wait_for_stdout(msg_id, "sleeping")
    k.manager.request_shutdown()
    # Generous for a loaded machine; what matters is that the kernel does not wait out the 600 s cell.
    started = time.monotonic()
    while k.manager.is_alive() and time.monotonic() - started < 60:
        time.sleep(0.05)
    assert not k.manager.is_alive(), "the kernel was still running 60 s after shutdown_request, behind a busy cell"
    assert k.manager.provisioner.process.wait(timeout=10) == 0, "the kernel did not exit cleanly"
    assert not _wait_gone(workers, 30), "worker processes outlived the kernel"


def test_restart_clears_state(fresh_kernel):
    k = fresh_kernel()
    k.execute("before_restart = 1")
    k.manager.restart_kernel(now=False)
    k.client.wait_for_ready(timeout=60)
    run = k.execute("'before_restart' in dir()")
    assert _result(run) == "False"


def test_sigkilled_kernel_leaves_no_worker(fresh_kernel):
    k = fresh_kernel()
    k.execute("1")
    workers = _descendants(k.pid)
    assert workers
    import glob
    import json
    owned = [d for d in glob.glob("/tmp/cbk-*") if _owner_pid(d) == k.pid]
    assert len(owned) == 1, owned
    with open(os.path.join(owned[0], "owner.json")) as f:
        workspace = json.load(f)["workspace"]
    assert os.path.isdir(workspace)
    os.kill(k.pid, signal.SIGKILL)
    assert not _wait_gone(workers, 5), "worker processes survived the kernel"
    # What a SIGKILLed kernel could not remove, the next kernel sweeps up.
    k.manager.provisioner.process.wait()
    fresh_kernel()
    assert not os.path.exists(owned[0]) and not os.path.exists(workspace)


def test_sigterm_shuts_down_cleanly(fresh_kernel):
    k = fresh_kernel()
    k.execute("1")
    workers = _descendants(k.pid)
    os.kill(k.pid, signal.SIGTERM)
    started = time.monotonic()
    while k.manager.is_alive() and time.monotonic() - started < 10:
        time.sleep(0.01)
    assert not k.manager.is_alive()
    assert not _wait_gone(workers, 5)


def test_sigterm_during_a_cell_ends_the_kernel_without_a_reply_that_blames_the_worker(fresh_kernel):
    """The kernel's own exit kills its worker; the running cell's client must learn that the kernel went away
    (no reply), not get a WorkerDied reply promising a fresh worker from a kernel that is gone (an agent
    session on Slurm reported WorkerDied after scancel)."""
    k = fresh_kernel()
    msg_id = k.client.execute("import time\nprint('running', flush=True)\ntime.sleep(60)")
    k.wait_for_stdout(msg_id, "running")
    os.kill(k.pid, signal.SIGTERM)
    replies = []
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            replies.append(k.client.get_shell_msg(timeout=0.2))
        except queue.Empty:
            if not k.manager.is_alive():
                break
    assert not k.manager.is_alive(), "SIGTERM did not end the kernel"
    assert [r for r in replies if r["parent_header"].get("msg_id") == msg_id] == [], replies


def test_gateway_workspace_is_the_working_directory(fresh_kernel, tmp_path):
    workspace = tmp_path / "ws"
    workspace.mkdir()
    (workspace / "input.csv").write_text("fruit,sold\napple,3\n")
    k = fresh_kernel(CELLBLOCK_WORKSPACE=workspace)
    run = k.execute("import os\nprint(os.getcwd())\nprint(open('input.csv').read().splitlines()[1])\n"
                    "open('result.txt', 'w').write('written inside')")
    assert run.content["status"] == "ok", run.content
    assert "apple,3" in run.stream_text()
    assert (workspace / "result.txt").read_text() == "written inside"
    k.shutdown()
    assert (workspace / "result.txt").exists(), "a workspace the gateway owns must survive the kernel"


def test_private_workspace_is_removed_at_exit(fresh_kernel):
    import glob
    import json
    import uuid
    marker = f"scratch-{uuid.uuid4().hex}.txt"
    k = fresh_kernel()
    run = k.execute(f"open({marker!r}, 'w').write('x')")
    assert run.content["status"] == "ok", run.content
    # Where the kernel creates private workspaces: workspace_root from its config, or a temp dir fallback.
    config_path = k.manager.kernel_spec.argv[k.manager.kernel_spec.argv.index("--config") + 1]
    with open(config_path) as f:
        root = json.load(f)["workspace_root"]
    root = os.path.join(os.path.dirname(config_path), root)
    candidates = glob.glob(os.path.join(root, "kernel-*", marker)) + glob.glob(f"/tmp/cellblock-workspace-*/{marker}")
    assert len(candidates) == 1, candidates
    k.shutdown()
    assert not os.path.exists(os.path.dirname(candidates[0])), "the private workspace was left behind"


def test_worker_dying_while_idle_does_not_fail_the_next_cell(fresh_kernel):
    k = fresh_kernel()
    run = k.execute("import os, threading, time\n"
                    "threading.Thread(target=lambda: (time.sleep(0.5), os._exit(7)), daemon=True).start()")
    assert run.content["status"] == "ok"
    workers = {pid for pid in _descendants(k.pid) if "cellblock_worker" in _cmdline(pid)}
    assert workers, _descendants(k.pid)
    # The next cell once the worker has exited (reaped), not after a guess at how long that takes.
    assert not _wait_gone(workers, 30), "the worker did not exit"
    after = k.execute("1 + 1")
    assert after.content["status"] == "ok", after.content
    assert _result(after) == "2"
    assert "exited with status 7" in after.stream_text("stderr")



def test_kernel_info_names_the_workers_python_version_before_the_worker_is_ready(tmp_path):
    """Clients ask kernel_info as soon as a kernel starts (it is their readiness probe), before the worker is
    up: the answer already names the Python the worker runs (e.g. 3.11.2) in language_info and the banner.
    The worker here gets 2 % of a CPU (its start takes many seconds), so the first answer is the kernel's own."""
    import subprocess

    from jupyter_client import KernelManager
    from jupyter_client.kernelspec import KernelSpecManager

    prefix = Path(os.environ["CELLBLOCK_PREFIX"]) / "share" / "cellblock"
    policy = json.loads((prefix / "sandbox-policy.json").read_text())
    policy["limits"]["cpu_cores"] = 0.02
    (tmp_path / "policy.json").write_text(json.dumps(policy))
    config = json.loads((prefix / "kernel-config.json").read_text())
    config["worker"]["script"] = str((prefix / config["worker"]["script"]).resolve())
    config["sandbox_policy"] = str(tmp_path / "policy.json")
    (tmp_path / "config.json").write_text(json.dumps(config))
    installed = KernelSpecManager().get_kernel_spec("cellblock-python").to_dict()
    installed["argv"][installed["argv"].index("--config") + 1] = str(tmp_path / "config.json")
    (tmp_path / "kernels" / "starved").mkdir(parents=True)
    (tmp_path / "kernels" / "starved" / "kernel.json").write_text(json.dumps(installed))

    expected = subprocess.run([config["worker"]["python"], "-c", "import platform; print(platform.python_version())"],
                              capture_output=True, text=True, check=True).stdout.strip()
    manager = KernelManager(kernel_name="starved",
                            kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(tmp_path / "kernels")]))
    manager.start_kernel()
    client = manager.blocking_client()
    client.start_channels()
    try:
        msg_id = client.kernel_info()
        reply = client.get_shell_msg(timeout=30)
        assert reply["parent_header"]["msg_id"] == msg_id
        assert reply["content"]["language_info"]["version"] == expected
        assert f"Python {expected}" in reply["content"]["banner"]
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


def _scheduling_policies(pids) -> dict:
    """{(pid, tid): policy} of every thread of `pids` that still exists."""
    policies = {}
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").glob("*"):
            with contextlib.suppress(OSError):
                policies[(pid, int(task.name))] = os.sched_getscheduler(int(task.name))
    return policies


def test_kernel_and_worker_run_as_batch_work(kernel):
    """kernel/README.md, "Scheduling": the kernel's threads and everything below it (sandbox, worker, by exec
    or forked) run SCHED_BATCH, so that many busy sessions do not preempt each other on every wake-up; user
    code sees that policy and may change its own."""
    assert kernel.execute("1+1").outcome["outcome"] == "ok"  # the worker is up
    policies = _scheduling_policies([kernel.pid])
    assert len(policies) >= 3, policies  # the I/O thread, the interpreter thread, libzmq's
    assert set(policies.values()) == {os.SCHED_BATCH}, policies
    below = _scheduling_policies(_descendants(kernel.pid))
    assert below, "the kernel's worker was not found"
    assert set(below.values()) == {os.SCHED_BATCH}, below
    run = kernel.execute("import os\nprint(os.sched_getscheduler(0) == os.SCHED_BATCH)\n"
                         "os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))\n"
                         "print(os.sched_getscheduler(0) == os.SCHED_OTHER)")
    assert run.outcome["outcome"] == "ok", run.content
    assert run.stream_text().split() == ["True", "True"]
