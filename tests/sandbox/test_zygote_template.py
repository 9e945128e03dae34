"""Hostile tests that only exist with a worker zygote (sandbox/README.md "Worker zygote", "Limits"): workers
forked from a tenant's template through the real kernel (`worker.zygote: true`, whatever CELLBLOCK_TEST_ZYGOTE
says), each checked on the host side.

- A worker cannot signal or ptrace its template: the template is alive afterwards (same pid, same start time),
  nothing pending for it, no tracer, and it still forks.
- No fd of the template is in a worker (/proc/PID/fd of both compared on the host).
- Nothing the template could have read of the host or of another session is in a worker's memory or the
  template's: the environment and HMAC key of the kernel that started the template, another kernel's key,
  another session's variables and its plan (its host workspace path), read from /proc/PID/mem on the host.
- The weaker property of one tenant (the lead's decision): two sessions of one tenant share the template's hash
  secret and address-space layout (documented), but not their random state; sessions of two tenants share neither.

The first launch of a tenant goes by exec while it starts the template; `forked_kernel` restarts that worker
until a fork serves it, and asserts on the host that the worker is the template's child.
"""
from __future__ import annotations

import os
import queue
import secrets
import signal
import time
from pathlib import Path

import cellblock_zygote
import pytest

from test_through_kernel import LiveKernel, hostile_kernelspec, process_status

TEMPLATE_START_TIMEOUT = 240  # the template imports IPython, numpy, pandas and matplotlib on a shared, loaded machine

PROBE = """
import random, secrets, numpy
report(hash_str=hash("x"), layout=id(len), random=random.getrandbits(64), numpy_state=numpy.random.get_state()[1][:8].tolist(),
       secrets=secrets.token_hex(16))
"""


@pytest.fixture(scope="module")
def zygote_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("zygote-kernelspec")
    tenant = cellblock_zygote.other_tenant("hostile")
    return hostile_kernelspec(root, zygote=True, tenant=tenant), root / "policy.json", tenant


@pytest.fixture
def forked_kernel(zygote_dirs, tmp_path):
    dirs, policy, default_tenant = zygote_dirs
    started = []

    def start(name, tenant=None, **env):
        tenant = tenant or default_tenant
        kernel = LiveKernel(dirs, tmp_path / name / "workspace", CELLBLOCK_ZYGOTE_TENANT=tenant, **env)
        started.append(kernel)
        template = cellblock_zygote.template_serving(policy, tenant, timeout=TEMPLATE_START_TIMEOUT)
        # A worker is there once a cell has run (the template can be serving before the kernel's own launch).
        assert kernel.execute("1+1").value() == "2"
        for _ in range(5):
            if cellblock_zygote.is_forked(kernel.worker_pid(), policy, tenant):
                break
            # That launch went by exec (the template was not serving yet): the next worker is a fork.
            assert kernel.execute("import os; os._exit(0)").content["status"] == "error"
            assert kernel.execute("1+1").value() == "2"
        assert cellblock_zygote.is_forked(kernel.worker_pid(), policy, tenant), \
            f"no forked worker; kernel log:\n{kernel.log_path.read_text()[-3000:]}"
        kernel.template = template
        kernel.policy, kernel.tenant = policy, tenant
        return kernel

    yield start
    for kernel in started:
        try:
            kernel.shutdown()
        except Exception:
            pass


def start_time(pid):
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])


def signal_view(pid):
    status = process_status(pid)
    return {name: status[name] for name in ("State", "SigPnd", "ShdPnd", "TracerPid")}


def test_a_worker_cannot_signal_or_ptrace_its_template(forked_kernel):
    kernel = forked_kernel("signals")
    template = kernel.template
    before, born = signal_view(template), start_time(template)
    assert before["TracerPid"] == "0" and set(before["SigPnd"]) == {"0"} and set(before["ShdPnd"]) == {"0"}, before
    cell = kernel.attack(f"""
        import signal
        template = {template}
        results = {{"ppid": os.getppid()}}
        SYS_ptrace, SYS_kill, SYS_tgkill, SYS_rt_sigqueueinfo, SYS_pidfd_open = 101, 62, 234, 129, 434
        for target in [template, 1, 2, 0]:
            for name, args in [("kill", (SYS_kill, target, signal.SIGKILL)),
                               ("kill_stop", (SYS_kill, target, signal.SIGSTOP)),
                               ("tgkill", (SYS_tgkill, target, target, signal.SIGKILL)),
                               ("sigqueue", (SYS_rt_sigqueueinfo, target, signal.SIGUSR1, 0)),
                               ("ptrace_attach", (SYS_ptrace, 16, target, 0, 0)),
                               ("ptrace_seize", (SYS_ptrace, 0x4206, target, 0, 0)),
                               ("pidfd_open", (SYS_pidfd_open, target, 0))]:
                if target in (0, 1) and name.startswith(("kill", "tgkill", "sigqueue")):
                    continue  # itself (pid 1 of its namespace) or its own group
                results[f"{{name}}:{{target}}"] = syscall(*args)[1]
        results["kill_all"] = syscall(SYS_kill, -1, signal.SIGCONT)[1]
        report(**results)
    """)
    results = cell.result()
    assert results["ppid"] == 0, results  # the template is outside the worker's pid namespace
    succeeded = {name: outcome for name, outcome in results.items()
                 if name != "ppid" and outcome == "OK" and not name.endswith((":1", ":2", ":0"))}
    assert not succeeded, f"reached the template: {succeeded}"
    # Host side: the same template, nothing pending, untraced, not stopped; it still forks.
    assert start_time(template) == born
    assert signal_view(template) == before
    assert forked_kernel("after-signals").template == template


def fd_targets(pid):
    targets = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            targets[int(fd)] = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
    return targets


def test_no_template_fd_in_a_worker(forked_kernel):
    kernel = forked_kernel("fds")
    worker, template = kernel.worker_pid(), kernel.template
    assert kernel.execute("1+1").value() == "2"
    ours, theirs = fd_targets(worker), fd_targets(template)
    assert {0, 1, 2, 3} <= set(ours), ours
    assert all(target == "/dev/null" for fd, target in ours.items() if fd > 3), ours  # IPython's devnull, put back
    shared = {target for target in ours.values() if target != "/dev/null"} & set(theirs.values())
    assert not shared, f"the worker holds the template's {shared}"
    assert not any(target.startswith(("mnt:", "anon_inode:[pidfd]")) for target in ours.values()), ours
    # The template holds what it needs to serve, nothing of a session's: a socket per connection, pidfds,
    # namespace fds, /dev/null.
    assert {target.split(":")[0] for target in theirs.values()} <= \
        {"socket", "anon_inode", "mnt", "/dev/null", "/workspace", "pipe"} | \
        {target for target in theirs.values() if target.endswith(".log")}, theirs


def readable_memory(pid):
    """Every readable mapping of `pid`, read on the host through /proc/PID/mem."""
    chunks = []
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", buffering=0) as memory:
        for line in maps:
            fields = line.split()
            start, end = (int(value, 16) for value in fields[0].split("-"))
            if "r" not in fields[1] or (len(fields) > 5 and fields[5] in ("[vvar]", "[vsyscall]", "[vvar_vclock]")):
                continue
            try:
                memory.seek(start)
                chunks.append(memory.read(end - start))
            except OSError:
                continue
    return b"\0".join(chunks)


def test_nothing_of_the_host_or_another_session_is_in_a_workers_memory(forked_kernel):
    tenant = cellblock_zygote.other_tenant("memory")
    host_secret = "ZYGOTE-HOST-" + secrets.token_hex(16)
    # The first kernel of this tenant starts its template, with a secret in its own environment.
    starter = forked_kernel("starter", tenant=tenant, CELLBLOCK_HOSTILE_MARKER=host_secret)
    session_secret = "ZYGOTE-SESSION-" + secrets.token_hex(16)
    assert starter.execute(f"kept = {session_secret!r} * 3; len(kept)").value() == str(3 * len(session_secret))
    later = forked_kernel("later", tenant=tenant)
    assert later.template == starter.template
    assert f"CELLBLOCK_HOSTILE_MARKER={host_secret}".encode() in Path(f"/proc/{starter.pid}/environ").read_bytes()
    needles = {"the starting kernel's environment": host_secret,
               "the starting kernel's key": starter.connection_key()[1]["key"],
               "the later kernel's key": later.connection_key()[1]["key"],
               "the other session's variable": session_secret,
               "the other session's workspace (its plan)": str(starter.workspace)}
    own_secret = "ZYGOTE-OWN-" + secrets.token_hex(16)
    assert later.execute(f"mine = {own_secret!r} * 3; len(mine)").content["status"] == "ok"
    for name, pid in [("the later worker", later.worker_pid()), ("the template", later.template)]:
        memory = readable_memory(pid)
        assert len(memory) > 20 << 20, f"read only {len(memory)} bytes of {name}"
        found = [what for what, needle in needles.items() if needle.encode() in memory]
        assert not found, f"{name} holds {found}"
        # The search is sound: a worker's own variable is found the same way (and never in the template).
        assert ((own_secret * 3).encode() in memory) == (name == "the later worker"), name


def test_one_tenant_shares_the_hash_secret_and_layout_but_not_random_state(forked_kernel):
    first, second = forked_kernel("tenant-a-1"), forked_kernel("tenant-a-2")
    other = forked_kernel("tenant-b", tenant=cellblock_zygote.other_tenant("other"))
    assert first.template == second.template != other.template
    a, b, c = (kernel.attack(PROBE).result() for kernel in (first, second, other))
    for key in ("random", "numpy_state", "secrets"):
        assert a[key] != b[key] and a[key] != c[key] and b[key] != c[key], f"{key} shared: {a[key]!r}"
    # Within one tenant (one template generation), by design: the same hash secret and layout.
    assert a["hash_str"] == b["hash_str"] and a["layout"] == b["layout"]
    # Across tenants: neither.
    assert c["hash_str"] != a["hash_str"] and c["layout"] != a["layout"]


def test_a_killed_kernel_leaves_no_forked_worker_behind(forked_kernel):
    kernel = forked_kernel("killed")
    worker, template = kernel.worker_pid(), kernel.template
    # Busy in a cell that ignores its channel: only the template's SIGKILL on the closed connection ends it
    # (an idle worker would also leave on the channel's end of file).
    msg_id = kernel.client.execute("import time\nprint('busy', flush=True)\ntime.sleep(600)")
    deadline = time.monotonic() + 90
    while True:
        assert time.monotonic() < deadline, "the cell never printed"
        try:
            message = kernel.client.get_iopub_msg(timeout=1)
        except queue.Empty:
            continue
        if message["parent_header"].get("msg_id") == msg_id and message["msg_type"] == "stream" \
                and "busy" in message["content"]["text"]:
            break
    os.kill(kernel.pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while Path(f"/proc/{worker}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Path(f"/proc/{worker}").exists(), "the forked worker outlived its kernel"
    # The template is untouched and still serves the tenant.
    assert cellblock_zygote.template_pid(kernel.policy, kernel.tenant) == template
