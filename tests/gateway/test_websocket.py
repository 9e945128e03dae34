"""The /api/kernels/{id}/channels WebSocket: both wire formats, client quirks, multiplexing, replay, death."""
import json
import os
import signal
import struct
import time
import uuid

import pytest
import websocket

from gateway_harness import V1, kernel_pids, new_header, outputs


def test_legacy_execute_frames_carry_top_level_fields(gateway, kernel):
    client = gateway.connect(kernel["id"])
    client.wait_ready()
    messages = client.execute("1+1")
    types = [(m["channel"], m["msg_type"]) for m in messages]
    assert ("iopub", "execute_input") in types and ("shell", "execute_reply") in types
    iopub = [m["msg_type"] for m in messages if m["channel"] == "iopub"]
    assert iopub[0] == "status" and iopub[-1] == "status"
    assert iopub.index("execute_input") < iopub.index("execute_result")
    for message in messages:
        assert message["msg_id"] == message["header"]["msg_id"]
        assert message["msg_type"] == message["header"]["msg_type"]
        assert message["buffers"] == []
        assert message["header"]["date"].endswith("Z") or "+" in message["header"]["date"]
    result = next(m for m in messages if m["msg_type"] == "execute_result")
    assert result["content"]["data"]["text/plain"] == "2"
    client.close()


@pytest.mark.parametrize("quirk", ["no_channel", "buffers_dict", "empty_session", "no_date", "float_date",
                                   "naive_date", "no_msg_id", "null_parent"])
def test_client_quirks_are_accepted(gateway, kernel, quirk):
    client = gateway.connect(kernel["id"])
    header = new_header("execute_request", session="")
    message = {"header": header, "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
               "content": {"code": "6*7", "silent": False}}
    if quirk == "no_channel":
        del message["channel"]  # E2B
    elif quirk == "buffers_dict":
        message["buffers"] = {}  # AutoGen, OpenHands
    elif quirk == "empty_session":
        header["session"] = ""
    elif quirk == "no_date":
        del header["date"]  # OpenHands
    elif quirk == "float_date":
        header["date"] = time.time()  # GatewayKernelClient
    elif quirk == "naive_date":
        header["date"] = "2026-01-01T12:00:00.123456"
    elif quirk == "no_msg_id":
        del header["msg_id"]
    elif quirk == "null_parent":
        message["parent_header"] = None
    client.ws.send(json.dumps(message))
    deadline = time.monotonic() + 60
    reply = None
    while reply is None and time.monotonic() < deadline:
        received = client.recv()
        if received["msg_type"] == "execute_reply":
            reply = received
    assert reply is not None and reply["content"]["status"] == "ok"
    if "msg_id" in header:
        assert reply["parent_header"]["msg_id"] == header["msg_id"]
    client.close()


def test_v1_subprotocol_round_trip(gateway, kernel):
    client = gateway.connect(kernel["id"], v1=True, session_id=uuid.uuid4().hex)
    assert client.ws.getsubprotocol() == V1
    assert client.wait_ready()["msg_type"] == "kernel_info_reply"
    messages = client.execute("print('over v1')")
    assert "over v1" in outputs(messages)
    assert {m["channel"] for m in messages} == {"iopub", "shell"}
    client.close()


def test_legacy_is_used_without_subprotocol_and_binary_only_with_buffers(gateway, kernel):
    client = gateway.connect(kernel["id"])
    assert client.ws.getsubprotocol() is None
    client.wait_ready()
    # Every frame of a buffer-less exchange is text.
    client.ws.settimeout(60)
    msg_id = client.send("execute_request", {"code": "1", "silent": False})
    while True:
        opcode, data = client.ws.recv_data()
        assert opcode == websocket.ABNF.OPCODE_TEXT
        message = json.loads(data)
        if message["parent_header"].get("msg_id") == msg_id and message["msg_type"] == "execute_reply":
            break
    client.close()


def test_a_large_message_arrives_as_one_frame(gateway, kernel):
    """A 200 KB stream message is one WebSocket frame, as Jupyter Server sends it, not fifty 4 KiB pieces
    that every client must parse and join."""
    client = gateway.connect(kernel["id"])
    client.wait_ready()
    client.ws.settimeout(60)
    msg_id = client.send("execute_request", {"code": "print('y' * 200_000)", "silent": False})
    text = []
    while True:
        frame = client.ws.recv_frame()
        if frame.opcode not in (websocket.ABNF.OPCODE_TEXT, websocket.ABNF.OPCODE_CONT):
            continue
        assert frame.opcode == websocket.ABNF.OPCODE_TEXT and frame.fin, \
            f"a message was cut into frames (opcode {frame.opcode}, fin {frame.fin}, {len(frame.data)} bytes)"
        message = json.loads(frame.data)
        if message["parent_header"].get("msg_id") != msg_id:
            continue
        if message["msg_type"] == "stream":
            text.append(message["content"]["text"])
        if message["msg_type"] == "status" and message["content"]["execution_state"] == "idle":
            break
    assert "".join(text) == "y" * 200_000 + "\n"
    client.close()


def test_outputs_arrive_before_the_reply_even_when_large(gateway, kernel):
    """A client that stops at execute_reply (OpenHands does) has every output of the cell by then, however
    large: IOPub and shell are separate sockets, so a big output still in transit could otherwise be overtaken
    by the small reply sent after it."""
    client = gateway.connect(kernel["id"])
    client.wait_ready()
    client.ws.settimeout(60)
    for size in [100_000, 300_000, 450_000] * 4:  # a stream and a display each: within the 1 MiB output limit
        code = (f"print('a' * {size})\nfrom IPython.display import display\n"
                f"display({{'text/plain': 'b' * {size}}}, raw=True)")
        msg_id = client.send("execute_request", {"code": code, "silent": False})
        text, displays, idle = [], [], False
        while True:
            message = json.loads(client.ws.recv())
            if message["parent_header"].get("msg_id") != msg_id:
                continue
            if message["msg_type"] == "stream":
                text.append(message["content"]["text"])
            if message["msg_type"] == "display_data":
                displays.append(message["content"]["data"]["text/plain"])
            idle = idle or message["msg_type"] == "status" and message["content"]["execution_state"] == "idle"
            if message["msg_type"] == "execute_reply":
                break
        assert "".join(text) == "a" * size + "\n" and displays == ["b" * size], \
            f"{size}: the reply came before {size + 1 - len(''.join(text))} bytes of text, {1 - len(displays)} display"
        while not idle:  # idle is published after the reply, on the other socket: it may come either side
            message = json.loads(client.ws.recv())
            idle = message["msg_type"] == "status" and message["content"]["execution_state"] == "idle"
    client.close()


def test_legacy_binary_frames_from_clients_are_accepted(gateway, kernel):
    client = gateway.connect(kernel["id"])
    header = new_header("execute_request", session=client.session)
    body = json.dumps({"header": header, "parent_header": {}, "metadata": {}, "channel": "shell",
                       "content": {"code": "3+4", "silent": False}}).encode()
    buffer = b"\x00\x01binary"
    offsets = [4 * 3, 4 * 3 + len(body)]
    frame = struct.pack(">I", 2) + b"".join(struct.pack(">I", o) for o in offsets) + body + buffer
    client.ws.send_binary(frame)
    messages = client.replies_to(header["msg_id"], lambda m: m["msg_type"] == "execute_reply")
    assert messages[-1]["content"]["status"] == "ok"
    client.close()


def test_two_clients_share_iopub_but_not_replies(gateway, kernel):
    alice = gateway.connect(kernel["id"], session_id="alice-" + uuid.uuid4().hex)
    bob = gateway.connect(kernel["id"], session_id="bob-" + uuid.uuid4().hex)
    alice.wait_ready()
    bob.wait_ready()
    assert gateway.get(f"/api/kernels/{kernel['id']}").json()["connections"] == 2
    msg_id = alice.send("execute_request", {"code": "print('shared')", "silent": False})
    alice_view = alice.replies_to(msg_id, lambda m: m["msg_type"] == "execute_reply")
    bob_view = bob.replies_to(msg_id, lambda m: m["msg_type"] == "status" and m["content"]["execution_state"] == "idle")
    assert "execute_input" in [m["msg_type"] for m in bob_view]
    assert "shared" in outputs(bob_view)
    # Bob never sees Alice's reply: send Bob a request of his own and check nothing of Alice's shell arrives first.
    own = bob.send("kernel_info_request")
    while True:
        message = bob.recv()
        assert not (message["channel"] == "shell" and message["parent_header"].get("msg_id") == msg_id)
        if message["parent_header"].get("msg_id") == own and message["msg_type"] == "kernel_info_reply":
            break
    alice.close()
    bob.close()


def test_input_request_goes_only_to_the_requester(gateway, kernel):
    asker = gateway.connect(kernel["id"], session_id="asker-" + uuid.uuid4().hex)
    watcher = gateway.connect(kernel["id"], session_id="watcher-" + uuid.uuid4().hex)
    asker.wait_ready()
    watcher.wait_ready()
    msg_id = asker.send("execute_request", {"code": "name = input('who? ')\nprint('hello', name)", "silent": False,
                                            "allow_stdin": True})
    request = asker.replies_to(msg_id, lambda m: m["msg_type"] == "input_request")[-1]
    assert request["channel"] == "stdin" and "who?" in request["content"]["prompt"]
    asker.send("input_reply", {"value": "agent"}, channel="stdin")
    done = asker.replies_to(msg_id, lambda m: m["msg_type"] == "execute_reply")
    watched = watcher.replies_to(msg_id, lambda m: m["msg_type"] == "status" and
                                 m["content"]["execution_state"] == "idle")
    assert "hello agent" in outputs(done) + outputs(watched)
    assert "input_request" not in [m["msg_type"] for m in watched]
    asker.close()
    watcher.close()


def test_connections_count_live_sockets(gateway, kernel):
    url = f"/api/kernels/{kernel['id']}"
    assert gateway.get(url).json()["connections"] == 0
    first = gateway.connect(kernel["id"])
    second = gateway.connect(kernel["id"], auth="query")
    first.wait_ready()
    second.wait_ready()
    assert gateway.get(url).json()["connections"] == 2
    first.close()
    second.close()
    deadline = time.monotonic() + 10
    while gateway.get(url).json()["connections"] != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gateway.get(url).json()["connections"] == 0


def test_reconnect_with_same_session_id_replays_missed_messages(gateway, kernel):
    session_id = "resume-" + uuid.uuid4().hex
    client = gateway.connect(kernel["id"], session_id=session_id)
    client.wait_ready()
    msg_id = client.send("execute_request", {"code": "import time; time.sleep(1.5); print('finished while away')",
                                             "silent": False})
    client.replies_to(msg_id, lambda m: m["msg_type"] == "execute_input")
    client.close()
    # Positive control: the cell really finished while no client was connected (the kernel went busy → idle), so
    # what the resumed connection receives can only come from the replay, not from the cell still running.
    deadline = time.monotonic() + 60
    while gateway.get(f"/api/kernels/{kernel['id']}").json()["execution_state"] != "idle":
        assert time.monotonic() < deadline, "the cell did not finish while the client was away"
        time.sleep(0.1)
    resumed = gateway.connect(kernel["id"], session_id=session_id)
    missed = resumed.replies_to(msg_id, lambda m: m["msg_type"] == "execute_reply", timeout=30)
    assert "finished while away" in outputs(missed)
    resumed.close()


def test_same_session_id_replaces_the_stale_connection(gateway, kernel):
    session_id = "dup-" + uuid.uuid4().hex
    old = gateway.connect(kernel["id"], session_id=session_id)
    old.wait_ready()
    new = gateway.connect(kernel["id"], session_id=session_id)
    new.wait_ready()
    with pytest.raises((websocket.WebSocketConnectionClosedException, ConnectionError, OSError)):
        for _ in range(100):
            old.recv(timeout=10)
    assert gateway.get(f"/api/kernels/{kernel['id']}").json()["connections"] == 1
    new.close()


def test_websocket_upgrade_requires_token(gateway, kernel):
    url = f"{gateway.ws_base}/api/kernels/{kernel['id']}/channels"
    with pytest.raises(websocket.WebSocketBadStatusException) as refused:
        websocket.create_connection(url, timeout=30)
    assert refused.value.status_code == 401
    with pytest.raises(websocket.WebSocketBadStatusException) as wrong:
        websocket.create_connection(url, header=["Authorization: token nope"], timeout=30)
    assert wrong.value.status_code == 401
    websocket.create_connection(url + f"?token={gateway.token}", timeout=30).close()
    websocket.create_connection(url, header=[f"Authorization: Bearer {gateway.token}"], timeout=30).close()


def test_websocket_to_unknown_kernel_is_404(gateway):
    with pytest.raises(websocket.WebSocketBadStatusException) as refused:
        websocket.create_connection(f"{gateway.ws_base}/api/kernels/00000000-0000-0000-0000-000000000000/channels",
                                    header=[f"Authorization: token {gateway.token}"], timeout=30)
    assert refused.value.status_code == 404


def next_note(client):
    """The next message that is not a status: IOPub status of the bystander's requests reaches every client."""
    message = client.recv()
    while message["msg_type"] == "status":
        message = client.recv()
    return message


def test_bad_frames_get_clear_errors_and_do_not_disturb_others(gateway, kernel):
    bystander = gateway.connect(kernel["id"])
    bystander.wait_ready()
    client = gateway.connect(kernel["id"])
    for bad in ("{not json", json.dumps([1, 2]), json.dumps({"header": {"msg_id": "x"}}),
                json.dumps({"header": {"msg_type": "execute_request"}, "channel": "iopub"})):
        client.ws.send(bad)
        note = next_note(client)
        assert note["msg_type"] == "stream" and "rejected" in note["content"]["text"], note
    client.ws.send_binary(b"\x00\x00\x00\x09garbage")
    assert "rejected" in next_note(client)["content"]["text"]
    assert client.wait_ready()["msg_type"] == "kernel_info_reply"  # still usable
    # Invalid UTF-8 in a text frame: the connection is closed (1007), nothing else is affected.
    client.ws.send(b"\xff\xfe\xfd", opcode=websocket.ABNF.OPCODE_TEXT)
    with pytest.raises((websocket.WebSocketConnectionClosedException, ConnectionError, OSError)):
        for _ in range(10):
            client.recv(timeout=10)
    # An oversized message is refused with a close (1009), the gateway keeps serving.
    big = gateway.connect(kernel["id"])
    with pytest.raises((websocket.WebSocketConnectionClosedException, ConnectionError, OSError)):
        big.ws.send("x" * (65 << 20))
        for _ in range(10):
            big.recv(timeout=20)
    assert "2" in outputs(bystander.execute("1+1"))
    assert gateway.alive()
    bystander.close()


def test_the_kernels_own_cellblock_requests_are_refused_from_clients(gateway, kernel):
    """Approval decisions go through the agent API (audited with who decided); a notebook client cannot answer
    one on the kernel's control channel, nor ask for the gateway's replay or lease messages."""
    client = gateway.connect(kernel["id"])
    client.wait_ready()
    for msg_type in ("cellblock_approval_decision_request", "cellblock_replay_request"):
        header = new_header(msg_type, session=client.session)
        client.ws.send(json.dumps({"header": header, "parent_header": {}, "metadata": {}, "channel": "control",
                                   "content": {"id": "x", "decision": "allow_session", "decided_by": "me"}}))
        note = next_note(client)
        assert note["msg_type"] == "stream" and "reserved for the gateway" in note["content"]["text"], note
        assert note["parent_header"].get("msg_id") == header["msg_id"]
    assert "2" in outputs(client.execute("1+1"))
    client.close()


def test_interrupt_stops_a_running_cell(gateway, kernel):
    client = gateway.connect(kernel["id"])
    client.wait_ready()
    msg_id = client.send("execute_request", {"code": "import time\nfor _ in range(600): time.sleep(0.1)",
                                             "silent": False})
    client.replies_to(msg_id, lambda m: m["msg_type"] == "execute_input")
    time.sleep(0.5)
    started = time.monotonic()
    assert gateway.post(f"/api/kernels/{kernel['id']}/interrupt").status_code == 204
    reply = client.replies_to(msg_id, lambda m: m["msg_type"] == "execute_reply", timeout=30)[-1]
    assert reply["content"]["status"] == "error" and time.monotonic() - started < 20
    assert "2" in outputs(client.execute("1+1"))
    client.close()


def test_kernel_death_is_reported_and_kernel_restarted(gateway, kernel):
    client = gateway.connect(kernel["id"])
    client.wait_ready()
    client.execute("x = 41")
    pids = kernel_pids(kernel["id"])
    assert pids
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    states = []
    deadline = time.monotonic() + 60
    while "idle" not in states[states.index("restarting"):] if "restarting" in states else True:
        assert time.monotonic() < deadline, states
        message = client.recv()
        if message["msg_type"] == "status":
            states.append(message["content"]["execution_state"])
    assert "restarting" in states
    # The restarted kernel is usable through the same WebSocket (its state is fresh).
    messages = client.execute("'x' in globals()")
    assert "False" in outputs(messages)
    assert gateway.get(f"/api/kernels/{kernel['id']}").json()["execution_state"] in ("idle", "busy")
    client.close()


def test_rest_restart_keeps_websocket_attached(gateway, kernel):
    client = gateway.connect(kernel["id"])
    client.wait_ready()
    client.execute("y = 1")
    assert gateway.post(f"/api/kernels/{kernel['id']}/restart").status_code == 200
    assert "False" in outputs(client.execute("'y' in globals()"))
    client.close()


def test_kernel_environment(gateway):
    """The kernel process gets KERNEL_* from the request, KERNEL_GATEWAY=1 and its own CELLBLOCK_WORKSPACE, and
    neither the gateway's token nor variables outside the whitelist (Kernel Gateway's rules)."""
    model = gateway.start_kernel(env={"KERNEL_FOO": "bar", "NOT_KERNEL": "dropped", "KERNEL_GATEWAY": "0"})
    pids = kernel_pids(model["id"])
    assert pids
    kernel_environment = dict(item.split("=", 1) for item in
                              open(f"/proc/{min(pids)}/environ", "rb").read().decode().split("\0") if "=" in item)
    assert kernel_environment["KERNEL_FOO"] == "bar"
    assert kernel_environment["KERNEL_GATEWAY"] == "1"
    assert kernel_environment["KERNEL_ID"] == model["id"]
    assert "NOT_KERNEL" not in kernel_environment and "KG_AUTH_TOKEN" not in kernel_environment
    workspace = kernel_environment["CELLBLOCK_WORKSPACE"]
    assert os.path.isdir(workspace) and model["id"] in workspace
    assert gateway.delete(f"/api/kernels/{model['id']}").status_code == 204
    deadline = time.monotonic() + 10
    while os.path.exists(workspace) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(workspace), "the workspace goes with the kernel"
