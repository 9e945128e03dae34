"""Network by allowlist, with approvals, end to end: a real cellblock-gateway with --network-allow and
--egress-hosts, real kernels whose proxy (in the kernel, kernel/README.md "Network egress proxy") is the worker's
only way out, and a local "internet" of HTTPS/HTTP servers on 127.x addresses with a test CA
(network_fixtures.py). Every refusal is also checked on the host: the server that must not be reached logged
nothing (requests and TLS server names)."""
import json
import os
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
import requests

from conftest import CLI_BINARY, AgentGateway
from network_fixtures import LocalInternet

APPROVAL_TIMEOUT_S = 8  # --network-approval-timeout of the module's gateway: the time-out path waits this long
CEILING = ["*.test", "localhost", "169.254.169.254"]


@pytest.fixture(scope="module")
def internet(tmp_path_factory):
    net = LocalInternet(tmp_path_factory.mktemp("internet"))
    try:
        yield net
    finally:
        net.stop()


def gateway_arguments(internet, *extra):
    arguments = []
    for pattern in CEILING:
        arguments += ["--network-allow", pattern]
    return [*arguments, "--egress-hosts", str(internet.hosts_file), "--network-approval-timeout",
            str(APPROVAL_TIMEOUT_S), "--agent-keepalive", "0.5", *extra]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, internet):
    directory = tmp_path_factory.mktemp("network-gateway")
    server = AgentGateway(directory / "state", directory / "gateway.log", *gateway_arguments(internet))
    try:
        yield server
    finally:
        server.stop()


def create(gateway, network, name=None):
    body = {"network": network}
    if name:
        body["name"] = name
    response = gateway.request("POST", "/agent/v1/sessions", json=body)
    assert response.status_code == 201, f"{response.status_code} {response.text}\n{gateway.log_tail()}"
    return response.json()


def trust_test_ca(gateway, internet, session):
    """The worker trusts the test CA: the CA goes into the workspace through the file API, the usual variables of
    urllib (OpenSSL), requests and pip point at it."""
    response = gateway.request("PUT", f"/agent/v1/sessions/{session}/files/ca.pem",
                               data=internet.ca_path.read_bytes())
    assert response.status_code == 201, response.text
    answer = gateway.execute(session, "import os\n"
                                      "for name in ('SSL_CERT_FILE', 'REQUESTS_CA_BUNDLE', 'PIP_CERT'):\n"
                                      "    os.environ[name] = '/workspace/ca.pem'\n"
                                      "print(os.environ.get('HTTPS_PROXY'))")
    assert answer["status"] == "ok", answer
    assert answer["stdout"].strip() == "http://127.0.0.1:3128", answer  # the kernel's proxy, inside the netns


@pytest.fixture(scope="module")
def allowed(gateway, internet):
    """A session that may reach pypi.test and files.test (and the names resolving to private addresses), no ask."""
    session = create(gateway, {"allow": ["pypi.test", "files.test", "localhost", "169.254.169.254"]})
    trust_test_ca(gateway, internet, session["id"])
    return session["id"]


def run(gateway, session, code, **extra):
    return gateway.execute(session, code, **extra)


def fetch_code(url, client="urllib"):
    if client == "urllib":
        return (f"import urllib.request\n"
                f"print(urllib.request.urlopen({url!r}, timeout=60).read().decode(), end='')")
    return f"import requests\nprint(requests.get({url!r}, timeout=60).text, end='')"


def explained_fetch_code(url):
    """Fetches `url`; on failure prints what the client shows: the exception and, for an HTTP error, its body."""
    return ("import urllib.request, urllib.error\n"
            "try:\n"
            f"    print(urllib.request.urlopen({url!r}, timeout=60).read().decode(), end='')\n"
            "except urllib.error.HTTPError as error:\n"
            "    print('failed', error.code, error.read().decode(), end='')\n"
            "except Exception as error:\n"
            "    print('failed', type(error).__name__, error)\n")


def failure_text(answer):
    error = answer.get("error") or {}
    return f"{error.get('ename')}: {error.get('evalue')}\n{error.get('traceback')}\n{answer.get('stdout')}"


# ------------------------------------------------------------------------------------------------ policies, ceiling


def kernel_environment(kernel_id):
    """The environment of the kernel process with KERNEL_ID=kernel_id, read from /proc on the host."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            raw = (entry / "environ").read_bytes()
        except OSError:
            continue
        variables = dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)
        if variables.get("KERNEL_ID") == kernel_id and "cellblock-kernel" in (entry / "cmdline").read_bytes().decode(
                errors="replace"):
            return variables
    raise AssertionError(f"no kernel process with KERNEL_ID={kernel_id}")


def test_session_policy_reaches_the_kernel_with_the_ceiling(gateway, internet):
    session = create(gateway, {"allow": ["PyPI.test.", "*.files.test"], "ask": True})
    assert session["network"] == {"allow": ["pypi.test", "*.files.test"], "ask": True}
    assert gateway.request("GET", f"/agent/v1/sessions/{session['id']}").json()["network"] == session["network"]
    env = kernel_environment(session["kernel_id"])
    policy = json.loads(env["CELLBLOCK_NETWORK_POLICY"])
    assert policy == {"allow": ["pypi.test", "*.files.test"], "ask": True, "ceiling": CEILING, "ports": [443, 80],
                      "approval_timeout_s": APPROVAL_TIMEOUT_S}
    assert env["CELLBLOCK_EGRESS_HOSTS"] == str(internet.hosts_file)
    # Without a policy: no network at all, as before network policies existed.
    plain = gateway.create_session()
    assert plain["network"] is None
    assert "CELLBLOCK_NETWORK_POLICY" not in kernel_environment(plain["kernel_id"])


@pytest.mark.parametrize("network, named", [
    ({"allow": ["pypi.org"]}, "pypi.org"),
    ({"allow": ["pypi.test", "*"]}, "*"),
    ({"allow": ["test"]}, "test"),  # "*.test" covers names below test, never "test" itself
    ({"allow": ["*.localhost"]}, "*.localhost"),
])
def test_policy_above_the_ceiling_is_refused_at_creation(gateway, network, named):
    before = {s["id"] for s in gateway.request("GET", "/agent/v1/sessions").json()["sessions"]}
    response = gateway.request("POST", "/agent/v1/sessions", json={"network": network})
    assert response.status_code == 400, response.text
    body = response.json()
    assert body["reason"] == "network_not_allowed"
    assert named in body["message"] and "*.test, localhost, 169.254.169.254" in body["message"], body
    after = {s["id"] for s in gateway.request("GET", "/agent/v1/sessions").json()["sessions"]}
    assert after == before  # nothing was created


def test_malformed_policy_is_refused(gateway):
    for network in ({"allow": "pypi.test"}, {"allow": ["https://pypi.test/"]}, {"ask": "yes"}, {"hosts": []}):
        response = gateway.request("POST", "/agent/v1/sessions", json={"network": network})
        assert response.status_code == 400 and response.json()["reason"] == "bad_network", response.text


def test_mcp_creates_with_a_policy_and_refuses_above_the_ceiling(gateway):
    def call(arguments):
        response = gateway.request("POST", "/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                                                         "params": {"name": "run_python", "arguments": arguments}})
        assert response.status_code == 200, response.text
        return response.json()["result"]

    refused = call({"session": "mcp-net-refused", "code": "1", "network": {"allow": ["evil.com"]}})
    assert refused["isError"] and refused["structuredContent"]["reason"] == "network_not_allowed", refused
    ok = call({"session": "mcp-net", "code": "1 + 1", "network": {"allow": ["pypi.test"]}})
    assert not ok["isError"], ok
    assert gateway.request("GET", "/agent/v1/sessions/mcp-net").json()["network"] == {"allow": ["pypi.test"],
                                                                                     "ask": False}
    # A session's network is fixed at creation.
    changed = call({"session": "mcp-net", "code": "1", "network": {"allow": ["files.test"]}})
    assert changed["isError"] and changed["structuredContent"]["reason"] == "network_fixed", changed


def test_policy_survives_a_gateway_restart(tmp_path, internet):
    first = AgentGateway(tmp_path / "state", tmp_path / "gateway.log", *gateway_arguments(internet),
                         keep_kernels=True)
    try:
        session = create(first, {"allow": ["pypi.test"], "ask": True}, name="kept")
    finally:
        first.stop()
    second = AgentGateway(tmp_path / "state", tmp_path / "gateway.log", *gateway_arguments(internet))
    try:
        model = second.request("GET", "/agent/v1/sessions/kept").json()
        assert model["network"] == {"allow": ["pypi.test"], "ask": True}, model
        answer = second.execute("kept", "1 + 1")  # the re-adopted kernel is attached once it answers
        assert answer["status"] == "ok" and not answer["state_lost"], answer
        assert second.request("GET", "/agent/v1/sessions/kept").json()["kernel_id"] == session["kernel_id"]
        assert json.loads(kernel_environment(session["kernel_id"])["CELLBLOCK_NETWORK_POLICY"])["allow"] == [
            "pypi.test"]
        # A new kernel started for it later (its kernel deleted through the Kernel Gateway API) has the same policy.
        assert second.request("DELETE", f"/api/kernels/{session['kernel_id']}").status_code == 204
        assert second.execute("kept", "1 + 1")["status"] == "ok"
        renewed = second.request("GET", "/agent/v1/sessions/kept").json()
        assert renewed["kernel_id"] != session["kernel_id"]
        env = kernel_environment(renewed["kernel_id"])
        assert json.loads(env["CELLBLOCK_NETWORK_POLICY"])["allow"] == ["pypi.test"]
    finally:
        second.stop()


def test_default_policy_for_kernel_gateway_kernels(tmp_path, internet):
    server = AgentGateway(tmp_path / "state", tmp_path / "gateway.log",
                          *gateway_arguments(internet, "--network-default", '{"allow": ["pypi.test"]}'))
    try:
        kernel = server.request("POST", "/api/kernels", json={"name": "python3"}).json()
        policy = json.loads(kernel_environment(kernel["id"])["CELLBLOCK_NETWORK_POLICY"])
        assert policy["allow"] == ["pypi.test"] and policy["ceiling"] == CEILING
        # A client's environment cannot set or widen it.
        forged = server.request("POST", "/api/kernels", json={"name": "python3", "env": {
            "KERNEL_X": "1", "CELLBLOCK_NETWORK_POLICY": '{"allow": ["*"]}'}}).json()
        assert json.loads(kernel_environment(forged["id"])["CELLBLOCK_NETWORK_POLICY"])["allow"] == ["pypi.test"]
        # Agent sessions do not inherit it: no policy = no network.
        session = server.create_session()
        assert "CELLBLOCK_NETWORK_POLICY" not in kernel_environment(session["kernel_id"])
    finally:
        server.stop()


def test_a_default_beyond_the_ceiling_stops_the_gateway(tmp_path, internet):
    from conftest import GATEWAY_BINARY
    result = subprocess.run([str(GATEWAY_BINARY), "--port", "0", "--state-dir", str(tmp_path / "state"),
                             "--network-allow", "*.test", "--network-default", '{"allow": ["evil.com"]}'],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result
    assert "evil.com is outside the gateway's network ceiling (*.test)" in result.stderr, result.stderr


# ------------------------------------------------------------------------------------------------ allowed traffic


@pytest.mark.parametrize("client", ["urllib", "requests"])
def test_allowed_host_over_https(gateway, allowed, internet, client):
    answer = run(gateway, allowed, fetch_code("https://pypi.test/hello", client))
    assert answer["status"] == "ok", failure_text(answer)
    assert answer["stdout"] == "hello from pypi.test\n"
    assert any(entry.get("path") == "/hello" and entry.get("tls") for entry in internet.requests_seen("pypi.test"))


def test_allowed_host_over_plain_http(gateway, allowed):
    answer = run(gateway, allowed, fetch_code("http://files.test/hello", "requests"))
    assert answer["status"] == "ok", failure_text(answer)
    assert answer["stdout"] == "hello from files.test\n"


def test_pip_installs_from_a_local_index_and_the_package_imports(gateway, allowed):
    answer = run(gateway, allowed,
                 "import subprocess, sys\n"
                 "done = subprocess.run([sys.executable, '-m', 'pip', 'install', '--no-cache-dir',\n"
                 "    '--disable-pip-version-check', '--target', '/workspace/site', '--index-url',\n"
                 "    'https://pypi.test/simple', 'tinypkg'], capture_output=True, text=True)\n"
                 "print(done.returncode)\nprint(done.stdout[-2000:])\nprint(done.stderr[-2000:])\n"
                 "sys.path.insert(0, '/workspace/site')\n"
                 "import tinypkg\nprint(tinypkg.GREETING)", timeout_s=300)
    assert answer["status"] == "ok", failure_text(answer)
    assert answer["stdout"].startswith("0\n"), answer["stdout"]
    assert "hello from tinypkg 1.0" in answer["stdout"]


# ------------------------------------------------------------------------------------------------ refusals


def test_host_not_on_the_allowlist_fails_with_a_readable_message(gateway, allowed, internet):
    answer = run(gateway, allowed, explained_fetch_code("http://evil.test/hello"))
    assert answer["status"] == "ok", failure_text(answer)
    out = answer["stdout"]
    assert out.startswith("failed 403"), out
    assert "evil.test is not on this session's network allowlist" in out, out
    assert "pypi.test" in out and "files.test" in out, out  # the policy is named
    assert internet.requests_seen("evil.test") == []


@pytest.mark.parametrize("client", ["urllib", "requests"])
def test_https_refusal_names_host_and_policy_in_the_clients_error(gateway, allowed, internet, client):
    # For CONNECT, urllib and requests show only the status line of the proxy's answer ("Tunnel connection
    # failed: 403 <reason>"), not its body: the reason phrase must carry the explanation.
    answer = run(gateway, allowed, fetch_code("https://evil.test/hello", client))
    assert answer["status"] == "error", answer
    text = failure_text(answer)
    assert "403" in text and "evil.test is not on this session's network allowlist" in text, text
    assert internet.requests_seen("evil.test") == []


def test_allowed_names_resolving_to_loopback_or_metadata_are_refused(gateway, allowed):
    answer = run(gateway, allowed,
                 "import urllib.request, urllib.error\n"
                 "for url in ('http://localhost/hello', 'http://169.254.169.254/latest/meta-data/'):\n"
                 "    try:\n"
                 "        urllib.request.urlopen(url, timeout=60)\n"
                 "        print('reached', url)\n"
                 "    except urllib.error.HTTPError as error:\n"
                 "        print(error.code, error.read().decode())\n")
    assert answer["status"] == "ok", failure_text(answer)
    lines = [line for line in answer["stdout"].splitlines() if line.strip()]
    assert len(lines) == 2 and not any(line.startswith("reached") for line in lines), answer["stdout"]
    assert lines[0].startswith("403") and "localhost" in lines[0], lines
    assert lines[1].startswith("403") and "169.254.169.254" in lines[1], lines


def test_tls_server_name_other_than_the_connect_host_is_refused(gateway, allowed, internet):
    answer = run(gateway, allowed,
                 "import socket, ssl\n"
                 "raw = socket.create_connection(('127.0.0.1', 3128), timeout=30)\n"
                 "raw.sendall(b'CONNECT pypi.test:443 HTTP/1.1\\r\\nHost: pypi.test:443\\r\\n\\r\\n')\n"
                 "head = b''\n"
                 "while b'\\r\\n\\r\\n' not in head:\n"
                 "    part = raw.recv(4096)\n"
                 "    if not part: break\n"
                 "    head += part\n"
                 "print(head.split(b'\\r\\n')[0].decode())\n"
                 "context = ssl.create_default_context(cafile='/workspace/ca.pem')\n"
                 "try:\n"
                 "    tls = context.wrap_socket(raw, server_hostname='evil.test')\n"
                 "    tls.sendall(b'GET /hello HTTP/1.1\\r\\nHost: evil.test\\r\\n\\r\\n')\n"
                 "    print('answered', tls.recv(4096))\n"
                 "except (OSError, ssl.SSLError) as error:\n"
                 "    print('refused', type(error).__name__)\n")
    assert answer["status"] == "ok", failure_text(answer)
    assert "refused" in answer["stdout"] and "answered" not in answer["stdout"], answer["stdout"]
    assert "evil.test" not in internet.server_names_seen()
    assert not any(entry.get("path") for entry in internet.requests_seen("pypi.test") if entry.get("host") ==
                   "evil.test")


def test_redirect_to_a_disallowed_host_is_refused(gateway, allowed, internet):
    answer = run(gateway, allowed,
                 "import requests\n"
                 "try:\n"
                 "    r = requests.get('https://pypi.test/redirect?to=https://evil.test/hello', timeout=60)\n"
                 "    print('status', r.status_code, r.text)\n"
                 "except requests.exceptions.RequestException as error:\n"
                 "    print('refused', error)\n")
    assert answer["status"] == "ok", failure_text(answer)
    assert "hello from evil.test" not in answer["stdout"], answer["stdout"]
    assert "refused" in answer["stdout"] and "evil.test" in answer["stdout"], answer["stdout"]
    assert any(entry.get("path", "").startswith("/redirect") for entry in internet.requests_seen("pypi.test"))
    assert internet.requests_seen("evil.test") == []


def test_dns_and_raw_sockets_still_fail_inside(gateway, allowed, internet):
    # Host-side listeners on the pinned address of pypi.test: a TCP port and a UDP port nothing else uses.
    address = internet.addresses["pypi.test"]
    tcp = socket.socket()
    tcp.bind((address, 0))
    tcp.listen()
    tcp.settimeout(0.5)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind((address, 0))
    udp.settimeout(0.5)
    try:
        answer = run(gateway, allowed,
                     "import socket\n"
                     f"for what, action in (('dns', lambda: socket.getaddrinfo('pypi.test', 443)),\n"
                     f"                     ('dns-any', lambda: socket.getaddrinfo('example.com', 80)),\n"
                     f"                     ('tcp', lambda: socket.create_connection(({address!r}, {tcp.getsockname()[1]}), timeout=5)),\n"
                     f"                     ('tcp-443', lambda: socket.create_connection(({address!r}, 443), timeout=5)),\n"
                     f"                     ('udp', lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ({address!r}, {udp.getsockname()[1]}))),\n"
                     f"                     ('udp-dns', lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('8.8.8.8', 53)))):\n"
                     "    try:\n"
                     "        action()\n"
                     "        print(what, 'no error')\n"
                     "    except OSError as error:\n"
                     "        print(what, 'failed', type(error).__name__)\n")
        assert answer["status"] == "ok", failure_text(answer)
        lines = dict(line.split(" ", 1) for line in answer["stdout"].splitlines())
        assert lines["dns"].startswith("failed") and lines["dns-any"].startswith("failed"), lines
        assert lines["tcp"].startswith("failed") and lines["tcp-443"].startswith("failed"), lines
        # A datagram "sent" inside the worker's namespace goes to its own lo (or nowhere): the host must not see it.
        assert lines["udp-dns"].startswith("failed"), lines
        with pytest.raises(socket.timeout):
            tcp.accept()
        with pytest.raises(socket.timeout):
            udp.recvfrom(16)
    finally:
        tcp.close()
        udp.close()


# ------------------------------------------------------------------------------------------------ approvals


class Stream:
    """An NDJSON execute read on a thread; `events` fills as lines arrive."""

    def __init__(self, gateway, session, code):
        self.events = []
        self.error = None
        self.response = gateway.http.post(f"{gateway.url}/agent/v1/sessions/{session}/execute",
                                          json={"code": code}, headers={"Accept": "application/x-ndjson"},
                                          stream=True, timeout=120)
        assert self.response.status_code == 200, self.response.text
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        try:
            for line in self.response.iter_lines():
                if line:
                    self.events.append(json.loads(line))
        except Exception as error:  # reported by the test through `end`
            self.error = error

    def wait_for(self, predicate, timeout=90):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for event in list(self.events):
                if predicate(event):
                    return event
            if not self.thread.is_alive():
                break
            time.sleep(0.05)
        raise AssertionError(f"no such event; got {self.events} (error {self.error})")

    def end(self):
        self.thread.join(timeout=120)
        return self.wait_for(lambda event: event["type"] == "end", timeout=1)


@pytest.fixture(scope="module")
def asking(gateway, internet):
    """A session allowed pypi.test that asks for anything else within the ceiling."""
    session = create(gateway, {"allow": ["pypi.test"], "ask": True}, name="asking")
    trust_test_ca(gateway, internet, session["id"])
    return session["id"]


def held_approval(stream, host):
    return stream.wait_for(lambda e: e["type"] == "approval" and e["state"] == "pending" and e["host"] == host)


def decide(gateway, session, approval_id, decision):
    return gateway.request("POST", f"/agent/v1/sessions/{session}/approvals/{approval_id}",
                           json={"decision": decision})


def test_approval_allow_once_completes_the_download(gateway, asking, internet):
    stream = Stream(gateway, asking, fetch_code("https://held.test/hello"))
    approval = held_approval(stream, "held.test")
    assert approval["port"] == 443 and approval["method"] == "CONNECT", approval
    assert internet.requests_seen("held.test") == []  # held: nothing reached the server yet
    listed = gateway.request("GET", f"/agent/v1/sessions/{asking}/approvals").json()["approvals"]
    assert any(a["id"] == approval["id"] and a["state"] == "pending" and a["requested"] for a in listed), listed
    response = decide(gateway, asking, approval["id"], "allow_once")
    assert response.status_code == 200, response.text
    assert response.json()["decision"] == "allow_once" and response.json()["decided_by"] == "agent api"
    end = stream.end()
    assert end["status"] == "ok" and end["stdout"] == "hello from held.test\n", end
    # Decided already: a second decision is a conflict; the list shows who decided and when.
    assert decide(gateway, asking, approval["id"], "deny").status_code == 409
    listed = gateway.request("GET", f"/agent/v1/sessions/{asking}/approvals").json()["approvals"]
    decided = next(a for a in listed if a["id"] == approval["id"])
    assert decided["decision"] == "allow_once" and decided["decided_by"] == "agent api" and decided["decided"]


def test_approval_deny_through_the_cli(gateway, asking, internet):
    stream = Stream(gateway, asking, explained_fetch_code("http://denied.test/hello"))
    approval = held_approval(stream, "denied.test")
    assert approval["port"] == 80 and approval["method"] == "GET", approval
    env = {**os.environ, "CELLBLOCK_URL": gateway.url, "CELLBLOCK_TOKEN": gateway.token}
    listed = subprocess.run([str(CLI_BINARY), "approvals", asking], capture_output=True, text=True, env=env,
                            timeout=60)
    assert listed.returncode == 0 and approval["id"] in listed.stdout and "denied.test:80" in listed.stdout, listed
    decided = subprocess.run([str(CLI_BINARY), "approve", asking, approval["id"], "deny"], capture_output=True,
                             text=True, env=env, timeout=60)
    assert decided.returncode == 0, decided
    end = stream.end()
    assert end["status"] == "ok", end
    assert end["stdout"].startswith("failed 403") and "denied by agent api" in end["stdout"], end["stdout"]
    assert internet.requests_seen("denied.test") == []


def test_approval_times_out_as_a_denial(gateway, asking, internet):
    started = time.monotonic()
    stream = Stream(gateway, asking, explained_fetch_code("http://late.test/hello"))
    approval = held_approval(stream, "late.test")
    assert approval["timeout_s"] == APPROVAL_TIMEOUT_S
    end = stream.end()
    assert time.monotonic() - started >= APPROVAL_TIMEOUT_S - 1
    assert end["status"] == "ok", end
    assert end["stdout"].startswith("failed 403"), end["stdout"]
    assert f"no decision within {APPROVAL_TIMEOUT_S}" in end["stdout"], end["stdout"]
    timed_out = next(a for a in gateway.request("GET", f"/agent/v1/sessions/{asking}/approvals").json()["approvals"]
                     if a["id"] == approval["id"])
    assert timed_out["decision"] == "timeout", timed_out
    assert decide(gateway, asking, approval["id"], "allow_once").status_code == 409
    assert internet.requests_seen("late.test") == []


def test_approval_decision_errors(gateway, asking):
    assert decide(gateway, asking, "no-such-approval", "allow_once").status_code == 404
    response = decide(gateway, asking, "no-such-approval", "maybe")
    assert response.status_code == 400 and response.json()["reason"] == "bad_decision", response.text
    response = gateway.request("POST", f"/agent/v1/sessions/{asking}/approvals/x", json={})
    assert response.status_code == 400 and response.json()["reason"] == "missing_decision", response.text


def test_outside_the_ceiling_is_refused_never_asked(gateway, asking):
    answer = run(gateway, asking,
                 "import requests\n"
                 "try:\n"
                 "    print('status', requests.get('https://example.com/', timeout=60).status_code)\n"
                 "except requests.exceptions.RequestException as error:\n"
                 "    print('refused', error)\n")
    assert answer["status"] == "ok", failure_text(answer)
    assert "refused" in answer["stdout"] and "example.com" in answer["stdout"], answer["stdout"]
    listed = gateway.request("GET", f"/agent/v1/sessions/{asking}/approvals").json()["approvals"]
    assert not any(a["host"] == "example.com" for a in listed), listed


def test_audit_records_connections_and_decisions(gateway, asking, allowed):
    approvals = gateway.request("GET", f"/agent/v1/sessions/{asking}/audit",
                                params={"event": "network_approval"}).json()["entries"]
    by_state = {(entry["host"], entry["state"]): entry for entry in approvals}
    assert ("held.test", "requested") in by_state and by_state[("held.test", "decided")]["decision"] == "allow_once"
    assert by_state[("denied.test", "decided")]["decision"] == "deny"
    assert by_state[("denied.test", "decided")]["decided_by"] == "agent api"
    # Who asked, whichever of the kernel's event and its answer to the decision came first.
    assert by_state[("denied.test", "decided")]["client"] and by_state[("denied.test", "decided")]["token_id"] == ""
    assert by_state[("late.test", "decided")]["decision"] == "timeout"
    connections = gateway.request("GET", f"/agent/v1/sessions/{allowed}/audit",
                                  params={"event": "network_connection"}).json()["entries"]
    fetched = [c for c in connections if c["host"] == "pypi.test" and c["allowed"]]
    assert fetched and all(c["bytes_down"] > 0 and c["duration_ms"] >= 0 and c["rule"] for c in fetched), connections
    assert {c["method"] for c in fetched} >= {"CONNECT"}
    refused = [c for c in connections if c["host"] == "evil.test"]
    assert refused and not any(c["allowed"] for c in refused), connections
    held = gateway.request("GET", f"/agent/v1/sessions/{asking}/audit",
                           params={"event": "network_connection"}).json()["entries"]
    assert any(c["host"] == "held.test" and c["allowed"] and "allow_once" in c["rule"] for c in held), held
