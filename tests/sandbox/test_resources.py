"""Resources: memory, disk, time, output, threads and fds are bounded, and the CLI says which limit
ended the program."""
import time

import pytest


def test_memory_bomb_is_killed_by_the_memory_limit(sandbox, canary):
    run = sandbox.python("""
        hoard = []
        while True:
            hoard.append(bytearray(16 << 20))
    """, memory_mb=128)
    assert run.returncode == 137
    assert "killed by the memory limit" in run.stderr
    assert canary.poll() is None


def test_tmp_fill_hits_the_tmpfs_size(sandbox, small_policy):
    run = sandbox.python("""
        written = 0
        try:
            with open("/tmp/fill", "wb") as handle:
                while written < (256 << 20):
                    handle.write(b"x" * (1 << 20))
                    handle.flush()
                    written += 1 << 20
            outcome = "filled"
        except OSError as error:
            outcome = errno.errorcode.get(error.errno)
        report(outcome=outcome, written_mb=written >> 20)
    """, policy=small_policy)
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


def test_many_threads_are_bounded_by_the_pids_limit(sandbox, small_policy, canary):
    run = sandbox.python("""
        import threading, time
        stop = threading.Event()
        started, failure = 0, None
        for _ in range(5000):
            try:
                threading.Thread(target=stop.wait, daemon=True).start()
                started += 1
            except RuntimeError as error:
                failure = str(error)
                break
        stop.set()
        report(started=started, failure=failure)
    """, policy=small_policy)
    result = run.result()
    assert result["failure"] is not None
    assert result["started"] < 64
    assert canary.poll() is None


def test_many_fds_are_bounded_by_nofile(sandbox, small_policy):
    run = sandbox.python("""
        import resource
        handles, failure = [], None
        try:
            for _ in range(100000):
                handles.append(open("/dev/null"))
        except OSError as error:
            failure = errno.errorcode.get(error.errno)
        report(opened=len(handles), failure=failure, limit=resource.getrlimit(resource.RLIMIT_NOFILE))
    """, policy=small_policy)
    result = run.result()
    assert result["failure"] == "EMFILE"
    assert result["opened"] < 64
    assert result["limit"] == [64, 64]


def test_rlimits_cannot_be_raised(sandbox):
    run = sandbox.python("""
        import resource
        outcomes = {}
        for name in ["RLIMIT_NOFILE", "RLIMIT_NPROC", "RLIMIT_FSIZE", "RLIMIT_CORE"]:
            limit = getattr(resource, name)
            soft, hard = resource.getrlimit(limit)
            try:
                resource.setrlimit(limit, (hard + 1 if hard != resource.RLIM_INFINITY else hard, resource.RLIM_INFINITY))
                outcomes[name] = "raised"
            except (ValueError, OSError) as error:
                outcomes[name] = "refused"
        report(core=resource.getrlimit(resource.RLIMIT_CORE), **outcomes)
    """)
    result = run.result()
    assert result.pop("core") == [1, 1]   # 1 disables piped core helpers too (see rlimits.cpp)
    assert set(result.values()) == {"refused"}


def test_cpu_quota_holds_two_busy_threads_to_about_one_core(sandbox):
    # Two spinning processes for ~1.5 s; with a 1-core quota they get about 1 CPU-second per second.
    # Noise on a busy host can only lower the ratio, so the bound cannot fail spuriously.
    run = sandbox.python("""
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
    """)
    assert run.result()["ratio"] < 1.5


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
