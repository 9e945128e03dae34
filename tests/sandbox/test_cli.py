"""The CLI's contract: exit status of the command, 125 for setup errors, stdin/stdout streaming."""
import subprocess

from conftest import SANDBOX


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
