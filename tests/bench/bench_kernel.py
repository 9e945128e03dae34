#!/usr/bin/env python3
"""cellblock-kernel vs ipykernel (Debian 6.17; PyPI 7.x) and xeus-python (PyPI 0.19) over raw ZMQ: cold start to
kernel_info_reply, `1+1` round trip, 1 MiB prints, idle PSS.

    /usr/bin/python3 tests/bench/bench_kernel.py [--quick] [--starts N] [--executes N]

Both kernels are launched the same way, from their kernelspec argv with a fresh connection file (no
jupyter_client KernelManager in the timed path), and driven by the same lean client: a DEALER on shell and a SUB
on IOPub, requests signed with hmac-sha256.
- cold start: Popen -> kernel_info_reply on shell (the request is queued in the DEALER before the kernel binds;
  a 2 ms reconnect interval keeps libzmq's 100 ms default out of the figure), and Popen -> the reply to a first
  `1+1` sent right after it (cellblock answers kernel_info while its worker is still starting; this one waits
  for the worker);
- `1+1`: execute_request sent -> IOPub `status: idle` for it (execute_input, execute_result and the reply included);
- 1 MiB print: execute_request sent -> IOPub `status: idle`, every IOPub message's signature checked, twice: with
  the client's JSON parsing (`json.loads` of the four parts of every message, as a client that shows the output
  must) and without it (what the kernel's delivery costs; the stream's content frames are kept and checked after
  the clock stops). cellblock's output cap, 1 MiB by default, is raised to 64 MiB so that the print arrives
  whole, as the peer sends it;
- idle PSS: the kernel process and every descendant (for cellblock: the sandbox and the Python worker), after
  the executes and a second of rest.
Unless --no-zygote, cellblock is measured twice: with its worker exec'd (the default) and with `worker.zygote: true`
(the worker forked from the tenant's running template, sandbox/README.md "Worker zygote"; the template is started
before the timed starts, as a kernel host keeps it; its PSS is not in the idle figure). The cold-start target
target is start -> kernel_info_reply *with a ready worker*, i.e. the first `1+1` reply of a zygote kernel.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import hmac
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import zmq

import benchlib
from benchlib import Row, Stats, markdown_table, progress
from bench_memory import ZYGOTE_KIND, cellblock_zygote, install_zygote_kernelspec, warm_template
from bench_outputs import ONE_MIB_PRINT, check_output

KINDS = [("cellblock", "cellblock-python"), ("ipykernel", "python3")]
ZYGOTE_LABEL = ZYGOTE_KIND[0]
DELIMITER = b"<IDS|MSG>"


class LeanClient:
    def __init__(self, context: zmq.Context, info: dict):
        self.key = info["key"].encode()
        self.session = uuid.uuid4().hex
        base = f"{info['transport']}://{info['ip']}:"
        self.shell = context.socket(zmq.DEALER)
        self.shell.linger = 0
        self.shell.setsockopt(zmq.RECONNECT_IVL, 2)
        self.shell.connect(base + str(info["shell_port"]))
        self.iopub = context.socket(zmq.SUB)
        self.iopub.linger = 0
        self.iopub.setsockopt(zmq.RECONNECT_IVL, 2)
        self.iopub.setsockopt(zmq.SUBSCRIBE, b"")
        self.iopub.connect(base + str(info["iopub_port"]))

    def close(self) -> None:
        self.shell.close()
        self.iopub.close()

    def send(self, msg_type: str, content: dict) -> bytes:
        msg_id = uuid.uuid4().hex
        header = json.dumps({"msg_id": msg_id, "msg_type": msg_type, "username": "bench", "session": self.session,
                             "version": "5.3",
                             "date": datetime.datetime.now(datetime.timezone.utc).isoformat()}).encode()
        frames = [header, b"{}", b"{}", json.dumps(content).encode()]
        signature = hmac.new(self.key, digestmod=hashlib.sha256)
        for frame in frames:
            signature.update(frame)
        self.shell.send_multipart([DELIMITER, signature.hexdigest().encode(), *frames])
        return msg_id.encode()

    def wait_reply(self, msg_id: bytes, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.shell.poll(50):
                frames = self.shell.recv_multipart()
                start = frames.index(DELIMITER)
                if msg_id in frames[start + 3]:
                    return json.loads(frames[start + 5])
        raise TimeoutError("no reply")

    def wait_idle(self, msg_id: bytes, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.iopub.poll(50):
                frames = self.iopub.recv_multipart()
                start = frames.index(DELIMITER)
                if msg_id in frames[start + 3] and b'"status"' in frames[start + 2] and b"idle" in frames[start + 5]:
                    return
        raise TimeoutError("no idle")

    def wait_output(self, msg_id: bytes, timeout: float, parse: bool) -> list[bytes | str]:
        """The stream output of a request, up to its IOPub idle: every message's signature checked; with `parse`,
        its JSON parsed and the stream texts returned, as a client that shows them must, else the stream messages'
        content frames (the idle is found as wait_idle finds it)."""
        deadline = time.monotonic() + timeout
        text = []
        while time.monotonic() < deadline:
            if not self.iopub.poll(50):
                continue
            frames = self.iopub.recv_multipart()
            start = frames.index(DELIMITER)
            parts = frames[start + 2:start + 6]
            signature = hmac.new(self.key, digestmod=hashlib.sha256)
            for part in parts:
                signature.update(part)
            if not hmac.compare_digest(signature.hexdigest().encode(), frames[start + 1]):
                raise RuntimeError("IOPub message with a bad signature")
            if not parse:
                if msg_id not in parts[1]:
                    continue
                if b'"stream"' in parts[0]:
                    text.append(parts[3])
                elif b'"status"' in parts[0] and b"idle" in parts[3]:
                    return text
                continue
            header, parent, _, content = (json.loads(part) for part in parts)
            if parent.get("msg_id", "").encode() != msg_id:
                continue
            if header["msg_type"] == "stream":
                text.append(content["text"])
            elif header["msg_type"] == "status" and content["execution_state"] == "idle":
                return text
        raise TimeoutError("no idle")

    def drain_shell(self) -> None:
        while self.shell.poll(0):
            self.shell.recv_multipart()


class LaunchedKernel:
    """A kernel started from its kernelspec argv with our own connection file."""

    def __init__(self, kernel_name: str, workdir: Path, env: dict[str, str] | None = None):
        from jupyter_client.connect import write_connection_file
        from jupyter_client.kernelspec import KernelSpecManager
        spec = KernelSpecManager().get_kernel_spec(kernel_name)
        self.connection_file = str(workdir / f"{kernel_name}-{uuid.uuid4().hex}.json")
        write_connection_file(self.connection_file, key=uuid.uuid4().hex.encode(), signature_scheme="hmac-sha256")
        with open(self.connection_file) as f:
            self.info = json.load(f)
        self.argv = [arg.replace("{connection_file}", self.connection_file) for arg in spec.argv]
        self.env = dict(os.environ, **spec.env, **(env or {}))
        self.process = None

    def start(self) -> None:
        self.process = subprocess.Popen(self.argv, env=self.env, start_new_session=True,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def stop(self) -> None:
        if self.process is not None:
            benchlib.stop_process(self.process)
        try:
            os.unlink(self.connection_file)
        except OSError:
            pass


def cold_start_ms(context: zmq.Context, kernel_name: str, workdir: Path) -> tuple[float, float]:
    """(start -> kernel_info_reply, start -> first `1+1` execute_reply), in ms, from one launch."""
    kernel = LaunchedKernel(kernel_name, workdir)
    client = LeanClient(context, kernel.info)
    try:
        started = time.perf_counter()
        kernel.start()
        client.wait_reply(client.send("kernel_info_request", {}), timeout=60)
        info_ms = (time.perf_counter() - started) * 1000.0
        content = {"code": "1+1", "silent": False, "store_history": True, "user_expressions": {},
                   "allow_stdin": False, "stop_on_error": True}
        reply = client.wait_reply(client.send("execute_request", content), timeout=60)
        if reply.get("status") != "ok":
            raise RuntimeError(f"first execute failed: {reply}")
        return info_ms, (time.perf_counter() - started) * 1000.0
    finally:
        client.close()
        kernel.stop()


def check_one_mib(output: list[bytes | str]) -> None:
    """bench_outputs.py's check of the print, on what wait_output returned (texts or unparsed content frames)."""
    texts = [json.loads(part)["text"] if isinstance(part, bytes) else part for part in output]
    check_output(ONE_MIB_PRINT, [{"msg_type": "stream", "content": {"text": text}} for text in texts])


def execute_and_memory(context: zmq.Context, kernel_name: str, workdir: Path, executes: int,
                       prints: int) -> tuple[Stats, Stats, dict[bool, Stats]]:
    """`1+1` round trips, then the idle PSS, then 1 MiB print round trips ({parsed: Stats})."""
    kernel = LaunchedKernel(kernel_name, workdir, env={"CELLBLOCK_OUTPUT_BYTES": str(64 << 20)})
    client = LeanClient(context, kernel.info)
    try:
        kernel.start()
        client.wait_reply(client.send("kernel_info_request", {}), timeout=60)
        content = {"code": "1+1", "silent": False, "store_history": True, "user_expressions": {},
                   "allow_stdin": False, "stop_on_error": True}
        # Warm up until IOPub is connected (the first idle can be missed by a slow joiner).
        for _ in range(100):
            msg_id = client.send("execute_request", content)
            try:
                client.wait_idle(msg_id, timeout=30 if _ == 0 else 2)
                break
            except TimeoutError:
                continue
        for _ in range(5):
            client.wait_idle(client.send("execute_request", content), timeout=30)
        client.drain_shell()
        samples = []
        for _ in range(executes):
            started = time.perf_counter()
            msg_id = client.send("execute_request", content)
            client.wait_idle(msg_id, timeout=30)
            samples.append((time.perf_counter() - started) * 1000.0)
            client.drain_shell()
        time.sleep(1.0)
        pss_mb = sum(benchlib.pss_kib(pid) for pid in benchlib.descendants(kernel.process.pid)) / 1024.0
        print_content = dict(content, code=ONE_MIB_PRINT)
        print_samples = {False: [], True: []}
        for index in range(2 * prints + 2):  # two warm-ups: the first 1 MiB buffers on both sides
            parse = index % 2 == 1  # interleaved, so that both see the same machine
            started = time.perf_counter()
            output = client.wait_output(client.send("execute_request", print_content), timeout=30, parse=parse)
            elapsed = (time.perf_counter() - started) * 1000.0
            check_one_mib(output)
            if index >= 2:
                print_samples[parse].append(elapsed)
            client.drain_shell()
        return Stats(samples), Stats([pss_mb]), {parse: Stats(values) for parse, values in print_samples.items()}
    finally:
        client.close()
        kernel.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="short smoke run")
    parser.add_argument("--starts", type=int, help="cold starts per kernel (default 20, quick 3)")
    parser.add_argument("--executes", type=int, help="timed `1+1` per kernel (default 300, quick 30)")
    parser.add_argument("--prints", type=int, help="timed 1 MiB prints per kernel (default 30, quick 3)")
    parser.add_argument("--no-zygote", dest="zygote", action="store_false",
                        help="leave out cellblock with its worker forked from a template")
    args = parser.parse_args()
    starts = args.starts or (3 if args.quick else 20)
    executes = args.executes or (30 if args.quick else 300)
    prints = args.prints or (3 if args.quick else 30)  # of each of the two kinds

    benchlib.use_installed_kernelspecs()
    context = zmq.Context()
    cold: dict[str, Stats | None] = {}
    first_result: dict[str, Stats | None] = {}
    round_trip: dict[str, Stats | None] = {}
    memory: dict[str, Stats | None] = {}
    big_print: dict[str, Stats | None] = {}
    with tempfile.TemporaryDirectory(prefix="bench-kernel-") as tmp:
        workdir = Path(tmp)
        pypi_kinds = benchlib.install_pypi_kernelspecs(workdir)
        kinds = list(KINDS) + list(pypi_kinds.items())
        zygote_policy = None
        if args.zygote:
            zygote_policy = install_zygote_kernelspec(workdir)
            warm_template(zygote_policy)
            kinds.insert(1, (ZYGOTE_LABEL, ZYGOTE_KIND[1]))
        try:
            measure_kinds(context, kinds, workdir, starts, (executes, prints), cold, first_result,
                          (round_trip, memory, big_print))
        finally:
            if zygote_policy is not None:
                cellblock_zygote.stop_templates(zygote_policy)
    context.term()

    def parsed_print(label: str, parse: bool) -> Stats | None:
        return big_print[label][parse] if big_print.get(label) else None

    peer_labels = ["ipykernel", *pypi_kinds]

    def peers(table: dict, parse: bool | None = None) -> dict[str, Stats | None]:
        """Every peer's column: Debian's ipykernel, then the PyPI ones (the same run)."""
        if parse is not None:
            return {label: parsed_print(label, parse) for label in peer_labels}
        return {label: table.get(label) for label in peer_labels}

    rows = [
        Row("cold start → kernel_info_reply", cold.get("cellblock"), peers(cold),
            target="≤ 400 ms", note="cellblock answers kernel_info before its worker is ready"),
        Row("cold start → first `1+1` execute_reply", first_result.get("cellblock"), peers(first_result),
            note="includes the confined worker's start (exec: IPython import)"),
    ]
    if args.zygote:
        rows.append(Row("cold start → first `1+1` execute_reply, zygote worker", first_result.get(ZYGOTE_LABEL),
                        peers(first_result), target="≤ 50 ms, ≤ 30 ms p50",
                        note="a ready worker forked from the running template"))
    rows += [
        Row("execute `1+1` → idle (ZMQ)", round_trip.get("cellblock"), peers(round_trip),
            target="≤ 1.5 ms"),
        Row("1 MiB print → idle (ZMQ), client parses", parsed_print("cellblock", True), peers(big_print, True),
            note="every IOPub message's signature checked and its JSON parsed (`json.loads`)"),
        Row("1 MiB print → idle (ZMQ), kernel's delivery", parsed_print("cellblock", False), peers(big_print, False), target="≤ 8 ms",
            note="every IOPub message's signature checked, the JSON parsed after the clock stops"),
        Row("idle PSS, kernel + worker", memory.get("cellblock"), peers(memory), unit="MB",
            note="sum over the kernel's process tree"),
    ]
    print(markdown_table("cellblock-kernel vs ipykernel 6.17 (Debian) and the PyPI peers (raw ZMQ client)", rows))
    # Every kind measured, peers included: a missing peer is an install step (install-deps.sh), not a skip.
    ok = all(value is not None for table in (cold, round_trip, memory, big_print) for value in table.values())
    ok = ok and (not args.zygote or first_result.get(ZYGOTE_LABEL) is not None)
    return 0 if ok else 1


def measure_kinds(context, kinds, workdir, starts, counts, cold, first_result, running) -> None:
    executes, prints = counts
    round_trip, memory, big_print = running
    for label, kernel_name in kinds:
        if not benchlib.kernelspec_available(kernel_name):
            progress(f"{label}: kernelspec {kernel_name} not available: the run fails")
            cold[label] = first_result[label] = round_trip[label] = memory[label] = big_print[label] = None
            continue
        try:
            progress(f"{label}: {starts} cold starts")
            # Nothing else runs meanwhile: each start is measured alone on the machine.
            pairs = [cold_start_ms(context, kernel_name, workdir) for _ in range(starts)]
            cold[label] = Stats([info for info, _ in pairs])
            first_result[label] = Stats([first for _, first in pairs])
            if label == ZYGOTE_LABEL:
                continue  # the same kernel once started: its executes are cellblock's
            progress(f"{label}: {executes} executes of 1+1, idle PSS, {prints} prints of 1 MiB")
            round_trip[label], memory[label], big_print[label] = execute_and_memory(
                context, kernel_name, workdir, executes, prints)
        except Exception as error:  # a peer failing must not hide our figures (and vice versa)
            progress(f"{label}: failed: {error!r}")
            for table in (cold, first_result, round_trip, memory, big_print):
                table.setdefault(label, None)


if __name__ == "__main__":
    sys.exit(main())
