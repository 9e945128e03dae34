"""Kernelspec directories made by a test, for kernels that start slowly, die, cannot start, or whose confined worker
cannot start. Each is the installed cellblock kernel with one thing changed, so the failure is the one named."""
import json
import os
import pathlib

PREFIX = pathlib.Path(os.environ.get("CELLBLOCK_PREFIX", "/usr/local"))
INSTALLED_SPEC = PREFIX / "share" / "jupyter" / "kernels" / "cellblock-python" / "kernel.json"
INSTALLED_KERNEL_CONFIG = PREFIX / "share" / "cellblock" / "kernel-config.json"


def installed_argv() -> list:
    return json.loads(INSTALLED_SPEC.read_text())["argv"]


def write_kernelspec(root: pathlib.Path, name: str, argv: list) -> pathlib.Path:
    """root/name/kernel.json; returns root (what --kernelspec-dir takes)."""
    spec = json.loads(INSTALLED_SPEC.read_text())
    spec["argv"] = argv
    spec["display_name"] = f"cellblock test kernel {name}"
    directory = root / name
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "kernel.json").write_text(json.dumps(spec, indent=2))
    return root


def slow_start(root: pathlib.Path, name: str, delay_s: float) -> pathlib.Path:
    """The real kernel, started `delay_s` seconds late (a shell sleeps, then execs it)."""
    return write_kernelspec(root, name, ["/bin/sh", "-c", f'sleep {delay_s}; exec "$0" "$@"', *installed_argv()])


def dies_during_start(root: pathlib.Path, name: str, delay_s: float = 1, status: int = 3) -> pathlib.Path:
    """A process that exits with `status` before it ever answers kernel_info_request."""
    return write_kernelspec(root, name, ["/bin/sh", "-c", f"sleep {delay_s}; echo dying >&2; exit {status}",
                                         "{connection_file}"])


def missing_binary(root: pathlib.Path, name: str) -> pathlib.Path:
    """argv[0] does not exist: the spawn itself fails."""
    return write_kernelspec(root, name, ["/nonexistent/cellblock-kernel", "-f", "{connection_file}"])


def with_kernel_config(root: pathlib.Path, name: str, work: pathlib.Path, worker_source: str = None,
                       python: str = None, **worker_settings) -> pathlib.Path:
    """The real kernel with its own kernel-config.json: another worker script (`worker_source`), another Python,
    or other worker settings. The worker's directory is bind-mounted into the sandbox, so it is world-readable."""
    config = json.loads(INSTALLED_KERNEL_CONFIG.read_text())
    base = INSTALLED_KERNEL_CONFIG.parent
    config["sandbox_policy"] = str((base / config["sandbox_policy"]).resolve())
    config["worker"]["script"] = str((base / config["worker"]["script"]).resolve())
    if worker_source is not None:
        worker_dir = work / f"{name}-worker"
        worker_dir.mkdir(parents=True, exist_ok=True)
        worker_dir.chmod(0o755)
        script = worker_dir / "cellblock_worker.py"
        script.write_text(worker_source)
        script.chmod(0o644)
        config["worker"]["script"] = str(script)
    if python is not None:
        config["worker"]["python"] = python
    config["worker"].update(worker_settings)
    config_file = work / f"{name}-kernel-config.json"
    config_file.write_text(json.dumps(config, indent=2))
    argv = installed_argv()
    argv[argv.index("--config") + 1] = str(config_file)
    return write_kernelspec(root, name, argv)

