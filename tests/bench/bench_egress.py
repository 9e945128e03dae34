#!/usr/bin/env python3
"""Network by allowlist: what the egress proxy costs.

- throughput: a 100 MB download from a local server (127.x, pinned with --egress-hosts, test CA) by code in an agent
  session, through the kernel's proxy (HTTPS = CONNECT tunnel, HTTP = absolute-form request the proxy forwards),
  against the same client code on the host talking to the same server directly. Target: ≥ 80 % of direct.
- added latency per request: a small GET (new connection each time, as urllib does) through the proxy vs direct.

The servers are tests/agent/network_fixtures.py's. Both sides use the same code (urllib, 1 MiB reads); medians of
repeated runs. Needs root (the servers listen on 443/80 of 127.x addresses) and the proxy (egress-core/-wiring).

    /usr/bin/python3 tests/bench/bench_egress.py [--quick] [--megabytes N] [--repeat N]
"""
import argparse
import json
import os
import re
import secrets
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import requests

import benchlib
from benchlib import Row, Stats, markdown_table, progress

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "agent"))
from network_fixtures import LocalInternet  # noqa: E402

CLIENT = r'''
import json, ssl, time, urllib.request
def download(url, size, opener):
    started = time.perf_counter()
    got = 0
    with opener.open(url, timeout=300) as response:
        while True:
            part = response.read(1 << 20)
            if not part:
                break
            got += len(part)
    elapsed = time.perf_counter() - started
    assert got == size, (got, size)
    return size / elapsed / 1e6
def latency(url, opener, count):
    samples = []
    for _ in range(count):
        started = time.perf_counter()
        with opener.open(url, timeout=60) as response:
            response.read()
        samples.append((time.perf_counter() - started) * 1000)
    return samples
def measure(base_https, base_http, size, repeat, requests_count, opener):
    return {"https": [download(f"{base_https}/bytes?n={size}", size, opener) for _ in range(repeat)],
            "http": [download(f"{base_http}/bytes?n={size}", size, opener) for _ in range(repeat)],
            "latency_https": latency(f"{base_https}/hello", opener, requests_count),
            "latency_http": latency(f"{base_http}/hello", opener, requests_count)}
'''


class Gateway:
    def __init__(self, prefix: Path, workdir: Path, internet: LocalInternet):
        self.port, token = benchlib.free_port(), secrets.token_hex(16)
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("KG_")}
        env["JUPYTER_PATH"] = str(prefix / "share" / "jupyter")
        log_path = workdir / "gateway.log"
        self.process = subprocess.Popen(
            [str(prefix / "bin" / "cellblock-gateway"), "--ip", "127.0.0.1", "--port", str(self.port), "--token",
             token, "--kernelspec-dir", str(prefix / "share" / "jupyter" / "kernels"), "--state-dir",
             str(workdir / "state"), "--shutdown-kernels-on-exit", "--warm-pool", "0", "--network-allow", "bulk.test",
             "--egress-hosts", str(internet.hosts_file)],
            stdout=open(log_path, "ab"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
            start_new_session=True)
        self.http = requests.Session()
        self.http.headers["Authorization"] = f"token {token}"
        deadline = time.monotonic() + 120
        while not re.search(rf"is available at http://127\.0\.0\.1:{self.port}\b", log_path.read_text(errors="replace")):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"gateway did not start:\n{log_path.read_text(errors='replace')[-2000:]}")
            time.sleep(0.05)

    def execute(self, session: str, code: str) -> dict:
        response = self.http.post(f"{self.url}/agent/v1/sessions/{session}/execute",
                                  json={"code": code, "timeout_s": 600}, timeout=900)
        response.raise_for_status()
        answer = response.json()
        if answer["status"] != "ok":
            raise RuntimeError(f"execute failed: {answer.get('error')}")
        return answer

    def stop(self):
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=120)


def pinned_opener(address: str, ca_path: Path):
    """urllib on the host straight to `address` (the name only in TLS SNI and Host), no proxy."""
    import http.client
    import socket
    import ssl

    context = ssl.create_default_context(cafile=str(ca_path))

    class PinnedHTTPSConnection(http.client.HTTPSConnection):
        def __init__(self, host, **kw):
            kw.pop("context", None)
            kw.pop("check_hostname", None)
            super().__init__(host, context=context, **kw)

        def connect(self):
            self.sock = context.wrap_socket(socket.create_connection((address, 443), self.timeout),
                                            server_hostname="bulk.test")

    class PinnedHTTPConnection(http.client.HTTPConnection):
        def connect(self):
            self.sock = socket.create_connection((address, 80), self.timeout)

    class PinnedHTTPS(urllib.request.HTTPSHandler):
        def https_open(self, req):
            return self.do_open(PinnedHTTPSConnection, req)

    class PinnedHTTP(urllib.request.HTTPHandler):
        def http_open(self, req):
            return self.do_open(PinnedHTTPConnection, req)

    return urllib.request.build_opener(urllib.request.ProxyHandler({}), PinnedHTTPS(), PinnedHTTP())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="short smoke run")
    parser.add_argument("--megabytes", type=int, default=0, help="download size (default 100, quick 10)")
    parser.add_argument("--repeat", type=int, default=0, help="downloads per measure (default 7, quick 2)")
    args = parser.parse_args()
    prefix = benchlib.cellblock_prefix()
    if not (prefix / "bin" / "cellblock-gateway").exists():
        print(f"cellblock-gateway is not installed under {prefix} (set CELLBLOCK_PREFIX)", file=sys.stderr)
        return 1
    size = (args.megabytes or (10 if args.quick else 100)) * 1_000_000
    repeat = args.repeat or (2 if args.quick else 7)
    requests_count = 10 if args.quick else 100
    with tempfile.TemporaryDirectory(prefix="bench-egress-") as scratch:
        workdir = Path(scratch)
        internet = LocalInternet(workdir / "internet", names=["bulk.test"])
        gateway = None
        try:
            gateway = Gateway(prefix, workdir, internet)
            response = gateway.http.post(f"{gateway.url}/agent/v1/sessions",
                                         json={"name": "bench", "network": {"allow": ["bulk.test"]}}, timeout=300)
            response.raise_for_status()
            gateway.http.put(f"{gateway.url}/agent/v1/sessions/bench/files/ca.pem",
                             data=internet.ca_path.read_bytes(), timeout=60).raise_for_status()
            progress(f"egress: {repeat} rounds of {size // 1_000_000} MB through the proxy and directly (HTTPS, "
                     f"HTTP), interleaved, and {requests_count} small requests each way")
            address = internet.addresses["bulk.test"]
            opener = pinned_opener(address, internet.ca_path)
            namespace = {}
            exec(CLIENT, namespace)
            setup = (CLIENT + "import os\nos.environ['SSL_CERT_FILE'] = '/workspace/ca.pem'\n"
                     "opener = urllib.request.build_opener()\n")  # the proxy variables the kernel set
            gateway.execute("bench", setup)
            proxied = {"https": [], "http": [], "latency_https": [], "latency_http": []}
            direct = {"https": [], "http": [], "latency_https": [], "latency_http": []}
            # Rounds alternate between the two so that the machine's load (shared, 2 cores) hits both alike.
            for round_ in range(repeat):
                latency_count = max(1, requests_count // repeat)
                code = (f"print(json.dumps(measure('https://bulk.test', 'http://bulk.test', {size}, 1, "
                        f"{latency_count}, opener)))")
                for key, values in json.loads(gateway.execute("bench", code)["stdout"]).items():
                    proxied[key] += values
                for key, values in namespace["measure"]("https://bulk.test", "http://bulk.test", size, 1,
                                                        latency_count, opener).items():
                    direct[key] += values
        finally:
            if gateway:
                gateway.stop()
            internet.stop()

    def ratio(kind):
        return Stats(proxied[kind]).median / Stats(direct[kind]).median * 100

    rows = [
        Row(f"{size // 1_000_000} MB over HTTPS (CONNECT tunnel)", Stats(proxied["https"]),
            {"direct on loopback": Stats(direct["https"])}, unit="MB/s", target="≥ 80 % of direct",
            note=f"{ratio('https'):.0f} % of direct"),
        Row(f"{size // 1_000_000} MB over HTTP (absolute-form, forwarded)", Stats(proxied["http"]),
            {"direct on loopback": Stats(direct["http"])}, unit="MB/s", target="≥ 80 % of direct",
            note=f"{ratio('http'):.0f} % of direct"),
    ]
    print(markdown_table("Download throughput through the egress proxy vs direct", rows, higher_is_better=True))
    added_https = Stats(proxied["latency_https"]).median - Stats(direct["latency_https"]).median
    added_http = Stats(proxied["latency_http"]).median - Stats(direct["latency_http"]).median
    print(markdown_table("Latency of one small request (new connection each)", [
        Row("GET /hello over HTTPS", Stats(proxied["latency_https"]), {"direct on loopback": Stats(direct["latency_https"])},
            note=f"the proxy adds {added_https:.2f} ms (median)"),
        Row("GET /hello over HTTP", Stats(proxied["latency_http"]), {"direct on loopback": Stats(direct["latency_http"])},
            note=f"the proxy adds {added_http:.2f} ms (median)"),
    ]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
