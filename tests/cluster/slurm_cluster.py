"""A real Slurm cluster for tests: slurmctld and two slurmd (one per node name, each on its own port) started
in a temporary directory with their own slurm.conf, and stopped with everything they started.

Debian's slurm-wlm 22.05 is built with multiple-slurmd support (`slurmd -N NAME`), so one host carries two nodes.
Authentication is `auth/none` + `cred/none` (no munged: the daemons listen on 127.0.0.1 only and the cluster
lives as long as one test module). Clients find it through SLURM_CONF (`SlurmCluster.environment`).
A missing Slurm binary is a failure (install it with share/scripts/install-deps.sh --with-test-tools), never a skip.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "gateway"))
from host_processes import with_cmdline  # noqa: E402

SLURM_BINARIES = ("slurmctld", "slurmd", "sbatch", "squeue", "scancel", "scontrol", "sinfo")
NODE_NAMES = ("cbnode1", "cbnode2")
# Declared per node: small enough to be real on any test machine (slurmd drains a node that has less than
# declared), so a job asking for more is one Slurm cannot place.
NODE_MEMORY_MB = 1024


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def require_binaries() -> dict[str, str]:
    found = {name: shutil.which(name) for name in SLURM_BINARIES}
    missing = [name for name, path in found.items() if path is None]
    assert not missing, (f"Slurm binaries missing: {missing}; run share/scripts/install-deps.sh "
                         "--with-test-tools (packages slurmctld slurmd slurm-client)")
    return found


def processes_mentioning(text: str) -> list[tuple[int, str]]:
    """(pid, command line) of every live process (but this one) whose command line contains `text`."""
    return [(p.pid, p.cmdline) for p in with_cmdline(text) if p.pid != os.getpid()]


class SlurmCluster:
    def __init__(self, nodes: tuple[str, ...] = NODE_NAMES):
        self.binaries = require_binaries()
        self.nodes = nodes
        self.directory = Path(tempfile.mkdtemp(prefix="cellblock-slurm-"))
        self.config_file = self.directory / "slurm.conf"
        self.controller_port = free_port()
        self.node_ports = {name: free_port() for name in nodes}
        self.partition = "cellblock"
        self.daemons: list[subprocess.Popen] = []

    @property
    def environment(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.config_file)}

    def write_config(self) -> None:
        d = self.directory
        for sub in ("state", "spool", "log"):
            (d / sub).mkdir()
        lines = [
            "ClusterName=cellblock",
            f"SlurmctldHost={socket.gethostname()}(127.0.0.1)",
            f"SlurmctldPort={self.controller_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/none",
            "CredType=cred/none",
            "ProctrackType=proctrack/pgid",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core_Memory",
            "SchedulerType=sched/backfill",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "ReturnToService=2",
            "MinJobAge=300",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=30",
            "KillWait=5",
            f"StateSaveLocation={d / 'state'}",
            f"SlurmdSpoolDir={d / 'spool'}/%n",
            f"SlurmctldPidFile={d / 'slurmctld.pid'}",
            f"SlurmdPidFile={d / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={d / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={d / 'log' / 'slurmd-%n.log'}",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
        ]
        for name, port in self.node_ports.items():
            lines.append(f"NodeName={name} NodeHostname={socket.gethostname()} NodeAddr=127.0.0.1 Port={port} "
                         f"CPUs=1 RealMemory={NODE_MEMORY_MB} State=UNKNOWN")
        lines.append(f"PartitionName={self.partition} Nodes={','.join(self.nodes)} Default=YES "
                     "MaxTime=INFINITE State=UP")
        self.config_file.write_text("\n".join(lines) + "\n")
        for name in self.nodes:
            (d / "spool" / name).mkdir()

    def start(self, timeout: float = 60) -> "SlurmCluster":
        self.write_config()
        env = self.environment
        log = open(self.directory / "log" / "daemons.out", "ab")
        try:
            # -D: stay in the foreground, so the daemon is our child and stops with us; -i: ignore old state.
            self.daemons.append(subprocess.Popen([self.binaries["slurmctld"], "-D", "-i"], env=env,
                                                 stdout=log, stderr=log, start_new_session=True))
            for name in self.nodes:
                self.daemons.append(subprocess.Popen([self.binaries["slurmd"], "-D", "-N", name], env=env,
                                                     stdout=log, stderr=log, start_new_session=True))
        finally:
            log.close()
        try:
            self.wait_idle(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def node_states(self) -> dict[str, str]:
        result = subprocess.run([self.binaries["sinfo"], "-h", "-N", "-o", "%N %t"], env=self.environment,
                                capture_output=True, text=True, timeout=20)
        states = {}
        for line in result.stdout.splitlines():
            parts = line.split()
            if len(parts) == 2:
                states[parts[0]] = parts[1]
        return states

    def wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            for daemon in self.daemons:
                assert daemon.poll() is None, f"a Slurm daemon exited during start:\n{self.logs()}"
            states = self.node_states()
            if set(states) == set(self.nodes) and all(state == "idle" for state in states.values()):
                return
            time.sleep(0.3)
        raise AssertionError(f"Slurm nodes not idle after {timeout} s: {states}\n{self.logs()}")

    def squeue(self, *arguments: str) -> str:
        return subprocess.run([self.binaries["squeue"], "-h", *arguments], env=self.environment,
                              capture_output=True, text=True, timeout=20, check=True).stdout

    def scontrol_job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job -o ID` as a dict (JobState, Reason, BatchHost, ...)."""
        output = subprocess.run([self.binaries["scontrol"], "show", "job", "-o", job_id],
                                env=self.environment, capture_output=True, text=True, timeout=20).stdout
        fields = {}
        for token in output.split():
            if "=" in token:
                key, _, value = token.partition("=")
                fields.setdefault(key, value)
        return fields

    def logs(self) -> str:
        text = []
        for path in sorted((self.directory / "log").glob("*")):
            content = path.read_text(errors="replace").splitlines()[-30:]
            text.append(f"--- {path.name}\n" + "\n".join(content))
        return "\n".join(text)

    def leftover_processes(self) -> list[tuple[int, str]]:
        """Processes still running that belong to this cluster (daemons, slurmstepd, jobs)."""
        leftovers = [(d.pid, " ".join(map(str, d.args))) for d in self.daemons if d.poll() is None]
        leftovers += processes_mentioning(str(self.directory))
        leftovers += [(pid, command) for pid, command in processes_mentioning("slurmstepd")
                      if self._stepd_is_ours(pid)]
        return leftovers

    def _stepd_is_ours(self, pid: int) -> bool:
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            return False
        return str(self.config_file).encode() in environ

    def stop(self) -> None:
        if self.daemons and self.daemons[0].poll() is None:
            subprocess.run([self.binaries["scancel"], "--full", f"--partition={self.partition}"],
                           env=self.environment, capture_output=True, timeout=20)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and self.squeue("-t", "all", "-o", "%i %T").strip():
                if "RUNNING" not in self.squeue("-o", "%T") and "COMPLETING" not in self.squeue("-o", "%T"):
                    break
                time.sleep(0.2)
        for daemon in reversed(self.daemons):  # nodes first, then the controller
            if daemon.poll() is None:
                daemon.send_signal(signal.SIGTERM)
        for daemon in self.daemons:
            try:
                daemon.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(daemon.pid, signal.SIGKILL)
                daemon.wait(timeout=10)
        deadline = time.monotonic() + 10
        while self.leftover_processes() and time.monotonic() < deadline:
            time.sleep(0.2)
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> "SlurmCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
