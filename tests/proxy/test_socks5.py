"""SOCKS5 (RFC 1928, no auth, CONNECT only): the sans-IO :class:`Socks5Parser`, and the listener of a running node.

The parser is fed every message whole, split at every byte boundary, and one byte at a time: the events must not
depend on how TCP cut the bytes. The live tests run one in-process ztunnel on its own loopback address.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import struct
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from ztunnel.proxy.common import HttpStatusError, ProxyError, ResponseFlag
from ztunnel.proxy.socks5 import (
    ConnectRequested,
    Event,
    MethodSelected,
    Rejected,
    Reply,
    Socks5Parser,
    reply,
    reply_for,
)
from ztunnel.testing import EchoServer, node_env, running_app, socks5_connect

GREETING = b"\x05\x01\x00"
V4_REQUEST = b"\x05\x01\x00\x01" + bytes([10, 1, 2, 3]) + struct.pack("!H", 8080)
V6_REQUEST = b"\x05\x01\x00\x04" + ipaddress.IPv6Address("fd00::1:2").packed + struct.pack("!H", 443)
DOMAIN_REQUEST = b"\x05\x01\x00\x03" + bytes([9]) + b"localhost" + struct.pack("!H", 65535)


def feed(chunks: list[bytes]) -> tuple[Socks5Parser, list[Event]]:
    parser = Socks5Parser()
    events: list[Event] = []
    for c in chunks:
        events.extend(parser.receive(c))
    return parser, events


def splits(data: bytes) -> list[list[bytes]]:
    """``data`` whole, cut once at every byte boundary, and one byte at a time."""
    out = [[data]]
    out += [[data[:i], data[i:]] for i in range(1, len(data))]
    out.append([data[i : i + 1] for i in range(len(data))])
    return out


def reply_bytes(code: int) -> bytes:
    return bytes([5, code, 0, 1, 0, 0, 0, 0, 0, 0])


# -- the parser ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("request_bytes", "host", "port"),
    [
        (V4_REQUEST, ipaddress.IPv4Address("10.1.2.3"), 8080),
        (V6_REQUEST, ipaddress.IPv6Address("fd00::1:2"), 443),
        (DOMAIN_REQUEST, "localhost", 65535),
        # An IPv4-mapped IPv6 address is the IPv4 address (as every address ztunnel looks up).
        (
            b"\x05\x01\x00\x04" + ipaddress.IPv6Address("::ffff:10.9.8.7").packed + b"\x00\x50",
            ipaddress.IPv4Address("10.9.8.7"),
            80,
        ),
        (b"\x05\x01\x00\x01" + bytes(4) + b"\x00\x00", ipaddress.IPv4Address("0.0.0.0"), 0),
    ],
    ids=["ipv4", "ipv6", "domain", "v4-mapped-v6", "zero"],
)
def test_connect_at_every_split(request_bytes: bytes, host: object, port: int) -> None:
    whole = GREETING + request_bytes
    for chunks in splits(whole):
        parser, events = feed(chunks)
        assert events == [MethodSelected(), ConnectRequested(host, port, b"")], chunks  # type: ignore[arg-type]
        assert parser.done


def test_greeting_alone_selects_no_auth_once() -> None:
    for chunks in splits(GREETING):
        parser, events = feed(chunks)
        assert events == [MethodSelected()]
        assert not parser.done  # waiting for the request


@pytest.mark.parametrize(
    "methods",
    [b"\x00", b"\x02\x00", b"\x01\x02\x80\x00", bytes(range(255))],
    ids=["only-noauth", "gssapi-first", "noauth-last", "255-methods"],
)
def test_greeting_with_no_auth_among_methods(methods: bytes) -> None:
    greeting = bytes([5, len(methods)]) + methods
    for chunks in splits(greeting + V4_REQUEST):
        _, events = feed(chunks)
        assert events == [MethodSelected(), ConnectRequested(ipaddress.IPv4Address("10.1.2.3"), 8080, b"")]


def test_pipelined_payload_is_leftover() -> None:
    payload = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
    whole = GREETING + DOMAIN_REQUEST + payload
    boundary = len(GREETING) + len(DOMAIN_REQUEST)
    for chunks in splits(whole):
        parser, events = feed(chunks)
        assert events[0] == MethodSelected()
        assert len(events) == 2
        ev = events[1]
        assert isinstance(ev, ConnectRequested)
        assert (ev.host, ev.port) == ("localhost", 65535)
        # Only the bytes that arrived in the same receive() as the end of the request are leftover; later
        # chunks go to the relay, not the parser (it is done and ignores them).
        delivered = 0
        for c in chunks:
            delivered += len(c)
            if delivered >= boundary:
                break
        assert ev.leftover == whole[boundary:delivered]
        assert parser.done
        assert parser.receive(b"more") == []


def test_all_leftover_in_one_chunk() -> None:
    payload = bytes(range(256)) * 8
    _, events = feed([GREETING + V6_REQUEST + payload])
    assert events == [MethodSelected(), ConnectRequested(ipaddress.IPv6Address("fd00::1:2"), 443, payload)]


@pytest.mark.parametrize(
    ("greeting", "response"),
    [
        (b"\x05\x01\x02", b"\x05\xff"),  # username/password only
        (b"\x05\x02\x01\x02", b"\x05\xff"),  # GSSAPI, username/password
        (b"\x05\x00", b"\x05\xff"),  # no methods at all
    ],
    ids=["userpass", "gssapi-userpass", "zero-methods"],
)
def test_greeting_without_no_auth_gets_05_ff(greeting: bytes, response: bytes) -> None:
    for chunks in splits(greeting + V4_REQUEST):
        parser, events = feed(chunks)
        assert len(events) == 1, chunks
        ev = events[0]
        assert isinstance(ev, Rejected)
        assert ev.response == response
        assert parser.done
        assert parser.receive(V4_REQUEST) == []


@pytest.mark.parametrize("version", [0x04, 0x00, 0x47], ids=["socks4", "zero", "http-G"])
def test_wrong_version_greeting_closes_without_reply(version: int) -> None:
    data = bytes([version, 1, 0]) + V4_REQUEST
    for chunks in splits(data):
        parser, events = feed(chunks)
        assert len(events) == 1
        ev = events[0]
        assert isinstance(ev, Rejected)
        assert ev.response == b""  # nothing sensible to say in SOCKS5 terms
        assert str(version) in ev.reason
        assert parser.done


def test_wrong_version_in_request_is_general_failure() -> None:
    request = b"\x04" + V4_REQUEST[1:]
    for chunks in splits(GREETING + request):
        _, events = feed(chunks)
        assert events[0] == MethodSelected()
        assert len(events) == 2
        assert isinstance(events[1], Rejected)
        assert events[1].response == reply_bytes(Reply.GENERAL_FAILURE)


@pytest.mark.parametrize(("command", "name"), [(0x02, "BIND"), (0x03, "UDP ASSOCIATE"), (0x00, "zero"), (0x7F, "x")])
def test_unsupported_command_gets_07(command: int, name: str) -> None:
    request = bytes([5, command]) + V4_REQUEST[2:]
    for chunks in splits(GREETING + request):
        parser, events = feed(chunks)
        assert events[0] == MethodSelected()
        assert len(events) == 2, name
        ev = events[1]
        assert isinstance(ev, Rejected)
        assert ev.response == reply_bytes(0x07)
        assert parser.done


@pytest.mark.parametrize("atyp", [0x00, 0x02, 0x05, 0xFF])
def test_unknown_address_type_gets_08(atyp: int) -> None:
    request = bytes([5, 1, 0, atyp]) + bytes(6)
    for chunks in splits(GREETING + request):
        _, events = feed(chunks)
        assert len(events) == 2
        ev = events[1]
        assert isinstance(ev, Rejected)
        assert ev.response == reply_bytes(0x08)


def test_empty_domain_is_host_unreachable() -> None:
    _, events = feed([GREETING + b"\x05\x01\x00\x03\x00\x00\x50"])
    assert isinstance(events[1], Rejected)
    assert events[1].response == reply_bytes(Reply.HOST_UNREACHABLE)


def test_non_ascii_domain_is_general_failure() -> None:
    name = "bücher.example".encode()
    _, events = feed([GREETING + b"\x05\x01\x00\x03" + bytes([len(name)]) + name + b"\x00\x50"])
    assert isinstance(events[1], Rejected)
    assert events[1].response == reply_bytes(Reply.GENERAL_FAILURE)


def test_incomplete_request_waits() -> None:
    parser = Socks5Parser()
    assert parser.receive(GREETING) == [MethodSelected()]
    # A domain request whose length byte promises more than has arrived: nothing yet, not an error.
    partial = b"\x05\x01\x00\x03" + bytes([200]) + b"a" * 150
    assert parser.receive(partial) == []
    assert not parser.done
    events = parser.receive(b"a" * 50 + b"\x01\xbb" + b"tail")
    assert events == [ConnectRequested("a" * 200, 443, b"tail")]


@pytest.mark.parametrize(
    "garbage",
    [
        b"\x16\x03\x01" + bytes(4000),  # a TLS ClientHello-ish prefix
        b"GET / HTTP/1.1\r\n" + b"X" * 4000,
        GREETING + b"\xff" * 4096,  # a good greeting, then junk where the request should be
        b"\x05\xff" + bytes(range(255)) + b"\x05\x01\x00\x09" + b"\xee" * 3000,  # 255 methods, then a bad ATYP
    ],
    ids=["tls", "http", "junk-request", "bad-atyp-with-tail"],
)
def test_oversized_garbage_is_rejected_once(garbage: bytes) -> None:
    for chunks in ([garbage], [garbage[i : i + 700] for i in range(0, len(garbage), 700)]):
        parser, events = feed(chunks)
        rejected = [e for e in events if isinstance(e, Rejected)]
        assert len(rejected) == 1, events
        assert not any(isinstance(e, ConnectRequested) for e in events)
        assert parser.done
        assert parser.receive(garbage) == []


def test_reply_encoding() -> None:
    assert reply(Reply.SUCCEEDED) == bytes([5, 0, 0, 1, 0, 0, 0, 0, 0, 0])
    assert reply(Reply.CONNECTION_REFUSED, (ipaddress.IPv4Address("10.0.0.1"), 8080)) == bytes(
        [5, 5, 0, 1, 10, 0, 0, 1, 0x1F, 0x90]
    )
    v6 = reply(Reply.NOT_ALLOWED, (ipaddress.IPv6Address("::1"), 1))
    assert v6[:4] == bytes([5, 2, 0, 4])
    assert v6[4:20] == ipaddress.IPv6Address("::1").packed
    assert v6[20:] == b"\x00\x01"


# -- a running node ------------------------------------------------------------------------------------------------

NODE_IP = "127.0.43.1"
SOCKS = (NODE_IP, 15080)
CONFIG = """
workloads:
- uid: Kubernetes//v1/Pod/default/socks-client
  name: socks-client
  namespace: default
  serviceAccount: socks-client
  workloadIps: ["127.0.43.1"]
  protocol: HBONE
  node: node-socks
- uid: Kubernetes//v1/Pod/default/socks-echo
  name: socks-echo
  namespace: default
  serviceAccount: socks-echo
  workloadIps: ["127.0.43.20"]
  protocol: TCP
  node: node-other
  services:
    "default/echo.default.svc.cluster.local":
      80: 8080
services:
- name: echo
  namespace: default
  hostname: echo.default.svc.cluster.local
  vips: ["/127.0.43.10"]
  ports:
    80: 8080
"""
ECHO_APP = ("127.0.43.20", 8080)


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Any]:
    cfg = tmp_path / "socks.yaml"
    cfg.write_text(CONFIG)
    env = node_env("node-socks", NODE_IP, "default/socks-client/socks-client", tmp_path / "ca", config=cfg)
    async with running_app(env) as app:
        yield app


async def read_all(reader: asyncio.StreamReader) -> bytes:
    return await asyncio.wait_for(reader.read(), 5)


@pytest.mark.parametrize(
    ("send", "expect"),
    [
        (b"\x05\x01\x02", b"\x05\xff"),  # username/password only
        (b"\x04\x01\x00\x50\x7f\x00\x00\x01\x00", b""),  # SOCKS4: closed without a reply
        (GREETING + b"\x05\x02\x00\x01" + bytes(6), b"\x05\x00" + reply_bytes(0x07)),  # BIND
        (GREETING + b"\x05\x01\x00\x07" + bytes(6), b"\x05\x00" + reply_bytes(0x08)),  # unknown ATYP
    ],
    ids=["no-acceptable-method", "socks4", "bind", "bad-atyp"],
)
async def test_malformed_gets_reply_then_close(node: Any, send: bytes, expect: bytes) -> None:
    reader, writer = await asyncio.open_connection(*SOCKS)
    try:
        writer.write(send)
        assert await read_all(reader) == expect  # the reply, then EOF: the socket was closed
    finally:
        writer.close()


async def test_connect_to_refused_destination_gets_05(node: Any) -> None:
    # Nothing listens there, and it is not in the mesh: a plain TCP connect that is refused.
    reader, writer = await asyncio.open_connection(*SOCKS)
    try:
        writer.write(GREETING + b"\x05\x01\x00\x01" + socket.inet_aton("127.0.43.9") + struct.pack("!H", 9))
        assert await read_all(reader) == b"\x05\x00" + reply_bytes(Reply.CONNECTION_REFUSED)
    finally:
        writer.close()
    with pytest.raises(ConnectionError, match="SOCKS5 reply 5"):
        await socks5_connect(SOCKS, "127.0.43.9", 9)


async def test_refused_port_that_contains_401_is_still_refused(node: Any) -> None:
    """The reply follows what the error is, not words in its message: a refused connect to port 40100 is ``05``
    (reading ``"401" in str(error)`` once made it ``02``, "not allowed by policy")."""
    with pytest.raises(ConnectionError, match="SOCKS5 reply 5"):
        await socks5_connect(SOCKS, "127.0.43.9", 40100)


@pytest.mark.parametrize(
    ("error", "expect"),
    [
        (HttpStatusError(401), Reply.NOT_ALLOWED),  # the destination's policy refused it
        (ProxyError("denied", ResponseFlag.DENY), Reply.NOT_ALLOWED),
        (HttpStatusError(503), Reply.CONNECTION_REFUSED),
        (ProxyError("connection to 10.0.0.1:80 timed out", timed_out=True), Reply.HOST_UNREACHABLE),
        (ProxyError("failed to connect to 10.0.0.1:4010: Connection refused"), Reply.CONNECTION_REFUSED),
    ],
)
def test_reply_follows_the_error_type(error: ProxyError, expect: Reply) -> None:
    assert reply_for(error) is expect


async def test_domain_name_resolves_and_pipelined_bytes_arrive(node: Any) -> None:
    """A service hostname is resolved (by the node's DNS proxy, as upstream) to its VIP, load-balanced to the
    endpoint, and the payload sent in the same write as the request is not lost in the hand-over."""
    echo = await EchoServer().start(*ECHO_APP)
    reader, writer = await asyncio.open_connection(*SOCKS)
    try:
        name = b"echo.default.svc.cluster.local"
        writer.write(GREETING + b"\x05\x01\x00\x03" + bytes([len(name)]) + name + struct.pack("!H", 80) + b"early")
        assert await asyncio.wait_for(reader.readexactly(2 + 10), 5) == b"\x05\x00" + reply_bytes(0)
        assert await asyncio.wait_for(reader.readexactly(5), 5) == b"early"
        writer.write(b" and late")
        writer.write_eof()
        assert await read_all(reader) == b" and late"
        assert echo.connections == 1
        assert node.proxy.pi.pool.dials == 0  # a TCP endpoint: no HBONE
    finally:
        writer.close()
        await echo.stop()


async def test_domain_that_does_not_resolve_gets_04(node: Any) -> None:
    async def fail(name: str) -> list[Any]:
        raise OSError(f"cannot resolve {name}")

    node.proxy.socks5.resolve = fail  # fails like a resolver that cannot answer (no real DNS in the test)
    reader, writer = await asyncio.open_connection(*SOCKS)
    try:
        name = b"nosuch.invalid"
        writer.write(GREETING + b"\x05\x01\x00\x03" + bytes([len(name)]) + name + b"\x00\x50")
        assert await read_all(reader) == b"\x05\x00" + reply_bytes(Reply.HOST_UNREACHABLE)
    finally:
        writer.close()


async def test_domain_resolving_to_nothing_gets_04(node: Any) -> None:
    async def empty(name: str) -> list[Any]:
        return []

    node.proxy.socks5.resolve = empty
    with pytest.raises(ConnectionError, match="SOCKS5 reply 4"):
        await socks5_connect(SOCKS, "nothing.example", 80)
