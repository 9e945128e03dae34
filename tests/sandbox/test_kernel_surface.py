"""Kernel attack surface: the seccomp filter answers these with clean errors (or kills the process for
a foreign architecture). Each expected errno differs from what the same call gives unfiltered here
(confinement.md §4: without seccomp these seven leaked)."""
import pytest

# name -> (python expression for the call, expected errno name)
SYSCALLS = {
    "io_uring_setup": ("syscall(425, 8, ctypes.addressof(ctypes.create_string_buffer(120)))", "ENOSYS"),
    "io_uring_enter": ("syscall(426, 0, 0, 0, 0, 0, 0)", "ENOSYS"),
    "keyctl_session_keyring": ("syscall(250, 0, -3, 0)", "EPERM"),   # KEYCTL_GET_KEYRING_ID, KEY_SPEC_SESSION_KEYRING
    "add_key": ("syscall(248, ctypes.cast(ctypes.c_char_p(b'user'), ctypes.c_void_p).value, "
                "ctypes.cast(ctypes.c_char_p(b'k'), ctypes.c_void_p).value, 0, 0, -3)", "EPERM"),
    "bpf_prog_load": ("syscall(321, 5, ctypes.addressof(ctypes.create_string_buffer(128)), 128)", "EPERM"),
    "perf_event_open": ("syscall(298, ctypes.addressof(ctypes.create_string_buffer(128)), 0, -1, -1, 0)", "EPERM"),
    "userfaultfd_user_mode": ("syscall(323, 1)", "EPERM"),          # UFFD_USER_MODE_ONLY
    "mbind": ("syscall(237, 0, 0, 0, 0, 0, 0)", "EPERM"),
    "set_mempolicy": ("syscall(238, 0, 0, 0)", "EPERM"),
    "move_pages": ("syscall(279, 0, 0, 0, 0, 0, 0)", "EPERM"),
    "init_module": ("syscall(175, 0, 0, 0)", "EPERM"),
    "finit_module": ("syscall(313, 0, 0, 0)", "EPERM"),
    "kexec_load": ("syscall(246, 0, 0, 0, 0)", "EPERM"),
    "reboot": ("syscall(169, 0xfee1dead, 672274793, 0x1234567, 0)", "EPERM"),
    "syslog_read_all": ("syscall(103, 3, ctypes.addressof(ctypes.create_string_buffer(4096)), 4096)", "EPERM"),
    "settimeofday": ("syscall(164, 0, 0)", "EPERM"),
    "clock_settime": ("syscall(227, 0, ctypes.addressof(ctypes.create_string_buffer(16)))", "EPERM"),
    "iopl": ("syscall(172, 3)", "EPERM"),
    "ioperm": ("syscall(173, 0x80, 1, 1)", "EPERM"),
    "pidfd_getfd": ("syscall(438, 0, 0, 0)", "EPERM"),
    "landlock_create_ruleset": ("syscall(444, 0, 0, 1)", "EPERM"),
    "swapon": ("syscall(167, 0, 0)", "EPERM"),
    "acct": ("syscall(163, 0)", "EPERM"),
}


@pytest.mark.parametrize("name", sorted(SYSCALLS))
def test_dangerous_syscall_is_denied(sandbox, name):
    call, expected = SYSCALLS[name]
    run = sandbox.python(f"""
        result = {call}
        report(result=result[0], errno=result[1])
    """)
    assert run.result() == {"result": -1, "errno": expected}


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


def test_i386_int80_syscall_kills_the_process(sandbox):
    run = sandbox.python("""
        import mmap
        code = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
        code.write(bytes([0xb8, 0x14, 0, 0, 0,   # mov eax, 20 (i386 getpid)
                          0xcd, 0x80,            # int 0x80
                          0xc3]))                # ret
        function = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(code)))
        print("survived", function(), flush=True)
    """)
    assert run.returncode == 128 + 31, run.output   # SIGSYS: killed for the foreign architecture
    assert "survived" not in run.stdout


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
