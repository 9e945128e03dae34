"""GET /metrics: the gateway's Prometheus metrics, read the way an operator reads them — scraped by a
real Prometheus server (Debian's /usr/bin/prometheus) with the gateway's token and queried back through
Prometheus's HTTP API — and checked by Prometheus's own linter (`promtool check metrics`). The figures asserted are
the work each test did: executes by outcome, the latency histogram's count, WebSocket connections and bytes,
kernels and agent sessions by state, the warm pool, launch failures by cause."""
import json
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import requests

import broken_kernels
from gateway_harness import TOKEN, Gateway, outputs

PROMETHEUS = "/usr/bin/prometheus"
PROMTOOL = "/usr/bin/promtool"
SCRAPE_DEADLINE_S = 90  # the first scrape waits for Prometheus to start; generous for a loaded 2-core machine


def required_tool(path):
    if not Path(path).exists():
        pytest.fail(f"{path} is missing: install the Debian package prometheus (share/scripts/install-deps.sh "
                    "--with-test-tools)")
    return path


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def scrape(gateway):
    response = gateway.get("/metrics")
    assert response.status_code == 200, response.text
    return response


def samples(text):
    """{'name{labels}': value} of an exposition's sample lines (labels as written)."""
    found = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            found[series] = float(value)
    return found


def promtool_check(text):
    """promtool check metrics: the exposition parses and follows Prometheus's naming rules (exit 0, no output)."""
    checked = subprocess.run([required_tool(PROMTOOL), "check", "metrics"], input=text, capture_output=True,
                             text=True, timeout=60)
    return checked.returncode, (checked.stdout + checked.stderr).strip()


class Prometheus:
    """A Prometheus server in a temporary directory that scrapes one gateway's /metrics every second with its
    token."""

    def __init__(self, gateway, token):
        self.directory = Path(tempfile.mkdtemp(prefix="cb-prometheus-"))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        target = gateway.url.split("://", 1)[1]
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{
                "job_name": "cellblock",
                "metrics_path": "/metrics",
                "static_configs": [{"targets": [target]}],
                "authorization": {"type": "Token", "credentials": token},
            }],
        }
        (self.directory / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
        self.log = open(self.directory / "prometheus.log", "w")
        self.process = subprocess.Popen(
            [required_tool(PROMETHEUS), f"--config.file={self.directory / 'prometheus.yml'}",
             f"--storage.tsdb.path={self.directory / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}",
             "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def query(self, expression):
        """The instant vector of `expression` as {frozenset(labels without __name__/job/instance): value}, or None
        while Prometheus is not answering yet."""
        try:
            response = requests.get(f"{self.url}/api/v1/query", params={"query": expression}, timeout=10)
        except requests.ConnectionError:
            return None
        if response.status_code != 200:
            return None
        body = response.json()
        assert body["status"] == "success", body
        result = {}
        for item in body["data"]["result"]:
            labels = {k: v for k, v in item["metric"].items() if k not in ("__name__", "job", "instance")}
            result[frozenset(labels.items())] = float(item["value"][1])
        return result

    def wait_for(self, expression, predicate, what):
        """Polls until the vector of `expression` satisfies `predicate`; returns it."""
        deadline = time.monotonic() + SCRAPE_DEADLINE_S
        last = None
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"prometheus exited:\n{self.log_text()}"
            last = self.query(expression)
            if last is not None and predicate(last):
                return last
            time.sleep(0.5)
        pytest.fail(f"Prometheus never reported {what} ({expression}); last answer {last}\n{self.log_text()}")

    def value(self, expression):
        """The single value of a scalar-like query (exactly one series)."""
        vector = self.wait_for(expression, lambda v: len(v) == 1, f"one series for {expression}")
        return next(iter(vector.values()))

    def log_text(self):
        self.log.flush()
        return (self.directory / "prometheus.log").read_text()[-4000:]

    def stop(self):
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()
        shutil.rmtree(self.directory, ignore_errors=True)


@pytest.fixture
def prometheus_for():
    started = []

    def start(gateway, token=TOKEN):
        instance = Prometheus(gateway, token)
        started.append(instance)
        return instance

    yield start
    for instance in started:
        instance.stop()


def create_session(gateway, name):
    response = gateway.post("/agent/v1/sessions", json={"name": name})
    assert response.status_code == 201, response.text
    return response.json()


def agent_execute(gateway, session, code, **extra):
    response = gateway.post(f"/agent/v1/sessions/{session}/execute", json={"code": code, **extra})
    assert response.status_code == 200, response.text
    return response.json()


# ------------------------------------------------------------------------------------------------ auth, format


def test_metrics_need_the_token_and_pass_promtool():
    gateway = Gateway(warm_pool=1)
    try:
        for headers in ({}, {"Authorization": "token wrong"}):
            refused = requests.get(gateway.url + "/metrics", headers=headers, timeout=30)
            assert refused.status_code == 401, refused.text
            assert "cellblock_" not in refused.text
            assert refused.json()["reason"] and refused.json()["message"], refused.text
        response = scrape(gateway)
        assert response.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
        assert requests.get(gateway.url + "/metrics", params={"token": TOKEN}, timeout=30).status_code == 200
        status, report = promtool_check(response.text)
        assert status == 0 and report == "", report
        # Every documented family is there, each with one HELP and one TYPE line, before anything happened.
        for family, kind in [("cellblock_agent_sessions", "gauge"), ("cellblock_kernels", "gauge"),
                             ("cellblock_agent_executes_total", "counter"),
                             ("cellblock_agent_execute_duration_seconds", "histogram"),
                             ("cellblock_warm_pool_kernels", "gauge"), ("cellblock_warm_pool_target", "gauge"),
                             ("cellblock_warm_pool_hits_total", "counter"),
                             ("cellblock_warm_pool_misses_total", "counter"),
                             ("cellblock_launch_failures_total", "counter"),
                             ("cellblock_websocket_connections_open", "gauge"),
                             ("cellblock_websocket_connections_accepted_total", "counter"),
                             ("cellblock_streamed_bytes_total", "counter")]:
            assert response.text.count(f"# TYPE {family} {kind}\n") == 1, family
            assert response.text.count(f"# HELP {family} ") == 1, family
        assert samples(response.text)["cellblock_warm_pool_target"] == 1
        # The linter is not a rubber stamp: it fails a broken exposition.
        status, report = promtool_check(response.text.replace("# TYPE cellblock_kernels gauge",
                                                              "# TYPE cellblock_kernels counter"))
        assert status != 0, report
    finally:
        gateway.stop()


def wait_for_ready_pool(gateway, deadline_s=120):
    deadline = time.monotonic() + deadline_s
    while gateway.get("/api/status").json().get("warm_pool_ready", 0) < 1:
        assert time.monotonic() < deadline, "the warm pool did not fill"
        time.sleep(0.05)


def test_back_to_back_creates_are_both_served_by_the_warm_pool():
    """The pool replaces a kernel it hands out after a short pause (so that the new kernel's start does not compete
    with the new session's first moments); a create within that pause still takes the replacement, started at once,
    and is counted as a pool hit, as before the pause. Then the pool fills again by itself."""
    gateway = Gateway(warm_pool=1)
    try:
        wait_for_ready_pool(gateway)
        first = gateway.start_kernel()
        second = gateway.start_kernel()
        assert first["id"] != second["id"]
        counted = samples(scrape(gateway).text)
        assert counted["cellblock_warm_pool_hits_total"] == 2, counted
        assert counted["cellblock_warm_pool_misses_total"] == 0, counted
        wait_for_ready_pool(gateway)
        for kernel in (first, second):
            client = gateway.connect(kernel["id"])
            assert outputs(client.execute("print(6 * 7)")) == "42\n"
            client.close()
    finally:
        gateway.stop()


# ------------------------------------------------------------------------------------------ through Prometheus


def test_prometheus_scrapes_what_the_gateway_did(prometheus_for):
    gateway = Gateway(warm_pool=1)
    try:
        # A Jupyter kernel (from the warm pool) and one WebSocket client that runs code on it.
        kernel = gateway.start_kernel()
        client = gateway.connect(kernel["id"])
        printed = "metrics " * 200
        assert printed in outputs(client.execute(f"print({printed!r})"))
        client.close()
        # An agent session (also from the warm pool), three ok executes, one that raises, one NDJSON stream,
        # one that runs past its time limit.
        create_session(gateway, "metrics")
        for code in ("1 + 1", "print('ok')", "x = 3"):
            assert agent_execute(gateway, "metrics", code)["status"] == "ok"
        failed = agent_execute(gateway, "metrics", "1 / 0")
        assert failed["status"] == "error" and failed["error"]["ename"] == "ZeroDivisionError", failed
        streamed = gateway.post("/agent/v1/sessions/metrics/execute", json={"code": "print('streamed ' * 50)"},
                                headers={"Accept": "application/x-ndjson"})
        assert streamed.status_code == 200 and "streamed" in streamed.text, streamed.text
        stream_bytes = len(streamed.content)
        slow = agent_execute(gateway, "metrics", "import time; time.sleep(30)", timeout_s=1)
        assert slow["status"] == "timeout", slow

        # What the gateway says itself, checked by promtool.
        direct = scrape(gateway).text
        status, report = promtool_check(direct)
        assert status == 0 and report == "", report

        prometheus = prometheus_for(gateway)
        prometheus.wait_for('up{job="cellblock"}', lambda v: list(v.values()) == [1.0], "a successful scrape")
        outcomes = prometheus.wait_for("cellblock_agent_executes_total",
                                       lambda v: v.get(frozenset({("outcome", "ok")})) == 4,
                                       "the four ok executes")
        by_outcome = {dict(labels)["outcome"]: value for labels, value in outcomes.items()}
        assert by_outcome == {"ok": 4, "error": 1, "timeout": 1, "interrupted": 0, "kernel_died": 0,
                              "worker_died": 0, "sandbox_unavailable": 0, "kernel_unavailable": 0,
                              "session_closed": 0, "abandoned": 0}, by_outcome
        assert prometheus.value("cellblock_agent_execute_duration_seconds_count") == 6
        # The timeout took at least its 1 s limit, so it is above the 1 s bucket; all took under 300 s.
        assert prometheus.value('cellblock_agent_execute_duration_seconds_bucket{le="1"}') <= 5
        assert prometheus.value('cellblock_agent_execute_duration_seconds_bucket{le="300"}') == 6  # seconds, not ms
        assert prometheus.value('cellblock_agent_execute_duration_seconds_bucket{le="+Inf"}') == 6
        assert prometheus.value("cellblock_agent_execute_duration_seconds_sum") >= 1.0

        assert prometheus.value("cellblock_websocket_connections_accepted_total") == 1
        assert prometheus.value("cellblock_websocket_connections_open") == 0
        assert prometheus.value('cellblock_streamed_bytes_total{transport="websocket"}') > len(printed)
        # The NDJSON body the client read, without the chunked framing.
        assert prometheus.value('cellblock_streamed_bytes_total{transport="http_stream"}') == stream_bytes

        # State gauges, computed from their owners at scrape time.
        assert prometheus.value('cellblock_agent_sessions{state="idle"}') == 1
        assert prometheus.value('sum(cellblock_agent_sessions)') == 1
        # The Jupyter kernel and the session's, idle (after a restart by the time limit's breaker, once it is
        # back); pool kernels are counted apart.
        kernels = prometheus.wait_for("cellblock_kernels",
                                      lambda v: len(v) == 5 and v.get(frozenset({("state", "idle")})) == 2,
                                      "two idle kernels")
        assert sum(kernels.values()) == 2, kernels
        assert prometheus.value("sum(cellblock_warm_pool_kernels)") == 1
        assert prometheus.value("cellblock_warm_pool_target") == 1
        assert prometheus.value("cellblock_warm_pool_hits_total") == 2
        assert prometheus.value("cellblock_warm_pool_misses_total") == 0
        assert prometheus.value("sum(cellblock_launch_failures_total)") == 0

        # A change is scraped again: the session is deleted, the open WebSocket counts while it is open.
        assert gateway.delete("/agent/v1/sessions/metrics").status_code == 204
        second = gateway.connect(kernel["id"])
        second.wait_ready()
        prometheus.wait_for("sum(cellblock_agent_sessions)", lambda v: list(v.values()) == [0.0],
                            "the deleted session gone")
        prometheus.wait_for("cellblock_websocket_connections_open", lambda v: list(v.values()) == [1.0],
                            "one open WebSocket")
        second.close()
        prometheus.wait_for("cellblock_websocket_connections_open", lambda v: list(v.values()) == [0.0],
                            "the WebSocket closed")
        assert prometheus.value("cellblock_websocket_connections_accepted_total") == 2
    finally:
        gateway.stop()


# ------------------------------------------------------------------------------------------------ failures


def test_launch_failures_and_pool_misses_are_counted_by_cause(tmp_path):
    root = tmp_path / "kernels"
    broken_kernels.missing_binary(root, "missing")
    broken_kernels.dies_during_start(root, "dies")
    broken_kernels.with_kernel_config(root, "noworker", tmp_path, python="/nonexistent/python3")
    # The warm pool holds the default kernel, whose binary is missing: every refill fails at spawn, so the pool
    # is empty when a request comes.
    gateway = Gateway("--kernelspec-dir", str(root), "--default-kernel-name", "missing", warm_pool=1)
    try:
        refused = gateway.post("/api/kernels", json={})
        assert refused.status_code == 500 and "No such file or directory" in refused.json()["message"], refused.text
        refused = gateway.post("/api/kernels", json={"name": "dies"})
        assert refused.status_code == 500 and "before it answered" in refused.json()["message"], refused.text
        values = samples(scrape(gateway).text)
        assert values["cellblock_warm_pool_misses_total"] == 1
        assert values["cellblock_warm_pool_hits_total"] == 0
        assert values['cellblock_launch_failures_total{cause="spawn_failed"}'] >= 2  # the request and the pool
        assert values['cellblock_launch_failures_total{cause="exited_during_start"}'] == 1
        assert values['cellblock_launch_failures_total{cause="start_timeout"}'] == 0
    finally:
        gateway.stop()

    # The agent path: the sandbox launch failure is counted as an outcome and as a launch failure.
    gateway = Gateway("--kernelspec-dir", str(root), "--default-kernel-name", "noworker", warm_pool=0)
    try:
        create_session(gateway, "noworker")
        answer = agent_execute(gateway, "noworker", "1 + 1")
        assert answer["status"] == "error" and answer["error"]["ename"] == "WorkerUnavailable", answer
        values = samples(scrape(gateway).text)
        assert values['cellblock_agent_executes_total{outcome="sandbox_unavailable"}'] == 1
        assert values['cellblock_agent_executes_total{outcome="error"}'] == 0
        assert values['cellblock_launch_failures_total{cause="sandbox_unavailable"}'] == 1
        assert values["cellblock_warm_pool_misses_total"] == 0, "no pool, no misses"
        assert gateway.delete("/agent/v1/sessions/noworker").status_code == 204
    finally:
        gateway.stop()
