"""The loopback listener (LaunchRequest::loopback_listener, `cellblock-sandbox --loopback-listener PORT`): a
socket listening on 127.0.0.1:PORT inside the sandbox's network namespace, handed to the caller, who serves it
from outside. The program reaches the caller through it and through nothing else: in that mode seccomp also
admits AF_INET/AF_INET6 sockets, and every other way out must still fail, with host witnesses that saw
nothing (as in test_network.py); without the option AF_INET stays refused (test_network.py)."""
import errno
import json
import secrets
import socket
import subprocess
import threading
import time

import pytest

from conftest import host_ip
from test_network import DNS_PROBE, resolver_witnesses, wait_for
from witnesses import SandboxedAttack, installed_filter, packet_witness, unconfined, verdict  # noqa: F401 (fixture)

SYS_SOCKET, SYS_SOCKETPAIR = 41, 53
AF_NETLINK, AF_PACKET, AF_VSOCK = 16, 17, 40


def free_host_port():
    """A port nothing listens on in the host's own loopback (so that a host connection to it is refused)."""
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    return port


class ListenerInbox:
    """The caller's end of --send-listeners-to: a unix socket that receives the listening sockets."""

    def __init__(self, directory, count):
        self.path = str(directory / "listeners.sock")
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(self.path)
        self.server.listen(1)
        self.server.settimeout(120)   # generous: a loaded machine starts sandboxes slowly
        self.count = count
        self.received = []
        self.error = None
        self.done = threading.Event()
        threading.Thread(target=self._receive, daemon=True).start()

    def _receive(self):
        try:
            connection, _ = self.server.accept()
            with connection:
                connection.settimeout(120)
                while len(self.received) < self.count:
                    _, fds, _, _ = socket.recv_fds(connection, 1, 1)
                    assert len(fds) == 1, "a message without exactly one descriptor"
                    self.received.append(socket.socket(fileno=fds[0]))
        except Exception as error:   # reported by listeners() in the test's thread
            self.error = error
        finally:
            self.done.set()

    def listeners(self):
        assert self.done.wait(150), "the CLI never sent its listening sockets"
        assert self.error is None, f"receiving the listeners failed: {self.error!r}"
        return self.received

    def close(self):
        for each in self.received:
            each.close()
        self.server.close()


def listener_options(port, inbox, ipv6=False):
    return ["--loopback-listener", str(port), "--send-listeners-to", inbox.path] + (
        ["--loopback-listener-ipv6"] if ipv6 else [])


class ListeningSandbox:
    """The battery's Sandbox, with the listener options added to every command."""

    def __init__(self, sandbox, options):
        self.sandbox, self.options = sandbox, options

    def workspace(self):
        return self.sandbox.workspace()

    def command(self, argv, **options):
        command = self.sandbox.command(argv, **options)
        split = command.index("--")
        return command[:split] + self.options + command[split:]


@pytest.mark.parametrize("family", ["ipv4", "ipv6"])
def test_program_reaches_the_caller_through_the_listener(sandbox, tmp_path, family):
    port = free_host_port()
    inbox = ListenerInbox(tmp_path, 2 if family == "ipv6" else 1)
    address = "::1" if family == "ipv6" else "127.0.0.1"
    token = secrets.token_hex(8)
    attack = SandboxedAttack(ListeningSandbox(sandbox, listener_options(port, inbox, family == "ipv6")), f"""
        connection = socket.create_connection(({address!r}, {port}), timeout=60)
        connection.sendall(b"{token} from inside\\n")
        report(reply=connection.makefile().readline().strip(), local=connection.getsockname()[0])
    """)
    try:
        listeners = inbox.listeners()
        assert [each.getsockname()[:2] for each in listeners] == \
            [("127.0.0.1", port)] + ([("::1", port)] if family == "ipv6" else [])
        assert all(each.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 1 for each in listeners)
        # Host-side proof that the listener lives in the sandbox's namespace, not the host's: the same
        # address and port on the host's own loopback has nobody listening.
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((address, port), timeout=5).close()
        server = listeners[-1]
        server.settimeout(120)
        connection, peer = server.accept()
        with connection:
            assert peer[0] == address
            connection.settimeout(60)
            assert connection.makefile().readline() == f"{token} from inside\n"
            connection.sendall(b"welcome\n")
        run = attack.run()
    finally:
        inbox.close()
    assert run.result() == {"reply": "welcome", "local": address}, run.output


def test_a_listener_needs_a_port_and_a_destination(sandbox, tmp_path):
    for options in (["--loopback-listener", "0", "--send-listeners-to", str(tmp_path / "x")],
                    ["--loopback-listener", "3128"],
                    ["--send-listeners-to", str(tmp_path / "x")]):
        command = sandbox.command(["/usr/bin/true"], workspace=sandbox.workspace())
        split = command.index("--")
        completed = subprocess.run(command[:split] + options + command[split:], capture_output=True, text=True)
        assert completed.returncode == 125, (options, completed)


EGRESS_PROBE = """
    targets = target()
    outcomes = {}
    try:
        socket.getaddrinfo(targets["name"], 443)
        outcomes["getaddrinfo"] = "resolved"
    except OSError:
        outcomes["getaddrinfo"] = "failed"
    for host, port in targets["tcp"]:
        try:
            connection = socket.create_connection((host, port), timeout=3)
            connection.sendall(targets["token"].encode())
            connection.close()
            outcomes[f"tcp {host}:{port}"] = "connected"
        except OSError as error:
            outcomes[f"tcp {host}:{port}"] = errno.errorcode.get(error.errno, str(error))
    for host, port in targets["udp"]:
        try:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            socket.socket(family, socket.SOCK_DGRAM).sendto(targets["token"].encode(), (host, port))
            outcomes[f"udp {host}:{port}"] = "sent"
        except OSError as error:
            outcomes[f"udp {host}:{port}"] = errno.errorcode.get(error.errno, str(error))
    for name, args in {"netlink": (16, socket.SOCK_RAW, 0), "packet": (17, socket.SOCK_RAW, 0x0300),
                       "raw_icmp": (socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)}.items():
        try:
            socket.socket(*args)
            outcomes[name] = "created"
        except OSError as error:
            outcomes[name] = errno.errorcode.get(error.errno)
    hold("filter")
    report(**outcomes)
"""


def test_with_a_listener_nothing_else_leaves_the_sandbox(sandbox, tmp_path, listeners, packet_witness):
    token = "cellblock-egress-" + secrets.token_hex(8)
    loopback = listeners(socket.AF_INET, socket.SOCK_STREAM, ("127.0.0.1", 0))
    everywhere = listeners(socket.AF_INET, socket.SOCK_STREAM, ("0.0.0.0", 0))
    receiver = listeners(socket.AF_INET, socket.SOCK_DGRAM, ("127.0.0.1", 0))
    resolvers = resolver_witnesses(listeners)
    captured = packet_witness(token.encode())
    targets = {
        "name": token + ".example.com", "token": token,
        "tcp": [["127.0.0.1", loopback.address[1]], [host_ip(), everywhere.address[1]],
                ["127.0.0.1", everywhere.address[1]], ["1.1.1.1", 53], ["10.0.0.1", 80], ["::1", loopback.address[1]]]
               + [[server, 53] for server in resolvers],
        "udp": [["127.0.0.1", receiver.address[1]], ["1.1.1.1", 53], ["10.0.0.1", 53]]
               + [[server, 53] for server in resolvers],
    }

    def seen():
        return {"packets": len(captured.hits),
                "loopback": len(loopback.events), "everywhere": len(everywhere.events),
                "receiver": len(receiver.events),
                **{f"{kind} {server}": len(witness.events)
                   for server, pair in resolvers.items() for kind, witness in zip(("udp", "tcp"), pair)}}

    # Positive control: unconfined on the host, the same probe reaches the host's witnesses (only the
    # host-local targets: a test sends nothing to the outside world, and resolves no real name).
    local = {"name": "localhost", "token": token,
             "tcp": [target for target in targets["tcp"] if target[0] not in ("1.1.1.1", "10.0.0.1")],
             "udp": [target for target in targets["udp"] if target[0] not in ("1.1.1.1", "10.0.0.1")]}
    control = unconfined(EGRESS_PROBE.replace('hold("filter")', "").replace("targets = target()",
                                                                             f"targets = {local!r}"))
    result = control.result()
    assert result["tcp 127.0.0.1:%d" % loopback.address[1]] == "connected", result
    assert result["udp 127.0.0.1:%d" % receiver.address[1]] == "sent", result
    wait_for(lambda: all(seen().values()))
    for witness in (loopback, everywhere, receiver):
        witness.events.clear()
    for pair in resolvers.values():
        for witness in pair:
            witness.events.clear()
    captured.hits.clear()

    inbox = ListenerInbox(tmp_path, 1)
    attack = SandboxedAttack(ListeningSandbox(sandbox, listener_options(free_host_port(), inbox)), EGRESS_PROBE)
    attack.provide(**targets)
    try:
        inbox.listeners()
        attack.wait_hold("filter")
        program = installed_filter(attack.program_pid())
    finally:
        attack.release("filter")
        run = attack.run()
        inbox.close()
    time.sleep(1)   # let anything in flight reach a witness
    assert set(seen().values()) == {0}, seen()   # the host's witnesses first: they are the proof
    outcomes = run.result()
    assert outcomes["getaddrinfo"] == "failed", outcomes
    assert "connected" not in outcomes.values(), outcomes
    # A datagram to the sandbox's own 127.0.0.1 is "sent" (into its own lo, where nobody listens); every
    # other destination has no route.
    for key, value in outcomes.items():
        if key.startswith("udp ") and not key.startswith("udp 127."):
            assert value == "ENETUNREACH", (key, outcomes)
    assert (outcomes["netlink"], outcomes["packet"]) == ("EAFNOSUPPORT", "EAFNOSUPPORT"), outcomes
    assert outcomes["raw_icmp"] == "EPERM", outcomes   # admitted by the filter, refused for want of CAP_NET_RAW
    # The filter admits exactly AF_UNIX, AF_INET and AF_INET6 sockets, and socketpair stays AF_UNIX only.
    for family in range(0, 46):
        expected = ("ALLOW", 0) if family in (socket.AF_UNIX, socket.AF_INET, socket.AF_INET6) else \
            ("ERRNO", errno.EAFNOSUPPORT)
        assert verdict(program, SYS_SOCKET, (family, socket.SOCK_STREAM, 0)) == expected, family
    for bogus in (socket.AF_INET | 1 << 32, -1, 1 << 31):
        assert verdict(program, SYS_SOCKET, (bogus, socket.SOCK_STREAM, 0)) == ("ERRNO", errno.EAFNOSUPPORT)
    assert verdict(program, SYS_SOCKETPAIR, (socket.AF_INET, socket.SOCK_STREAM, 0)) == \
        ("ERRNO", errno.EAFNOSUPPORT)
    assert verdict(program, SYS_SOCKETPAIR, (socket.AF_UNIX, socket.SOCK_STREAM, 0)) == ("ALLOW", 0)
