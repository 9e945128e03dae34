"""The CLI's contract: exit status of the command, 125 for setup errors, stdin/stdout streaming, a stop."""
import signal
import subprocess
from pathlib import Path

import pytest

from conftest import SANDBOX, assert_no_session_process, session_processes
from witnesses import cgroup_dirs


def test_exit_status_and_signals_pass_through(sandbox):
    assert sandbox.run(["/bin/sh", "-c", "exit 3"]).returncode == 3
    # A real fault (the program is pid 1 of its namespace, which ignores signals it sends itself).
    killed = sandbox.run(["/usr/bin/python3", "-c", "import ctypes; ctypes.string_at(0)"])
    assert killed.returncode == 128 + 11
    assert "limit" not in killed.stderr


def test_stdin_is_streamed_in_and_output_out(sandbox, default_policy, tmp_path):
    workspace = tmp_path / "ws-stdin"
    workspace.mkdir()
    completed = subprocess.run([str(SANDBOX), "--policy", str(default_policy), "--workspace", str(workspace), "--",
                                "/usr/bin/tr", "a-z", "A-Z"], input="hello sandbox\n", capture_output=True,
                               text=True, timeout=60)
    assert completed.returncode == 0
    assert completed.stdout == "HELLO SANDBOX\n"


def test_setup_errors_exit_125_with_the_reason(sandbox, default_policy):
    completed = subprocess.run([str(SANDBOX), "--policy", str(default_policy), "--", "/usr/bin/no-such-program"],
                               capture_output=True, text=True, timeout=60)
    assert completed.returncode == 125
    assert "execve /usr/bin/no-such-program: No such file or directory" in completed.stderr


def test_temporary_workspace_is_removed(default_policy):
    completed = subprocess.run([str(SANDBOX), "--policy", str(default_policy), "--", "/bin/sh", "-c",
                                "echo data > kept.txt; ls -d \"$PWD\"; cat /proc/self/mountinfo"],
                               capture_output=True, text=True, timeout=60)
    assert completed.returncode == 0
    host_path = next(line.split()[3] for line in completed.stdout.splitlines()[1:] if " /workspace " in line)
    assert "cellblock-workspace-" in host_path
    import os
    assert not os.path.exists(host_path)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_stopped_cli_leaves_nothing_of_its_sandbox(default_policy, signum):
    """A service manager's stop, a Ctrl-C, a closed terminal: the CLI kills the sandbox, then lets go of its
    cgroups and its temporary workspace, and exits 128 + the signal. Checked on the host, not by what it says."""
    cli = subprocess.Popen([str(SANDBOX), "--policy", str(default_policy), "--", "/bin/sh", "-c",
                            "grep ' /workspace ' /proc/self/mountinfo; echo ready; exec sleep 600"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    try:
        workspace_mount = cli.stdout.readline()
        assert cli.stdout.readline() == "ready\n", workspace_mount
        workspace = Path(workspace_mount.split()[3])
        uid = workspace.stat().st_uid
        [(program, _)] = session_processes(uid)
        cgroups = [path for path in cgroup_dirs(program).values() if "cellblock" in path.parts]
        assert cgroups and all(path.is_dir() for path in cgroups), cgroup_dirs(program)
        cli.send_signal(signum)
        _, stderr = cli.communicate(timeout=60)
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.wait()
    assert cli.returncode == 128 + signum, stderr
    assert f"stopped by {signal.Signals(signum).name}" in stderr
    assert_no_session_process(uid)
    assert [path for path in cgroups if path.exists()] == []
    assert not workspace.exists()
