"""Network egress: the sandbox has an empty network namespace and only AF_UNIX sockets.
Every test keeps a host witness open (listener, packet capture, the installed filter, the program's network
namespace seen from the host) and proves it saw nothing; where the witness is a listener, the same attack
run unconfined on the host first shows that it fires."""
import errno
import json
import os
import secrets
import socket
import time
import uuid

import pytest

from conftest import host_ip
from witnesses import (SandboxedAttack, UnconfinedAttack, packet_witness, sandbox_filter,  # noqa: F401 (fixtures)
                       unconfined, verdict)


def wait_for(condition, seconds=30):
    """Waits for a host witness to record what a positive control did (generous: a loaded machine)."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "the witness never saw the unconfined attack"
        time.sleep(0.05)

FAMILIES = {
    "AF_INET": socket.AF_INET,
    "AF_INET6": socket.AF_INET6,
    "AF_NETLINK": 16,
    "AF_PACKET": 17,
    "AF_VSOCK": 40,
    "AF_BLUETOOTH": 31,
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_socket_families_other_than_unix_are_refused(sandbox, sandbox_filter, family):
    run = sandbox.python(f"""
        try:
            s = socket.socket({FAMILIES[family]}, socket.SOCK_DGRAM if {FAMILIES[family]} != 16 else socket.SOCK_RAW)
            report(created=True)
        except OSError as error:
            report(created=False, errno=errno.errorcode.get(error.errno))
    """)
    assert run.result() == {"created": False, "errno": "EAFNOSUPPORT"}
    # A kernel without AF_VSOCK or AF_BLUETOOTH answers EAFNOSUPPORT by itself: the filter must refuse the family.
    for number in (41, 53):   # socket, socketpair
        assert verdict(sandbox_filter, number, (FAMILIES[family], 2, 0)) == ("ERRNO", errno.EAFNOSUPPORT)
    assert verdict(sandbox_filter, 41, (socket.AF_UNIX, 2, 0)) == ("ALLOW", 0)


def test_tcp_to_host_loopback_and_external_address_never_connects(sandbox, listeners):
    loopback = listeners(socket.AF_INET, socket.SOCK_STREAM, ("127.0.0.1", 0))
    everywhere = listeners(socket.AF_INET, socket.SOCK_STREAM, ("0.0.0.0", 0))
    targets = [("127.0.0.1", loopback.address[1]), (host_ip(), everywhere.address[1]), ("127.0.0.1", everywhere.address[1])]
    attack = f"""
        outcomes = []
        for target in {targets!r}:
            try:
                socket.create_connection(tuple(target), timeout=2).close()
                outcomes.append("connected")
            except OSError as error:
                outcomes.append(errno.errorcode.get(error.errno, str(error)))
        report(outcomes=outcomes)
    """
    # Positive control: unconfined, the same attack reaches both listeners.
    assert unconfined(attack).result()["outcomes"] == ["connected"] * 3
    wait_for(lambda: len(loopback.events) == 1 and len(everywhere.events) == 2)
    loopback.events.clear()
    everywhere.events.clear()

    run = sandbox.python(attack)
    assert loopback.events == [] and everywhere.events == []
    assert "connected" not in run.result()["outcomes"]


def test_udp_to_host_is_never_delivered(sandbox, listeners):
    receiver = listeners(socket.AF_INET, socket.SOCK_DGRAM, ("127.0.0.1", 0))
    attack = f"""
        try:
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.sendto(b"exfiltrated", ("127.0.0.1", {receiver.address[1]}))
            report(sent=True)
        except OSError as error:
            report(sent=False, errno=errno.errorcode.get(error.errno))
    """
    assert unconfined(attack).result() == {"sent": True}   # positive control
    wait_for(lambda: [event[2] for event in receiver.events] == [b"exfiltrated"])
    receiver.events.clear()

    run = sandbox.python(attack)
    assert receiver.events == []
    assert run.result()["sent"] is False


def test_raw_and_packet_sockets_are_refused(sandbox, sandbox_filter):
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
    # Without the filter these fail with EPERM (no CAP_NET_RAW); the filter refuses the families itself.
    assert verdict(sandbox_filter, 41, (socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)) == \
        ("ERRNO", errno.EAFNOSUPPORT)
    assert verdict(sandbox_filter, 41, (17, socket.SOCK_RAW, 0x0300)) == ("ERRNO", errno.EAFNOSUPPORT)


def test_unix_socket_by_host_path_is_unreachable(sandbox, listeners, tmp_path):
    path = f"/tmp/cellblock-host-{uuid.uuid4().hex[:8]}.sock"
    listener = listeners(socket.AF_UNIX, socket.SOCK_STREAM, path)
    try:
        attack = f"""
            outcomes = []
            for candidate in [{path!r}, "/run/dbus/system_bus_socket", "/var/run/docker.sock"]:
                try:
                    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    s.connect(candidate)
                    outcomes.append("connected")
                except OSError as error:
                    outcomes.append(errno.errorcode.get(error.errno))
            report(outcomes=outcomes)
        """
        assert unconfined(attack).result()["outcomes"][0] == "connected"   # positive control
        wait_for(lambda: len(listener.events) == 1)
        listener.events.clear()

        run = sandbox.python(attack)
        assert listener.events == []
        assert run.result()["outcomes"] == ["ENOENT", "ENOENT", "ENOENT"]
    finally:
        os.unlink(path)


def test_abstract_unix_socket_of_the_host_is_unreachable(sandbox, listeners):
    name = "\0cellblock-host-" + uuid.uuid4().hex[:8]
    listener = listeners(socket.AF_UNIX, socket.SOCK_STREAM, name)
    attack = f"""
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect({name!r})
            report(connected=True)
        except OSError as error:
            report(connected=False, errno=errno.errorcode.get(error.errno))
    """
    assert unconfined(attack).result() == {"connected": True}   # positive control: same network namespace
    wait_for(lambda: len(listener.events) == 1)
    listener.events.clear()

    run = sandbox.python(attack)
    assert listener.events == []
    assert run.result() == {"connected": False, "errno": "ECONNREFUSED"}


DNS_PROBE = """
    name, servers = target()["name"], target()["servers"]
    outcomes = {}
    try:
        outcomes["getaddrinfo"] = socket.getaddrinfo(name, 443)[0][4][0]
    except OSError as error:
        outcomes["getaddrinfo"] = "failed"
    # The same query by hand, over UDP and TCP, to each resolver the sandbox is configured with.
    query = (bytes.fromhex("c0de01000001000000000000") +
             b"".join(bytes([len(label)]) + label.encode() for label in name.split(".")) + bytes.fromhex("0000010001"))
    for server in servers:
        try:
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(query, (server, 53))
            outcomes["udp " + server] = "sent"
        except OSError as error:
            outcomes["udp " + server] = errno.errorcode.get(error.errno, str(error))
        try:
            connection = socket.create_connection((server, 53), timeout=2)
            connection.sendall(len(query).to_bytes(2, "big") + query)
            connection.close()
            outcomes["tcp " + server] = "sent"
        except OSError as error:
            outcomes["tcp " + server] = errno.errorcode.get(error.errno, str(error))
    report(**outcomes)
"""


def resolver_witnesses(listeners):
    """UDP and TCP listeners on port 53 of the host's loopback and of its address on the default route: the
    resolvers a sandbox would reach if it shared the host's network."""
    witnesses = {}
    for candidates in (["127.0.0.1", "127.53.0.1"], [host_ip()]):
        for address in candidates:
            if address in witnesses:
                break
            try:
                witnesses[address] = (listeners(socket.AF_INET, socket.SOCK_DGRAM, (address, 53)),
                                      listeners(socket.AF_INET, socket.SOCK_STREAM, (address, 53)))
                break
            except OSError as error:
                last = error
        else:
            raise AssertionError(f"cannot listen on port 53 of any of {candidates}: {last}")
    return witnesses


def test_dns_resolution_fails_and_no_query_leaves_the_sandbox(sandbox, default_policy, listeners, packet_witness,
                                                              tmp_path):
    label = "cellblock-probe-" + secrets.token_hex(8)
    name = label + ".example.com"
    witnesses = resolver_witnesses(listeners)
    servers = sorted(witnesses)
    # A sandbox whose C library really asks DNS (hosts: files dns) and whose resolvers are the witnesses.
    resolv_conf = "".join(f"nameserver {server}\n" for server in servers) + "options timeout:1 attempts:1\n"
    nsswitch_conf = "passwd: files\ngroup: files\nhosts: files dns\n"
    policy = json.loads(default_policy.read_text())
    policy["mounts"] = [mount for mount in policy["mounts"] if mount["target"] != "/etc/nsswitch.conf"]
    policy["mounts"] += [{"type": "file", "target": "/etc/resolv.conf", "content": resolv_conf},
                         {"type": "file", "target": "/etc/nsswitch.conf", "content": nsswitch_conf}]
    (tmp_path / "dns-policy.json").write_text(json.dumps(policy))
    (tmp_path / "resolv.conf").write_text(resolv_conf)
    (tmp_path / "nsswitch.conf").write_text(nsswitch_conf)
    captured = packet_witness(label.encode())

    def seen():
        return {"packets": len(captured.hits),
                **{f"{kind} {server}": len(listener.events)
                   for server, pair in witnesses.items() for kind, listener in zip(("udp", "tcp"), pair)}}

    # Positive control: the same probe with the same two files, unconfined on the host (a private mount
    # namespace binds them over the host's): the C library's query and the hand-made ones reach every witness.
    bind = (f"mount --bind {tmp_path}/resolv.conf /etc/resolv.conf && "
            f"mount --bind {tmp_path}/nsswitch.conf /etc/nsswitch.conf && exec \"$@\"")
    control = UnconfinedAttack(DNS_PROBE, wrapper=["unshare", "--mount", "--propagation", "private",
                                                   "/bin/sh", "-c", bind, "sh"])
    control.provide(name=name, servers=servers)
    result = control.run().result()
    assert set(result.values()) == {"failed", "sent"}, result
    wait_for(lambda: all(seen().values()))
    # The C library's own queries: in the control, udp witnesses saw more than the one hand-made datagram each.
    assert any(len(pair[0].events) > 1 for pair in witnesses.values()), seen()
    for pair in witnesses.values():
        for listener in pair:
            listener.events.clear()
    captured.hits.clear()

    # Confined, with the resolvers configured and with the default policy (which has none): nothing arrives.
    for policy in (tmp_path / "dns-policy.json", default_policy):
        attack = SandboxedAttack(sandbox, DNS_PROBE, policy=policy)
        attack.provide(name=name, servers=servers)
        result = attack.run().result()
        assert set(seen().values()) == {0}, (policy, seen())   # the host's witnesses first: they are the proof
        assert result["getaddrinfo"] == "failed", result
        assert "sent" not in result.values(), result


def interfaces(net_dev):
    return sorted(line.split(":")[0].strip() for line in net_dev.splitlines()[2:])


def test_only_loopback_interface_exists(sandbox):
    attack = SandboxedAttack(sandbox, """
        lines = open("/proc/net/dev").read().splitlines()[2:]
        hold("inspect")
        report(interfaces=sorted(line.split(":")[0].strip() for line in lines))
    """)
    try:
        attack.wait_hold("inspect")
        pid = attack.program_pid()
        # Seen from the host: the program's network namespace is not the host's, and it has only lo.
        namespace, host_namespace = os.readlink(f"/proc/{pid}/ns/net"), os.readlink("/proc/self/ns/net")
        seen = interfaces(open(f"/proc/{pid}/net/dev").read())
    finally:
        attack.release("inspect")
    result = attack.run().result()
    assert namespace != host_namespace
    assert seen == ["lo"]
    assert result["interfaces"] == ["lo"]
    assert len(interfaces(open("/proc/self/net/dev").read())) > 1   # the host's view has its own interfaces


def test_unix_sockets_inside_the_sandbox_still_work(sandbox):
    # The filter must not be a blanket ban: multiprocessing and friends need AF_UNIX socketpairs.
    run = sandbox.python("""
        a, b = socket.socketpair()
        a.sendall(b"ping")
        report(echo=b.recv(4).decode())
    """)
    assert run.result() == {"echo": "ping"}
