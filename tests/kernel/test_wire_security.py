"""The kernel's wire hardening (beyond xeus 2.4.1) and the secrecy of its key from the worker."""
import json
import time

import zmq
from jupyter_client.session import Session


def _shell_socket(kernel):
    info = kernel.manager.get_connection_info()
    context = zmq.Context.instance()
    socket = context.socket(zmq.DEALER)
    socket.linger = 0
    socket.connect(f"{info['transport']}://{info['ip']}:{info['shell_port']}")
    return socket


def _replies(socket, session, wait: float) -> list:
    """Every message that arrives on `socket` within `wait` seconds, deserialized with `session`."""
    replies = []
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        if socket.poll(50):
            frames = socket.recv_multipart()
            _, frames = session.feed_identities(frames)
            replies.append(session.deserialize(frames))
    return replies


def _signed_request(session, msg_type="kernel_info_request"):
    msg = session.msg(msg_type, {})
    return session.serialize(msg)  # [b"<IDS|MSG>", signature, header, parent, metadata, content]


def test_valid_message_is_answered(kernel):
    session = Session(key=kernel.manager.session.key)
    socket = _shell_socket(kernel)
    socket.send_multipart(_signed_request(session))
    replies = _replies(socket, session, 5)
    assert [r["msg_type"] for r in replies] == ["kernel_info_reply"]


def test_bad_signatures_get_no_reply_and_the_kernel_keeps_serving(kernel):
    key = kernel.manager.session.key
    session = Session(key=key)
    socket = _shell_socket(kernel)

    wrong_key = _signed_request(Session(key=b"not-the-key"))
    junk = _signed_request(session)
    junk[1] = junk[1] + b"00"
    empty = _signed_request(session)
    empty[1] = b""
    garbage = [b"<IDS|MSG>", b"x"]
    for frames in (wrong_key, junk, empty, garbage):
        socket.send_multipart(frames)
    assert _replies(socket, session, 2) == []

    socket.send_multipart(_signed_request(session))
    assert [r["msg_type"] for r in _replies(socket, session, 5)] == ["kernel_info_reply"]
    assert kernel.execute("1 + 1").content["status"] == "ok"


def test_replayed_message_is_answered_once(kernel):
    session = Session(key=kernel.manager.session.key)
    socket = _shell_socket(kernel)
    frames = _signed_request(session)
    socket.send_multipart(frames)
    socket.send_multipart(frames)
    replies = _replies(socket, session, 3)
    assert [r["msg_type"] for r in replies] == ["kernel_info_reply"]


def test_replies_are_signed_with_the_connection_key(kernel):
    session = Session(key=kernel.manager.session.key)
    socket = _shell_socket(kernel)
    socket.send_multipart(_signed_request(session, "kernel_info_request"))
    deadline = time.monotonic() + 5
    while not socket.poll(50):
        assert time.monotonic() < deadline
    frames = socket.recv_multipart()
    _, frames = session.feed_identities(frames)
    # Session.deserialize checks the signature (raises on mismatch).
    reply = session.deserialize(frames, content=True)
    assert reply["content"]["language_info"]["name"] == "python"


def test_worker_cannot_see_the_key_or_connection_file(kernel):
    key = kernel.manager.session.key.decode()
    probe = f"""
import os
needle = {key!r}
found = []
for name, value in os.environ.items():
    if needle in value or needle in name:
        found.append('env:' + name)
for pid in os.listdir('/proc'):
    if not pid.isdigit():
        continue
    for part in ('environ', 'cmdline'):
        try:
            with open(f'/proc/{{pid}}/{{part}}', 'rb') as f:
                if needle.encode() in f.read():
                    found.append(f'/proc/{{pid}}/{{part}}')
        except OSError:
            pass
fds = sorted(int(fd) for fd in os.listdir('/proc/self/fd'))
for top in ('/', '/tmp', '/workspace', '/run', '/etc', '/opt', '/home', '/root', '/var'):
    for root, dirs, files in os.walk(top):
        if root.startswith(('/proc', '/sys', '/usr', '/dev')):
            dirs[:] = []
            continue
        for file in files:
            path = os.path.join(root, file)
            try:
                if os.path.isfile(path) and os.path.getsize(path) < 1_000_000:
                    with open(path, 'rb') as f:
                        if needle.encode() in f.read():
                            found.append(path)
            except OSError:
                pass
print('FOUND', sorted(set(found)))
print('CONNECTION_FILE_VISIBLE', os.path.exists({kernel.manager.connection_file!r}))
print('FDS', fds)
"""
    run = kernel.execute(probe, timeout=120)
    assert run.content["status"] == "ok", run.content
    out = run.stream_text()
    assert "FOUND []" in out, out
    assert "CONNECTION_FILE_VISIBLE False" in out, out
    fds_line = [line for line in out.splitlines() if line.startswith("FDS")][0]
    fds = json.loads(fds_line[4:])
    # 0-2 stdio, 3 the worker channel, plus the listdir handle itself (and at most a few Python-internal ones).
    assert max(fds) < 10, fds


def test_empty_key_means_unsigned_messages_work(fresh_kernel):
    k = fresh_kernel(key=b"")
    with open(k.manager.connection_file) as f:
        assert json.load(f)["key"] == ""
    run = k.execute("6 * 7")
    assert run.of_type("execute_result")[0]["content"]["data"]["text/plain"] == "42"
    assert run.reply["header"]["msg_type"] == "execute_reply"
