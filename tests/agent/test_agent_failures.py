"""Agent sessions when things go wrong: the session is deleted while its kernel starts, while code runs, with executes
queued; its kernel is killed, culled, cannot start, or its confined worker cannot start; the session and kernel
limits. Every waiting request must get an answer naming the cause, nothing may hang, and what the session owned
(its kernel process and confined worker) must be gone, checked from the host through /proc."""
import concurrent.futures
import json
import os
import signal
import sys
from pathlib import Path

import cellblock_zygote
import pytest

from conftest import AgentGateway

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "gateway"))
import broken_kernels  # noqa: E402
from host_processes import descendants, is_running, kernel_tree, wait_for, wait_until_gone  # noqa: E402

# Generous bounds for a loaded 2-core machine: these say "it did not hang", not "it was fast".
ANSWER_TIMEOUT_S = 60
GONE_TIMEOUT_S = 60


@pytest.fixture
def make_gateway(tmp_path):
    started = []

    def make(*arguments, name="gateway"):
        runtime = tmp_path / f"{name}-runtime"
        server = AgentGateway(tmp_path / f"{name}-state", tmp_path / f"{name}.log", "--runtime-dir", str(runtime),
                              *arguments)
        server.runtime_dir = str(runtime)
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop()


def kernel_processes(server, kernel_id=None):
    """The gateway's kernel processes (their command line names a connection file in the gateway's runtime
    directory) with everything below them: the confined worker and the sandbox's own processes."""
    return kernel_tree(server.runtime_dir, kernel_id or "")


def workers_of(server, kernel_id):
    return [p for p in kernel_processes(server, kernel_id) if p.is_worker]


def in_background(pool, server, method, path, **kwargs):
    kwargs.setdefault("timeout", ANSWER_TIMEOUT_S + 60)
    return pool.submit(server.request, method, path, **kwargs)


def answer_of(future):
    """The HTTP answer of a background request; a hang fails here instead of blocking the suite."""
    try:
        return future.result(timeout=ANSWER_TIMEOUT_S)
    except concurrent.futures.TimeoutError:
        raise AssertionError(f"no answer within {ANSWER_TIMEOUT_S} s: the request hangs") from None


def session_model(server, name):
    return server.request("GET", f"/agent/v1/sessions/{name}").json()


def assert_everything_gone(server, processes, what):
    left = wait_until_gone(processes, GONE_TIMEOUT_S)
    assert not left, f"{what} still running: {[str(p) for p in left]}\n{server.log_tail()}"


def listed_kernels(server):
    return [k["id"] for k in server.request("GET", "/api/kernels").json()]


@pytest.fixture
def slow_kernel_gateway(make_gateway, tmp_path):
    """A gateway whose only kernelspec runs the real kernel through a shell (broken_kernels.slow_start), so no
    template service serves its kernels (gateway/src/kernels/template_services.cpp starts one only for a
    cellblock-kernel argv), under a zygote tenant of this test's own; after the test, no template of that tenant
    may be left running. Such a kernel must get no tenant: with one it starts its tenant's template itself, which
    outlives every kernel for its hour (kernel/README.md "Worker zygote")."""
    policy = cellblock_zygote.resolved_config(broken_kernels.INSTALLED_KERNEL_CONFIG)["sandbox_policy"]
    tenant = cellblock_zygote.named_tenant(f"{cellblock_zygote.TENANT}-slow")
    specs = broken_kernels.slow_start(tmp_path / "kernels", "slow-python", delay_s=6)
    try:
        yield make_gateway("--warm-pool", "0", "--kernelspec-dir", str(specs), "--default-kernel-name",
                           "slow-python", "--zygote-tenant", tenant)
        left = cellblock_zygote.template_pids(policy, tenant)
        assert not left, f"a zygote template of tenant {tenant} started by a kernel is left running: {left}"
    finally:
        cellblock_zygote.stop_templates(policy)


# ------------------------------------------------------------------------------------------ deleting a session


def test_deleting_a_session_while_its_kernel_starts_answers_the_create(slow_kernel_gateway):
    server = slow_kernel_gateway
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        create = in_background(pool, server, "POST", "/agent/v1/sessions", json={"name": "doomed"})
        wait_for(lambda: server.request("GET", "/agent/v1/sessions/doomed").status_code == 200,
                 what="the session to be registered")
        assert session_model(server, "doomed")["state"] == "starting"
        starting = wait_for(lambda: kernel_processes(server), what="the kernel process to be spawned")
        assert not create.done(), "the kernel was meant to be still starting"
        assert server.request("DELETE", "/agent/v1/sessions/doomed").status_code == 204
        created = answer_of(create)
    assert created.status_code == 410, f"{created.status_code} {created.text}"
    assert "deleted" in created.json()["message"], created.text
    assert server.request("GET", "/agent/v1/sessions/doomed").status_code == 404
    # The kernel that was starting for it is stopped once it is up; nothing of it stays.
    assert_everything_gone(server, starting, "the deleted session's kernel")
    wait_for(lambda: not kernel_processes(server), timeout=GONE_TIMEOUT_S, what="no kernel process at all")
    assert listed_kernels(server) == []
    server.assert_alive()


def test_deleting_a_session_answers_an_execute_waiting_for_its_kernel_and_the_queue(slow_kernel_gateway):
    server = slow_kernel_gateway
    session = server.create_session("waiting")
    # Its kernel goes away (as through a notebook's shutdown): the next execute has to wait for a new one.
    assert server.request("DELETE", f"/api/kernels/{session['kernel_id']}").status_code == 204
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        first = in_background(pool, server, "POST", "/agent/v1/sessions/waiting/execute", json={"code": "1 + 1"})
        wait_for(lambda: session_model(server, "waiting")["state"] == "starting", what="a new kernel to start")
        queued = [in_background(pool, server, "POST", "/agent/v1/sessions/waiting/execute", json={"code": f"{n}"})
                  for n in range(2)]
        wait_for(lambda: session_model(server, "waiting")["queued"] == 2, what="two executes to queue")
        starting = wait_for(lambda: kernel_processes(server), what="the new kernel process")
        assert server.request("DELETE", "/agent/v1/sessions/waiting").status_code == 204
        answers = [answer_of(future) for future in [first, *queued]]
    for answer in answers:
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["status"] == "error" and body["error"]["ename"] == "SessionClosed", body
        assert "deleted" in body["error"]["evalue"], body
    assert_everything_gone(server, starting, "the deleted session's kernel")
    wait_for(lambda: not kernel_processes(server), timeout=GONE_TIMEOUT_S, what="no kernel process at all")
    server.assert_alive()


def test_deleting_a_session_while_code_runs_answers_it_and_the_queue_and_stops_the_worker(make_gateway):
    server = make_gateway("--warm-pool", "0")
    session = server.create_session("busy")
    server.execute("busy", "import time")
    kernel_id = session["kernel_id"]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        running = in_background(pool, server, "POST", "/agent/v1/sessions/busy/execute",
                                json={"code": "time.sleep(120)"})
        wait_for(lambda: server.request("GET", f"/api/kernels/{kernel_id}").json()["execution_state"] == "busy",
                 what="the kernel to run the code")
        queued = [in_background(pool, server, "POST", "/agent/v1/sessions/busy/execute", json={"code": f"{n}"})
                  for n in range(2)]
        wait_for(lambda: session_model(server, "busy")["queued"] == 2, what="two executes to queue")
        owned = kernel_processes(server, kernel_id)
        assert [p for p in owned if p.is_worker], f"no confined worker found below the kernel: {owned}"
        assert server.request("DELETE", "/agent/v1/sessions/busy").status_code == 204
        answers = [answer_of(future).json() for future in [running, *queued]]
    assert answers[0]["status"] == "error" and answers[0]["error"]["ename"] == "SessionClosed", answers[0]
    assert "deleted" in answers[0]["error"]["evalue"]
    for answer in answers[1:]:
        assert answer["status"] == "error" and answer["error"]["ename"] == "SessionClosed", answer
    assert_everything_gone(server, owned, "the deleted session's kernel or worker")
    assert kernel_id not in listed_kernels(server)
    server.assert_alive()


# ------------------------------------------------------------------------------------------ the kernel goes away


def test_kernel_killed_mid_execute_gives_a_clear_error_and_the_session_continues(make_gateway):
    server = make_gateway()
    session = server.create_session("victim")
    kernel_id = session["kernel_id"]
    server.execute("victim", "import time\nkept = 1")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = in_background(pool, server, "POST", "/agent/v1/sessions/victim/execute",
                                json={"code": "time.sleep(120)"})
        wait_for(lambda: server.request("GET", f"/api/kernels/{kernel_id}").json()["execution_state"] == "busy",
                 what="the kernel to run the code")
        before = kernel_processes(server, kernel_id)
        kernel = next(p for p in before if f"kernel-{kernel_id}.json" in p.cmdline)
        assert [p for p in before if p.is_worker], f"no confined worker found below the kernel: {before}"
        os.kill(kernel.pid, signal.SIGKILL)
        answer = answer_of(running).json()
    assert answer["status"] == "error" and answer["error"]["ename"] == "KernelDied", answer
    assert "died" in answer["error"]["evalue"] and answer["state_lost"] is True, answer
    # The old kernel's confined worker went with it.
    assert_everything_gone(server, before, "the killed kernel's processes")
    after = server.execute("victim", "'kept' in globals()")
    assert after["status"] == "ok" and after["result"]["text/plain"] == "False", after
    assert not is_running(kernel) and kernel_processes(server, kernel_id), "the kernel was not replaced"
    server.assert_alive()


def test_culled_kernel_is_replaced_on_the_next_execute_and_its_worker_is_gone(make_gateway):
    # The agent's own link counts as a connection, so only --cull-connected lets the culler take its kernel.
    server = make_gateway("--cull-idle-timeout", "2", "--cull-interval", "0.25", "--cull-connected", "true")
    session = server.create_session("idle")
    server.execute("idle", "x = 1")
    owned = kernel_processes(server, session["kernel_id"])
    assert [p for p in owned if p.is_worker]
    wait_for(lambda: session["kernel_id"] not in listed_kernels(server), timeout=GONE_TIMEOUT_S,
             what="the culler to shut the kernel down")
    assert_everything_gone(server, owned, "the culled kernel's processes")
    assert server.request("GET", "/agent/v1/sessions/idle").status_code == 200
    answer = server.execute("idle", "'x' in globals()")
    assert answer["status"] == "ok" and answer["result"]["text/plain"] == "False", answer
    assert answer["state_lost"] is True and "new kernel" in answer["notice"], answer
    server.assert_alive()


def test_cull_busy_decides_whether_a_long_execute_survives_the_culler(make_gateway):
    culling = ("--cull-idle-timeout", "1", "--cull-interval", "0.25", "--cull-connected", "true")
    kept = make_gateway(*culling, name="kept")
    kept.create_session("long")
    survived = kept.execute("long", "import time\ntime.sleep(6)\n'survived'")
    assert survived["status"] == "ok" and survived["result"]["text/plain"] == "'survived'", survived

    culled = make_gateway(*culling, "--cull-busy", "true", name="culled")
    session = culled.create_session("long")
    owned = kernel_processes(culled, session["kernel_id"])
    answer = culled.execute("long", "import time\ntime.sleep(120)")
    assert answer["status"] == "error" and answer["error"]["ename"] == "KernelDied", answer
    assert "culled" in answer["error"]["evalue"], answer
    assert_everything_gone(culled, owned, "the culled kernel's processes")
    culled.assert_alive()


# ------------------------------------------------------------------------------------------ kernels that cannot start


@pytest.mark.parametrize("make_spec, cause", [
    (broken_kernels.missing_binary, "No such file or directory"),
    (broken_kernels.dies_during_start, "exited with status 3"),
])
def test_kernel_start_failure_is_503_and_leaves_no_session(make_gateway, tmp_path, make_spec, cause):
    specs = make_spec(tmp_path / "kernels", "broken")
    server = make_gateway("--warm-pool", "0", "--kernelspec-dir", str(specs), "--default-kernel-name", "broken")
    refused = server.request("POST", "/agent/v1/sessions", json={"name": "never"})
    assert refused.status_code == 503, refused.text
    assert refused.json()["reason"] == "kernel_unavailable" and cause in refused.json()["message"], refused.text
    assert server.request("GET", "/agent/v1/sessions/never").status_code == 404
    assert server.request("GET", "/agent/v1/sessions").json()["sessions"] == []
    wait_for(lambda: not kernel_processes(server), timeout=GONE_TIMEOUT_S, what="no kernel process left")
    server.assert_alive()


def test_max_sessions_is_429_until_one_is_deleted(make_gateway):
    server = make_gateway("--agent-max-sessions", "2")
    server.create_session("one")
    server.create_session("two")
    refused = server.request("POST", "/agent/v1/sessions", json={"name": "three"})
    assert refused.status_code == 429 and refused.json()["reason"] == "too_many_sessions", refused.text
    assert server.request("GET", "/agent/v1/sessions/three").status_code == 404
    assert server.request("DELETE", "/agent/v1/sessions/one").status_code == 204
    assert server.create_session("three")["name"] == "three"


def test_max_kernels_bounds_agent_sessions_and_is_freed_by_a_delete(make_gateway):
    server = make_gateway("--max-kernels", "1")
    first = server.create_session("first")
    refused = server.request("POST", "/agent/v1/sessions", json={"name": "second"})
    assert refused.status_code == 503, refused.text
    assert "Maximum number of kernels (1)" in refused.json()["message"], refused.text
    assert server.request("GET", "/agent/v1/sessions/second").status_code == 404
    # The Kernel Gateway API shares the quota with agent sessions.
    assert server.request("POST", "/api/kernels", json={}).status_code == 403
    assert server.request("DELETE", "/agent/v1/sessions/first").status_code == 204
    wait_for(lambda: first["kernel_id"] not in listed_kernels(server), what="the first kernel to go")
    assert server.create_session("second")["kernel_id"]


# ------------------------------------------------------------------------------------------ the confined worker


NEVER_READY = "import time\nwhile True:\n    time.sleep(1)\n"
DIES_BEFORE_READY = "import sys\nprint('worker refuses to start', file=sys.stderr, flush=True)\nsys.exit(3)\n"


@pytest.mark.parametrize("case", ["launch_failure", "death_before_ready", "startup_timeout"])
def test_worker_that_cannot_start_gives_a_named_error_and_the_kernel_keeps_serving(make_gateway, tmp_path, case):
    root = tmp_path / "kernels"
    if case == "launch_failure":
        specs = broken_kernels.with_kernel_config(root, "broken", tmp_path, python="/nonexistent/python3")
        causes = ["could not be started", "/nonexistent/python3"]
    elif case == "death_before_ready":
        specs = broken_kernels.with_kernel_config(root, "broken", tmp_path, worker_source=DIES_BEFORE_READY)
        causes = ["ended during start-up", "exited with status 3", "worker refuses to start"]
    else:
        specs = broken_kernels.with_kernel_config(root, "broken", tmp_path, worker_source=NEVER_READY,
                                                  start_timeout_s=3)
        causes = ["did not report ready within 3 s"]
    server = make_gateway("--warm-pool", "0", "--kernelspec-dir", str(specs), "--default-kernel-name", "broken")
    session = server.create_session("no-worker")  # the kernel answers kernel_info without a worker
    kernel = next(p for p in kernel_processes(server, session["kernel_id"])
                  if f"kernel-{session['kernel_id']}.json" in p.cmdline)
    for attempt in range(2):  # and again: the kernel retries the launch for the next execute
        answer = server.execute("no-worker", "1 + 1")
        assert answer["status"] == "error" and answer["error"]["ename"] == "WorkerUnavailable", answer
        for cause in causes:
            assert cause in answer["error"]["evalue"], (cause, answer["error"]["evalue"])
    assert is_running(kernel), "the kernel must survive its worker's failure"
    # Nothing of the failed workers is left below the kernel.
    wait_for(lambda: not descendants(kernel.pid), timeout=GONE_TIMEOUT_S, what="no process below the kernel")
    server.assert_alive()


# ------------------------------------------------------------------------------------------ the agent's own link


def test_a_websocket_client_cannot_take_over_the_agent_link_to_its_kernel(make_gateway):
    import websocket
    server = make_gateway()
    session = server.create_session("guarded")
    kernel_id = session["kernel_id"]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = in_background(pool, server, "POST", "/agent/v1/sessions/guarded/execute",
                                json={"code": "import time\ntime.sleep(4)\n'finished'"})
        wait_for(lambda: server.request("GET", f"/api/kernels/{kernel_id}").json()["execution_state"] == "busy",
                 what="the kernel to run the code")
        # Any id under the agent prefix, not only the session's exact one, is refused.
        for session_id in (f"cellblock-agent-{session['id']}", "cellblock-agent-x"):
            intruder = websocket.create_connection(
                f"ws://127.0.0.1:{server.port}/api/kernels/{kernel_id}/channels?session_id={session_id}",
                header=[f"Authorization: token {server.token}"], timeout=30)
            intruder.send(json.dumps({"header": {"msg_type": "kernel_info_request", "msg_id": "intruder-1",
                                                 "session": session_id},
                                      "parent_header": {}, "metadata": {}, "content": {}, "channel": "shell"}))
            while json.loads(intruder.recv())["msg_type"] != "kernel_info_reply":
                pass
            intruder.close()
        answer = answer_of(running).json()
    assert answer["status"] == "ok" and answer["result"]["text/plain"] == "'finished'", answer
