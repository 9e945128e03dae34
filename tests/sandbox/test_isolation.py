"""Persistence and sessions attacking each other."""
import json
import os
import subprocess
import time

import pytest

from conftest import assert_no_session_process, battery_policy, session_processes, sha256


def test_double_forked_daemon_does_not_outlive_the_sandbox(sandbox):
    run = sandbox.python("""
        import signal, time
        if os.fork() == 0:
            os.setsid()
            signal.signal(signal.SIGHUP, signal.SIG_IGN)
            if os.fork() == 0:
                while True:
                    with open("/workspace/heartbeat", "a") as handle:
                        handle.write("beat\\n")
                    time.sleep(0.05)
            os._exit(0)
        time.sleep(0.5)
        report(started=True)
    """)
    assert run.result() == {"started": True}
    heartbeat = run.workspace / "heartbeat"
    assert heartbeat.exists()
    size = heartbeat.stat().st_size
    time.sleep(0.5)
    assert heartbeat.stat().st_size == size, "the daemon kept writing after its sandbox ended"
    assert session_processes(run.uid) == []


def test_killing_the_cli_tears_the_sandbox_down(sandbox):
    process, workspace = sandbox.spawn_python("""
        import time
        for _ in range(4):
            if os.fork() == 0:
                time.sleep(300)
        print("ready", flush=True)
        time.sleep(300)
    """)
    try:
        assert process.stdout.readline().strip() == "ready"
        uid = workspace.stat().st_uid
        assert len(session_processes(uid)) >= 5
        process.kill()     # SIGKILL: no cleanup code in the CLI runs; PDEATHSIG must do the job
        process.wait(timeout=30)
        assert_no_session_process(uid)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_two_sessions_cannot_reach_each_other(sandbox):
    victim, victim_ws = sandbox.spawn_python("""
        import time
        with open("/workspace/private.txt", "w") as handle:
            handle.write("victim-data")
        with open("/tmp/private.txt", "w") as handle:
            handle.write("victim-tmp")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind("\\0cellblock-victim")
        listener.listen(1)
        print("ready", flush=True)
        time.sleep(300)
    """)
    try:
        assert victim.stdout.readline().strip() == "ready"
        victim_uid = victim_ws.stat().st_uid
        private = victim_ws / "private.txt"
        before = sha256(private)
        victim_pids = [pid for pid, _ in session_processes(victim_uid)]
        attack = sandbox.python(f"""
            outcomes = {{}}
            for path in [{str(private)!r}, "/tmp/private.txt", "/run/cellblock/roots"]:
                try:
                    outcomes[path] = open(path).read()
                except OSError as error:
                    outcomes[path] = errno.errorcode.get(error.errno)
            for pid in {victim_pids!r}:
                try:
                    os.kill(pid, 9)
                    outcomes["kill"] = "sent"
                except OSError as error:
                    outcomes["kill"] = errno.errorcode.get(error.errno)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect("\\0cellblock-victim")
                outcomes["abstract"] = "connected"
            except OSError as error:
                outcomes["abstract"] = errno.errorcode.get(error.errno)
            report(**outcomes)
        """)
        result = attack.result()
        assert attack.uid != victim_uid
        assert result[str(private)] == "ENOENT"
        assert result["/tmp/private.txt"] == "ENOENT"
        assert result["/run/cellblock/roots"] == "ENOENT"
        assert result.get("kill", "ESRCH") == "ESRCH"
        assert result["abstract"] == "ECONNREFUSED"
        assert "victim-data" not in attack.output and "victim-tmp" not in attack.output
        assert victim.poll() is None, "the victim sandbox was killed"
        assert sha256(private) == before
    finally:
        victim.kill()
        victim.wait()


def test_workspace_is_closed_to_other_uids(sandbox):
    run = sandbox.python("open('/workspace/a.txt', 'w').write('first'); report(ok=True)")
    assert run.result() == {"ok": True}
    mode = run.workspace.stat().st_mode & 0o777
    assert mode & 0o007 == 0, f"workspace is accessible to other uids: {oct(mode)}"
    assert (run.workspace / "a.txt").stat().st_uid == run.uid


def test_sandboxes_of_policies_with_different_state_dirs_never_share_a_host_uid(sandbox, tmp_path):
    """Host uids and their cgroups (/cellblock/<uid>) are host-wide, so two policies that differ only in their
    state_dir (two installs on one host, a custom policy) must not lease the same uid: the second session would
    own the first's files and could signal it, and its launch clears a cgroup it takes for stale, killing the
    first. Host-side: the first sandbox is still running, and the two workspaces are owned by different uids."""
    policies = []
    for name in ("a", "b"):
        policy = battery_policy()
        policy["state_dir"] = str(tmp_path / f"state-{name}")
        path = tmp_path / f"policy-{name}.json"
        path.write_text(json.dumps(policy))
        policies.append(path)
    first, first_workspace = sandbox.spawn_python(
        "import time\nprint('up', flush=True)\ntime.sleep(60)", policy=policies[0])
    try:
        assert first.stdout.readline().strip() == "up", first.stderr.read()
        first_uid = first_workspace.stat().st_uid
        second = sandbox.run(["/usr/bin/python3", "-c", "pass"], policy=policies[1], check_leftovers=False)
        assert second.returncode == 0, second.stderr
        assert second.uid != first_uid, f"both sessions run as host uid {first_uid}"
        assert first.poll() is None, "the first session was killed by the second's launch"
        assert session_processes(first_uid), "no process of the first session is left on the host"
    finally:
        first.kill()  # SIGKILL: the sandboxed program goes by PDEATHSIG; later tests must not find it
        first.wait()
        assert_no_session_process(first_workspace.stat().st_uid)
