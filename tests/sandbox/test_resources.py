"""Resources: memory, disk, time, output, threads and fds are bounded, and the CLI says which limit
ended the program. Where the attack's own count would be the only evidence, the attack holds what it got
and the host counts it through /proc (threads, fds, limits, the /tmp file), after the same attack run
unconfined showed that the host's count sees more than the limit."""
import os
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from conftest import PRELUDE, Run, assert_no_session_process, session_processes
from witnesses import PYTHON, Measured, SandboxedAttack, UnconfinedAttack, cgroup_file


def held(attack, look):
    """Runs a held attack: `look(pid)` (pid of the program as the host sees it) at its "holding" point."""
    attack.wait_hold("holding")
    try:
        seen = look(attack.program_pid() if isinstance(attack, SandboxedAttack) else attack.process.pid)
    finally:
        attack.release("holding")
    return attack.run(), seen


def cgroup_quota(pid):
    """CPU cores a host process's cgroup may use (cgroup v1 cfs quota, or v2 cpu.max); None when unlimited."""
    try:
        quota, period = cgroup_file(pid, "cpu", "cpu.max").split()
    except FileNotFoundError:
        quota, period = cgroup_file(pid, "cpu", "cpu.cfs_quota_us"), cgroup_file(pid, "cpu", "cpu.cfs_period_us")
    return None if quota in ("max", "-1") else int(quota) / int(period)


def host_tasks(pid):
    return len(os.listdir(f"/proc/{pid}/task"))


def host_fds(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


def host_limits(pid):
    """{"Max open files": (soft, hard), ...} from /proc/<pid>/limits."""
    limits = {}
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines()[1:]:
        name, soft, hard = line[:26].strip(), *line[26:].split()[:2]
        limits[name] = (soft, hard)
    return limits


MEMORY_BOMB = """
import sys
hoard = []
for _ in range(int(sys.argv[1]) // 16):
    hoard.append(bytearray(16 << 20))
"""


def test_memory_bomb_is_killed_by_the_memory_limit(sandbox, canary):
    # The host's own accounting (peak RSS of every process the run reaped); positive control: unconfined, the
    # same bomb stopped at 512 MiB shows at least that much.
    control = Measured([PYTHON, "-c", MEMORY_BOMB, "512"])
    assert control.returncode == 0 and control.max_rss_mib >= 512, vars(control)

    workspace = sandbox.workspace()
    run = Measured(sandbox.command([PYTHON, "-c", MEMORY_BOMB, "1024"], workspace=workspace, memory_mb=128))
    assert_no_session_process(workspace.stat().st_uid)
    # RSS also counts pages of shared libraries that the page cache charges elsewhere: 32 MiB of slack.
    assert run.max_rss_mib <= 128 + 32, vars(run)
    assert run.returncode == 137
    assert "killed by the memory limit" in run.stderr
    assert canary.poll() is None


TMP_FILL = """
    written, path = 0, target()["path"]
    try:
        with open(path, "wb") as handle:
            while written < (16 << 20):
                handle.write(b"x" * (1 << 20))
                handle.flush()
                written += 1 << 20
        outcome = "filled"
    except OSError as error:
        outcome = errno.errorcode.get(error.errno)
    hold("holding")
    report(outcome=outcome, written_mb=written >> 20)
"""


def test_tmp_fill_hits_the_tmpfs_size(sandbox, small_policy):
    # Positive control: unconfined, the host measures the whole 16 MiB the attack writes.
    control = UnconfinedAttack(TMP_FILL)
    control.provide(path=str(control.directory / "fill"))
    run, size = held(control, lambda pid: os.stat(control.directory / "fill").st_size)
    assert run.result() == {"outcome": "filled", "written_mb": 16} and size == 16 << 20

    attack = SandboxedAttack(sandbox, TMP_FILL, policy=small_policy)
    attack.provide(path="/tmp/fill")
    # The sandbox's /tmp seen from the host: an 8 MiB filesystem holding at most 8 MiB of the file.
    run, (size, capacity) = held(attack, lambda pid: (os.stat(f"/proc/{pid}/root/tmp/fill").st_size,
                                                      (lambda fs: fs.f_blocks * fs.f_frsize)(
                                                          os.statvfs(f"/proc/{pid}/root/tmp"))))
    assert capacity == 8 << 20 and size <= 8 << 20, (size, capacity)
    result = run.result()
    assert result["outcome"] == "ENOSPC"
    assert result["written_mb"] <= 8


def test_workspace_file_size_is_capped(sandbox, small_policy):
    run = sandbox.python("""
        written = 0
        try:
            with open("/workspace/huge.bin", "wb") as handle:
                while written < (128 << 20):
                    handle.write(b"x" * (1 << 20))
                    handle.flush()
                    written += 1 << 20
            outcome = "written"
        except OSError as error:
            outcome = errno.errorcode.get(error.errno)
        report(outcome=outcome)
    """, policy=small_policy)
    assert run.result() == {"outcome": "EFBIG"}
    assert (run.workspace / "huge.bin").stat().st_size <= 16 << 20


def test_infinite_loop_is_killed_by_the_time_limit(sandbox):
    run = sandbox.python("""
        while True:
            pass
    """, timeout=1.5)
    assert run.returncode == 137
    assert "killed by the time limit" in run.stderr
    assert run.seconds < 30


def test_sleeping_children_do_not_extend_the_time_limit(sandbox):
    run = sandbox.run(["/bin/sh", "-c", "sleep 100 & sleep 100 & wait"], timeout=1)
    assert "killed by the time limit" in run.stderr
    assert run.seconds < 30


def test_huge_output_is_cut_at_the_output_limit(sandbox):
    run = sandbox.python("""
        import sys
        while True:
            sys.stdout.write("A" * 65536)
    """, output_bytes=100000)
    assert run.stdout.count("A") == 100000
    assert "killed by the output limit" in run.stderr
    assert run.returncode == 137


THREADS = """
    import threading
    stop = threading.Event()
    started, failure = 0, None
    for _ in range(target()["ceiling"]):
        try:
            threading.Thread(target=stop.wait, daemon=True).start()
            started += 1
        except RuntimeError as error:
            failure = str(error)
            break
    hold("holding")
    stop.set()
    report(started=started, failure=failure)
"""


def test_many_threads_are_bounded_by_the_pids_limit(sandbox, small_policy, canary):
    # Positive control: unconfined, the host counts all 200 threads the attack starts.
    control = UnconfinedAttack(THREADS)
    control.provide(ceiling=200)
    run, tasks = held(control, host_tasks)
    assert run.result() == {"started": 200, "failure": None} and tasks > 200

    attack = SandboxedAttack(sandbox, THREADS, policy=small_policy)
    attack.provide(ceiling=5000)
    run, tasks = held(attack, lambda pid: sum(host_tasks(other) for other in attack.pids()))
    assert tasks <= 64, tasks   # the policy's pids limit, counted by the host
    result = run.result()
    assert result["failure"] is not None
    assert result["started"] < 64
    assert canary.poll() is None


FDS = """
    import resource
    handles, failure = [], None
    try:
        for _ in range(target()["ceiling"]):
            handles.append(open("/dev/null"))
    except OSError as error:
        failure = errno.errorcode.get(error.errno)
    hold("holding")
    report(opened=len(handles), failure=failure, limit=resource.getrlimit(resource.RLIMIT_NOFILE))
"""


def test_many_fds_are_bounded_by_nofile(sandbox, small_policy):
    # Positive control: unconfined, the host counts the 200 descriptors the attack opens.
    control = UnconfinedAttack(FDS)
    control.provide(ceiling=200)
    run, fds = held(control, host_fds)
    assert run.result()["opened"] == 200 and fds > 200

    attack = SandboxedAttack(sandbox, FDS, policy=small_policy)
    attack.provide(ceiling=100000)
    run, fds = held(attack, host_fds)
    assert fds <= 64, fds   # counted by the host
    result = run.result()
    assert result["failure"] == "EMFILE"
    assert result["opened"] < 64
    assert result["limit"] == [64, 64]


RAISE_RLIMITS = """
    import resource
    outcomes = {}
    for name in ["RLIMIT_NOFILE", "RLIMIT_NPROC", "RLIMIT_FSIZE", "RLIMIT_CORE"]:
        limit = getattr(resource, name)
        soft, hard = resource.getrlimit(limit)
        resource.setrlimit(limit, (hard, hard))     # the soft limit up to the hard one: allowed to anyone
        try:
            resource.setrlimit(limit, (hard + 1, hard + 1))
            outcomes[name] = "raised"
        except (ValueError, OSError) as error:
            outcomes[name] = "refused"
    hold("holding")
    report(core=resource.getrlimit(resource.RLIMIT_CORE), **outcomes)
"""
LIMIT_NAMES = ["Max open files", "Max processes", "Max file size", "Max core file size"]
POLICY_LIMITS = ["256", "512", "268435456", "1"]   # the default policy's (open_files, processes, file_size, 1)


def test_rlimits_cannot_be_raised(sandbox):
    # Positive control: unconfined, started with soft limits below the policy's values, the host sees the
    # attack's changes (the soft limits move up; root without the sandbox may raise the hard ones too).
    control = UnconfinedAttack(RAISE_RLIMITS, wrapper=["prlimit", "--nofile=128:256", "--nproc=256:512",
                                                       "--fsize=4096:268435456", "--core=0:1"])
    run, limits = held(control, host_limits)
    run.result()
    for name, value in zip(LIMIT_NAMES, POLICY_LIMITS):
        assert int(limits[name][0]) >= int(value), limits

    attack = SandboxedAttack(sandbox, RAISE_RLIMITS)
    run, limits = held(attack, host_limits)
    # The default policy's limits, as the host sees them while the attack holds.
    assert [limits[name] for name in LIMIT_NAMES] == [(value, value) for value in POLICY_LIMITS], limits
    result = run.result()
    assert result.pop("core") == [1, 1]   # 1 disables piped core helpers too (see rlimits.cpp)
    assert set(result.values()) == {"refused"}


def test_cpu_quota_holds_two_busy_threads_to_about_one_core(sandbox):
    # Two spinning processes for ~1.5 s; with a 1-core quota they get about 1 CPU-second per second.
    # Noise on a busy host can only lower the ratio, so the bound cannot fail spuriously. (No unconfined
    # control: on the shared 2-core test machine two spinners need not get more than one core either.)
    workspace = sandbox.workspace()
    measured = Measured(sandbox.command([PYTHON, "-c", PRELUDE + textwrap.dedent("""
        import time, multiprocessing
        def spin(deadline):
            while time.monotonic() < deadline:
                pass
        deadline = time.monotonic() + 1.5
        start_wall, start_cpu = time.monotonic(), os.times()
        workers = [multiprocessing.Process(target=spin, args=(deadline,)) for _ in range(2)]
        for w in workers: w.start()
        for w in workers: w.join()
        end_wall, end_cpu = time.monotonic(), os.times()
        cpu = (end_cpu.children_user + end_cpu.children_system) - (start_cpu.children_user + start_cpu.children_system)
        report(ratio=cpu / (end_wall - start_wall))
    """)], workspace=workspace))
    assert_no_session_process(workspace.stat().st_uid)
    # The quota itself, read by the host from the program's cgroup: the ratios below cannot tell a missing
    # quota on a host too busy to give two spinners more than one core.
    attack = SandboxedAttack(sandbox, """
        hold("holding")
        report(ok=True)
    """)
    run, quota = held(attack, lambda pid: cgroup_quota(pid))
    assert run.result() == {"ok": True}
    assert quota == 1.0, quota      # the default policy's cpu_cores
    # The host's accounting of the whole run (start-up included, which only lowers the ratio).
    assert measured.cpu_seconds / measured.wall_seconds < 1.5, vars(measured)
    assert Run(measured.returncode, measured.stdout, measured.stderr, 0, workspace, 0).result()["ratio"] < 1.5


SPINNER = """
import time
print("up", flush=True)
deadline = time.monotonic() + 20
while time.monotonic() < deadline:
    pass
"""


def is_spinner(pid):
    try:
        return b"print(\"up\", flush=True)" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def host_cpu_seconds(pids):
    """CPU time the host has charged to `pids` (every thread), from /proc/<pid>/schedstat."""
    return sum(int(Path(f"/proc/{pid}/schedstat").read_text().split()[0]) for pid in pids) / 1e9


def test_busy_sessions_together_weigh_one_process_against_the_host(sandbox):
    """Busy loops in any number of sessions cannot starve the processes that start, supervise and interrupt them:
    every session's cgroup sits under one parent, which the scheduler weighs as one process. Host-side: with the
    cores contended by as many busy host processes as busy sessions, the sessions together get about what one
    host process gets (a third of the host processes' CPU here; as much as they, were each session weighed alone)."""
    count = (os.cpu_count() or 1) + 1
    sessions, workspaces, hosts = [], [], []
    try:
        for _ in range(count):
            process, workspace = sandbox.spawn_python(SPINNER)
            sessions.append(process)
            workspaces.append(workspace)
        for process in sessions:
            assert process.stdout.readline().strip() == "up", process.stderr.read()
        # Each in a session of its own, as a kernel is: with autogroup scheduling, the processes of one session
        # are one entity too.
        hosts = [subprocess.Popen([PYTHON, "-c", SPINNER], stdout=subprocess.PIPE, text=True, start_new_session=True)
                 for _ in range(count)]
        for process in hosts:
            assert process.stdout.readline().strip() == "up"
        session_pids = [pid for workspace in workspaces for pid, _ in session_processes(workspace.stat().st_uid)
                        if is_spinner(pid)]
        assert len(session_pids) == count, session_pids
        host_pids = [process.pid for process in hosts]
        time.sleep(0.5)
        before = host_cpu_seconds(session_pids), host_cpu_seconds(host_pids)
        time.sleep(3)
        after = host_cpu_seconds(session_pids), host_cpu_seconds(host_pids)
        in_sessions, on_host = after[0] - before[0], after[1] - before[1]
        assert in_sessions > 0.1, (in_sessions, on_host)
        assert in_sessions / on_host < 0.6, f"sessions {in_sessions:.2f} s of CPU, host processes {on_host:.2f} s"
    finally:
        for process in [*sessions, *hosts]:
            process.kill()
            process.wait()
    for workspace in workspaces:
        assert_no_session_process(workspace.stat().st_uid)


def test_crash_leaves_no_core_dump(sandbox):
    run = sandbox.python("""
        os.chdir("/workspace")
        if os.fork() == 0:
            ctypes.string_at(0)     # segfault in a child (pid 1 would also be killed; the child is simpler)
        pid, status = os.wait()
        report(signal=os.WTERMSIG(status) if os.WIFSIGNALED(status) else None, core=os.WCOREDUMP(status))
    """)
    assert run.result() == {"signal": 11, "core": False}
    assert not any(p.name.startswith("core") for p in run.workspace.iterdir())
