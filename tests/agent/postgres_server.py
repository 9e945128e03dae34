"""A PostgreSQL server of a test's own (initdb/pg_ctl in a temporary directory, stopped by `stop`), for the tests of
gateways sharing a store: tests/agent/test_shared_store.py and the ones that import it, and
tests/cluster/test_slurm_kernels.py. A missing PostgreSQL is a failure, never a skip."""
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def postgres_bin() -> Path:
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
    if not versions:
        pytest.fail("PostgreSQL is not installed (no /usr/lib/postgresql/*/bin/initdb): run "
                    "share/scripts/install-deps.sh --with-test-tools (package postgresql)")
    return versions[-1].parent


class Postgres:
    """A server of the test's own in a temporary directory, run as the postgres user when the test runs as root."""

    def __init__(self):
        self.bin = postgres_bin()
        self.directory = Path(tempfile.mkdtemp(prefix="cb-pg-"))
        self.as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if os.geteuid() == 0:
            shutil.chown(self.directory, "postgres", "postgres")
        self.port = free_port()
        data = self.directory / "data"
        self._run([str(self.bin / "initdb"), "--auth=trust", "-U", "cellblock", "-D", str(data)])
        self._run([str(self.bin / "pg_ctl"), "-D", str(data), "-l", str(self.directory / "server.log"), "-o",
                   f"-p {self.port} -k {self.directory} -c listen_addresses=127.0.0.1", "-w", "start"])
        self.url = f"postgresql://cellblock@127.0.0.1:{self.port}/postgres"
        # The secret every gateway on this store seals kernels' keys with (gateway/README.md): one per store.
        self.key_file = Path(tempfile.mkdtemp(prefix="cb-pg-key-")) / "store-key"
        self.key_file.write_text(secrets.token_hex(32) + "\n")
        self.key_file.chmod(0o600)

    def _run(self, argv):
        done = subprocess.run(self.as_user + argv, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"{argv[0]} failed: {done.stdout}\n{done.stderr}"

    def sql(self, statement) -> str:
        """Runs `statement`; answers its rows unaligned, without headers."""
        done = subprocess.run([str(self.bin / "psql"), self.url, "-v", "ON_ERROR_STOP=1", "-At", "-c", statement],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, f"psql failed: {done.stdout}\n{done.stderr}"
        return done.stdout.strip()

    def stop(self):
        subprocess.run(self.as_user + [str(self.bin / "pg_ctl"), "-D", str(self.directory / "data"), "-m",
                                       "immediate", "-w", "stop"], capture_output=True, timeout=120)
        shutil.rmtree(self.directory, ignore_errors=True)
        shutil.rmtree(self.key_file.parent, ignore_errors=True)
