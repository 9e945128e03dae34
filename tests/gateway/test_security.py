"""The gateway's side of the security read's findings (gateway/README.md, "Threat model"): what a client, a local
user or a log reader can get, each checked from the host (a file not created, /proc/PID/cmdline, the log's text)."""
import os
import subprocess
from pathlib import Path

from gateway_harness import Gateway, gateway_binary


def test_an_env_name_that_is_not_a_name_is_refused_with_bad_env_and_runs_nothing(gateway, tmp_path):
    marker = tmp_path / "owned"
    for name in (f"KERNEL_X$(touch {marker})", "KERNEL_A B", "1KERNEL", "KERNEL_X`id`", "KERNEL_Ä"):
        response = gateway.post("/api/kernels", json={"env": {name: "1"}})
        assert response.status_code == 400, response.text
        body = response.json()
        assert body["reason"] == "bad_env" and body["message"], body
        assert name in body["message"], body
    assert gateway.post("/api/kernels", json={"env": "KERNEL_X=1"}).json()["reason"] == "bad_env"
    assert not marker.exists()
    # A good name with any value still starts a kernel (the control: the refusal is about the name).
    model = gateway.start_kernel(env={"KERNEL_NOTE": f"$(touch {marker})"})
    assert gateway.delete(f"/api/kernels/{model['id']}").status_code == 204
    assert not marker.exists()


def cmdline(pid):
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def test_the_token_and_store_password_can_come_from_files_never_seen_in_the_command_line(make_gateway, tmp_path):
    secret = "file-token-" + os.urandom(8).hex()
    token_file = tmp_path / "token"
    token_file.write_text(secret + "\n")
    token_file.chmod(0o600)
    gateway = make_gateway("--token-file", str(token_file), token=None, warm_pool=0)
    gateway.token = secret
    assert gateway.get("/api/kernels").status_code == 200
    assert gateway.get("/api/kernels", headers={"Authorization": "token wrong"}).status_code == 401
    assert secret not in cmdline(gateway.process.pid)
    assert "warning" not in "".join(gateway.output)

    store_file = tmp_path / "store"
    store_file.write_text("host=/nonexistent password=pw-" + secret + "\n")
    store_file.chmod(0o600)
    printed = subprocess.run([gateway_binary(), "--store-file", str(store_file), "--print-config"],
                             capture_output=True, text=True, timeout=30)
    assert printed.returncode == 0, printed.stderr
    assert secret not in printed.stdout and "password=***" in printed.stdout, printed.stdout
    assert printed.stderr == "", printed.stderr


def test_a_secret_on_the_command_line_is_warned_about(tmp_path):
    for arguments, what in ((["--token", "on-argv"], "--token"),
                            (["--store", "postgresql://alice:pw@db/x"], "--store")):
        printed = subprocess.run([gateway_binary(), *arguments, "--print-config"], capture_output=True, text=True,
                                 timeout=30)
        assert printed.returncode == 0, printed.stderr
        assert f"warning: {what}" in printed.stderr or f"password in {what}" in printed.stderr, printed.stderr
        assert "/proc/PID/cmdline" in printed.stderr
    empty = tmp_path / "empty"
    empty.write_text("\n")
    refused = subprocess.run([gateway_binary(), "--token-file", str(empty), "--print-config"], capture_output=True,
                             text=True, timeout=30)
    assert refused.returncode == 2 and "is empty" in refused.stderr, refused.stderr


def test_start_sh_puts_no_secret_on_the_gateways_command_line():
    start = (Path(__file__).resolve().parents[2] / "share" / "scripts" / "start.sh").read_text()
    exec_line = start[start.index("exec "):]
    assert "--token" not in exec_line and "--store" not in exec_line, exec_line


def answered_from_the_head(port, head):
    """Sends a request head announcing an 8 MB body and no body; returns (status line, seconds to the answer)."""
    import socket
    import time
    client = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        started = time.monotonic()
        client.sendall(head.encode())
        client.settimeout(5)
        try:
            answer = client.recv(4096)
        except socket.timeout:
            return None, time.monotonic() - started
        return answer.split(b"\r\n", 1)[0].decode(), time.monotonic() - started
    finally:
        client.close()


def test_requests_without_the_token_are_answered_from_their_head_without_reading_the_body(gateway):
    port = int(gateway.url.rsplit(":", 1)[1])
    body_announced = "Content-Length: 8000000\r\nContent-Type: application/json\r\n"
    for head, status in (
            (f"OPTIONS /api/kernels HTTP/1.1\r\nHost: x\r\n{body_announced}\r\n", "200"),
            (f"POST /api/kernels HTTP/1.1\r\nHost: x\r\nOrigin: http://evil.example\r\n{body_announced}\r\n", "404"),
            (f"POST /api/kernels HTTP/1.1\r\nHost: x\r\n{body_announced}\r\n", "401")):
        line, seconds = answered_from_the_head(port, head)
        assert line is not None and f" {status} " in line + " ", (head, line)
        assert seconds < 1, f"{head.split()[0]} answered after {seconds:.2f} s"
    # Control: with the token the gateway does wait for the body it was promised.
    line, seconds = answered_from_the_head(
        port, f"POST /api/kernels HTTP/1.1\r\nHost: x\r\nAuthorization: token {gateway.token}\r\n{body_announced}\r\n")
    assert line is None, f"an authenticated request was answered before its body: {line}"
