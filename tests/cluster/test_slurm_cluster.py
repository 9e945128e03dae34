"""The Slurm test cluster itself: both nodes take jobs, scancel ends one, and stopping leaves nothing behind."""
import subprocess
import time

from slurm_cluster import SlurmCluster


def sbatch(cluster, *arguments, script="#!/bin/sh\nsleep 300\n"):
    result = subprocess.run(["sbatch", "--parsable", "--output=/dev/null", *arguments], input=script, env=cluster.environment,
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().split(";")[0]


def wait_job_state(cluster, job_id, wanted, timeout=30):
    deadline = time.monotonic() + timeout
    fields = {}
    while time.monotonic() < deadline:
        fields = cluster.scontrol_job(job_id)
        if fields.get("JobState") in wanted:
            return fields
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} never reached {wanted}: {fields}")


def test_both_nodes_run_jobs_and_scancel_ends_one(slurm_cluster):
    assert slurm_cluster.node_states() == {"cbnode1": "idle", "cbnode2": "idle"}
    jobs = {node: sbatch(slurm_cluster, "--job-name", f"probe-{node}", "-w", node) for node in slurm_cluster.nodes}
    for node, job_id in jobs.items():
        fields = wait_job_state(slurm_cluster, job_id, {"RUNNING"})
        assert fields["NodeList"] == node
    names = slurm_cluster.squeue("--name", "probe-cbnode1", "-o", "%i").split()
    assert names == [jobs["cbnode1"]]
    for job_id in jobs.values():
        subprocess.run(["scancel", job_id], env=slurm_cluster.environment, check=True, timeout=20)
    for job_id in jobs.values():
        assert wait_job_state(slurm_cluster, job_id, {"CANCELLED"})["JobState"] == "CANCELLED"


def test_a_job_larger_than_any_node_is_refused_with_slurms_reason(slurm_cluster):
    result = subprocess.run(["sbatch", "--parsable", "--output=/dev/null", "--mem", "64G"], input="#!/bin/sh\ntrue\n",
                            env=slurm_cluster.environment, capture_output=True, text=True, timeout=30)
    assert result.returncode != 0
    assert "Requested node configuration is not available" in result.stderr


def test_stop_leaves_no_daemon_job_or_step_behind():
    cluster = SlurmCluster().start()
    try:
        job_id = sbatch(cluster, "--job-name", "left-running")
        wait_job_state(cluster, job_id, {"RUNNING"})
        assert cluster.leftover_processes(), "the running cluster and its job must be visible to the check"
    finally:
        cluster.stop()
    assert cluster.leftover_processes() == []
    assert not cluster.directory.exists()
