"""Filesystem: a read-only minimal root, only the workspace writable, nothing of the host beyond /usr
and a few /etc files; host files keep their hashes."""
import errno
import os
import stat

import pytest

from conftest import sha256
from witnesses import SandboxedAttack, UnconfinedAttack, sandbox_filter, verdict  # noqa: F401 (fixture)


def test_host_secret_file_is_not_visible(sandbox, host_secret):
    value, path = host_secret
    run = sandbox.python(f"""
        attempts = {{}}
        for candidate in [{str(path)!r}, "/root/.bash_history", "/root", "/home", "/var/log/syslog", "/run", "/srv",
                          "/var/lib/dpkg/status"]:
            try:
                with open(candidate) as handle:
                    attempts[candidate] = handle.read()
            except OSError as error:
                attempts[candidate] = errno.errorcode.get(error.errno)
        report(attempts=attempts, root=sorted(os.listdir("/")))
    """)
    result = run.result()
    assert all(v == "ENOENT" for v in result["attempts"].values()), result
    assert value not in run.output
    # /var holds only the read-only font cache when the host has one.
    assert set(result["root"]) - {"var"} == {"bin", "dev", "etc", "lib", "lib64", "proc", "sbin", "tmp", "usr", "workspace"}


def test_whole_visible_filesystem_contains_no_host_secret(sandbox, host_secret):
    value, _ = host_secret
    run = sandbox.python(f"""
        hits, scanned = [], 0
        for top in ["/etc", "/tmp", "/dev/shm", "/workspace", "/"]:
            for directory, dirs, files in os.walk(top):
                if directory == "/":
                    dirs[:] = [d for d in dirs if d not in ("proc", "usr", "dev")]
                for name in files:
                    full = os.path.join(directory, name)
                    try:
                        with open(full, "rb") as handle:
                            scanned += 1
                            if {value.encode()!r} in handle.read(1 << 20):
                                hits.append(full)
                    except OSError:
                        pass
        report(hits=hits, scanned=scanned)
    """)
    assert run.result()["hits"] == []
    assert value not in run.output


def test_shadow_and_etc_contents_are_minimal(sandbox):
    run = sandbox.python("""
        try:
            open("/etc/shadow").read()
            shadow = "read"
        except OSError as error:
            shadow = errno.errorcode.get(error.errno)
        report(shadow=shadow, etc=sorted(os.listdir("/etc")))
    """)
    result = run.result()
    assert result["shadow"] == "ENOENT"
    assert "shadow" not in result["etc"] and "ssh" not in result["etc"]


def test_root_usr_and_etc_are_read_only_and_host_files_unchanged(sandbox):
    before = {p: sha256(p) for p in ["/usr/bin/python3", "/etc/ld.so.cache"]}
    run = sandbox.python("""
        outcomes = {}
        for target in ["/evil", "/usr/bin/python3", "/usr/lib/evil.so", "/etc/ld.so.cache", "/etc/passwd", "/bin/sh"]:
            try:
                with open(target, "ab") as handle:
                    handle.write(b"pwned")
                outcomes[target] = "written"
            except OSError as error:
                outcomes[target] = errno.errorcode.get(error.errno)
        report(**outcomes)
    """)
    result = run.result()
    assert "written" not in result.values(), result
    assert set(result.values()) <= {"EROFS", "EACCES"}
    assert before == {p: sha256(p) for p in before}
    assert not os.path.exists("/evil") and not os.path.exists("/usr/lib/evil.so")


def test_writes_only_land_in_the_workspace(sandbox):
    run = sandbox.python("""
        with open("/workspace/result.txt", "w") as handle:
            handle.write("from inside")
        with open("/tmp/scratch.txt", "w") as handle:
            handle.write("tmp is private")
        report(cwd=os.getcwd())
    """)
    assert run.result() == {"cwd": "/workspace"}
    written = run.workspace / "result.txt"
    assert written.read_text() == "from inside"
    assert written.stat().st_uid == run.uid
    assert not any(p.name == "scratch.txt" for p in __import__("pathlib").Path("/tmp").glob("scratch.txt"))


def test_proc_shows_only_the_sandbox(sandbox, canary):
    run = sandbox.python(f"""
        pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
        cmdline = open("/proc/1/cmdline", "rb").read().split(b"\\0")[0].decode()
        try:
            os.kill({canary.pid}, 0)
            canary = "visible"
        except OSError as error:
            canary = errno.errorcode.get(error.errno)
        report(pids=pids, cmdline=cmdline, canary=canary, mypid=os.getpid())
    """)
    result = run.result()
    assert result["mypid"] == 1
    assert result["cmdline"] == "/usr/bin/python3"
    assert result["pids"] == [1]
    assert result["canary"] == "ESRCH"
    assert canary.poll() is None


def test_sys_and_host_devices_are_absent(sandbox):
    run = sandbox.python("""
        report(sys=os.path.exists("/sys"), dev=sorted(os.listdir("/dev")),
               mem=os.path.exists("/dev/mem"), vda=os.path.exists("/dev/vda"))
    """)
    result = run.result()
    assert result["sys"] is False and result["mem"] is False and result["vda"] is False
    assert set(result["dev"]) <= {"null", "zero", "full", "random", "urandom", "tty", "shm", "fd", "stdin",
                                  "stdout", "stderr"}


MKNOD = """
    outcomes = {}
    for path in target()["paths"]:
        try:
            os.mknod(path, 0o600 | 0o060000, os.makedev(254, 0))   # a block device
            outcomes[path] = "created"
        except OSError as error:
            outcomes[path] = errno.errorcode.get(error.errno)
    hold("made")
    report(**outcomes)
"""


def nodes(paths):
    """What the host finds at each path: "block device", "character device", another kind, or "absent"."""
    found = {}
    for path in paths:
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            found[path] = "absent"
            continue
        found[path] = ("block device" if stat.S_ISBLK(mode) else "character device" if stat.S_ISCHR(mode)
                       else "something else")
    return found


def test_mknod_and_device_creation_fail(sandbox):
    # Positive control: unconfined (as root), the host sees the device node the attack made.
    control = UnconfinedAttack(MKNOD)
    control.provide(paths=[str(control.directory / "sda")])
    control.wait_hold("made")
    seen = nodes([control.directory / "sda"])
    control.release("made")
    assert control.run().result() == {str(control.directory / "sda"): "created"}
    assert list(seen.values()) == ["block device"]

    paths = ["/workspace/sda", "/tmp/sda", "/dev/shm/sda"]
    attack = SandboxedAttack(sandbox, MKNOD)
    attack.provide(paths=paths)
    try:
        attack.wait_hold("made")
        # The sandbox's own /tmp and /dev/shm, looked at from the host through its root.
        root = f"/proc/{attack.program_pid()}/root"
        seen = nodes([root + path for path in paths] + [attack.workspace / "sda"])
    finally:
        attack.release("made")
    run = attack.run()
    assert "created" not in run.result().values(), run.result()
    assert set(seen.values()) == {"absent"}, seen


def test_hardlinks_to_files_outside_the_workspace_fail(sandbox):
    run = sandbox.python("""
        outcomes = {}
        for source in ["/usr/bin/python3", "/etc/ld.so.cache", "/etc/passwd"]:
            try:
                os.link(source, "/workspace/" + os.path.basename(source))
                outcomes[source] = "linked"
            except OSError as error:
                outcomes[source] = errno.errorcode.get(error.errno)
        report(**outcomes)
    """)
    assert set(run.result().values()) <= {"EXDEV", "EPERM", "EROFS"}
    assert list(run.workspace.iterdir()) == []


def test_planted_symlinks_resolve_inside_the_sandbox_only(sandbox, host_secret):
    value, path = host_secret
    run = sandbox.python(f"""
        os.symlink({str(path)!r}, "/workspace/report.csv")
        os.symlink("/", "/workspace/rootlink")
        outcomes = {{}}
        for candidate in ["/workspace/report.csv", "/workspace/rootlink/" + {str(path)!r}.lstrip("/")]:
            try:
                outcomes[candidate] = open(candidate).read()
            except OSError as error:
                outcomes[candidate] = errno.errorcode.get(error.errno)
        report(**outcomes)
    """)
    assert set(run.result().values()) == {"ENOENT"}
    assert value not in run.output
    # The links stay in the workspace for the host to trip over; the host file is unchanged.
    assert (run.workspace / "report.csv").is_symlink()
    assert path.read_text().strip() == value


def test_mount_pivot_root_and_chroot_are_denied(sandbox, sandbox_filter):
    run = sandbox.python("""
        outcomes = {}
        outcomes["mount"] = syscall(165, 0, 0, 0, 0, 0)[1]   # mount(NULL, NULL, NULL, 0, NULL)
        outcomes["mount_tmpfs"] = libc.mount(b"tmpfs", b"/tmp", b"tmpfs", 0, None), ctypes.get_errno()
        outcomes["umount_root"] = syscall(166, ctypes.cast(ctypes.c_char_p(b"/"), ctypes.c_void_p).value, 2)[1]
        outcomes["pivot_root"] = syscall(155, 0, 0)[1]
        outcomes["chroot"] = syscall(161, ctypes.cast(ctypes.c_char_p(b"/tmp"), ctypes.c_void_p).value)[1]
        outcomes["fsopen"] = syscall(430, ctypes.cast(ctypes.c_char_p(b"tmpfs"), ctypes.c_void_p).value, 0)[1]
        outcomes["open_tree"] = syscall(428, -100, ctypes.cast(ctypes.c_char_p(b"/"), ctypes.c_void_p).value, 1)[1]
        report(**outcomes)
    """)
    result = run.result()
    assert result["mount_tmpfs"] == [-1, 1]
    for name in ["mount", "umount_root", "pivot_root", "chroot", "fsopen", "open_tree"]:
        assert result[name] == "EPERM", (name, result)
    # The program has no capabilities, so the kernel alone would answer EPERM too: the filter must deny
    # these calls itself (mount, umount2, pivot_root, chroot, fsopen, open_tree, move_mount, fsmount).
    for number in (165, 166, 155, 161, 430, 428, 429, 432):
        assert verdict(sandbox_filter, number) == ("ERRNO", errno.EPERM), number


def test_open_by_handle_cannot_reach_host_inodes(sandbox, sandbox_filter):
    run = sandbox.python("""
        # name_to_handle_at(AT_FDCWD, "/usr", handle, &mount_id, 0) then open_by_handle_at
        handle = ctypes.create_string_buffer(128)
        ctypes.memmove(handle, (128 - 8).to_bytes(4, "little"), 4)
        mount_id = ctypes.c_int(0)
        first = syscall(303, -100, ctypes.cast(ctypes.c_char_p(b"/usr"), ctypes.c_void_p).value,
                        ctypes.addressof(handle), ctypes.addressof(mount_id), 0)
        second = syscall(304, 3, ctypes.addressof(handle), 0)
        report(name_to_handle=first[1], open_by_handle=second[1])
    """)
    assert run.result() == {"name_to_handle": "EPERM", "open_by_handle": "EPERM"}
    # open_by_handle_at needs CAP_DAC_READ_SEARCH anyway: the filter's own rules prove the denial.
    for number in (303, 304):
        assert verdict(sandbox_filter, number) == ("ERRNO", errno.EPERM), number
