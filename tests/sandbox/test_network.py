"""Network egress: the sandbox has an empty network namespace and only AF_UNIX sockets.
Every test keeps a host listener open and proves it saw nothing."""
import socket
import uuid

import pytest

from conftest import host_ip

FAMILIES = {
    "AF_INET": socket.AF_INET,
    "AF_INET6": socket.AF_INET6,
    "AF_NETLINK": 16,
    "AF_PACKET": 17,
    "AF_VSOCK": 40,
    "AF_BLUETOOTH": 31,
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_socket_families_other_than_unix_are_refused(sandbox, family):
    run = sandbox.python(f"""
        try:
            s = socket.socket({FAMILIES[family]}, socket.SOCK_DGRAM if {FAMILIES[family]} != 16 else socket.SOCK_RAW)
            report(created=True)
        except OSError as error:
            report(created=False, errno=errno.errorcode.get(error.errno))
    """)
    assert run.result() == {"created": False, "errno": "EAFNOSUPPORT"}


def test_tcp_to_host_loopback_and_external_address_never_connects(sandbox, listeners):
    loopback = listeners(socket.AF_INET, socket.SOCK_STREAM, ("127.0.0.1", 0))
    everywhere = listeners(socket.AF_INET, socket.SOCK_STREAM, ("0.0.0.0", 0))
    targets = [("127.0.0.1", loopback.address[1]), (host_ip(), everywhere.address[1]), ("127.0.0.1", everywhere.address[1])]
    run = sandbox.python(f"""
        outcomes = []
        for target in {targets!r}:
            try:
                socket.create_connection(tuple(target), timeout=2).close()
                outcomes.append("connected")
            except OSError as error:
                outcomes.append(errno.errorcode.get(error.errno, str(error)))
        report(outcomes=outcomes)
    """)
    assert "connected" not in run.result()["outcomes"]
    assert loopback.events == [] and everywhere.events == []


def test_udp_to_host_is_never_delivered(sandbox, listeners):
    receiver = listeners(socket.AF_INET, socket.SOCK_DGRAM, ("127.0.0.1", 0))
    run = sandbox.python(f"""
        try:
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.sendto(b"exfiltrated", ("127.0.0.1", {receiver.address[1]}))
            report(sent=True)
        except OSError as error:
            report(sent=False, errno=errno.errorcode.get(error.errno))
    """)
    assert run.result()["sent"] is False
    assert receiver.events == []


def test_raw_and_packet_sockets_are_refused(sandbox):
    run = sandbox.python("""
        outcomes = {}
        for name, args in {"raw_icmp": (socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP),
                           "packet": (17, socket.SOCK_RAW, 0x0300)}.items():
            try:
                socket.socket(*args)
                outcomes[name] = "created"
            except OSError as error:
                outcomes[name] = errno.errorcode.get(error.errno)
        report(**outcomes)
    """)
    assert run.result() == {"raw_icmp": "EAFNOSUPPORT", "packet": "EAFNOSUPPORT"}


def test_unix_socket_by_host_path_is_unreachable(sandbox, listeners, tmp_path):
    path = f"/tmp/cellblock-host-{uuid.uuid4().hex[:8]}.sock"
    listener = listeners(socket.AF_UNIX, socket.SOCK_STREAM, path)
    try:
        run = sandbox.python(f"""
            outcomes = []
            for candidate in [{path!r}, "/run/dbus/system_bus_socket", "/var/run/docker.sock"]:
                try:
                    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    s.connect(candidate)
                    outcomes.append("connected")
                except OSError as error:
                    outcomes.append(errno.errorcode.get(error.errno))
            report(outcomes=outcomes)
        """)
        assert run.result()["outcomes"] == ["ENOENT", "ENOENT", "ENOENT"]
        assert listener.events == []
    finally:
        import os
        os.unlink(path)


def test_abstract_unix_socket_of_the_host_is_unreachable(sandbox, listeners):
    name = "\0cellblock-host-" + uuid.uuid4().hex[:8]
    listener = listeners(socket.AF_UNIX, socket.SOCK_STREAM, name)
    run = sandbox.python(f"""
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect({name!r})
            report(connected=True)
        except OSError as error:
            report(connected=False, errno=errno.errorcode.get(error.errno))
    """)
    assert run.result() == {"connected": False, "errno": "ECONNREFUSED"}
    assert listener.events == []


def test_dns_resolution_fails_and_no_query_reaches_the_host(sandbox, listeners):
    # A host UDP "resolver" on loopback would see a query if the sandbox could send one anywhere.
    resolver = listeners(socket.AF_INET, socket.SOCK_DGRAM, ("127.0.0.1", 0))
    run = sandbox.python("""
        answers = {}
        for name in ["example.com", "pypi.org", "localhost-nonexistent.invalid"]:
            try:
                answers[name] = socket.getaddrinfo(name, 443)[0][4][0]
            except OSError as error:
                answers[name] = "failed"
        report(answers=answers)
    """)
    assert set(run.result()["answers"].values()) == {"failed"}
    assert resolver.events == []


def test_only_loopback_interface_exists(sandbox):
    run = sandbox.python("""
        lines = open("/proc/net/dev").read().splitlines()[2:]
        report(interfaces=sorted(line.split(":")[0].strip() for line in lines))
    """)
    assert run.result()["interfaces"] == ["lo"]


def test_unix_sockets_inside_the_sandbox_still_work(sandbox):
    # The filter must not be a blanket ban: multiprocessing and friends need AF_UNIX socketpairs.
    run = sandbox.python("""
        a, b = socket.socketpair()
        a.sendall(b"ping")
        report(echo=b.recv(4).decode())
    """)
    assert run.result() == {"echo": "ping"}
