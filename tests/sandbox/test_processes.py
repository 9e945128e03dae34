"""Processes: pid namespace, pids limit, no privileges, no new namespaces, no tracing.

Attacks on host processes aim at canaries of the session's own host uid (witnesses.HostCanary), so that
only the sandbox, not a uid or capability check, stands between the attack and its target; the host then
checks the canary (alive, untraced, no signal handled, secret not read). Each such test first runs the same
attack unconfined as a uid of its own against a canary of that uid, to show the witness fires."""
import errno
import os
import signal

import pytest

from conftest import session_processes
from witnesses import HostCanary, SandboxedAttack, UnconfinedAttack, sandbox_filter, unused_uid, verdict  # noqa: F401


FORK_BOMB = """
    import time
    children, refused = [], None
    for _ in range(target()["ceiling"]):
        try:
            pid = os.fork()
        except OSError as error:
            refused = errno.errorcode.get(error.errno)
            break
        if pid == 0:
            time.sleep(60)
            os._exit(0)
        children.append(pid)
    hold("holding")
    for pid in children:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    report(children=len(children), refused=refused)
"""


def count_processes_while_holding(attack, uid):
    attack.wait_hold("holding")
    try:
        return len(session_processes(uid))
    finally:
        attack.release("holding")


def test_fork_bomb_is_stopped_by_the_pids_limit(sandbox, small_policy, canary):
    # Positive control: unconfined, as a uid of its own, the host counts all 100 children of the bomb.
    uid = unused_uid()
    control = UnconfinedAttack(FORK_BOMB, user=uid)
    control.provide(ceiling=100)
    counted = count_processes_while_holding(control, uid)
    assert control.run().result() == {"children": 100, "refused": None} and counted == 101, counted

    attack = SandboxedAttack(sandbox, FORK_BOMB, policy=small_policy)
    attack.provide(ceiling=2000)
    attack.wait_hold("holding")
    counted = count_processes_while_holding(attack, attack.uid)
    run = attack.run()
    assert counted <= 64, counted    # the policy's pids limit, counted by the host
    result = run.result()
    assert result["refused"] == "EAGAIN"
    assert result["children"] < 64
    assert canary.poll() is None


KILL_EVERYTHING = """
    hold("ready")
    outcomes = {}
    for target_pid in target()["pids"]:
        try:
            os.kill(target_pid, 9)
            outcomes[target_pid] = "sent"
        except OSError as error:
            outcomes[target_pid] = errno.errorcode.get(error.errno)
    try:
        os.kill(-1, 9)
        outcomes["-1"] = "sent"
    except OSError as error:
        outcomes["-1"] = errno.errorcode.get(error.errno)
    hold("done")
    report(**{str(k): v for k, v in outcomes.items()})
"""


def kill_everything(attack, uid, root_canary):
    """Runs KILL_EVERYTHING against a canary of `uid` and a root canary; returns (result, survived) where
    survived says which canaries still handle signals afterwards."""
    attack.wait_hold("ready")
    canary = HostCanary(uid)
    try:
        attack.provide(pids=[canary.pid, root_canary.pid, os.getpid(), 2, 300])
        attack.release("ready")
        attack.wait_hold("done")
        survived = {"same_uid": canary.handled_signals() == [], "root": root_canary.handled_signals() == []}
    finally:
        attack.release("done")
        run = attack.run(after_exit=canary.stop)
    return run.result(), survived


def test_kill_everything_spares_host_processes(sandbox):
    root_canary = HostCanary(0)
    try:
        # Positive control: unconfined, as a uid of its own, the attack kills that uid's canary.
        uid = unused_uid()
        result, survived = kill_everything(UnconfinedAttack(KILL_EVERYTHING, user=uid), uid, root_canary)
        assert survived == {"same_uid": False, "root": True}, (result, survived)

        attack = SandboxedAttack(sandbox, KILL_EVERYTHING)
        attack.wait_hold("ready")   # the session uid is known once the program runs
        result, survived = kill_everything(attack, attack.uid, root_canary)
        assert survived == {"same_uid": True, "root": True}, (result, survived)
        assert set(result.values()) <= {"ESRCH"}, result   # no host pid is even visible
    finally:
        root_canary.stop()


CANARY_ATTACK = """
    hold("ready")
    canary = target()
    pid = canary["pid"]
    outcomes = {}
    for name, number in [("SIGUSR1", 10), ("SIGTERM", 15)]:
        try:
            os.kill(pid, number)
            outcomes[name] = "sent"
        except OSError as error:
            outcomes[name] = errno.errorcode.get(error.errno)
    try:
        os.kill(-1, 10)    # every process this attack may signal
        outcomes["everyone"] = "sent"
    except OSError as error:
        outcomes["everyone"] = errno.errorcode.get(error.errno)
    outcomes["pidfd_open"] = syscall(434, pid, 0)[1]
    hold("signalled")
    buffer = ctypes.create_string_buffer(canary["length"])
    local = (ctypes.c_size_t * 2)(ctypes.addressof(buffer), canary["length"])
    remote = (ctypes.c_size_t * 2)(canary["address"], canary["length"])
    outcomes["vm_read"] = syscall(310, pid, ctypes.addressof(local), 1, ctypes.addressof(remote), 1, 0)[1]
    outcomes["attach"] = syscall(101, 16, pid, 0, 0)[1]               # PTRACE_ATTACH
    if outcomes["attach"] != "OK":
        outcomes["seize"] = syscall(101, 0x4206, pid, 0, 0)[1]        # PTRACE_SEIZE
    hold("traced")
    report(read=buffer.raw.decode("latin-1"), **outcomes)
"""


def attack_canary(attack, uid):
    """Runs CANARY_ATTACK against a host canary of `uid`; returns (result, what the host saw)."""
    attack.wait_hold("ready")
    canary = HostCanary(uid)
    seen = {}
    try:
        attack.provide(pid=canary.pid, **canary.memory)
        attack.release("ready")
        attack.wait_hold("signalled")
        seen["signals"] = sorted(set(canary.handled_signals()))
        attack.release("signalled")
        attack.wait_hold("traced")
        seen["tracer"] = canary.tracer()
        seen["alive"] = canary.process.poll() is None
    finally:
        attack.release("traced")
        run = attack.run(after_exit=canary.stop)   # a tracer must exit before its tracee can be reaped
    seen["secret_read"] = canary.secret in run.output
    return run.result(), seen


def test_host_process_of_the_same_uid_cannot_be_signalled_traced_or_read(sandbox):
    # Positive control: unconfined, as the canary's own uid, every step reaches the canary.
    uid = unused_uid()
    result, seen = attack_canary(UnconfinedAttack(CANARY_ATTACK, user=uid), uid)
    assert seen["signals"] == [signal.SIGUSR1, signal.SIGTERM], (result, seen)
    assert seen["tracer"] != 0 and seen["secret_read"], (result, seen)

    attack = SandboxedAttack(sandbox, CANARY_ATTACK)
    attack.wait_hold("ready")
    result, seen = attack_canary(attack, attack.uid)
    assert seen == {"signals": [], "tracer": 0, "alive": True, "secret_read": False}, (result, seen)
    assert "sent" not in result.values() and "OK" not in result.values(), result


def test_ptrace_is_denied(sandbox, sandbox_filter):
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
    # ptrace, process_vm_readv/writev, kcmp, pidfd_getfd: the filter's own rules.
    for number in (101, 310, 311, 312, 438):
        assert verdict(sandbox_filter, number) == ("ERRNO", errno.EPERM), number


def host_status(pid):
    return {key: value.split() for key, value in
            (line.split(":", 1) for line in open(f"/proc/{pid}/status").read().splitlines())}


def test_setuid_setgid_and_capabilities_are_gone(sandbox):
    attack = SandboxedAttack(sandbox, """
        outcomes = {}
        for name, call in {"setuid0": lambda: os.setuid(0), "setgid0": lambda: os.setgid(0),
                           "setgroups": lambda: os.setgroups([0]), "setresuid": lambda: os.setresuid(0, 0, 0)}.items():
            try:
                call()
                outcomes[name] = "succeeded"
            except OSError as error:
                outcomes[name] = errno.errorcode.get(error.errno)
        status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
        hold("holding")
        report(outcomes=outcomes, uid=os.getuid(), euid=os.geteuid(), groups=os.getgroups(),
               caps={k: status[k].strip() for k in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"]},
               nnp=status["NoNewPrivs"].strip(), seccomp=status["Seccomp"].strip())
    """)
    attack.wait_hold("holding")
    try:
        seen = host_status(attack.program_pid())
    finally:
        attack.release("holding")
    run = attack.run()
    # Seen from the host after the attempts: the session's uid and gid in every slot, no capability at all.
    assert seen["Uid"] == [str(run.uid)] * 4 and len(set(seen["Gid"])) == 1 and seen["Gid"][0] != "0", seen
    assert all(seen[k] == ["0000000000000000"] for k in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"]), seen
    assert seen["NoNewPrivs"] == ["1"] and seen["Seccomp"] == ["2"], seen
    assert host_status(os.getpid())["CapEff"] != ["0000000000000000"]   # the reader sees capabilities where they are
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


def test_unshare_and_setns_are_denied(sandbox, sandbox_filter):
    run = sandbox.python("""
        outcomes = {}
        for name, flag in {"user": 0x10000000, "mount": 0x00020000, "net": 0x40000000, "pid": 0x20000000}.items():
            outcomes["unshare_" + name] = syscall(272, flag)[1]
        outcomes["setns"] = syscall(308, 0, 0)[1]
        report(**outcomes)
    """)
    assert set(run.result().values()) == {"EPERM"}
    # unshare(CLONE_NEWNS) would fail for lack of CAP_SYS_ADMIN anyway: the filter itself must deny both calls.
    assert verdict(sandbox_filter, 272, (0x00020000,)) == ("ERRNO", errno.EPERM)
    assert verdict(sandbox_filter, 308) == ("ERRNO", errno.EPERM)


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
