import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from slurm_cluster import SlurmCluster  # noqa: E402


@pytest.fixture(scope="module")
def slurm_cluster():
    """A two-node Slurm cluster for the module; every daemon and job is gone afterwards (checked)."""
    cluster = SlurmCluster()
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()
        leftovers = cluster.leftover_processes()
        assert not leftovers, f"processes left after the Slurm cluster stopped: {leftovers}"
