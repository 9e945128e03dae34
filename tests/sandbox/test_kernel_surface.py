"""Kernel attack surface: the seccomp filter answers these with clean errors (or kills the process for
a foreign architecture).

The errno a sandboxed call returns is not proof on its own: init_module, kexec_load, reboot, settimeofday,
iopl, swapon, acct (and syslog, bpf, perf_event_open on Debian's defaults) fail with the same EPERM for lack
of capabilities, filtered or not. So every case also reads the filter the sandboxed program runs under from
the host and checks that it answers that syscall itself (witnesses.py; test_installed_filter_is_read_from_the_host
shows the reader tells allowed from denied)."""
import errno
import json

import pytest

from conftest import Sandbox
from witnesses import AUDIT_ARCH_I386, read_sandbox_filter, sandbox_filter, unconfined, verdict  # noqa: F401 (fixture)

# name -> (syscall number, python arguments for the call, expected errno name)
SYSCALLS = {
    "io_uring_setup": (425, "8, ctypes.addressof(ctypes.create_string_buffer(120))", "ENOSYS"),
    "io_uring_enter": (426, "0, 0, 0, 0, 0, 0", "ENOSYS"),
    "keyctl_session_keyring": (250, "0, -3, 0", "EPERM"),   # KEYCTL_GET_KEYRING_ID, KEY_SPEC_SESSION_KEYRING
    "add_key": (248, "ctypes.cast(ctypes.c_char_p(b'user'), ctypes.c_void_p).value, "
                     "ctypes.cast(ctypes.c_char_p(b'k'), ctypes.c_void_p).value, 0, 0, -3", "EPERM"),
    "bpf_prog_load": (321, "5, ctypes.addressof(ctypes.create_string_buffer(128)), 128", "EPERM"),
    "perf_event_open": (298, "ctypes.addressof(ctypes.create_string_buffer(128)), 0, -1, -1, 0", "EPERM"),
    "userfaultfd_user_mode": (323, "1", "EPERM"),          # UFFD_USER_MODE_ONLY
    "mbind": (237, "0, 0, 0, 0, 0, 0", "EPERM"),
    "set_mempolicy": (238, "0, 0, 0", "EPERM"),
    "move_pages": (279, "0, 0, 0, 0, 0, 0", "EPERM"),
    "init_module": (175, "0, 0, 0", "EPERM"),
    "finit_module": (313, "0, 0, 0", "EPERM"),
    "kexec_load": (246, "0, 0, 0, 0", "EPERM"),
    "reboot": (169, "0xfee1dead, 672274793, 0x1234567, 0", "EPERM"),
    "syslog_read_all": (103, "3, ctypes.addressof(ctypes.create_string_buffer(4096)), 4096", "EPERM"),
    "settimeofday": (164, "0, 0", "EPERM"),
    "clock_settime": (227, "0, ctypes.addressof(ctypes.create_string_buffer(16))", "EPERM"),
    "iopl": (172, "3", "EPERM"),
    "ioperm": (173, "0x80, 1, 1", "EPERM"),
    "pidfd_getfd": (438, "0, 0, 0", "EPERM"),
    "landlock_create_ruleset": (444, "0, 0, 1", "EPERM"),
    "swapon": (167, "0, 0", "EPERM"),
    "acct": (163, "0", "EPERM"),
}


@pytest.mark.parametrize("name", sorted(SYSCALLS))
def test_dangerous_syscall_is_denied(sandbox, sandbox_filter, name):
    number, arguments, expected = SYSCALLS[name]
    run = sandbox.python(f"""
        result = syscall({number}, {arguments})
        report(result=result[0], errno=result[1])
    """)
    assert run.result() == {"result": -1, "errno": expected}
    # The rules are unconditional: whatever the arguments, the filter itself answers with that errno.
    assert verdict(sandbox_filter, number) == ("ERRNO", getattr(errno, expected)), name


def test_installed_filter_is_read_from_the_host(sandbox_filter, tmp_path, default_policy):
    # Positive controls for the witness above: the reader sees what the filter allows, the conditional
    # rules and the foreign-architecture kill, and finds no filter when the policy turns seccomp off.
    assert verdict(sandbox_filter, 39) == ("ALLOW", 0)                                       # getpid
    assert verdict(sandbox_filter, 41, (1, 1, 0)) == ("ALLOW", 0)                           # socket(AF_UNIX)
    assert verdict(sandbox_filter, 41, (2, 1, 0)) == ("ERRNO", errno.EAFNOSUPPORT)          # socket(AF_INET)
    assert verdict(sandbox_filter, 56, (17, 0, 0, 0, 0)) == ("ALLOW", 0)                    # clone(SIGCHLD)
    assert verdict(sandbox_filter, 56, (0x10000011, 0, 0, 0, 0)) == ("ERRNO", errno.EPERM)  # + CLONE_NEWUSER
    assert verdict(sandbox_filter, 20, arch=AUDIT_ARCH_I386) == ("KILL_PROCESS", 0)
    unfiltered = json.loads(default_policy.read_text())
    unfiltered["seccomp"] = False
    policy = tmp_path / "no-seccomp.json"
    policy.write_text(json.dumps(unfiltered))
    with pytest.raises(OSError) as refused:
        read_sandbox_filter(Sandbox(tmp_path, policy))
    assert refused.value.errno == errno.EINVAL   # PTRACE_SECCOMP_GET_FILTER on a process without a filter


def test_personality_flags_weakening_mitigations_are_denied(sandbox):
    run = sandbox.python("""
        # Setting the plain Linux persona stays allowed. (The 0xffffffff query has every flag bit set and
        # is refused too: the filter compares flags, and one rule may test an argument only once.)
        outcomes = {"plain": syscall(135, 0)[1]}
        for name, flag in {"READ_IMPLIES_EXEC": 0x0400000, "ADDR_NO_RANDOMIZE": 0x0040000,
                           "MMAP_PAGE_ZERO": 0x0100000}.items():
            outcomes[name] = syscall(135, flag)[1]
        report(**outcomes)
    """)
    assert run.result() == {"plain": "OK", "READ_IMPLIES_EXEC": "EPERM", "ADDR_NO_RANDOMIZE": "EPERM",
                            "MMAP_PAGE_ZERO": "EPERM"}


INT80_GETPID = """
    import mmap
    code = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    code.write(bytes([0xb8, 0x14, 0, 0, 0,   # mov eax, 20 (i386 getpid)
                      0xcd, 0x80,            # int 0x80
                      0xc3]))                # ret
    function = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(code)))
    print("survived", function(), flush=True)
"""


def test_i386_int80_syscall_kills_the_process(sandbox, sandbox_filter):
    # The filter kills any syscall of a foreign architecture, whatever the kernel would do with it.
    assert verdict(sandbox_filter, 20, arch=AUDIT_ARCH_I386) == ("KILL_PROCESS", 0)
    run = sandbox.python(INT80_GETPID)
    assert "survived" not in run.stdout
    # Some hosts cannot run i386 syscalls at all (a VM without 32-bit entry: int 0x80 is a SIGSEGV there,
    # confined or not); where the host can, the sandboxed program must die of SIGSYS instead.
    host = unconfined(INT80_GETPID)
    if host.returncode == 0:
        assert "survived" in host.stdout
        assert run.returncode == 128 + 31, run.output   # SIGSYS: killed for the foreign architecture
    else:
        assert host.returncode == -11 and run.returncode == 128 + 11, (host, run.output)


def test_terminal_injection_ioctls_are_denied_even_with_high_bits(sandbox):
    run = sandbox.python("""
        TIOCSTI, TIOCLINUX = 0x5412, 0x541C
        byte = ctypes.c_char(b"x")
        report(tiocsti=syscall(16, 0, TIOCSTI, ctypes.addressof(byte))[1],
               tiocsti_high=syscall(16, 0, TIOCSTI | (1 << 32), ctypes.addressof(byte))[1],
               tioclinux=syscall(16, 0, TIOCLINUX, ctypes.addressof(byte))[1],
               ordinary=syscall(16, 0, 0x5401, ctypes.addressof(ctypes.create_string_buffer(64)))[1])  # TCGETS
    """)
    # An ordinary ioctl on the (non-tty) stdin gets ENOTTY from the kernel: the filter is selective.
    assert run.result() == {"tiocsti": "EPERM", "tiocsti_high": "EPERM", "tioclinux": "EPERM", "ordinary": "ENOTTY"}
