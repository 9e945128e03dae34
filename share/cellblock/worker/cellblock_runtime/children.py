"""Reaping zombies: the worker is pid 1 of its pid namespace, so orphaned grandchildren become its children.

A plain waitpid(-1) loop would also reap processes that user code still owns through a
subprocess.Popen (or multiprocessing.Process) object, which then reports a wrong exit status. So
Popen objects are tracked, and only zombies nobody owns are reaped.
"""

import functools
import os
import subprocess
import sys
import weakref


class ZombieReaper:
    def __init__(self):
        self._popens = weakref.WeakSet()

    def track_popen_objects(self):
        """Remember every subprocess.Popen the user creates (asyncio subprocesses use Popen too)."""
        original_init = subprocess.Popen.__init__
        popens = self._popens

        @functools.wraps(original_init)
        def tracking_init(popen, *args, **kwargs):
            original_init(popen, *args, **kwargs)
            popens.add(popen)

        subprocess.Popen.__init__ = tracking_init

    def _owned_pids(self):
        owned = {popen.pid for popen in list(self._popens) if popen.returncode is None}
        process_module = sys.modules.get("multiprocessing.process")
        if process_module is not None:
            for process in list(getattr(process_module, "_children", ())):
                pid = getattr(getattr(process, "_popen", None), "pid", None)
                if pid is not None:
                    owned.add(pid)
        return owned

    def reap(self):
        """Reap every exited child that no Popen/Process object owns. Returns the reaped pids."""
        reaped = []
        try:
            # Cheap check first: one syscall in the usual case of no exited child.
            if os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
                return reaped
        except ChildProcessError:
            return reaped
        owned = self._owned_pids()
        for pid in self._exited_children():
            if pid in owned:
                continue
            try:
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    reaped.append(pid)
            except ChildProcessError:
                pass
        return reaped

    @staticmethod
    def _exited_children():
        """Zombie children of this process, from /proc; without /proc, the first exited child waitid sees."""
        me = os.getpid()
        try:
            entries = os.listdir("/proc")
        except OSError:
            entries = None
        if entries is None:
            found = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            return [found.si_pid] if found is not None else []
        zombies = []
        for entry in entries:
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat", "rb") as stat_file:
                    stat = stat_file.read()
            except OSError:
                continue
            # "pid (comm) state ppid ...": comm may contain spaces and parentheses, so split after the last ')'.
            fields = stat[stat.rfind(b")") + 2:].split()
            if len(fields) >= 2 and fields[0] == b"Z" and int(fields[1]) == me:
                zombies.append(int(entry))
        return zombies
