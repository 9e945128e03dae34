"""The worker zygote switch for the suites that start real kernels (tests/kernel, tests/sandbox through the kernel,
tests/bench), and the host's view of workers a kernel did not fork.

CELLBLOCK_TEST_ZYGOTE=1 runs a suite with `worker.zygote: true` in every kernel config it starts (the same tests,
the other launch path); CELLBLOCK_TEST_ZYGOTE_TENANT names the tenant (default: one per pytest process, so a test
run never shares a template with an earlier run's code). A forked worker is the template's child, not the
kernel's: the kernel holds it through a pidfd, which is how `kernel_workers` finds it on the host.
"""
import json
import os
import re
import signal
import time
from pathlib import Path

ENABLED = os.environ.get("CELLBLOCK_TEST_ZYGOTE", "") == "1"
TENANT = os.environ.get("CELLBLOCK_TEST_ZYGOTE_TENANT") or f"test{os.getpid()}"
DEFAULT_STATE_DIR = Path("/run/cellblock")


def resolved_config(config_path: Path) -> dict:
    """A kernel-config.json with its relative paths made absolute (it is written elsewhere by the tests)."""
    config = json.loads(Path(config_path).read_text())
    base = Path(config_path).parent
    config["worker"]["script"] = str((base / config["worker"]["script"]).resolve())
    config["sandbox_policy"] = str((base / config["sandbox_policy"]).resolve())
    if "zygote_library" in config["worker"]:
        config["worker"]["zygote_library"] = str((base / config["worker"]["zygote_library"]).resolve())
    return config


def switch_config(config: dict, enabled: bool = ENABLED, tenant: str = TENANT) -> dict:
    """The kernel config with the zygote switched as the run asks (unchanged when it is off)."""
    if enabled:
        config["worker"]["zygote"] = True
        config["worker"]["zygote_tenant"] = tenant
    return config


def state_dir(policy_path) -> Path:
    return Path(json.loads(Path(policy_path).read_text()).get("state_dir", str(DEFAULT_STATE_DIR)))


def socket_path(policy_path, tenant: str = TENANT) -> Path:
    return state_dir(policy_path) / f"zygote-{tenant}.sock"


def _ppid(pid: int):
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def pidfd_targets(pid: int) -> list:
    """Host pids of the processes `pid` holds pidfds of (a kernel holds its worker's)."""
    found = []
    try:
        entries = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return found
    for fd in entries:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") != "anon_inode:[pidfd]":
                continue
            for line in Path(f"/proc/{pid}/fdinfo/{fd}").read_text().splitlines():
                if line.startswith("Pid:") and int(line.split()[1]) > 0:
                    found.append(int(line.split()[1]))
        except (OSError, ValueError):
            continue
    return found


def _children_map() -> dict:
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            ppid = _ppid(int(entry))
            if ppid is not None:
                children.setdefault(ppid, []).append(int(entry))
    return children


def kernel_tree(kernel_pid: int) -> list:
    """The kernel, everything below it, and the workers it holds by pidfd with everything below them."""
    children = _children_map()
    found, todo = [], [kernel_pid]
    while todo:
        current = todo.pop()
        if current in found:
            continue
        found.append(current)
        todo.extend(children.get(current, []))
        if current == kernel_pid:
            todo.extend(pidfd_targets(kernel_pid))
    return found


def _listening_unix_inodes() -> set:
    inodes = set()
    try:
        for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
            fields = line.split()
            if len(fields) >= 7 and int(fields[3], 16) & 0x10000:  # __SO_ACCEPTCON
                inodes.add(f"socket:[{fields[6]}]")
    except OSError:
        pass
    return inodes


def template_services(tenant: str) -> list:
    """Pids of the tenant's template services (`cellblock-kernel --template-service`, a gateway's child that
    starts and supervises the tenant's template: kernel/src/launch/template_service.hpp)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and b"--template-service" in Path(f"/proc/{entry}/cmdline").read_bytes() and \
                    f"CELLBLOCK_ZYGOTE_TENANT={tenant}".encode() in \
                    Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                found.append(int(entry))
        except OSError:
            continue
    return found


def template_pids(policy_path, tenant: str = TENANT) -> list:
    """Live templates of the tenant that still accept: a worker process (by its command line) whose stdout is
    the tenant's log (a kernel without a supervisor starts it so) or that is a child of the tenant's template
    service, and that holds a listening unix socket. (The socket is bound under a temporary name and renamed, so
    /proc/net/unix does not show its path.)"""
    log = str(state_dir(policy_path) / f"zygote-{tenant}.log")
    listening = _listening_unix_inodes()
    services = set(template_services(tenant))
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if b"cellblock_worker" not in Path(f"/proc/{entry}/cmdline").read_bytes():
                continue
            if os.readlink(f"/proc/{entry}/fd/1") != log and _ppid(int(entry)) not in services:
                continue
            if any(os.readlink(f"/proc/{entry}/fd/{fd}") in listening for fd in os.listdir(f"/proc/{entry}/fd")):
                found.append(int(entry))
        except OSError:
            continue
    return found


def template_pid(policy_path, tenant: str = TENANT, timeout: float = 0):
    """The pid of the tenant's listening template, waiting up to `timeout` s for it; None if there is none."""
    deadline = time.monotonic() + timeout
    while True:
        holders = template_pids(policy_path, tenant)
        if holders or time.monotonic() >= deadline:
            return holders[0] if holders else None
        time.sleep(0.1)


_TENANTS_USED = {TENANT}


def other_tenant(suffix: str) -> str:
    """A second tenant of this run (stopped with the first by stop_templates)."""
    tenant = f"{TENANT}-{suffix}"
    _TENANTS_USED.add(tenant)
    return tenant


def named_tenant(tenant: str) -> str:
    """A tenant named by someone else (the gateway's "t_<store tenant>"), stopped with the rest by stop_templates."""
    _TENANTS_USED.add(tenant)
    return tenant


def stop_templates(policy_path) -> None:
    """Ends the templates of this run's tenants (a test run's templates are not left idling for their hour) and
    removes their state files (socket, lock, log, the template's empty workspace)."""
    import shutil

    directory = state_dir(policy_path)
    for tenant in sorted(_TENANTS_USED):
        pid = template_pid(policy_path, tenant)
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for suffix in (".sock", ".lock", ".log"):
            (directory / f"zygote-{tenant}{suffix}").unlink(missing_ok=True)
        shutil.rmtree(directory / "templates" / f"zygote-{tenant}", ignore_errors=True)
        for workspace in (directory / "templates").glob(f"zygote-{tenant}.*"):  # an owned template's (one a generation)
            if re.fullmatch(r"[0-9a-f]{16}", workspace.suffix[1:]):
                shutil.rmtree(workspace, ignore_errors=True)


def template_serving(policy_path, tenant: str = TENANT, timeout: float = 0) -> int:
    """Waits until the tenant's template has prepared and serves (its log's "serving" line); returns its pid."""
    log = state_dir(policy_path) / f"zygote-{tenant}.log"
    deadline = time.monotonic() + timeout
    while True:
        pid = template_pid(policy_path, tenant)
        try:
            serving = pid is not None and any(
                json.loads(line).get("event") == "serving" and json.loads(line).get("pid") == pid
                for line in log.read_text(errors="replace").splitlines() if line.startswith("{"))
        except (OSError, ValueError):
            serving = False
        if serving:
            return pid
        if time.monotonic() >= deadline:
            raise AssertionError(f"no template serves tenant {tenant!r} after {timeout} s; its log:\n"
                                 f"{log.read_text(errors='replace')[-3000:] if log.exists() else '(none)'}")
        time.sleep(0.2)


def is_forked(worker_pid: int, policy_path, tenant: str = TENANT) -> bool:
    """True when the worker is a child of the tenant's template (not of its kernel: the exec path)."""
    template = template_pid(policy_path, tenant)
    return template is not None and _ppid(worker_pid) == template


class ForkTally:
    """What a zygote run saw of its kernels' workers: a run whose workers all went by exec (the template never
    came up, or every launch fell back) tested the exec path twice and must fail, not pass."""

    def __init__(self):
        self.forked = 0
        self.execd = 0

    def note(self, kernel_pid: int) -> None:
        """Counts the kernel's current worker as forked (a child of a template, held by pidfd) or exec'd."""
        workers = pidfd_targets(kernel_pid)
        if not workers:
            return
        if any(_ppid(worker) not in (None, kernel_pid) for worker in workers):
            self.forked += 1
        else:
            self.execd += 1

    def require_forks(self, suite: str) -> None:
        summary = f"{suite}: {self.forked} kernels ran a forked worker, {self.execd} an exec'd one"
        print(f"\n[zygote] {summary}")
        assert self.forked > 0, f"the zygote run never forked a worker ({summary})"


TALLY = ForkTally()
