"""The host's view of processes, read from /proc: process trees, and whether a process seen earlier is still running.

A process is identified by its pid and its start time (field 22 of /proc/PID/stat), so a pid that the kernel reused
for an unrelated process does not count as "still running". Other test runs share this machine: checks are always
about processes this test saw itself (descendants of a process it started), never about every process on the host.
"""
import os
import time
from dataclasses import dataclass

import cellblock_zygote


@dataclass(frozen=True)
class HostProcess:
    pid: int
    ppid: int
    start_time: int  # clock ticks since boot
    cmdline: str

    @property
    def is_worker(self) -> bool:
        """The confined Python worker (cellblock_worker.py, run by python inside the sandbox), not a zygote template
        (the same program: kernel/README.md "Worker zygote"). Not told apart by its parent: a forked worker whose
        template ended (retired, or killed after its service's stop grace) is the template service's child then,
        as the template is (the service is their subreaper), and still its kernel's worker."""
        return "cellblock_worker" in self.cmdline and not self.is_template

    @property
    def is_template(self) -> bool:
        """A tenant's worker zygote template: the worker program in a cgroup its template service starts it in
        (template-zygote-<tenant>.<hex>, one a generation: kernel/src/launch/template_service.cpp), or one that holds
        a listening unix socket (a template without a cgroup of its own serves launches on one; a worker listens on
        none). A fork of a template is in the template's cgroup, with its fds, only until it confines itself."""
        if "cellblock_worker" not in self.cmdline:
            return False
        try:
            with open(f"/proc/{self.pid}/cgroup") as cgroup_file:
                cgroups = cgroup_file.read()
        except OSError:
            return False
        paths = (line.split(":", 2)[-1] for line in cgroups.splitlines())
        if any(part.startswith("template-zygote-") for path in paths for part in path.split("/")):
            return True
        return bool(_socket_inodes(self.pid) & cellblock_zygote._listening_unix_inodes())

    def __str__(self):
        return f"{self.pid} ({self.cmdline[:120]})"


def _socket_inodes(pid: int) -> set:
    """The sockets a process holds open ("socket:[INODE]")."""
    found = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return found
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            found.add(target)
    return found


def _read(pid: int):
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat_file:
            stat = stat_file.read().decode("utf-8", "replace")
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline_file:
            cmdline = cmdline_file.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    # After the command name: state, ppid, ... starttime is field 22 overall, index 19 here.
    return fields[0], HostProcess(pid, int(fields[1]), int(fields[19]), cmdline)


def process_table() -> dict:
    """Every live (non-zombie) process: pid -> HostProcess."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        read = _read(int(entry))
        if read and read[0] != "Z":
            table[int(entry)] = read[1]
    return table


def descendants(root_pid: int, include_root: bool = False) -> list:
    """The processes below root_pid (children, grandchildren, ...)."""
    table = process_table()
    children = {}
    for process in table.values():
        children.setdefault(process.ppid, []).append(process)
    found, todo = [], [root_pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child.pid)
    if include_root and root_pid in table:
        found.insert(0, table[root_pid])
    return found


def with_cmdline(fragment: str) -> list:
    """Live processes whose command line contains `fragment` (e.g. a directory only this test uses)."""
    return [p for p in process_table().values() if fragment in p.cmdline]


def below_kernel(kernel_pid: int) -> list:
    """Everything a kernel runs: the processes below it and, when its worker is a fork of a zygote template (the
    template's child, not the kernel's), that worker, which the kernel holds by a pidfd, with what is below it."""
    found = descendants(kernel_pid)
    for pid in cellblock_zygote.pidfd_targets(kernel_pid):
        read = _read(pid)
        if read and read[0] != "Z" and all(p.pid != pid for p in found):
            found.append(read[1])
            found.extend(descendants(pid))
    return found


def kernel_tree(runtime_dir, kernel_id: str = "") -> list:
    """A gateway's kernel processes (their command line names a connection file in its runtime directory; all of
    them when `kernel_id` is empty) with everything they run (below_kernel): the confined worker and the sandbox's
    processes."""
    found = []
    for kernel in with_cmdline(f"{runtime_dir}/kernel-{kernel_id}"):
        found.append(kernel)
        found.extend(below_kernel(kernel.pid))
    return found


def is_running(process: HostProcess) -> bool:
    """The same process (pid and start time) still exists and is not a zombie."""
    read = _read(process.pid)
    return bool(read) and read[0] != "Z" and read[1].start_time == process.start_time


def wait_until_gone(processes, timeout: float = 30) -> list:
    """Waits (generously) for every process to end; returns those still running at the deadline."""
    deadline = time.monotonic() + timeout
    left = [p for p in processes if is_running(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [p for p in left if is_running(p)]
    return left


def wait_for(predicate, timeout: float = 60, interval: float = 0.1, what: str = "condition"):
    """Polls predicate() until it returns something truthy; fails the test with `what` otherwise."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)
