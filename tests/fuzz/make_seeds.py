#!/usr/bin/python3
"""Writes the seed corpora in tests/fuzz/corpus/<target>/ (run from anywhere; rewrites the seeds it owns).

Seeds are small real messages: what JupyterLab, jupyter_client, OpenHands-style clients and the worker send,
signed with the keys the fuzz targets use, so the fuzzers start past the signature checks. The keys below must
match kernel_wire_verifier.cpp and gateway_wire_decode.cpp."""
import hashlib
import hmac
import json
import pathlib
import shutil
import struct

HERE = pathlib.Path(__file__).resolve().parent
KERNEL_KEY = b"0b8d3c4e-6f1a-4c2b-9e7d-5a3f2c1b0d9e"
GATEWAY_KEY = b"7c2e9a41-3b5d-4f60-8e1a-2d9c7b3f5e80"
SEP = b"\x1e"
DELIM = b"<IDS|MSG>"


def compact(value):
    return json.dumps(value, separators=(",", ":")).encode()


def header(msg_type, msg_id="8a1f3b2c-7d4e-4f6a-9b0c-1d2e3f4a5b6c", session="c0ffee00-1111-2222-3333-444455556666"):
    return {"msg_id": msg_id, "msg_type": msg_type, "session": session, "username": "agent",
            "date": "2026-11-30T12:00:00.000000Z", "version": "5.3"}


def signed(key, parts):
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        mac.update(part)
    return mac.hexdigest().encode()


def wire(key, identities, msg_type, content, parent=None, metadata=None, buffers=(), bad_signature=False):
    parts = [compact(header(msg_type)), compact(parent or {}), compact(metadata or {}), compact(content)]
    signature = b"0" * 64 if bad_signature else signed(key, parts)
    return SEP.join(list(identities) + [DELIM, signature] + parts + list(buffers))


def write(target, name, data):
    folder = HERE / "corpus" / target
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_bytes(data)


EXECUTE = {"code": "import pandas as pd\nprint(pd.__version__)", "silent": False, "store_history": True,
           "user_expressions": {}, "allow_stdin": True, "stop_on_error": True}
PARENT = header("execute_request")


def kernel_wire_verifier():
    ident = [b"\x00k\x8bEg"]
    # mode 0: checked exactly as received (valid signatures made with the target's key)
    write("kernel_wire_verifier", "execute_request", b"\x00" + wire(KERNEL_KEY, ident, "execute_request", EXECUTE))
    write("kernel_wire_verifier", "kernel_info_request",
          b"\x00" + wire(KERNEL_KEY, ident, "kernel_info_request", {}))
    write("kernel_wire_verifier", "shutdown_request",
          b"\x00" + wire(KERNEL_KEY, ident, "shutdown_request", {"restart": False}))
    write("kernel_wire_verifier", "input_reply", b"\x00" + wire(KERNEL_KEY, ident, "input_reply", {"value": "42"}))
    write("kernel_wire_verifier", "cellblock_replay_request",
          b"\x00" + wire(KERNEL_KEY, ident, "cellblock_replay_request", {"after": 0}))
    write("kernel_wire_verifier", "bad_signature",
          b"\x00" + wire(KERNEL_KEY, ident, "execute_request", EXECUTE, bad_signature=True))
    write("kernel_wire_verifier", "no_delimiter", b"\x00" + SEP.join([b"id", b"sig", b"{}", b"{}", b"{}", b"{}"]))
    # mode 1: the target re-signs, so the header parsing behind the HMAC is reached
    write("kernel_wire_verifier", "resigned_comm_msg_with_buffer", b"\x01" + wire(
        KERNEL_KEY, ident, "comm_msg", {"comm_id": "c1", "data": {"method": "update"}}, buffers=[b"\x00\x01\x02\xff"]))
    write("kernel_wire_verifier", "resigned_header_not_object",
          b"\x01" + SEP.join(ident + [DELIM, b"", b"[\"msg_type\"]", b"{}", b"{}", b"{}"]))
    # mode 2: no key (signing disabled)
    write("kernel_wire_verifier", "keyless_execute",
          b"\x02" + SEP.join([DELIM, b"", compact(header("execute_request")), b"{}", b"{}", compact(EXECUTE)]))


def gateway_wire_decode():
    def w(*args, **kwargs):
        return wire(GATEWAY_KEY, [], *args, parent=PARENT, **kwargs)
    # mode byte: bit 0 re-sign, bit 1 no key, bits 2-3 channel (0 shell, 1 control, 2 stdin, 3 iopub)
    iopub = 3 << 2
    write("gateway_wire_decode", "status_busy", bytes([iopub]) + w("status", {"execution_state": "busy"}))
    write("gateway_wire_decode", "stream", bytes([iopub]) + w("stream", {"name": "stdout", "text": "0.1.0\n"}))
    write("gateway_wire_decode", "display_data_png", bytes([iopub]) + w(
        "display_data", {"data": {"text/plain": "<Figure>", "image/png": "iVBORw0KGgo="}, "metadata": {},
                         "transient": {"display_id": "d1"}}))
    write("gateway_wire_decode", "comm_msg_buffers", bytes([iopub]) + w(
        "comm_msg", {"comm_id": "c1", "data": {"buffer_paths": [["a"]]}}, buffers=[b"\x00" * 8, b"\xff\xfe"]))
    write("gateway_wire_decode", "execute_reply", bytes([0]) + w(
        "execute_reply", {"status": "ok", "execution_count": 3, "user_expressions": {}, "payload": []}))
    write("gateway_wire_decode", "kernel_info_reply_control", bytes([1 << 2]) + w(
        "kernel_info_reply", {"status": "ok", "protocol_version": "5.3", "implementation": "cellblock",
                              "language_info": {"name": "python", "version": "3.11.2"}}))
    write("gateway_wire_decode", "input_request_stdin", bytes([2 << 2]) + w(
        "input_request", {"prompt": "name? ", "password": False}))
    write("gateway_wire_decode", "bad_signature", bytes([iopub]) + w(
        "status", {"execution_state": "idle"}, bad_signature=True))
    write("gateway_wire_decode", "resigned_msg_id_number", bytes([iopub | 1]) + SEP.join(
        [DELIM, b"", b'{"msg_id":7,"msg_type":"status"}', b"{}", b"{}", b'{"execution_state":"idle"}']))
    write("gateway_wire_decode", "keyless_stream", bytes([iopub | 2]) + SEP.join(
        [DELIM, b"", compact(header("stream")), b"{}", b"{}", b'{"name":"stderr","text":"x"}']))


def legacy_envelope(msg_type, content, **extra):
    envelope = {"header": header(msg_type), "parent_header": {}, "metadata": {}, "content": content,
                "buffers": [], "channel": "shell"}
    envelope.update(extra)
    return envelope


def legacy_binary(envelope, buffers):
    body = compact(envelope)
    count = 1 + len(buffers)
    offsets, position = [], 4 * (count + 1)
    for part in [body] + list(buffers):
        offsets.append(position)
        position += len(part)
    return struct.pack(">I", count) + b"".join(struct.pack(">I", o) for o in offsets) + body + b"".join(buffers)


def v1(channel, msg_type, content, buffers=()):
    parts = [channel.encode(), compact(header(msg_type)), b"{}", b"{}", compact(content)] + list(buffers)
    count = len(parts) + 1
    offsets, position = [], 8 * (count + 1)
    offsets.append(position)
    for part in parts:
        position += len(part)
        offsets.append(position)
    return struct.pack("<Q", count) + b"".join(struct.pack("<Q", o) for o in offsets) + b"".join(parts)


def websocket_message():
    text = b"\x00"
    write("websocket_message", "jupyterlab_execute", text + compact(legacy_envelope("execute_request", EXECUTE)))
    write("websocket_message", "openhands_minimal", text + compact(
        {"header": {"msg_type": "execute_request"}, "parent_header": {}, "metadata": {},
         "content": {"code": "1+1", "silent": False}}))
    float_date = legacy_envelope("kernel_info_request", {})
    float_date["header"]["date"] = 1764504000.25
    del float_date["channel"]
    write("websocket_message", "gateway_client_float_date", text + compact(float_date))
    write("websocket_message", "input_reply_stdin", text + compact(
        legacy_envelope("input_reply", {"value": "yes"}, channel="stdin")))
    write("websocket_message", "interrupt_control", text + compact(
        legacy_envelope("interrupt_request", {}, channel="control")))
    write("websocket_message", "iopub_refused", text + compact(legacy_envelope("status", {}, channel="iopub")))
    # Regression: a float date past system_clock's range overflowed its integer conversion (UBSan).
    write("websocket_message", "regression_date_overflow",
          text + b'{"header":{"msg_type":"kernel_info_request","date":1e300},"channel":"shell"}')
    write("websocket_message", "legacy_binary_comm", b"\x01" + legacy_binary(
        legacy_envelope("comm_msg", {"comm_id": "c1", "data": {"buffer_paths": [["x"]]}}), [b"\x01\x02\x03\x04"]))
    write("websocket_message", "legacy_binary_no_buffers", b"\x01" + legacy_binary(
        legacy_envelope("complete_request", {"code": "pd.", "cursor_pos": 3}), []))
    write("websocket_message", "v1_execute", b"\x02" + v1("shell", "execute_request", EXECUTE))
    write("websocket_message", "v1_comm_buffers", b"\x02" + v1(
        "shell", "comm_msg", {"comm_id": "c1", "data": {}}, [b"\xde\xad\xbe\xef", b""]))
    write("websocket_message", "v1_no_channel", b"\x02" + v1("", "inspect_request", {"code": "len", "cursor_pos": 3}))


def router():
    paths = [
        "/api", "/api/status", "/api/kernelspecs", "/api/kernelspecs/cellblock-python",
        "/kernelspecs/cellblock-python/logo-64x64.png",
        "/api/kernels?token=3f2a", "/api/kernels/6b1c1f9e-2d3a-4b5c-8d7e-9f0a1b2c3d4e",
        "/api/kernels/6b1c1f9e-2d3a-4b5c-8d7e-9f0a1b2c3d4e/channels?session_id=c0ffee00-1111&token=abc%20def",
        "/api/kernels/6b1c1f9e-2d3a-4b5c-8d7e-9f0a1b2c3d4e/interrupt",
        "/api/kernels/6b1c1f9e-2d3a-4b5c-8d7e-9f0a1b2c3d4e/restart",
        "/api/sessions/s%2D1", "/agent/v1/sessions", "/agent/v1/sessions/sales-analysis/execute",
        "/agent/v1/sessions/sales-analysis/files/data/sales%20q1.csv",
        "/agent/v1/sessions/s/files/r%C3%A9sum%C3%A9.txt?download=1&x=a+b",
        "/agent/v1/sessions/s/files/a%2Fb", "/agent/v1/sessions/s/files/..%2F..%2Fetc/passwd",
        "/api/kernels/%00", "/api/kernels/%zz", "/agent/v1/sessions/s%", "/mcp", "//api//kernels//",
        "/agent/v1/sessions/s/notebook?format=ipynb", "/agent/v1/sessions/s/audit?limit=10&&=x&limit=2",
    ]
    for index, path in enumerate(paths):
        write("router", f"path{index:02d}", path.encode())


def frame(message):
    body = compact(message)
    return struct.pack(">I", len(body)) + body


def worker_stream():
    ready = frame({"type": "ready", "python": "3.11.2", "ipython": "8.5.0", "pid": 1})
    display = frame({"type": "display_data", "data": {"text/plain": "x", "image/png": "iVBOR"}, "metadata": {},
                     "transient": {"display_id": "a"}})
    reply = frame({"type": "reply", "id": "r1", "content": {"status": "ok", "user_expressions": {}, "payload": []}})
    error = frame({"type": "error", "ename": "ZeroDivisionError", "evalue": "division by zero",
                   "traceback": ["\x1b[0;31mZeroDivisionError\x1b[0m"]})
    write("worker_stream", "ready_display_reply", b"\x03\x07" + ready + display + reply)
    write("worker_stream", "error_reply_one_byte_chunks", b"\x00\x00" + error + reply)
    write("worker_stream", "input_request", b"\x05\x3f" + frame({"type": "input_request", "prompt": "? ",
                                                                 "password": False}))
    write("worker_stream", "stdout_utf8_split", b"\x02\x01" + "caf\u00e9 \u2603 \U0001F600 done\n".encode())
    write("worker_stream", "stdout_invalid_utf8", b"\x01\x02" + b"ok \xc3\x28 \xed\xa0\x80 \xf4\x90\x80\x80 \xe2\x82")
    write("worker_stream", "frame_without_type", b"\x10\x10" + frame({"id": "r1"}))
    write("worker_stream", "oversized_length", b"\x04\x04" + b"\x7f\xff\xff\xff{}")
    stdout = b"\x01" + "caf\u00e9 \u2603\n".encode()
    stderr = b"\x02" + b"cut \xe2\x82"
    write("worker_stream", "stream_frames", b"\x03\x05" + struct.pack(">I", len(stdout)) + stdout + display
          + struct.pack(">I", len(stderr)) + stderr + reply)
    write("worker_stream", "stream_frame_without_text", b"\x02\x02" + b"\x00\x00\x00\x01\x01")
    write("worker_stream", "unknown_channel_byte", b"\x02\x02" + b"\x00\x00\x00\x03\x03ab")


def sandbox_policy():
    repo_policy = HERE.parents[1] / "share" / "cellblock" / "sandbox-policy.json"
    write("sandbox_policy", "shipped_policy", repo_policy.read_bytes())
    write("sandbox_policy", "small", compact({
        "uid_range": {"first": 300000, "count": 100}, "inside_uid": 1000, "hostname": "box",
        "mounts": [{"type": "bind", "source": "/usr", "target": "/usr"},
                   {"type": "tmpfs", "target": "/tmp", "size": "64M"},
                   {"type": "symlink", "source": "usr/bin", "target": "/bin"},
                   {"type": "file", "target": "/etc/passwd", "content": "u:x:1000:1000::/:/bin/sh\n"},
                   {"type": "proc", "target": "/proc"}, {"type": "dev", "target": "/dev", "size": 65536}],
        "environment": ["PATH=/usr/bin:/bin", "HOME=/workspace"],
        "limits": {"memory": "512M", "pids": 64, "cpu_cores": 1.5, "open_files": 256, "file_size": "1G",
                   "cpu_seconds": 600, "wall_clock_seconds": 3600, "output": 1048576},
        "seccomp": True, "network_loopback": True}))
    write("sandbox_policy", "uid_past_32_bits", compact({"uid_range": {"first": 4294968296, "count": 10}}))
    write("sandbox_policy", "size_wraps", compact({"limits": {"memory": "999999999999999G"}}))
    write("sandbox_policy", "unknown_key", compact({"limit": {"memory": "1G"}}))


def tls_client_hello():
    # Real ClientHellos captured from `openssl s_client -servername ...` and Python's ssl module (the unit test
    # fixtures), after two split-point bytes.
    fixtures = HERE.parents[0] / "unit" / "kernel" / "fixtures" / "tls_client_hello"
    for path in sorted(fixtures.glob("*.bin")):
        write("tls_client_hello", path.stem, b"\x00\x40" + path.read_bytes())
    hello = (fixtures / "tls13_pypi_test.bin").read_bytes()
    payload = hello[5:]
    records = b"".join(b"\x16\x03\x01" + struct.pack(">H", len(payload[at:at + 60])) + payload[at:at + 60]
                       for at in range(0, len(payload), 60))
    write("tls_client_hello", "split_over_records", b"\x01\x00" + records)
    write("tls_client_hello", "truncated", b"\x00\x10" + hello[:len(hello) // 2])
    write("tls_client_hello", "plain_http_in_tunnel", b"\x00\x05" + b"GET / HTTP/1.1\r\nHost: pypi.test\r\n\r\n")


def json_text():
    # Text a cell prints (long plain runs, escapes, valid and broken UTF-8) and a message the kernel sends.
    write("json_text", "long_print", b"x" * 300 + b"\n")
    write("json_text", "escapes_and_utf8", "tab\t quote\" back\\ bell\x07 caf\u00e9 \u2603 \U0001F600 "
          .encode() * 8 + b"\x7f")
    write("json_text", "broken_utf8", b"ok " * 30 + b"\xc3\x28 \xed\xa0\x80 \xf4\x90\x80\x80 \xe2\x82")
    write("json_text", "stream_message", compact({"name": "stdout", "text": "0123456789abcdef" * 8 + "\n"}))
    write("json_text", "display_data", compact({"data": {"text/plain": "<Figure>", "image/png": "iVBOR" * 30},
                                                "metadata": {}, "transient": {}}))


def mcp_jsonrpc():
    # What @modelcontextprotocol/sdk's client POSTs (tests/agent/mcp_client), after the mode byte: tools answering
    # at once (0), later in reverse order (1), throwing once their arguments passed (2).
    def rpc(method, params=None, id=None):
        message = {"jsonrpc": "2.0", "method": method}
        if id is not None:
            message["id"] = id
        if params is not None:
            message["params"] = params
        return message

    initialize = rpc("initialize", {"protocolVersion": "2025-06-18", "capabilities": {},
                                    "clientInfo": {"name": "cellblock-mcp-test", "version": "1.0.0"}}, 0)
    run = rpc("tools/call", {"name": "run_python", "arguments": {"session": "analysis", "code": "import numpy as np\n"
                                                                 "np.arange(5).sum()", "timeout_s": 30}}, 2)
    decide = rpc("tools/call", {"name": "decide_approval",
                                "arguments": {"session": "net", "id": "a1", "decision": "allow_once"}}, "d-1")
    write("mcp_jsonrpc", "initialize", b"\x00" + compact(initialize))
    write("mcp_jsonrpc", "initialized_notification", b"\x00" + compact(rpc("notifications/initialized")))
    write("mcp_jsonrpc", "tools_list", b"\x00" + compact(rpc("tools/list", {}, 1)))
    write("mcp_jsonrpc", "run_python", b"\x00" + compact(run))
    write("mcp_jsonrpc", "run_python_later", b"\x01" + compact(run))
    write("mcp_jsonrpc", "decide_approval_throws", b"\x02" + compact(decide))
    write("mcp_jsonrpc", "batch_in_reverse", b"\x01" + compact(
        [run, rpc("ping", None, 3), rpc("notifications/cancelled", {"requestId": 2}),
         {"jsonrpc": "2.0", "id": 7, "result": {}}, decide]))
    write("mcp_jsonrpc", "unknown_method", b"\x00" + compact(rpc("resources/list", {}, 4)))
    write("mcp_jsonrpc", "not_json", b"\x00" + b'{"jsonrpc": "2.0", "id": 1, "method": ')
    # Found by this target: a field of the wrong JSON type threw out of the protocol (a 500 for the whole batch).
    write("mcp_jsonrpc", "regression_jsonrpc_not_a_string", b"\x01" + compact(
        [{"jsonrpc": {"name": "run_python", "arguments": {"session": "s", "id": "a1"}}}, rpc("ping", None, 9)]))
    write("mcp_jsonrpc", "regression_protocol_version_number", b"\x00" + compact(
        rpc("initialize", {"protocolVersion": 20250618}, 0)))


def gateway_config():
    # A config file as gateway/README.md describes it (mode byte 0) and the environment a Kernel Gateway
    # deployment sets (mode byte 1, NAME=VALUE lines).
    write("gateway_config", "config_file", b"\x00" + json.dumps({
        "_comment": "cellblock-gateway config", "ip": "0.0.0.0", "port": 8888, "base_url": "/", "warm_pool": 2,
        "max_kernels": 50, "cull_idle_timeout": 3600, "cull_interval": 60.5, "list_kernels": True,
        "max_body_bytes": 8388608, "header_timeout": 10, "fd_reserve": 128, "kernel_aliases": {"python3": "cellblock-python"},
        "env_whitelist": ["LANG"], "store": "postgresql://cellblock@db.example:5432/cellblock",
        "network": {"allow": ["pypi.org", "*.pythonhosted.org"], "approval_timeout": 120, "ports": [443]}},
        indent=2).encode())
    write("gateway_config", "environment", b"\x01" + b"\n".join([
        b"KG_IP=0.0.0.0", b"KG_PORT=9000", b"KG_PRESPAWN_COUNT=3", b"KG_MAX_KERNELS=20",
        b"KG_WS_PING_INTERVAL_SECS=2.5", b"KG_LIST_KERNELS=false", b"CELLBLOCK_GATEWAY_FD_RESERVE=64",
        b"CELLBLOCK_GATEWAY_CULL_INTERVAL=30", b"CELLBLOCK_GATEWAY_NETWORK_ALLOW=pypi.org,*.pythonhosted.org"]))
    # What the gateway truncated or wrapped before it refused them.
    write("gateway_config", "regression_port_past_16_bits", b"\x00" + compact({"port": 70000}))
    write("gateway_config", "regression_negative_fd_reserve", b"\x00" + compact({"fd_reserve": -5}))
    write("gateway_config", "regression_count_past_int", b"\x01" + b"KG_MAX_KERNELS=1e10")


def kernel_config():
    # The shipped kernel config, then the variables the gateway sets per kernel (after 0x1e, NAME=VALUE lines).
    shipped = (HERE.parent.parent / "share" / "cellblock" / "kernel-config.json").read_bytes()
    write("kernel_config", "shipped", shipped)
    write("kernel_config", "agent_session", shipped + SEP + b"\n".join([
        b"CELLBLOCK_TIMEOUT_S=30.5", b"CELLBLOCK_MEMORY_MB=1024", b"CELLBLOCK_OUTPUT_BYTES=65536",
        b"CELLBLOCK_INTERRUPT_GRACE_S=2", b"CELLBLOCK_ZYGOTE_TENANT=team-7.agents",
        b'CELLBLOCK_NETWORK_POLICY={"allow": ["pypi.org"], "ask": true}', b"CELLBLOCK_WORKSPACE=/tmp/ws"]))
    write("kernel_config", "zygote", compact({
        "worker": {"script": "worker.py", "python": "/usr/bin/python3", "start_timeout_s": 60, "zygote": True,
                   "zygote_tenant": "default", "zygote_preload": ["numpy", "pandas", "matplotlib.pyplot"],
                   "zygote_generation_forks": 200, "zygote_generation_seconds": 3600.5},
        "sandbox_policy": "sandbox-policy.json", "workspace_root": "workspaces",
        "limits": {"timeout_s": 600, "interrupt_grace_s": 2, "output_bytes": 1048576, "memory_mb": 2048}}))
    # What the kernel wrapped, rounded or overflowed before it refused them.
    minimal = {"worker": {"script": "w.py"}, "sandbox_policy": "p.json"}
    write("kernel_config", "regression_memory_wraps_to_no_limit",
          compact({**minimal, "limits": {"memory_mb": 17592186044416}}))
    write("kernel_config", "regression_forks_rounded",
          compact({"worker": {"script": "w.py", "zygote_generation_forks": 1.5}, "sandbox_policy": "p.json"}))
    write("kernel_config", "regression_timeout_overflows", compact(minimal) + SEP + b"CELLBLOCK_TIMEOUT_S=1e300")
    # Found by this target's first campaign: json::out_of_range (not a parse_error) escaped load().
    write("kernel_config", "regression_network_policy_number_overflow",
          compact(minimal) + SEP + b'CELLBLOCK_NETWORK_POLICY={"approval_timeout_s": 1e999}')
    # Found by CI: a tenant of 65 to 74 characters (a store tenant behind the gateway's "t<8 hex>_") is one
    # the kernel takes; the target held it to the old 64.
    write("kernel_config", "regression_prefixed_tenant_name",
          compact({"worker": {"script": "w.py", "zygote_tenant": "t0123abcd_" + "a" * 64}, "sandbox_policy": "p.json"}))


def execution_collector():
    # What a cellblock kernel sends for one execute: kind byte (the target's table: 0 status, 1 stream,
    # 2 execute_input, 3 execute_result, 4 display_data, 5 error, 8 execute_reply; +0x80 another request's),
    # content, then 0x1f and metadata.
    def message(kind, content, metadata=None, other=False):
        data = bytes([kind | (0x80 if other else 0)]) + compact(content)
        return data + b"\x1f" + compact(metadata) if metadata is not None else data
    busy, idle = message(0, {"execution_state": "busy"}), message(0, {"execution_state": "idle"})
    write("execution_collector", "print_plot_result", SEP.join([
        busy, message(2, {"code": "print(1)", "execution_count": 3}),
        message(1, {"name": "stdout", "text": "loading data\n"}),
        message(1, {"name": "stdout", "text": "rows: 1000\n"}),
        message(1, {"name": "stderr", "text": "UserWarning: \u00e9t\u00e9\n"}),
        message(4, {"data": {"image/png": "iVBORw0KGgo=", "text/plain": "<Figure>"}, "metadata": {"image/png": {"width": 640}}}),
        message(1, {"name": "stdout", "text": "done\n"}),
        message(3, {"data": {"text/plain": "60"}, "metadata": {}, "execution_count": 3}),
        message(8, {"status": "ok", "execution_count": 3, "user_expressions": {}},
                {"cellblock": {"outcome": "ok", "state_lost": False, "last_iopub_msg_id": "x"}}),
        idle]))
    write("execution_collector", "error_and_limit", SEP.join([
        busy, message(1, {"name": "stdout", "text": "x" * 64}),
        message(5, {"ename": "ZeroDivisionError", "evalue": "division by zero",
                    "traceback": ["Traceback (most recent call last):", "ZeroDivisionError: division by zero"]}),
        idle,
        message(8, {"status": "error", "execution_count": 4, "ename": "ZeroDivisionError", "evalue": "division by zero",
                    "traceback": []},
                {"cellblock": {"outcome": "output_limit", "state_lost": False, "output_truncated": True}})]))
    write("execution_collector", "another_clients_request_between", SEP.join([
        busy, message(0, {"execution_state": "busy"}, other=True),
        message(1, {"name": "stdout", "text": "theirs\n"}, other=True),
        message(1, {"name": "stdout", "text": "ours\n"}),
        message(8, {"status": "ok", "execution_count": 9}, other=True),
        message(0, {"execution_state": "idle"}, other=True),
        message(8, {"status": "ok", "execution_count": 10}), idle]))
    # What threw json::type_error out of consume() (found by this target in its first seconds).
    write("execution_collector", "regression_wrong_typed_members", SEP.join([
        message(0, {"execution_state": 1}), message(1, {"name": 2, "text": "x"}),
        message(4, {"data": "not a bundle", "metadata": 3}),
        message(5, {"ename": 5, "evalue": {}, "traceback": ["line", 9]}),
        message(8, {"status": False, "execution_count": 1099511627776}), idle]))


if __name__ == "__main__":
    for target in ["kernel_wire_verifier", "gateway_wire_decode", "websocket_message", "router", "worker_stream",
                   "sandbox_policy", "tls_client_hello", "json_text", "mcp_jsonrpc", "gateway_config",
                   "kernel_config", "execution_collector"]:
        shutil.rmtree(HERE / "corpus" / target, ignore_errors=True)
        globals()[target]()
