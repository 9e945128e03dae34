"""Secrets: nothing of the launcher's environment, argv or open files reaches the program."""
import os
import secrets

import pytest


def test_launcher_environment_does_not_leak(sandbox, host_secret):
    value, _ = host_secret
    env = dict(os.environ, KERNEL_HMAC_KEY=value, AWS_SECRET_ACCESS_KEY=value)
    run = sandbox.python("""
        found = {}
        found["environ"] = sorted(os.environ)
        for pid in [p for p in os.listdir("/proc") if p.isdigit()]:
            for part in ["environ", "cmdline"]:
                try:
                    found[pid + "/" + part] = open("/proc/" + pid + "/" + part, "rb").read().decode(errors="replace")
                except OSError as error:
                    found[pid + "/" + part] = errno.errorcode.get(error.errno)
        report(**found)
    """, env=env)
    result = run.result()
    assert "KERNEL_HMAC_KEY" not in result["environ"] and "AWS_SECRET_ACCESS_KEY" not in result["environ"]
    assert value not in run.output
    assert "HOME" in result["environ"] and "PATH" in result["environ"]


def test_inherited_file_descriptors_are_closed(sandbox, host_secret):
    value, path = host_secret
    # Opened WITHOUT close-on-exec and handed to the CLI, as a careless parent might.
    secret_fd = os.open(path, os.O_RDONLY)
    directory_fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY)
    os.set_inheritable(secret_fd, True)
    os.set_inheritable(directory_fd, True)
    try:
        run = sandbox.python("""
            open_fds = sorted(int(fd) for fd in os.listdir("/proc/self/fd"))
            stolen = []
            for fd in range(3, 1024):
                try:
                    os.lseek(fd, 0, 0)
                    stolen.append(os.read(fd, 4096).decode(errors="replace"))
                except OSError:
                    pass
                try:
                    stolen.append(str(os.listdir(fd)))
                except (OSError, TypeError):
                    pass
            report(open_fds=open_fds, stolen=stolen)
        """, pass_fds=(secret_fd, directory_fd))
    finally:
        os.close(secret_fd)
        os.close(directory_fd)
    result = run.result()
    # 0, 1, 2 and the fd listdir itself holds.
    assert result["open_fds"] == [0, 1, 2, 3]
    assert value not in run.output
    assert not any("etc" in entry for entry in result["stolen"])


def test_connection_file_and_runtime_dir_are_not_inside(sandbox, tmp_path):
    key = secrets.token_hex(32)
    runtime = tmp_path / "runtime"
    runtime.mkdir()
    connection = runtime / "kernel-1234.json"
    connection.write_text('{"key": "%s", "signature_scheme": "hmac-sha256"}' % key)
    run = sandbox.python(f"""
        hits = []
        for top in ["/", "/tmp", "/dev/shm", "/workspace"]:
            for directory, dirs, files in os.walk(top):
                if directory == "/":
                    dirs[:] = [d for d in dirs if d not in ("proc", "usr")]
                for name in files:
                    if name.startswith("kernel-") and name.endswith(".json"):
                        hits.append(os.path.join(directory, name))
        try:
            direct = open({str(connection)!r}).read()
        except OSError as error:
            direct = errno.errorcode.get(error.errno)
        report(hits=hits, direct=direct)
    """)
    assert run.result() == {"hits": [], "direct": "ENOENT"}
    assert key not in run.output


def test_hostname_and_identity_reveal_nothing_of_the_host(sandbox):
    run = sandbox.python("""
        import pwd
        report(hostname=socket.gethostname(), user=pwd.getpwuid(os.getuid()).pw_name,
               uname_node=os.uname().nodename, passwd=open("/etc/passwd").read().count("\\n"))
    """)
    result = run.result()
    assert result["hostname"] == result["uname_node"] == "cellblock"
    assert result["user"] == "sandbox"
    assert result["passwd"] <= 3
