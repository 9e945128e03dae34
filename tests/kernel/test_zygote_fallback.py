"""The kernel's zygote switch (sandbox/README.md "Worker zygote"): on by default where a tenant is named (the
gateway names one for every kernel); any failure of the template path falls back to the exec path with one `zygote_fallback` log line, never to no worker or weaker confinement.

The kernels run the installed binary and worker with a copy of the installed config that changes only the
`worker.zygote*` keys (and the worker script made absolute, since the copy lives elsewhere).
"""
from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pytest
from jupyter_client import KernelManager
from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

PREFIX = Path(os.environ["CELLBLOCK_PREFIX"])
KERNEL_CONFIG = PREFIX / "share" / "cellblock" / "kernel-config.json"
STATE_DIR = Path(json.loads((PREFIX / "share" / "cellblock" / "sandbox-policy.json").read_text()).get("state_dir",
                                                                                                    "/run/cellblock"))
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
    tmp_path.mkdir(parents=True, exist_ok=True)
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


def run_one_plus_one(tmp_path: Path, name: str, env: dict | None = None, code: str = "1+1",
                     **worker) -> tuple[str, list[dict]]:
    """Starts the kernel, executes `code` (1+1), shuts it down; returns the result and the kernel's log lines."""
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
            reply = client.execute_interactive(code, timeout=120, output_hook=outputs.append)
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


@pytest.fixture
def tenant():
    """A tenant of this test alone (the kernel keeps its lock and log files in the state dir: removed after)."""
    name = f"fallback-{uuid.uuid4().hex[:12]}"
    yield name
    for suffix in (".lock", ".log", ".sock"):
        (STATE_DIR / f"zygote-{name}{suffix}").unlink(missing_ok=True)


def test_zygote_without_its_library_still_serves_by_exec_and_says_so(tmp_path, tenant):
    result, log = run_one_plus_one(tmp_path, "cellblock-zygote-nolib", zygote=True, zygote_tenant=tenant,
                                   zygote_library=str(tmp_path / "no-such-libcellblock_zygote.so"))
    assert result == "2"
    fallbacks = [line for line in log if line.get("event") == "zygote_fallback"]
    assert len(fallbacks) == 1, log
    assert fallbacks[0]["tenant"] == tenant
    assert f"zygote-{tenant}.sock" in fallbacks[0]["reason"], fallbacks[0]
    assert "could not start the template" in fallbacks[0]["template"], fallbacks[0]
    assert "no-such-libcellblock_zygote.so" in fallbacks[0]["template"], fallbacks[0]


def test_the_tenant_comes_from_the_environment_too(tmp_path, tenant):
    result, log = run_one_plus_one(tmp_path, "cellblock-zygote-envtenant", env={"CELLBLOCK_ZYGOTE_TENANT": tenant},
                                   zygote=True, zygote_tenant="from-the-file",
                                   zygote_library=str(tmp_path / "no-such-lib.so"))
    assert result == "2"
    fallbacks = [line for line in log if line.get("event") == "zygote_fallback"]
    assert [f["tenant"] for f in fallbacks] == [tenant], log


def test_a_template_that_keeps_failing_is_not_restarted_by_every_launch(tmp_path, tenant):
    """The first launch tries to start the template (and fails); the next within the restart interval does not."""
    first, first_log = run_one_plus_one(tmp_path / "a", "cellblock-zygote-retry-a", zygote=True, zygote_tenant=tenant,
                                        zygote_library=str(tmp_path / "missing.so"))
    second, second_log = run_one_plus_one(tmp_path / "b", "cellblock-zygote-retry-b", zygote=True,
                                          zygote_tenant=tenant, zygote_library=str(tmp_path / "missing.so"))
    assert first == second == "2"
    [first_fallback] = [line for line in first_log if line.get("event") == "zygote_fallback"]
    [second_fallback] = [line for line in second_log if line.get("event") == "zygote_fallback"]
    assert "could not start the template" in first_fallback["template"], first_fallback
    assert "not starting another yet" in second_fallback["template"], second_fallback


def test_zygote_is_on_by_default_and_a_supervised_kernel_leaves_the_template_to_its_service(tmp_path, tenant):
    # The config as installed, a tenant named, no template yet: the launch asks the tenant's template first, then
    # goes by exec; supervised (the gateway's template service owns the template), the kernel starts none itself.
    result, log = run_one_plus_one(tmp_path, "cellblock-zygote-default",
                                   env={"CELLBLOCK_ZYGOTE_TENANT": tenant, "CELLBLOCK_ZYGOTE_SUPERVISED": "1"})
    assert result == "2"
    fallbacks = [line for line in log if line.get("event") == "zygote_fallback"]
    assert len(fallbacks) == 1 and fallbacks[0]["tenant"] == tenant, log
    assert fallbacks[0]["template"] == "its template service starts it", fallbacks[0]
    assert not [line for line in log if line.get("event") == "zygote_template_started"], log
    assert not (STATE_DIR / f"zygote-{tenant}.sock").exists()


@pytest.mark.parametrize("how", ["no tenant", "zygote false"])
def test_without_a_tenant_or_switched_off_every_worker_is_execd(tmp_path, tenant, how):
    env, worker = ({}, {}) if how == "no tenant" else ({"CELLBLOCK_ZYGOTE_TENANT": tenant}, {"zygote": False})
    result, log = run_one_plus_one(tmp_path, "cellblock-zygote-off", env=env, **worker)
    assert result == "2"
    assert not [line for line in log if str(line.get("event", "")).startswith("zygote")], log


def test_a_template_started_by_a_kernel_preloads_what_its_config_names(tmp_path, tenant):
    """worker.zygote_preload reaches the template: a fork has imported exactly what the config names (here a
    module nothing else imports) and not the default list (pandas)."""
    import signal

    import cellblock_zygote

    policy = (KERNEL_CONFIG.parent / json.loads(KERNEL_CONFIG.read_text())["sandbox_policy"]).resolve()
    probe = "import sys; ('colorsys' in sys.modules, 'pandas' in sys.modules)"
    settings = dict(zygote=True, zygote_tenant=tenant, zygote_preload=["colorsys"], zygote_generation_forks=5)
    try:
        by_exec, _ = run_one_plus_one(tmp_path / "a", "cellblock-zygote-preload-a", code=probe, **settings)
        template = cellblock_zygote.template_serving(policy, tenant, timeout=240)
        forked, log = run_one_plus_one(tmp_path / "b", "cellblock-zygote-preload-b", code=probe, **settings)
        assert by_exec == "(False, False)", "the first launch starts the template and goes by exec"
        assert not [line for line in log if line.get("event") == "zygote_fallback"], log
        assert forked == "(True, False)"
        serving = [json.loads(line) for line in (STATE_DIR / f"zygote-{tenant}.log").read_text().splitlines()
                   if '"serving"' in line]
        assert serving and serving[-1]["preload"] == ["colorsys"] and serving[-1]["generation_forks"] == 5, serving
    finally:
        pid = cellblock_zygote.template_pid(policy, tenant)
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
        import shutil
        shutil.rmtree(STATE_DIR / "templates" / f"zygote-{tenant}", ignore_errors=True)


def test_a_generation_used_up_within_the_restart_interval_is_replaced_at_once(tmp_path, tenant):
    """A template retires after its generation's forks (one here); the next launch starts the next template at once,
    well within the restart interval that holds back a template that died, and the launch after it is forked."""
    import shutil
    import signal

    import cellblock_zygote

    policy = (KERNEL_CONFIG.parent / json.loads(KERNEL_CONFIG.read_text())["sandbox_policy"]).resolve()
    probe = "import sys; 'colorsys' in sys.modules"
    settings = dict(zygote=True, zygote_tenant=tenant, zygote_preload=["colorsys"], zygote_generation_forks=1)
    try:
        run_one_plus_one(tmp_path / "a", "cellblock-zygote-generation-a", code=probe, **settings)
        first_template = cellblock_zygote.template_serving(policy, tenant, timeout=240)
        forked, log = run_one_plus_one(tmp_path / "b", "cellblock-zygote-generation-b", code=probe, **settings)
        assert forked == "True" and not [line for line in log if line.get("event") == "zygote_fallback"], log

        # The first template has used its one fork and retired: this launch goes by exec and starts the next one.
        by_exec, log = run_one_plus_one(tmp_path / "c", "cellblock-zygote-generation-c", code=probe, **settings)
        [fallback] = [line for line in log if line.get("event") == "zygote_fallback"]
        assert by_exec == "False"
        assert "started the template" in fallback["template"], fallback
        second_template = cellblock_zygote.template_serving(policy, tenant, timeout=240)
        assert second_template != first_template

        forked, log = run_one_plus_one(tmp_path / "d", "cellblock-zygote-generation-d", code=probe, **settings)
        assert forked == "True" and not [line for line in log if line.get("event") == "zygote_fallback"], log
    finally:
        for pid in cellblock_zygote.template_pids(policy, tenant):
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(STATE_DIR / "templates" / f"zygote-{tenant}", ignore_errors=True)
