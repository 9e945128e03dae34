#!/usr/bin/env python3
"""The live page of an agent session: IOPub -> the page's DOM, and the gateway's CPU per watcher.

    /usr/bin/python3 tests/bench/bench_live_page.py [--quick] [--prints N] [--bigs N] [--readers 0,1,50]
                                                    [--lines N] [--rounds N] [--json PATH]

One installed cellblock-gateway (a temporary state directory, no warm pool, its defaults otherwise: the live
relay stops at --agent-inline-output-bytes, 32 KiB, per cell), confined cellblock kernels.
- Latency (live_page_latency.js, headless Chromium through playwright-core, the live page as a person opens it):
  the "IOPub" clock is the arrival of the agent API's NDJSON execute stream event (as
  tests/gateway/clients/live-page.test.js measures it); the page's clock a MutationObserver in the page. A
  one-line print: its stdout event -> the line in the page's DOM. A 1 MB print (1,048,576 bytes, a marker as
  its last line): the page shows the first 32 KiB live and the head and tail of the whole with the cell's end,
  so: the NDJSON `end` event -> the marker in the page in a cell marked ok; also first stdout event -> the
  head line in the page, and first stdout event -> the end in the page. The floor beside each: a plain HTTP
  reader of the same server-sent events in the same Node process (what any page waits for before it can draw).
- CPU: one session prints --lines lines steadily (flushed one at a time, a 2 ms pause after each, kept under
  the live relay's cap, so every line is relayed to every reader) while 0, 1 or N plain HTTP readers of its
  events (raw sockets on one selector thread in this process, each reading every event as EventSource would)
  are connected; utime+stime of the gateway process from /proc before the execute and after every reader saw
  the cell's end event. A fresh session per measurement (nothing to replay), the reader counts interleaved in
  every round; CPU per reader and per event delivered are differences against 0 readers in the same round.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import secrets
import selectors
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import benchlib
from benchlib import Row, Stats, markdown_table, progress

HERE = Path(__file__).resolve().parent
CLIENTS_DIR = HERE.parent / "gateway" / "clients"
LATENCY_SCRIPT = HERE / "live_page_latency.js"


class Gateway:
    def __init__(self, prefix: Path, state_dir: Path, log_path: Path):
        self.port = benchlib.free_port()
        self.token = secrets.token_hex(16)
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("KG_")}
        env["JUPYTER_PATH"] = str(prefix / "share" / "jupyter")
        self.log = open(log_path, "wb")
        self.log_path = log_path
        self.process = subprocess.Popen(
            [str(prefix / "bin" / "cellblock-gateway"), "--ip", "127.0.0.1", "--port", str(self.port), "--token",
             self.token, "--kernelspec-dir", str(prefix / "share" / "jupyter" / "kernels"), "--state-dir",
             str(state_dir), "--shutdown-kernels-on-exit", "--warm-pool", "0"],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        deadline = time.monotonic() + 60
        ready = re.compile(rf"is available at http://127\.0\.0\.1:{self.port}\b")
        while not ready.search(log_path.read_text(errors="replace")):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"gateway did not start:\n{log_path.read_text(errors='replace')[-2000:]}")
            time.sleep(0.05)
        self.connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)

    def call(self, method: str, path: str, body=None) -> tuple[int, bytes]:
        headers = {"Authorization": f"token {self.token}", "Accept": "application/json"}
        payload = None
        if body is not None:
            payload = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        self.connection.request(method, path, body=payload, headers=headers)
        response = self.connection.getresponse()
        return response.status, response.read()

    def create_session(self) -> str:
        status, body = self.call("POST", "/agent/v1/sessions", {})
        if status != 201:
            raise RuntimeError(f"create session: {status} {body[:200]!r}")
        return json.loads(body)["id"]

    def execute(self, session: str, code: str) -> dict:
        status, body = self.call("POST", f"/agent/v1/sessions/{session}/execute", {"code": code})
        answer = json.loads(body) if body else {}
        if status != 200 or answer.get("status") != "ok":
            raise RuntimeError(f"execute: {status} {body[:300]!r}")
        return answer

    def stop(self) -> None:
        self.connection.close()
        benchlib.stop_process(self.process)
        self.log.close()


# ------------------------------------------------------------------------------------- latency (Chromium)
def node_clients_ready() -> Path:
    """The Node clients of tests/gateway/clients (playwright-core), installed as that suite installs them."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if not node:
        raise RuntimeError("node is required (share/scripts/install-deps.sh --with-test-tools installs it)")
    if not (CLIENTS_DIR / "node_modules" / "playwright-core" / "package.json").exists():
        if not npm:
            raise RuntimeError(f"{CLIENTS_DIR}/node_modules is missing and npm is not installed")
        progress(f"live page: npm ci in {CLIENTS_DIR}")
        subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"], cwd=CLIENTS_DIR, check=True,
                       stdout=sys.stderr)
    return Path(node)


def measure_latency(gateway: Gateway, prints: int, bigs: int) -> dict:
    node = node_clients_ready()
    session = gateway.create_session()
    gateway.execute(session, "pass")  # the kernel's first cell is not what is measured
    env = dict(os.environ, GATEWAY_URL=gateway.url, GATEWAY_TOKEN=gateway.token, SESSION=session,
               PRINTS=str(prints), BIGS=str(bigs), BIG_BYTES=str(1 << 20))
    result = subprocess.run([str(node), str(LATENCY_SCRIPT)], env=env, stdout=subprocess.PIPE, text=True,
                            timeout=900)
    if result.returncode != 0:
        raise RuntimeError(f"{LATENCY_SCRIPT.name} exited with {result.returncode}")
    return json.loads(result.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------------------- CPU (readers)
class Readers:
    """`count` plain HTTP/1.1 readers of one session's events on raw sockets, read by one selector thread: each
    parses its stream as EventSource does (chunked transfer coding, blank-line separated events, id and data
    lines) and counts its events; `wait_end(cell)` returns once every reader has read that cell's end event."""

    def __init__(self, gateway: Gateway, session: str, count: int):
        self.count = count
        self.selector = selectors.DefaultSelector()
        self.condition = threading.Condition()
        self.state = []
        self.error: Exception | None = None
        self.stopping = False
        request = (f"GET /agent/v1/sessions/{session}/events HTTP/1.1\r\nHost: 127.0.0.1:{gateway.port}\r\n"
                   f"Authorization: token {gateway.token}\r\nAccept: text/event-stream\r\n\r\n").encode()
        for index in range(count):
            sock = socket.create_connection(("127.0.0.1", gateway.port), timeout=30)
            sock.sendall(request)
            sock.setblocking(False)
            reader = {"raw": b"", "headers": False, "chunked": False, "body": b"", "events": 0, "ends": set()}
            self.state.append(reader)
            self.selector.register(sock, selectors.EVENT_READ, reader)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while not self.stopping:
                for key, _ in self.selector.select(0.2):
                    data = key.fileobj.recv(1 << 20)
                    if not data:
                        raise RuntimeError("the gateway closed an events stream")
                    self._feed(key.data, data)
        except Exception as failure:  # noqa: BLE001 - reported to the waiting thread
            with self.condition:
                self.error = failure
                self.condition.notify_all()

    def _feed(self, reader: dict, data: bytes) -> None:
        reader["raw"] += data
        if not reader["headers"]:
            end = reader["raw"].find(b"\r\n\r\n")
            if end < 0:
                return
            head = reader["raw"][:end].decode("latin-1")
            if not head.startswith("HTTP/1.1 200"):
                raise RuntimeError(f"events: {head.splitlines()[0]}")
            reader["chunked"] = "transfer-encoding: chunked" in head.lower()
            reader["headers"] = True
            reader["raw"] = reader["raw"][end + 4:]
        if reader["chunked"]:
            raw = reader["raw"]
            while True:
                line_end = raw.find(b"\r\n")
                if line_end < 0:
                    break
                size = int(raw[:line_end].split(b";")[0], 16)
                if len(raw) < line_end + 2 + size + 2:
                    break
                reader["body"] += raw[line_end + 2:line_end + 2 + size]
                raw = raw[line_end + 2 + size + 2:]
            reader["raw"] = raw
        else:
            reader["body"] += reader["raw"]
            reader["raw"] = b""
        body = reader["body"]
        ended = None
        start = 0
        while True:
            end = body.find(b"\n\n", start)
            if end < 0:
                break
            block = body[start:end]
            start = end + 2
            if not block.startswith(b"id: "):
                continue  # the retry line, keepalive comments
            reader["events"] += 1
            if b'"type":"end"' in block:
                data = block[block.index(b"\ndata: ") + 7:]
                ended = json.loads(data)["cell"]
                reader["ends"].add(ended)
        reader["body"] = body[start:]
        if ended is not None:
            with self.condition:
                self.condition.notify_all()

    def wait_end(self, cell: int, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        with self.condition:
            while not all(cell in reader["ends"] for reader in self.state):
                if self.error:
                    raise self.error
                if not self.condition.wait(max(0.0, deadline - time.monotonic())):
                    raise TimeoutError(f"not every reader saw cell {cell}'s end within {timeout} s")

    def events(self) -> list[int]:
        with self.condition:
            return [reader["events"] for reader in self.state]

    def close(self) -> None:
        self.stopping = True
        self.thread.join(5)
        for key in list(self.selector.get_map().values()):
            key.fileobj.close()
        self.selector.close()


def busy_code(lines: int) -> str:
    # Lines of 15 bytes: 2,000 of them (30,000 bytes) stay under the live relay's 32 KiB cap, so all are relayed.
    return (f"import sys, time\nfor i in range({lines}):\n    sys.stdout.write(f'{{i:06d}} busy-00\\n')\n"
            "    sys.stdout.flush()\n    time.sleep(0.002)")


def measure_cpu(gateway: Gateway, counts: list[int], lines: int, rounds: int) -> dict:
    """{readers: [(gateway CPU seconds, events per reader, seconds), ...]} over the rounds."""
    measured: dict[int, list[tuple[float, int, float]]] = {count: [] for count in counts}
    for round_index in range(rounds):
        order = counts if round_index % 2 == 0 else list(reversed(counts))
        for count in order:
            session = gateway.create_session()
            readers = Readers(gateway, session, count)
            try:
                gateway.execute(session, "pass")  # cell 0: every reader is subscribed once it has read its end
                readers.wait_end(0)
                before_events = readers.events()
                cpu_before, started = benchlib.cpu_seconds([gateway.process.pid]), time.perf_counter()
                answer = gateway.execute(session, busy_code(lines))
                readers.wait_end(1)
                cpu_after, elapsed = benchlib.cpu_seconds([gateway.process.pid]), time.perf_counter() - started
                if len(answer.get("stdout", "")) != lines * 15:
                    raise RuntimeError(f"busy cell printed {len(answer.get('stdout', ''))} bytes")
                per_reader = [after - before for after, before in zip(readers.events(), before_events)]
                if len(set(per_reader)) > 1:
                    raise RuntimeError(f"readers read different numbers of events: {sorted(set(per_reader))}")
            finally:
                readers.close()
                gateway.call("DELETE", f"/agent/v1/sessions/{session}")
            events = per_reader[0] if per_reader else 0
            measured[count].append((cpu_after - cpu_before, events, elapsed))
            progress(f"live page: round {round_index + 1}, {count} readers: gateway {cpu_after - cpu_before:.2f} "
                     f"CPU s over {elapsed:.2f} s, {events} events per reader")
    return measured


DRAIN = """import selectors, socket, sys
port, count = int(sys.argv[1]), int(sys.argv[2])
selector = selectors.DefaultSelector()
for _ in range(count):
    selector.register(socket.create_connection(("127.0.0.1", port)), selectors.EVENT_READ)
while selector.get_map():
    for key, _ in selector.select():
        if not key.fileobj.recv(1 << 20):
            selector.unregister(key.fileobj)
"""


def send_floor_us(payload: bytes, readers: int, events: int, repeats: int) -> Stats:
    """The least a server can spend to deliver one event to one reader: one send() of the event's bytes on a
    loopback TCP connection with TCP_NODELAY (as the gateway's), fanned out to `readers` connections that another
    process drains, events 1 ms apart as a steadily printing cell's are (back to back, Linux would cork them into
    one segment). The sending thread's CPU per send, µs, less the same loop without the sends (the sleeps); Linux
    charges the loopback delivery to the sender, as it does to the gateway."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=readers)
    drain = subprocess.Popen([sys.executable, "-c", DRAIN, str(listener.getsockname()[1]), str(readers)])
    connections = []
    try:
        for _ in range(readers):
            connection, _ = listener.accept()
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            connections.append(connection)

        def run(send: bool) -> float:
            started = time.thread_time()
            for _ in range(events):
                if send:
                    for connection in connections:
                        connection.sendall(payload)
                time.sleep(0.001)
            return time.thread_time() - started

        samples = []
        for repeat in range(repeats + 1):  # the first is a warm-up
            with_sends, without = run(True), run(False)
            if repeat:
                samples.append((with_sends - without) / (events * readers) * 1e6)
    finally:
        for connection in connections:
            connection.close()
        listener.close()
        drain.wait(10)
    return Stats(samples)


def measure_cpu_pages(gateway: Gateway, counts: list[int], lines: int, rounds: int) -> dict:
    """The same as measure_cpu with live pages in headless Chromium instead of plain readers."""
    node = node_clients_ready()
    env = dict(os.environ, MODE="pages", GATEWAY_URL=gateway.url, GATEWAY_TOKEN=gateway.token,
               GATEWAY_PID=str(gateway.process.pid), PAGE_COUNTS=",".join(map(str, counts)), ROUNDS=str(rounds),
               BUSY_CODE=busy_code(lines))
    result = subprocess.run([str(node), str(LATENCY_SCRIPT)], env=env, stdout=subprocess.PIPE, text=True,
                            timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(f"{LATENCY_SCRIPT.name} (pages) exited with {result.returncode}")
    return {int(count): [(s["cpu_s"], 0, s["seconds"]) for s in samples]
            for count, samples in json.loads(result.stdout.strip().splitlines()[-1]).items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="short smoke run")
    parser.add_argument("--prints", type=int, help="one-line prints measured (default 30, quick 3)")
    parser.add_argument("--bigs", type=int, help="1 MB prints measured (default 10, quick 1)")
    parser.add_argument("--readers", help="reader counts for the CPU part (default 0,1,50; quick 0,1,10)")
    parser.add_argument("--lines", type=int, help="lines the busy cell prints (default 2000, quick 200)")
    parser.add_argument("--rounds", type=int, help="rounds of the CPU part (default 5, quick 1)")
    parser.add_argument("--pages", help="page counts for the CPU part with live pages in Chromium (default 0,10; "
                        "quick: none; '' for none)")
    parser.add_argument("--json", type=Path, help="also write the samples to this file")
    args = parser.parse_args()
    prints = args.prints or (3 if args.quick else 30)
    bigs = args.bigs or (1 if args.quick else 10)
    counts = [int(c) for c in (args.readers or ("0,1,10" if args.quick else "0,1,50")).split(",")]
    lines = args.lines or (200 if args.quick else 2000)
    pages_arg = args.pages if args.pages is not None else ("" if args.quick else "0,10")
    page_counts = [int(c) for c in pages_arg.split(",") if c.strip()]
    if page_counts and 0 not in page_counts:
        parser.error("--pages must include 0 (the baseline)")
    rounds = args.rounds or (1 if args.quick else 5)
    if lines * 15 > 32768:
        parser.error("--lines above 2184 would pass the live relay's 32 KiB cap")
    if 0 not in counts:
        parser.error("--readers must include 0 (the baseline)")
    prefix = benchlib.cellblock_prefix()
    if not (prefix / "bin" / "cellblock-gateway").exists():
        print(f"cellblock-gateway is not installed under {prefix} (set CELLBLOCK_PREFIX)", file=sys.stderr)
        return 1

    with tempfile.TemporaryDirectory(prefix="bench-live-page-") as scratch:
        gateway = Gateway(prefix, Path(scratch) / "state", Path(scratch) / "gateway.log")
        try:
            progress(f"live page: latency, {prints} prints and {bigs} outputs of 1 MiB in headless Chromium")
            latency = measure_latency(gateway, prints, bigs)
            progress(f"live page: gateway CPU, {lines} lines with {counts} readers, {rounds} rounds")
            cpu = measure_cpu(gateway, counts, lines, rounds)
            # One event of the busy cell as the gateway writes it (event, chunk framing): the floor's payload.
            event = b'id: 1234\ndata: {"cell":1,"text":"001234 busy-00\\n","type":"stdout"}\n\n'
            floor_us = {count: send_floor_us(b"%x\r\n" % len(event) + event + b"\r\n", count,
                                             100 if args.quick else 400, 1 if args.quick else 5)
                        for count in sorted(set(counts) | set(page_counts)) if count}
            cpu_pages, pages_failed = {}, None
            if page_counts:
                progress(f"live page: gateway CPU, {lines} lines with {page_counts} pages, {rounds} rounds")
                try:
                    cpu_pages = measure_cpu_pages(gateway, page_counts, lines, rounds)
                except Exception as failure:  # noqa: BLE001 - the figures measured so far are still printed
                    pages_failed = f"{type(failure).__name__}: {failure}"
                    progress(f"live page: pages not measured ({pages_failed}): the run fails")
        finally:
            gateway.stop()

    floor, plain = "EventSource message in the page (floor)", "plain HTTP reader in Node"
    rows = [
        Row("one-line print: NDJSON stdout event → the line in the page's DOM", Stats(latency["print"]["page"]),
            {floor: Stats(latency["print"]["eventSource"]), plain: Stats(latency["print"]["plain"])},
            target="≤ 1,000 ms", note="the page applies events once per animation frame"),
        Row("1 MB print: NDJSON end event → the page shows the cell's end (tail, ok)", Stats(latency["big"]["page"]),
            {floor: Stats(latency["big"]["eventSource"]), plain: Stats(latency["big"]["plain"])},
            note="the live relay stops at 32 KiB; the end event brings the head and the tail"),
        Row("1 MB print: first NDJSON stdout event → its head line in the page", Stats(latency["big"]["firstPage"]),
            {floor: Stats(latency["big"]["firstEventSource"]), plain: Stats(latency["big"]["firstPlain"])},
            note="that event is the first 32 KiB"),
        Row("1 MB print: first NDJSON stdout event → the page shows the cell's end", Stats(latency["big"]["total"]),
            note="includes the kernel publishing the whole MiB and the gateway saving it"),
    ]
    print(markdown_table("IOPub → the live page's DOM (headless Chromium)", rows))

    # Events each reader read per busy cell (the kernel coalesces some lines into one stream message), by round;
    # the pages read the same stream, counted by the plain readers.
    events = Stats([sample[1] for count, samples in cpu.items() if count for sample in samples]).median
    cpu_rows = []
    for kind, measured in (("plain reader", cpu), ("page", cpu_pages)):
        for count in sorted(measured):
            samples = measured[count]
            cpu_rows.append(Row(f"gateway CPU, busy cell, {count} {kind}{'s' if count != 1 else ''}",
                                Stats([s[0] * 1000 for s in samples]), unit="ms CPU",
                                note=f"{Stats([s[2] for s in samples]).median:.1f} s per cell"))
        for count in sorted(measured):
            if count == 0:
                continue
            extra = [measured[count][r][0] - measured[0][r][0] for r in range(rounds)]
            watching = f"{count} {kind}{'s' if count != 1 else ''} watching"
            cpu_rows.append(Row(f"… per {kind}, {watching} (minus 0)",
                                Stats([e / count * 1000 for e in extra]), unit="ms CPU",
                                note=f"for the cell's {lines} lines"))
            per_round = [measured[count][r][1] or events for r in range(rounds)]
            cpu_rows.append(Row(f"… per event delivered to one {kind}, {watching}",
                                Stats([e / (count * n) * 1e6 for e, n in zip(extra, per_round)]),
                                {"one send() per event and reader (floor)": floor_us[count]}, unit="µs CPU",
                                note=f"{events:.0f} events per reader (median)"))
    print(markdown_table(f"Gateway CPU while readers watch one busy session ({lines} lines, flushed one by one)",
                         cpu_rows))
    offsets = ", ".join(f"{c['offset']:+.2f} ms (round trip {c['rtt']:.2f})" for c in latency.get("clock", []))
    print(f"Latency: the page's clock corrected by its offset to Node's, before and after ({offsets}). "
          f"CPU: utime+stime of the gateway process (/proc, {benchlib.CLOCK_TICKS} ticks/s) from the execute to the "
          f"last reader's end event, median of {rounds} round(s), reader counts interleaved; plain readers are HTTP "
          "clients of the events stream (as EventSource) on raw sockets, pages are live pages in one headless "
          "Chromium.\n")

    if pages_failed:
        print(f"The page variant of the CPU part failed: {pages_failed}\n")
    if args.json:
        args.json.write_text(json.dumps({"latency_ms": latency,
                                         "cpu": {str(c): [{"cpu_s": s[0], "events_per_reader": s[1], "seconds": s[2]}
                                                          for s in v] for c, v in cpu.items()},
                                         "send_floor_us": {str(c): v.samples for c, v in floor_us.items()},
                                         "cpu_pages": {str(c): [{"cpu_s": s[0], "seconds": s[2]} for s in v]
                                                       for c, v in cpu_pages.items()},
                                         "lines": lines, "rounds": rounds}, indent=1))
    return 1 if pages_failed else 0


if __name__ == "__main__":
    sys.exit(main())
