"""Kernels as Slurm jobs through a gateway with `--provisioner slurm`, on the real two-node test cluster.

Every kernel is one batch job named cellblock-<kernel_id>; the kernel binds ephemeral TCP ports on its node and
reports them to the gateway's launch registry over CurveZMQ with a one-time token (gateway/README.md)."""
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "gateway"))
from gateway_harness import Gateway, outputs  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "agent"))
from postgres_server import Postgres  # noqa: E402

JOB_TIMEOUT = 60


def jobs_named(cluster, kernel_id):
    """{job id: state} of the jobs named after the kernel (ended ones included while Slurm remembers them)."""
    jobs = {}
    for line in cluster.squeue("-t", "all", "--name", f"cellblock-{kernel_id}", "-o", "%i %T").splitlines():
        job_id, state = line.split()
        jobs[job_id] = state
    return jobs


def live_jobs(cluster, kernel_id):
    return {job: state for job, state in jobs_named(cluster, kernel_id).items()
            if state in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING")}


def wait_for(condition, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def slurm_gateway(slurm_cluster, request):
    marker = request.node.get_closest_marker("gateway_args")
    arguments = list(marker.args) if marker else []
    gateway = Gateway("--provisioner", "slurm", *arguments, warm_pool=0, env=slurm_cluster.environment)
    yield gateway
    gateway.stop()


def test_a_kernel_is_a_job_that_executes_keeps_state_interrupts_restarts_and_is_deleted(slurm_cluster,
                                                                                         slurm_gateway):
    model = slurm_gateway.start_kernel(name="python3")
    kernel_id = model["id"]
    jobs = live_jobs(slurm_cluster, kernel_id)
    assert list(jobs.values()) == ["RUNNING"], jobs
    first_job = next(iter(jobs))
    assert model["provisioner"]["name"] == "slurm" and model["provisioner"]["job_id"] == first_job

    socket = slurm_gateway.connect(kernel_id)
    try:
        assert outputs(socket.execute("import socket\nx = 41\nprint('ran')")) == "ran\n"
        assert outputs(socket.execute("x + 1")) == "42"

        # Interrupt: a sleeping cell ends with KeyboardInterrupt.
        msg_id = socket.send("execute_request", {"code": "import time\nprint('sleeping', flush=True)\ntime.sleep(120)",
                                                 "silent": False})
        socket.replies_to(msg_id, lambda m: m["msg_type"] == "stream" and "sleeping" in m["content"]["text"])
        started = time.monotonic()
        assert slurm_gateway.post(f"/api/kernels/{kernel_id}/interrupt").status_code == 204
        reply = socket.replies_to(msg_id, lambda m: m["msg_type"] == "execute_reply", timeout=30)[-1]
        assert reply["content"]["status"] == "error" and reply["content"]["ename"] == "KeyboardInterrupt"
        assert time.monotonic() - started < 30
        assert outputs(socket.execute("x")) == "41", "the interrupt must not lose the kernel's state"

        # Restart: a new job (new ports, key), the same kernel id, and this WebSocket keeps working.
        response = slurm_gateway.post(f"/api/kernels/{kernel_id}/restart")
        assert response.status_code == 200, response.text
        assert jobs_named(slurm_cluster, kernel_id)[first_job] != "RUNNING"
        second = live_jobs(slurm_cluster, kernel_id)
        assert len(second) == 1 and first_job not in second, second
        messages = socket.execute("x", timeout=60)
        assert any(m["msg_type"] == "error" and m["content"]["ename"] == "NameError" for m in messages)
        assert outputs(socket.execute("6 * 7")) == "42"
    finally:
        socket.close()

    assert slurm_gateway.delete(f"/api/kernels/{kernel_id}").status_code == 204
    wait_for(lambda: not live_jobs(slurm_cluster, kernel_id), 30, "the kernel's job to leave squeue")
    assert slurm_gateway.get(f"/api/kernels/{kernel_id}").status_code == 404


def test_scancel_is_reported_to_clients_as_a_dead_kernel_with_the_cause(slurm_cluster, slurm_gateway):
    kernel_id = slurm_gateway.start_kernel(name="python3")["id"]
    (job_id,) = live_jobs(slurm_cluster, kernel_id)
    socket = slurm_gateway.connect(kernel_id)
    try:
        assert outputs(socket.execute("1 + 1")) == "2"
        subprocess.run(["scancel", job_id], env=slurm_cluster.environment, check=True, timeout=20)
        notes, dead = [], False
        deadline = time.monotonic() + 30
        while not dead and time.monotonic() < deadline:
            message = socket.recv(timeout=deadline - time.monotonic())
            if message["msg_type"] == "stream":
                notes.append(message["content"]["text"])
            dead = message["msg_type"] == "status" and message["content"]["execution_state"] == "dead"
        assert dead, notes
        assert any("CANCELLED" in note and job_id in note for note in notes), notes
    finally:
        socket.close()
    model = slurm_gateway.get(f"/api/kernels/{kernel_id}").json()
    assert model["execution_state"] == "dead"
    # Dead is final (gateway/include/cellblock/gateway/kernels/kernel_lifecycle.hpp: an exit in it is ignored, only a
    # client's restart leaves it), and an automatic restart would have said "restarting", not "dead": the gateway's
    # decision is made, and a job it submitted is listed by squeue from sbatch's answer on.
    assert not live_jobs(slurm_cluster, kernel_id), "a cancelled kernel must not be resubmitted"


def test_a_job_slurm_cannot_place_fails_with_slurms_reason(slurm_cluster, tmp_path):
    config = tmp_path / "gateway.json"
    config.write_text(json.dumps({"slurm_mem_mb": 64 * 1024}))
    gateway = Gateway("--provisioner", "slurm", "--config", str(config), warm_pool=0, env=slurm_cluster.environment)
    try:
        started = time.monotonic()
        response = gateway.post("/api/kernels", json={"name": "python3"})
        assert response.status_code == 500, response.text
        assert "Requested node configuration is not available" in response.json()["message"]
        assert time.monotonic() - started < 30
    finally:
        gateway.stop()


def test_a_pending_job_fails_after_the_launch_timeout_with_slurms_reason(slurm_cluster, tmp_path):
    # Both one-CPU nodes busy: the kernel's job stays pending (Reason=Resources).
    blockers = []
    for node in slurm_cluster.nodes:
        result = subprocess.run(["sbatch", "--parsable", "--output=/dev/null", "-w", node, "--job-name", "blocker"],
                                input="#!/bin/sh\nsleep 300\n", env=slurm_cluster.environment,
                                capture_output=True, text=True, timeout=30, check=True)
        blockers.append(result.stdout.strip())
    config = tmp_path / "gateway.json"
    config.write_text(json.dumps({"kernel_launch_timeout": 8}))
    gateway = Gateway("--provisioner", "slurm", "--config", str(config), warm_pool=0, env=slurm_cluster.environment)
    try:
        wait_for(lambda: slurm_cluster.squeue("-t", "RUNNING", "--name", "blocker", "-o", "%i").split() and
                 len(slurm_cluster.squeue("-t", "RUNNING", "--name", "blocker", "-o", "%i").split()) == 2,
                 30, "the blockers to run")
        answer = {}
        thread = threading.Thread(target=lambda: answer.update(
            response=gateway.post("/api/kernels", json={"name": "python3"})))
        started = time.monotonic()
        thread.start()
        pending = wait_for(lambda: [line for line in slurm_cluster.squeue("-o", "%j %T").splitlines()
                                    if line.startswith("cellblock-") and line.endswith("PENDING")],
                           20, "the kernel's job to be pending")
        assert pending
        thread.join(60)
        assert "response" in answer, "no answer from the gateway:\n" + "".join(gateway.output)
        response = answer["response"]
        elapsed = time.monotonic() - started
        assert response.status_code == 500, response.text
        message = response.json()["message"]
        assert "within 8 s" in message and "pending" in message and "Resources" in message, message
        assert 7 <= elapsed < 40, elapsed
        wait_for(lambda: not [line for line in slurm_cluster.squeue("-o", "%j").splitlines()
                              if line.startswith("cellblock-")], 20, "the pending job to be cancelled")
    finally:
        gateway.stop()
        subprocess.run(["scancel", *blockers], env=slurm_cluster.environment, timeout=20)
        wait_for(lambda: not slurm_cluster.squeue("--name", "blocker", "-o", "%i").strip(), 30, "blockers to end")


def test_the_warm_pool_holds_slurm_jobs(slurm_cluster):
    gateway = Gateway("--provisioner", "slurm", "--log-level", "info", warm_pool=1, env=slurm_cluster.environment)
    try:
        def pool_jobs():
            return [line.split()[0] for line in slurm_cluster.squeue("-t", "RUNNING", "-o", "%j").splitlines()
                    if line.startswith("cellblock-")]
        (pooled_name,) = wait_for(pool_jobs, 60, "a warm-pool job")
        pooled_id = pooled_name.removeprefix("cellblock-")
        wait_for(lambda: any('"kernel_ready"' in line and pooled_id in line for line in list(gateway.output)), 60,
                 "the pooled kernel to be ready")
        started = time.monotonic()
        model = gateway.start_kernel(name="python3")
        took = time.monotonic() - started
        assert f"cellblock-{model['id']}" == pooled_name, "the request must get the pooled job's kernel"
        socket = gateway.connect(model["id"])
        try:
            assert outputs(socket.execute("2 + 3")) == "5"
        finally:
            socket.close()
        assert took < 5, took
        wait_for(lambda: len(pool_jobs()) == 2, 60, "the pool to submit its replacement job")
    finally:
        gateway.stop()
    wait_for(lambda: not [line for line in slurm_cluster.squeue("-o", "%j").splitlines()
                          if line.startswith("cellblock-")], 30, "the gateway's jobs to be cancelled at exit")


def kernel_process_of(kernel_id):
    """The pid of the cellblock-kernel process serving `kernel_id` (found by its environment)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if b"cellblock-kernel" in command.split(b"\0")[0] and f"KERNEL_ID={kernel_id}".encode() in environ.split(b"\0"):
            return int(entry.name)
    return None


def listening_ports(pid):
    output = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    ports = []
    for line in output.splitlines():
        if f"pid={pid}," in line:
            ports.append(int(line.split()[3].rsplit(":", 1)[1]))
    return ports


def test_a_plain_zmq_client_on_the_kernels_ports_reads_nothing(slurm_cluster, slurm_gateway):
    """The kernel's TCP ports serve CurveZMQ only: a client without the kernel's public key, subscribed to every
    port while the kernel prints, receives nothing (host-side check of what a wire listener could get)."""
    import zmq
    from zmq.utils.monitor import recv_monitor_message

    kernel_id = slurm_gateway.start_kernel(name="python3")["id"]
    pid = wait_for(lambda: kernel_process_of(kernel_id), 10, "the kernel process")
    ports = listening_ports(pid)
    assert len(ports) == 5, ports
    context = zmq.Context()
    subscribers, monitors = [], []
    try:
        for port in ports:
            subscriber = context.socket(zmq.SUB)
            subscriber.setsockopt(zmq.LINGER, 0)
            subscriber.setsockopt(zmq.SUBSCRIBE, b"")
            monitors.append(subscriber.get_monitor_socket())
            subscriber.connect(f"tcp://127.0.0.1:{port}")
            subscribers.append(subscriber)
        # Each subscriber connected to its port and the kernel's ZMTP layer answered it, refusing the handshake
        # (a mechanism mismatch): they are there while the kernel prints, not after a guess at how long
        # connecting takes, and the kernel has seen and turned them away.
        refusals = {zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
                    zmq.EVENT_HANDSHAKE_FAILED_AUTH}
        for port, monitor in zip(ports, monitors):
            seen = []
            deadline = time.monotonic() + 30
            while not (zmq.EVENT_CONNECTED in seen and refusals & set(seen)):
                assert time.monotonic() < deadline, f"port {port}: monitor events {seen}"
                if monitor.poll(500):
                    seen.append(recv_monitor_message(monitor)["event"])
        socket = slurm_gateway.connect(kernel_id)
        try:
            text = outputs(socket.execute("for i in range(20):\n    print('secret-output', i)"))
            assert "secret-output 19" in text, "the gateway itself must get the output"
        finally:
            socket.close()
        poller = zmq.Poller()
        for subscriber in subscribers:
            poller.register(subscriber, zmq.POLLIN)
        assert dict(poller.poll(2000)) == {}, "a client without the kernel's Curve key received messages"
    finally:
        for subscriber in subscribers:
            subscriber.disable_monitor()
            subscriber.close()
        for monitor in monitors:
            monitor.close()
        context.term()


def test_a_slurm_kernel_is_readopted_by_the_next_gateway_with_its_state(slurm_cluster, tmp_path):
    """SIGTERM leaves the job running; the next gateway on the same state directory finds it by the job id in
    its store, reconnects over CurveZMQ and the kernel's variables are still there."""
    state_dir = tmp_path / "state"
    first = Gateway("--provisioner", "slurm", warm_pool=0, env=slurm_cluster.environment, state_dir=state_dir,
                    keep_kernels=True)
    try:
        kernel_id = first.start_kernel(name="python3")["id"]
        (job_id,) = live_jobs(slurm_cluster, kernel_id)
        socket = first.connect(kernel_id)
        try:
            socket.execute("kept = 'across gateways'")
        finally:
            socket.close()
    finally:
        first.stop()
    assert live_jobs(slurm_cluster, kernel_id) == {job_id: "RUNNING"}, "SIGTERM must leave the job running"

    second = Gateway("--provisioner", "slurm", warm_pool=0, env=slurm_cluster.environment, state_dir=state_dir)
    try:
        model = wait_for(lambda: (lambda r: r.status_code == 200 and r.json())(
            second.get(f"/api/kernels/{kernel_id}")), 30, "the kernel to be re-adopted")
        assert model["provisioner"]["job_id"] == job_id
        socket = second.connect(kernel_id)
        try:
            assert outputs(socket.execute("print(kept)")) == "across gateways\n"
        finally:
            socket.close()
        assert second.delete(f"/api/kernels/{kernel_id}").status_code == 204
        wait_for(lambda: not live_jobs(slurm_cluster, kernel_id), 30, "the re-adopted job to end")
    finally:
        second.stop()


def test_after_a_gateway_kill_9_a_running_job_is_readopted_and_one_that_ended_meanwhile_is_reported(slurm_cluster,
                                                                                                    tmp_path):
    """kill -9 of a Slurm gateway leaves its jobs running. An agent session's job is cancelled while no gateway runs;
    the next gateway on the same state directory re-adopts the other kernel's job with its variables, lets the
    cancelled one go without submitting it again, and the session's next execute says its state was lost and why."""
    state_dir = tmp_path / "state"
    first = Gateway("--provisioner", "slurm", warm_pool=0, env=slurm_cluster.environment, state_dir=state_dir,
                    keep_kernels=True)
    try:
        kept_id = first.start_kernel(name="python3")["id"]
        socket = first.connect(kept_id)
        try:
            socket.execute("kept = 'across a kill -9'")
        finally:
            socket.close()
        created = first.post("/agent/v1/sessions", json={"name": "ended"})
        assert created.status_code == 201, created.text
        assert first.post("/agent/v1/sessions/ended/execute", json={"code": "x = 1"}).json()["status"] == "ok"
        ended_id = first.get("/agent/v1/sessions/ended").json()["kernel_id"]
        (kept_job,) = live_jobs(slurm_cluster, kept_id)
        (ended_job,) = live_jobs(slurm_cluster, ended_id)
    finally:
        first.stop(signal.SIGKILL)
    assert first.process.returncode == -signal.SIGKILL
    assert live_jobs(slurm_cluster, kept_id) == {kept_job: "RUNNING"}, "kill -9 of the gateway ended a job"
    assert live_jobs(slurm_cluster, ended_id) == {ended_job: "RUNNING"}, "kill -9 of the gateway ended a job"
    subprocess.run(["scancel", ended_job], env=slurm_cluster.environment, check=True, timeout=20)
    wait_for(lambda: not live_jobs(slurm_cluster, ended_id), 30, "the cancelled job to end")

    second = Gateway("--provisioner", "slurm", warm_pool=0, env=slurm_cluster.environment, state_dir=state_dir)
    try:
        model = wait_for(lambda: (lambda r: r.status_code == 200 and r.json())(
            second.get(f"/api/kernels/{kept_id}")), 30, "the running kernel to be re-adopted")
        assert model["provisioner"]["job_id"] == kept_job
        socket = second.connect(kept_id)
        try:
            assert outputs(socket.execute("print(kept)")) == "across a kill -9\n"
        finally:
            socket.close()
        # The gateway's one decision on the cancelled job: logged once the re-adoption failed, the kernel forgotten.
        failed = wait_for(lambda: [json.loads(line) for line in list(second.output)
                                   if '"kernel_readoption_failed"' in line and ended_id in line], 30,
                          "the cancelled job's re-adoption to fail")
        assert failed[0]["error"] == f"Slurm job {ended_job} ended: CANCELLED", failed
        assert second.get(f"/api/kernels/{ended_id}").status_code == 404
        assert jobs_named(slurm_cluster, ended_id) == {ended_job: "CANCELLED"}, "the cancelled kernel was resubmitted"
        answer = second.post("/agent/v1/sessions/ended/execute", json={"code": "'x' in dir()"}).json()
        assert answer["status"] == "ok" and answer["state_lost"] is True, answer
        assert answer["result"]["text/plain"] == "False"
        assert f"Slurm job {ended_job} ended: CANCELLED" in answer["notice"], answer["notice"]
        new_id = second.get("/agent/v1/sessions/ended").json()["kernel_id"]
        assert new_id != ended_id and live_jobs(slurm_cluster, new_id)
        assert second.delete(f"/api/kernels/{kept_id}").status_code == 204
        assert second.delete("/agent/v1/sessions/ended").status_code in (200, 204)
        wait_for(lambda: not live_jobs(slurm_cluster, kept_id), 30, "the re-adopted job to end")
        wait_for(lambda: not live_jobs(slurm_cluster, new_id), 30, "the session's new job to end")
    finally:
        second.stop()


def test_a_kernelspec_chooses_slurm_on_a_local_gateway(slurm_cluster, tmp_path):
    """metadata.cellblock.provisioner: one kernelspec runs on Slurm while the gateway's default stays local."""
    installed = Path(os.environ["CELLBLOCK_PREFIX"]) / "share" / "jupyter" / "kernels" / "cellblock-python"
    spec = json.loads((installed / "kernel.json").read_text())
    spec["metadata"]["cellblock"]["provisioner"] = "slurm"
    spec["display_name"] = "Python 3 (cellblock on Slurm)"
    (tmp_path / "kernels" / "cellblock-slurm").mkdir(parents=True)
    (tmp_path / "kernels" / "cellblock-slurm" / "kernel.json").write_text(json.dumps(spec))
    gateway = Gateway("--kernelspec-dir", str(tmp_path / "kernels"), warm_pool=0, env=slurm_cluster.environment)
    try:
        on_slurm = gateway.start_kernel(name="cellblock-slurm")["id"]
        local = gateway.start_kernel(name="python3")["id"]
        assert list(live_jobs(slurm_cluster, on_slurm).values()) == ["RUNNING"]
        assert live_jobs(slurm_cluster, local) == {}
        for kernel_id in (on_slurm, local):
            socket = gateway.connect(kernel_id)
            try:
                assert outputs(socket.execute("3 * 3")) == "9"
            finally:
                socket.close()
    finally:
        gateway.stop()


def test_an_agent_session_on_slurm_gets_its_limits_as_job_resources_and_kernel_died_on_scancel(slurm_cluster,
                                                                                                slurm_gateway):
    session = slurm_gateway.post("/agent/v1/sessions", json={"limits": {"memory_mb": 300}})
    assert session.status_code == 201, session.text
    session_id = session.json()["id"]
    answer = slurm_gateway.post(f"/agent/v1/sessions/{session_id}/execute", json={"code": "6 * 7"}).json()
    assert answer["status"] == "ok" and answer["result"]["text/plain"] == "42", answer
    jobs = [line.split() for line in slurm_cluster.squeue("-o", "%i %j").splitlines()]
    (job_id,) = [job for job, name in jobs if name.startswith("cellblock-")]
    # The session's memory limit (the worker's) plus the kernel process's own overhead (256 MiB).
    assert slurm_cluster.scontrol_job(job_id)["MinMemoryNode"] == "556M"

    # The job is cancelled while the cell runs: once its first line arrived on the execute's NDJSON stream.
    response = slurm_gateway.post(f"/agent/v1/sessions/{session_id}/execute",
                                  json={"code": "import time\nprint('sleeping', flush=True)\ntime.sleep(120)"},
                                  headers={"Accept": "application/x-ndjson"}, stream=True, timeout=60)
    assert response.status_code == 200, response.text
    events = (json.loads(line) for line in response.iter_lines() if line)
    seen = []
    for event in events:
        seen.append(event)
        if event["type"] == "stdout" and "sleeping" in event.get("text", ""):
            break
    assert seen[-1]["type"] == "stdout", seen
    subprocess.run(["scancel", job_id], env=slurm_cluster.environment, check=True, timeout=20)
    seen += list(events)
    slow = seen[-1]
    assert slow["type"] == "end" and slow["status"] == "error" and slow["error"]["ename"] == "KernelDied", seen
    assert slow["state_lost"] is True


def test_the_agent_file_api_reaches_the_workspace_of_a_slurm_kernel(slurm_cluster, slurm_gateway):
    """The file API asks the session's kernel (cellblock_file_request on its control channel), so a kernel that runs
    as a job serves it: what is uploaded is the code's, what the code writes is read, listed and deleted."""
    session = slurm_gateway.post("/agent/v1/sessions", json={"name": "slurm-files"})
    assert session.status_code == 201, session.text
    base = "/agent/v1/sessions/slurm-files/files"
    put = slurm_gateway.request("PUT", f"{base}/data/in.bin", data=bytes(range(256)))
    assert put.status_code == 201, put.text
    answer = slurm_gateway.post("/agent/v1/sessions/slurm-files/execute", json={
        "code": "data = open('data/in.bin', 'rb').read()\nopen('out.txt', 'w').write(f'{len(data)} {data[255]}')"}).json()
    assert answer["status"] == "ok", answer
    assert slurm_gateway.get(f"{base}/out.txt").content == b"256 255"
    listed = {f["path"]: f["size"] for f in slurm_gateway.get(base).json()["files"]}
    assert listed.get("data/in.bin") == 256 and listed.get("out.txt") == 7, listed
    assert slurm_gateway.delete(f"{base}/data/in.bin").status_code == 204
    missing = slurm_gateway.get(f"{base}/data/in.bin")
    assert missing.status_code == 404 and missing.json()["reason"] == "file_not_found", missing.text


def test_an_env_name_or_value_cannot_run_a_command_in_the_job_script(slurm_cluster, slurm_gateway, tmp_path):
    """A client's `env` reaches the job only as data: a name that is a shell command is refused (400 bad_env, the
    variable named) and runs nothing; a value that is one arrives literally in the kernel's environment on its node
    (host-side proof: the marker files do not exist, /proc/PID/environ holds the text)."""
    marker = tmp_path / "owned"
    name = f"KERNEL_X$(touch {marker})"
    response = slurm_gateway.post("/api/kernels", json={"name": "python3", "env": {name: "1"}})
    assert response.status_code == 400, response.text
    assert response.json()["reason"] == "bad_env" and name in response.json()["message"]

    value = f"$(touch {marker}) `touch {marker}` '; touch {marker}; '\nCELLBLOCK_LAUNCH_ENVIRONMENT\ntouch {marker}"
    model = slurm_gateway.start_kernel(name="python3", env={"KERNEL_NOTE": value})
    socket = slurm_gateway.connect(model["id"])
    try:
        assert outputs(socket.execute("6*7")) == "42"
    finally:
        socket.close()
    pid = kernel_process_of(model["id"])
    assert pid, "the kernel's process was not found on its node"
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    assert f"KERNEL_NOTE={value}".encode() in environ, "the value did not arrive literally"
    token = b"CELLBLOCK_REPORT_TOKEN="
    assert not any(entry.startswith(token) and len(entry) > len(token) for entry in environ), \
        "the one-time report token is still readable in the kernel's /proc environ"
    assert not marker.exists(), "a name or value of env ran a command in the job script"


def vm_peak_kib(pid, field="VmHWM"):
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def test_the_launch_registry_drops_an_oversized_report_unread(slurm_cluster, slurm_gateway):
    """Whoever holds the registry's public key (every job's environment does) can send it a report: one of 48 MiB
    is dropped by libzmq after its size header (the connection is closed, nothing answered) and the gateway's peak
    RSS (VmHWM from /proc) does not grow by it, while a small report on another connection is still answered."""
    import zmq
    import zmq.utils.monitor

    kernel_id = slurm_gateway.start_kernel(name="python3")["id"]
    pid = wait_for(lambda: kernel_process_of(kernel_id), 10, "the kernel process")
    environ = dict(entry.split(b"=", 1) for entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                   if b"=" in entry)
    server_key = environ[b"CELLBLOCK_REPORT_SERVER_KEY"]
    command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    endpoint = command[command.index(b"--report-to") + 1].decode()
    gateway_pid = slurm_gateway.process.pid
    context = zmq.Context()

    def reporter():
        socket = context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.curve_serverkey = server_key
        socket.curve_publickey, socket.curve_secretkey = zmq.curve_keypair()
        return socket

    oversized, small = reporter(), reporter()
    try:
        monitor = oversized.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        oversized.connect(endpoint)
        assert monitor.poll(30_000), "no CurveZMQ handshake with the launch registry"
        assert zmq.utils.monitor.recv_monitor_message(monitor)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
        peak_before = vm_peak_kib(gateway_pid)
        oversized.send(json.dumps({"token": "not-a-token", "padding": "x" * (48 << 20)}).encode())
        # The registry answers every report it reads (here: unknown token); the oversized one is never read.
        poller = zmq.Poller()
        poller.register(monitor, zmq.POLLIN)
        poller.register(oversized, zmq.POLLIN)
        ready = dict(poller.poll(60_000))
        assert oversized not in ready, "the registry read and answered a 48 MiB report"
        assert monitor in ready and zmq.utils.monitor.recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
        small.connect(endpoint)
        small.send(json.dumps({"token": "not-a-token"}).encode())
        assert small.poll(30_000), "the registry stopped answering after the oversized report"
        assert json.loads(small.recv())["reason"] == "unknown or already used token"
        grown_mib = (vm_peak_kib(gateway_pid) - peak_before) / 1024
        assert grown_mib < 16, f"the gateway's peak RSS grew by {grown_mib:.0f} MiB for a dropped report"
    finally:
        context.destroy(linger=0)  # every socket, the monitor's too: term() would wait for an open one forever


def logged(gateway, event, kernel_id):
    """How many of the gateway's log lines are `event` about the kernel."""
    return sum(1 for line in list(gateway.output) if f'"{event}"' in line and kernel_id in line)


def kept_through(gateway):
    """The agent session "shared" answers, through `gateway`, with the variable set through another one."""
    answer = gateway.post("/agent/v1/sessions/shared/execute", json={"code": "print(kept)"}).json()
    assert answer["status"] == "ok" and answer["stdout"] == "42\n", answer
    assert not answer.get("state_lost"), answer


def shared_session_through(a, b, cluster):
    """Agent session "shared" created through A (kept = 42) and served through B by A's one job: (kernel, job)."""
    created = a.post("/agent/v1/sessions", json={"name": "shared"})
    assert created.status_code == 201, created.text
    assert a.post("/agent/v1/sessions/shared/execute", json={"code": "kept = 6 * 7"}).json()["status"] == "ok"
    kernel_id = a.get("/agent/v1/sessions/shared").json()["kernel_id"]
    (job_id,) = live_jobs(cluster, kernel_id)
    kept_through(b)
    assert jobs_named(cluster, kernel_id) == {job_id: "RUNNING"}, "B must attach A's job, not submit one"
    return kernel_id, job_id


def test_gateways_on_one_postgresql_store_serve_one_slurm_job_until_it_is_deleted(slurm_cluster, tmp_path):
    """An agent session created through gateway A on Slurm is served through gateway B (same store, own state
    directory) by the same job with its variables, also after kill -9 of A. A third gateway that attached the job
    and exits releases it (the job keeps running, B keeps serving). When the kernel process ends while two gateways
    hold its job, one job is submitted again, not two. A delete through B ends the job."""
    postgres = Postgres()
    gateways, kernel_id = [], None

    def start(name, keep_kernels=True):
        gateways.append(Gateway("--provisioner", "slurm", "--store", postgres.url, "--store-key-file",
                                str(postgres.key_file), "--log-level", "info", warm_pool=0,
                                env=slurm_cluster.environment, state_dir=tmp_path / f"state-{name}",
                                keep_kernels=keep_kernels))
        return gateways[-1]

    try:
        a, b = start("a"), start("b")
        kernel_id, job_id = shared_session_through(a, b, slurm_cluster)
        assert b.get("/agent/v1/sessions/shared").json()["kernel_id"] == kernel_id
        socket = b.connect(kernel_id)  # a notebook's WebSocket through B, to the same job
        try:
            assert outputs(socket.execute("kept + 1")) == "43"
        finally:
            socket.close()

        a.stop(signal.SIGKILL)
        assert a.process.returncode == -signal.SIGKILL
        kept_through(b)
        assert jobs_named(slurm_cluster, kernel_id) == {job_id: "RUNNING"}

        # C attaches the job and stops its own kernels on exit (--shutdown-kernels-on-exit): not this one.
        c = start("c", keep_kernels=False)
        kept_through(c)
        assert c.get(f"/api/kernels/{kernel_id}").json()["provisioner"]["job_id"] == job_id
        assert c.stop() == 0
        kept_through(b)
        assert jobs_named(slurm_cluster, kernel_id) == {job_id: "RUNNING"}, "an attaching gateway's exit ended the job"

        # A again, on its state directory (it re-adopts the job): two gateways hold the job and poll it. The kernel
        # process ends; exactly one of them submits the kernel again (its restart lease, kernel-restart:<id>), the
        # other lets it go.
        a = start("a")
        kept_through(a)  # re-adopted, not only recorded: a job that ends while it is re-adopted is forgotten
        ready_before = {gateway: logged(gateway, "kernel_ready", kernel_id) for gateway in (a, b)}
        os.kill(kernel_process_of(kernel_id), signal.SIGKILL)
        loser = wait_for(lambda: next((g for g in (a, b) if logged(g, "kernel_ended_elsewhere", kernel_id)), None)
                         or len(jobs_named(slurm_cluster, kernel_id)) > 2, 60,
                         "one gateway to leave the restart to the other")
        assert loser in (a, b), f"both gateways submitted the kernel again: {jobs_named(slurm_cluster, kernel_id)}"
        winner = b if loser is a else a
        wait_for(lambda: logged(winner, "kernel_ready", kernel_id) > ready_before[winner], 60,
                 "the kernel to be ready on its new job")
        jobs = jobs_named(slurm_cluster, kernel_id)
        assert len(jobs) == 2 and jobs[job_id] != "RUNNING", f"{len(jobs) - 1} jobs submitted again: {jobs}"
        (job_id,) = [job for job in jobs if job != job_id]
        assert jobs[job_id] == "RUNNING", jobs
        assert b.post("/agent/v1/sessions/shared/execute", json={"code": "kept = 6 * 7"}).json()["status"] == "ok"
        kept_through(b)
        # A's session saw the kernel die too (its answer may say state_lost); what B set since is there.
        answer = a.post("/agent/v1/sessions/shared/execute", json={"code": "print(kept)"}).json()
        assert answer["status"] == "ok" and answer["stdout"] == "42\n", answer
        assert jobs_named(slurm_cluster, kernel_id)[job_id] == "RUNNING"

        assert b.delete("/agent/v1/sessions/shared").status_code in (200, 204)
        wait_for(lambda: not live_jobs(slurm_cluster, kernel_id), 30, "the deleted session's job to leave squeue")
        assert b.get(f"/api/kernels/{kernel_id}").status_code == 404
    finally:
        for gateway in gateways:
            gateway.stop()
        if kernel_id:
            subprocess.run(["scancel", "--name", f"cellblock-{kernel_id}"], env=slurm_cluster.environment, timeout=20)
        postgres.stop()


def squeue_spy(directory, real_squeue):
    """A PATH directory whose `squeue` appends its argv (one line) to directory/calls, then execs the real one. The
    gateway starts squeue through PATH (posix_spawnp in kernel_process.cpp, from SlurmCommands in provisioner.cpp),
    so with the directory first on a gateway's PATH the file lists every squeue that gateway ran."""
    directory.mkdir()
    calls = directory / "calls"
    calls.touch()
    spy = directory / "squeue"
    spy.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$*\" >> '{calls}'\nexec '{real_squeue}' \"$@\"\n")
    spy.chmod(0o755)
    return calls


def squeue_calls_naming(calls, job_id):
    """How many of the logged squeue calls ask for `job_id` (-j ID,ID,...); a line still being written is not one."""
    text = calls.read_text()
    count = 0
    for line in text[:text.rfind("\n") + 1].splitlines():
        words = line.split()
        if "-j" in words[:-1] and job_id in words[words.index("-j") + 1].split(","):
            count += 1
    return count


def test_on_one_postgresql_store_one_gateway_polls_a_slurm_job_and_another_takes_over_when_it_dies(slurm_cluster,
                                                                                                   tmp_path):
    """Two gateways on one store hold the same Slurm job (A submitted it, B serves its session too), but only the
    holder of its store lease slurm-watch:<kernel>:<job> polls it: over several poll intervals exactly one gateway's
    squeue calls name the job. kill -9 of that gateway ends its lease with its database connection; the other
    then polls the job within a few poll intervals and still serves the session. Host-side proof: each gateway
    has its own `squeue` first on PATH that logs its calls (squeue_spy)."""
    poll_interval = 0.5
    window_calls = 10  # polls of the job seen by both gateways together: several intervals of one poller
    postgres = Postgres()
    gateways, kernel_id = {}, None
    calls = {}

    def start(name):
        calls[name] = squeue_spy(tmp_path / f"path-{name}", slurm_cluster.binaries["squeue"])
        environment = slurm_cluster.environment
        environment["PATH"] = f"{calls[name].parent}{os.pathsep}{environment.get('PATH', os.defpath)}"
        environment["CELLBLOCK_GATEWAY_SLURM_POLL_INTERVAL"] = str(poll_interval)
        gateways[name] = Gateway("--provisioner", "slurm", "--store", postgres.url, "--store-key-file",
                                 str(postgres.key_file), "--log-level", "info", warm_pool=0, env=environment,
                                 state_dir=tmp_path / f"state-{name}", keep_kernels=True)
        return gateways[name]

    def polls(job_id):
        return {name: squeue_calls_naming(log, job_id) for name, log in calls.items()}

    try:
        a, b = start("a"), start("b")
        kernel_id, job_id = shared_session_through(a, b, slurm_cluster)
        assert b.get(f"/api/kernels/{kernel_id}").json()["provisioner"]["job_id"] == job_id

        # Both hold the job now. A window of `window_calls` polls of it (whoever made them): one gateway made all.
        before = polls(job_id)
        wait_for(lambda: sum(polls(job_id).values()) >= sum(before.values()) + window_calls,
                 window_calls * poll_interval + 30, f"{window_calls} squeue calls naming job {job_id}")
        grown = {name: count - before[name] for name, count in polls(job_id).items()}
        print(f"squeue calls naming job {job_id} per gateway over the window: {grown}")
        pollers = [name for name, count in grown.items() if count]
        assert len(pollers) == 1, f"squeue calls naming job {job_id} per gateway over the window: {grown}"
        (watcher,) = pollers
        survivor = "b" if watcher == "a" else "a"

        # kill -9 of the polling gateway: its lease goes with its connection, the other gateway takes it over.
        before = polls(job_id)
        gateways[watcher].stop(signal.SIGKILL)
        assert gateways[watcher].process.returncode == -signal.SIGKILL
        killed = time.monotonic()
        wait_for(lambda: polls(job_id)[survivor] >= before[survivor] + 2, 30,
                 f"gateway {survivor} to poll job {job_id} after kill -9 of {watcher}")
        took_over = time.monotonic() - killed
        print(f"gateway {survivor} polled job {job_id} twice {took_over:.2f} s after kill -9 of {watcher}")
        # Its next lease try (one a poll interval) gets the lease, the poll after it and one more name the job.
        assert took_over < 10 * poll_interval, f"{survivor} took {took_over:.2f} s to poll job {job_id}"
        kept_through(gateways[survivor])
        assert jobs_named(slurm_cluster, kernel_id) == {job_id: "RUNNING"}

        assert gateways[survivor].delete("/agent/v1/sessions/shared").status_code in (200, 204)
        wait_for(lambda: not live_jobs(slurm_cluster, kernel_id), 30, "the deleted session's job to leave squeue")
    finally:
        for gateway in gateways.values():
            gateway.stop()
        if kernel_id:
            subprocess.run(["scancel", "--name", f"cellblock-{kernel_id}"], env=slurm_cluster.environment, timeout=20)
        postgres.stop()
