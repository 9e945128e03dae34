"""jupyter_kernel_test's checks against cellblock-kernel running as a Slurm job in its reported-launch mode
(`--report-to`): this test is the launch registry (pyzmq, CurveZMQ server), receives the kernel's report with the
one-time token, and connects jupyter_client as a CurveZMQ client with the kernel's public key."""
import json
import os
import subprocess
import sys
import unittest
from pathlib import Path

import jupyter_kernel_test as jkt
import zmq
from jupyter_client import BlockingKernelClient

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "kernel"))
from slurm_cluster import SlurmCluster  # noqa: E402
from test_kernel_conformance import CellblockKernelConformance  # noqa: E402

PREFIX = Path(os.environ.get("CELLBLOCK_PREFIX", "/usr/local"))


class CurveKernelClient(BlockingKernelClient):
    """jupyter_client with CurveZMQ on every socket (it has no such option of its own)."""

    curve_server_key = b""

    def _create_connected_socket(self, channel, identity=None):
        socket = self.context.socket(jupyter_client_socket_type(channel))
        socket.linger = 1000
        public, secret = zmq.curve_keypair()
        socket.curve_serverkey = self.curve_server_key
        socket.curve_publickey = public
        socket.curve_secretkey = secret
        if identity:
            socket.identity = identity
        socket.connect(self._make_url(channel))
        return socket


def jupyter_client_socket_type(channel):
    from jupyter_client.connect import channel_socket_types
    return channel_socket_types[channel]


class SlurmJobHandle:
    """What KernelTests.tearDownClass calls `km`: ends the kernel's job."""

    def __init__(self, cluster, job_id):
        self.cluster, self.job_id = cluster, job_id

    def shutdown_kernel(self):
        subprocess.run(["scancel", self.job_id], env=self.cluster.environment, timeout=20)


def launch_reporting_kernel(cluster):
    kernel = PREFIX / "bin" / "cellblock-kernel"
    config = PREFIX / "share" / "cellblock" / "kernel-config.json"
    assert kernel.exists() and config.exists(), f"cellblock-kernel is not installed under {PREFIX}"
    context = zmq.Context.instance()
    registry = context.socket(zmq.ROUTER)
    registry_public, registry_secret = zmq.curve_keypair()
    registry.curve_server = True
    registry.curve_secretkey = registry_secret
    registry.linger = 0
    port = registry.bind_to_random_port("tcp://127.0.0.1")
    token = os.urandom(16).hex()
    script = ("#!/bin/sh\n"
              f"export CELLBLOCK_REPORT_TOKEN={token}\n"
              f"exec {kernel} --config {config} --report-to tcp://127.0.0.1:{port} "
              f"--report-server-key '{registry_public.decode()}'\n")
    submitted = subprocess.run(["sbatch", "--parsable", "--output=/dev/null", "--chdir=/tmp",
                                "--job-name=cellblock-conformance"], input=script, env=cluster.environment,
                               capture_output=True, text=True, timeout=30, check=True)
    job_id = submitted.stdout.strip().split(";")[0]
    try:
        assert registry.poll(60000), "the kernel did not report within 60 s"
        identity, payload = registry.recv_multipart()
        report = json.loads(payload)
        assert report["token"] == token
        registry.send_multipart([identity, json.dumps({"status": "ok"}).encode()])
    except BaseException:
        subprocess.run(["scancel", job_id], env=cluster.environment, timeout=20)
        raise
    finally:
        registry.close()
    return job_id, report


class SlurmHostedKernelConformance(CellblockKernelConformance):
    cluster = None

    @classmethod
    def setUpClass(cls):
        cls.cluster = SlurmCluster().start()
        try:
            job_id, report = launch_reporting_kernel(cls.cluster)
            client = CurveKernelClient()
            client.curve_server_key = report["curve_public_key"].encode()
            client.load_connection_info({
                "transport": "tcp", "ip": report["ip"], "shell_port": report["shell_port"],
                "iopub_port": report["iopub_port"], "stdin_port": report["stdin_port"],
                "control_port": report["control_port"], "hb_port": report["hb_port"], "key": report["key"],
                "signature_scheme": report["signature_scheme"]})
            client.start_channels(hb=False)
            client.wait_for_ready(timeout=60)
            cls.km, cls.kc = SlurmJobHandle(cls.cluster, job_id), client
        except BaseException:
            cls.cluster.stop()
            raise

    @classmethod
    def tearDownClass(cls):
        try:
            super().tearDownClass()
        finally:
            cls.cluster.stop()
            leftovers = cls.cluster.leftover_processes()
            assert not leftovers, f"processes left after the Slurm cluster stopped: {leftovers}"


del CellblockKernelConformance  # collected here only through the Slurm-hosted subclass

if __name__ == "__main__":
    unittest.main()
