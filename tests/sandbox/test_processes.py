"""Processes: pid namespace, pids limit, no privileges, no new namespaces, no tracing."""
import os
import signal

import pytest


def test_fork_bomb_is_stopped_by_the_pids_limit(sandbox, small_policy, canary):
    run = sandbox.python("""
        import time
        children, refused = 0, None
        for _ in range(2000):
            try:
                pid = os.fork()
            except OSError as error:
                refused = errno.errorcode.get(error.errno)
                break
            if pid == 0:
                time.sleep(60)
                os._exit(0)
            children += 1
        report(children=children, refused=refused)
    """, policy=small_policy, limit=120)
    result = run.result()
    assert result["refused"] == "EAGAIN"
    assert result["children"] < 64
    assert canary.poll() is None


def test_kill_everything_spares_host_processes(sandbox, canary):
    run = sandbox.python(f"""
        outcomes = {{}}
        for target in [{canary.pid}, {os.getpid()}, 2, 300]:
            try:
                os.kill(target, 9)
                outcomes[target] = "sent"
            except OSError as error:
                outcomes[target] = errno.errorcode.get(error.errno)
        import signal as sig
        sig.signal(sig.SIGTERM, sig.SIG_IGN)
        try:
            os.kill(-1, 9)
            outcomes["-1"] = "sent"
        except OSError as error:
            outcomes["-1"] = errno.errorcode.get(error.errno)
        report(**{{str(k): v for k, v in outcomes.items()}})
    """)
    result = run.result()
    assert result[str(canary.pid)] == "ESRCH"
    assert result[str(os.getpid())] == "ESRCH"
    assert canary.poll() is None, "a host process was killed"


def test_ptrace_is_denied(sandbox):
    run = sandbox.python("""
        pid = os.fork()
        if pid == 0:
            import time; time.sleep(5); os._exit(0)
        attach = syscall(101, 16, pid, 0, 0)       # PTRACE_ATTACH child
        attach_init = syscall(101, 16, 1, 0, 0)    # PTRACE_ATTACH pid 1 (ourselves' namespace init)
        traceme = syscall(101, 0, 0, 0, 0)         # PTRACE_TRACEME
        vm_read = syscall(310, pid, 0, 0, 0, 0, 0) # process_vm_readv
        kcmp = syscall(312, 1, pid, 0, 0, 0)       # kcmp
        os.kill(pid, 9)
        report(attach=attach[1], attach_init=attach_init[1], traceme=traceme[1], vm_read=vm_read[1], kcmp=kcmp[1])
    """)
    assert run.result() == {"attach": "EPERM", "attach_init": "EPERM", "traceme": "EPERM", "vm_read": "EPERM",
                            "kcmp": "EPERM"}


def test_setuid_setgid_and_capabilities_are_gone(sandbox):
    run = sandbox.python("""
        outcomes = {}
        for name, call in {"setuid0": lambda: os.setuid(0), "setgid0": lambda: os.setgid(0),
                           "setgroups": lambda: os.setgroups([0]), "setresuid": lambda: os.setresuid(0, 0, 0)}.items():
            try:
                call()
                outcomes[name] = "succeeded"
            except OSError as error:
                outcomes[name] = errno.errorcode.get(error.errno)
        status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
        report(outcomes=outcomes, uid=os.getuid(), euid=os.geteuid(), groups=os.getgroups(),
               caps={k: status[k].strip() for k in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"]},
               nnp=status["NoNewPrivs"].strip(), seccomp=status["Seccomp"].strip())
    """)
    result = run.result()
    # EINVAL: gid 0 does not even exist in the sandbox's user namespace.
    assert set(result["outcomes"].values()) <= {"EPERM", "EINVAL"}
    assert result["uid"] == result["euid"] == 1000
    assert result["groups"] in ([], [1000])
    assert set(result["caps"].values()) == {"0000000000000000"}
    assert result["nnp"] == "1" and result["seccomp"] == "2"


def test_setuid_binaries_grant_nothing(sandbox):
    # su and passwd are setuid root on the host; nosuid + NO_NEW_PRIVS make them plain programs.
    run = sandbox.run(["/bin/sh", "-c", "for p in /usr/bin/su /usr/bin/passwd /usr/bin/newgrp /usr/bin/chsh; do "
                                        "[ -u $p ] && echo setuid-bit:$p; done; /usr/bin/su root -c 'id -u' </dev/null; "
                                        "echo su-status:$?; id -u"])
    assert "setuid-bit:/usr/bin/su" in run.stdout, "the test needs a setuid binary to try"
    assert "su-status:0" not in run.stdout
    assert run.stdout.strip().splitlines()[-1] == "1000"


def test_unshare_and_setns_are_denied(sandbox):
    run = sandbox.python("""
        outcomes = {}
        for name, flag in {"user": 0x10000000, "mount": 0x00020000, "net": 0x40000000, "pid": 0x20000000}.items():
            outcomes["unshare_" + name] = syscall(272, flag)[1]
        outcomes["setns"] = syscall(308, 0, 0)[1]
        report(**outcomes)
    """)
    assert set(run.result().values()) == {"EPERM"}


def test_clone_into_a_new_user_namespace_is_denied_and_clone3_is_enosys(sandbox):
    run = sandbox.python("""
        import signal
        # clone(CLONE_NEWUSER | SIGCHLD): no child must be created.
        newuser = syscall(56, 0x10000000 | signal.SIGCHLD, 0, 0, 0, 0)
        if newuser[0] == 0:
            os._exit(0)
        newnet = syscall(56, 0x40000000 | signal.SIGCHLD, 0, 0, 0, 0)
        if newnet[0] == 0:
            os._exit(0)
        clone3 = syscall(435, 0, 0)
        # A plain fork still works.
        pid = os.fork()
        if pid == 0:
            os._exit(7)
        report(newuser=newuser[1], newnet=newnet[1], clone3=clone3[1], fork=os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
    """)
    assert run.result() == {"newuser": "EPERM", "newnet": "EPERM", "clone3": "ENOSYS", "fork": 7}


def test_sandbox_is_its_own_session_without_a_terminal(sandbox):
    run = sandbox.python("""
        try:
            fd = os.open("/dev/tty", os.O_RDWR)
            tty = "opened"
        except OSError as error:
            tty = errno.errorcode.get(error.errno)
        report(sid=os.getsid(0), pid=os.getpid(), tty=tty)
    """)
    assert run.result() == {"sid": 1, "pid": 1, "tty": "ENXIO"}
