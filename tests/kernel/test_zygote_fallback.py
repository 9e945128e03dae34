"""The kernel's zygote switch (sandbox/README.md "Worker zygote"): off by default; on, any failure of the template
path falls back to the exec path with one `zygote_fallback` log line, never to no worker or weaker confinement.

The kernels run the installed binary and worker with a copy of the installed config that changes only the
`worker.zygote*` keys (and the worker script made absolute, since the copy lives elsewhere).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from jupyter_client import KernelManager
from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

PREFIX = Path(os.environ["CELLBLOCK_PREFIX"])
KERNEL_CONFIG = PREFIX / "share" / "cellblock" / "kernel-config.json"
INSTALLED_KERNEL = "cellblock-python"
START_TIMEOUT = 60


def kernelspec_with(tmp_path: Path, name: str, **worker) -> list[str]:
    """A kernelspec dir whose kernel is the installed one with `worker` keys added to its config."""
    try:
        installed = KernelSpecManager().get_kernel_spec(INSTALLED_KERNEL)
    except NoSuchKernel:
        pytest.fail(f"kernelspec {INSTALLED_KERNEL!r} not found; JUPYTER_PATH={os.environ.get('JUPYTER_PATH')!r}")
    config = json.loads(KERNEL_CONFIG.read_text())
    config["worker"]["script"] = str((KERNEL_CONFIG.parent / config["worker"]["script"]).resolve())
    config["sandbox_policy"] = str((KERNEL_CONFIG.parent / config["sandbox_policy"]).resolve())
    config["worker"].update(worker)
    config_path = tmp_path / f"{name}-config.json"
    config_path.write_text(json.dumps(config))
    argv = list(installed.argv)
    argv[argv.index("--config") + 1] = str(config_path)
    spec_dir = tmp_path / "kernels" / name
    spec_dir.mkdir(parents=True)
    spec = installed.to_dict()
    spec["argv"] = argv
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    return [str(tmp_path / "kernels")]


def run_one_plus_one(tmp_path: Path, name: str, env: dict | None = None, **worker) -> tuple[str, list[dict]]:
    """Starts the kernel, executes 1+1, shuts it down; returns the result and the kernel's log lines."""
    outputs: list = []
    manager = KernelManager(kernel_name=name,
                            kernel_spec_manager=KernelSpecManager(kernel_dirs=kernelspec_with(tmp_path, name, **worker)))
    log_path = tmp_path / f"{name}.log"
    with open(log_path, "ab") as log:
        manager.start_kernel(env=dict(os.environ, **(env or {})), stderr=log)
        client = manager.blocking_client()
        try:
            client.start_channels()
            client.wait_for_ready(timeout=START_TIMEOUT)
            reply = client.execute_interactive("1+1", timeout=120, output_hook=outputs.append)
        finally:
            client.stop_channels()
            manager.shutdown_kernel(now=False)
    assert reply["content"]["status"] == "ok", reply["content"]
    results = [m["content"]["data"]["text/plain"] for m in outputs if m["msg_type"] == "execute_result"]
    lines = []
    for line in log_path.read_text(errors="replace").splitlines():
        try:
            lines.append(json.loads(line))
        except ValueError:
            pass
    return (results[0] if results else ""), lines


def test_zygote_without_its_library_still_serves_by_exec_and_says_so(tmp_path):
    result, log = run_one_plus_one(tmp_path, "cellblock-zygote-nolib", zygote=True, zygote_tenant="fallback-test",
                                   zygote_library=str(tmp_path / "no-such-libcellblock_zygote.so"))
    assert result == "2"
    fallbacks = [line for line in log if line.get("event") == "zygote_fallback"]
    assert len(fallbacks) == 1, log
    assert fallbacks[0]["tenant"] == "fallback-test"
    assert "zygote-fallback-test.sock" in fallbacks[0]["reason"], fallbacks[0]
    assert "could not start the template" in fallbacks[0]["template"], fallbacks[0]
    assert "no-such-libcellblock_zygote.so" in fallbacks[0]["template"], fallbacks[0]


def test_the_tenant_comes_from_the_environment_too(tmp_path):
    result, log = run_one_plus_one(tmp_path, "cellblock-zygote-envtenant", env={"CELLBLOCK_ZYGOTE_TENANT": "from-env"},
                                   zygote=True, zygote_library=str(tmp_path / "no-such-lib.so"))
    assert result == "2"
    fallbacks = [line for line in log if line.get("event") == "zygote_fallback"]
    assert [f["tenant"] for f in fallbacks] == ["from-env"], log


def test_zygote_is_off_by_default(tmp_path):
    result, log = run_one_plus_one(tmp_path, "cellblock-zygote-default", env={"CELLBLOCK_ZYGOTE_TENANT": "someone"})
    assert result == "2"
    assert not [line for line in log if str(line.get("event", "")).startswith("zygote")], log
