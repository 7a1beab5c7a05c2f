"""SOCKS5 handshakes fuzzed: the sans-IO parser and a live 15080.

Inputs come three ways: random bytes; byte strings built from the RFC 1928 grammar with fields drawn from valid and
invalid values (version, methods, command, address type, domain bytes, port), whose outcome is known and checked
exactly; and those grammar-built strings mutated at the byte level (only the invariants are checked then).

Properties of the parser, for any input cut into any chunks: the events are ``MethodSelected`` then one
``ConnectRequested`` or one ``Rejected`` (or a prefix of that), nothing after; a rejection has a reason naming the
field and a response that is empty, ``05 FF`` or a 10-byte SOCKS5 reply; a connect has a port, and a host that is
an IP or a non-empty ASCII name; the outcome does not depend on how the bytes were cut; and nothing waits for more
bytes once more than 1 KiB is buffered.

The live test sends the same inputs to a running node's 15080 and expects exactly the bytes the parser's events
call for, then the close; after every batch a good SOCKS5 tunnel still works.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzzing import LIVE_TIMEOUT, AppThread, errors_logged, fuzz_settings, mutated
from ztunnel.proxy.socks5 import (
    _MAX_BUFFERED,
    ConnectRequested,
    Event,
    MethodSelected,
    Rejected,
    Reply,
    Socks5Parser,
    reply,
)
from ztunnel.testing import EchoServer, node_env

# -- the grammar ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Handshake:
    """A greeting and a request built field by field, and what the parser must make of them."""

    data: bytes
    expected: list[Event]


def _expect_request(version: int, cmd: int, atyp: int, addr: bytes, port: int, tail: bytes) -> Event:
    if version != 5:
        return Rejected(reply(Reply.GENERAL_FAILURE), f"unsupported SOCKS version {version} in request")
    if cmd != 1:
        return Rejected(reply(Reply.COMMAND_NOT_SUPPORTED), f"unsupported command {cmd}")
    if atyp == 1:
        return ConnectRequested(ipaddress.IPv4Address(addr), port, tail)
    if atyp == 4:
        v6 = ipaddress.IPv6Address(addr)
        return ConnectRequested(v6.ipv4_mapped or v6, port, tail)
    if atyp == 3:
        name = addr[1:]
        if not name.isascii():
            return Rejected(reply(Reply.GENERAL_FAILURE), "domain name is not ASCII")
        if not name:
            return Rejected(reply(Reply.HOST_UNREACHABLE), "empty domain name")
        return ConnectRequested(name.decode(), port, tail)
    return Rejected(reply(Reply.ADDRESS_TYPE_NOT_SUPPORTED), f"unsupported address type {atyp}")


@st.composite
def handshakes(draw: st.DrawFn) -> Handshake:
    version = draw(st.sampled_from([5] * 12 + [4, 0, 0x47, 0x16]))
    methods = draw(
        st.one_of(
            st.just(b"\x00"),
            st.just(b"\x00"),
            st.binary(min_size=0, max_size=255),
            st.lists(st.sampled_from([0, 1, 2, 0x80, 0xFF]), max_size=8).map(bytes),
        )
    )
    greeting = bytes([version, len(methods)]) + methods
    if version != 5:
        return Handshake(greeting, [Rejected(b"", f"unsupported SOCKS version {version}")])
    if not methods or 0 not in methods:
        reason = "no authentication methods offered" if not methods else "only unauthenticated SOCKS5 is supported"
        return Handshake(greeting, [Rejected(b"\x05\xff", reason)])
    rversion = draw(st.sampled_from([5] * 10 + [4, 0]))
    cmd = draw(st.sampled_from([1] * 10 + [2, 3, 0, 0x7F]))
    rsv = draw(st.sampled_from([0, 0, 0xFF]))  # reserved: ignored
    atyp = draw(st.sampled_from([1, 1, 1, 3, 3, 3, 4, 4, 4, 0, 2, 5, 0xFF]))
    if atyp == 1:
        addr = draw(st.binary(min_size=4, max_size=4))
    elif atyp == 4:
        addr = draw(
            st.one_of(
                st.binary(min_size=16, max_size=16),
                st.binary(min_size=4, max_size=4).map(
                    lambda b: ipaddress.IPv6Address(b"\0" * 10 + b"\xff\xff" + b).packed
                ),
            )
        )
    elif atyp == 3:
        name = draw(
            st.one_of(
                st.from_regex(r"[a-z0-9.-]{0,63}", fullmatch=True).map(str.encode),
                st.binary(max_size=255),
                st.just(b"x" * 255),
            )
        )
        addr = bytes([len(name)]) + name
    else:
        addr = draw(st.binary(max_size=20))
    port = draw(st.integers(0, 65535))
    tail = draw(st.binary(max_size=64))
    request = bytes([rversion, cmd, rsv, atyp]) + addr + struct.pack("!H", port)
    data = greeting + request + tail
    return Handshake(data, [MethodSelected(), _expect_request(rversion, cmd, atyp, addr, port, tail)])


def _chunks(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    out, last = [], 0
    for p in [*points, len(data)]:
        out.append(data[last:p])
        last = p
    return out


def feed(chunks: list[bytes]) -> tuple[Socks5Parser, list[Event]]:
    parser = Socks5Parser()
    events: list[Event] = []
    for c in chunks:
        events.extend(parser.receive(c))
    return parser, events


_REASONS = (
    "unsupported SOCKS version ",
    "no authentication methods offered",
    "only unauthenticated SOCKS5 is supported",
    "unsupported command ",
    "unsupported address type ",
    "domain name is not ASCII",
    "empty domain name",
    "SOCKS5 message too long",
)


def check_invariants(data: bytes, parser: Socks5Parser, events: list[Event]) -> None:
    kinds = [type(e) for e in events]
    assert kinds in ([], [MethodSelected], [Rejected], [MethodSelected, Rejected], [MethodSelected, ConnectRequested])
    assert parser.done == (kinds[-1:] in ([Rejected], [ConnectRequested]))
    if not parser.done:
        # Waiting for more is only allowed while the message could still be complete: nothing more than a greeting
        # and 1 KiB is ever held.
        assert len(data) <= 2 + 255 + _MAX_BUFFERED
    for ev in events:
        if isinstance(ev, Rejected):
            assert ev.reason.startswith(_REASONS), ev.reason
            assert ev.response in (b"", b"\x05\xff") or (
                len(ev.response) == 10 and ev.response[:1] == b"\x05" and ev.response[1] in set(Reply)
            )
        elif isinstance(ev, ConnectRequested):
            assert 0 <= ev.port <= 65535
            if isinstance(ev.host, str):
                assert ev.host and ev.host.isascii() and len(ev.host) <= 255
            else:
                assert not (isinstance(ev.host, ipaddress.IPv6Address) and ev.host.ipv4_mapped)
    if parser.done:
        assert parser.receive(b"\x05\x01\x00") == []  # a finished parser ignores whatever comes next


def outcome(events: list[Event]) -> list[Event]:
    """Events without the pipelined payload, which depends on how the bytes were cut."""
    return [ConnectRequested(e.host, e.port, b"") if isinstance(e, ConnectRequested) else e for e in events]


inputs = st.one_of(
    st.binary(max_size=600),
    handshakes().map(lambda h: h.data),
    mutated(handshakes().map(lambda h: h.data)),
    st.binary(min_size=1100, max_size=1400),  # past the 1 KiB bound
)


@fuzz_settings(2000)
@given(inputs, st.lists(st.integers(0, 2000), max_size=6))
def test_parser_any_bytes_any_cut(data: bytes, cuts: list[int]) -> None:
    whole_parser, whole = feed([data])
    check_invariants(data, whole_parser, whole)
    chunks = _chunks(data, cuts)
    parser, events = feed(chunks)
    check_invariants(data, parser, events)
    assert outcome(events) == outcome(whole), chunks
    if whole and isinstance(whole[-1], ConnectRequested) and isinstance(events[-1], ConnectRequested):
        # The payload is what followed the request in the chunks received so far: never lost, never invented.
        end = len(data) - len(whole[-1].leftover)
        assert data[end:].startswith(events[-1].leftover)
    one_by_one = feed([data[i : i + 1] for i in range(min(len(data), 600))])[1]
    if len(data) <= 600:
        assert outcome(one_by_one) == outcome(whole)


@fuzz_settings(1500)
@given(handshakes(), st.lists(st.integers(0, 600), max_size=4))
def test_grammar_built_handshakes_parse_exactly(h: Handshake, cuts: list[int]) -> None:
    _, whole = feed([h.data])
    assert whole == h.expected
    _, events = feed(_chunks(h.data, cuts))
    assert outcome(events) == outcome(h.expected)


# -- a live 15080 --------------------------------------------------------------------------------------------------

live_inputs = st.one_of(
    handshakes().map(lambda h: h.data),
    handshakes().map(lambda h: h.data),
    mutated(handshakes().map(lambda h: h.data)),
    st.binary(max_size=300),
)

NODE_IP = "127.0.47.1"
SOCKS = (NODE_IP, 15080)
ECHO_APP = ("127.0.47.20", 8080)
CONFIG = """
workloads:
- uid: Kubernetes//v1/Pod/default/fuzz-client
  name: fuzz-client
  namespace: default
  serviceAccount: fuzz-client
  workloadIps: ["127.0.47.1"]
  protocol: HBONE
  node: node-socks-fuzz
- uid: Kubernetes//v1/Pod/default/fuzz-echo
  name: fuzz-echo
  namespace: default
  workloadIps: ["127.0.47.20"]
  protocol: TCP
  node: node-other
"""
BATCH = 10


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[AppThread, EchoServer]]:
    tmp: Path = tmp_path_factory.mktemp("socks5-fuzz")
    cfg = tmp / "socks.yaml"
    cfg.write_text(CONFIG)
    env = node_env("node-socks-fuzz", NODE_IP, "default/fuzz-client/fuzz-client", tmp / "ca", config=cfg)
    with AppThread(env) as node:

        async def no_dns(name: str) -> list[ipaddress.IPv4Address]:
            return [ipaddress.IPv4Address(ECHO_APP[0])]  # every name is the echo app: no real DNS from a test

        node.app.proxy.socks5.resolve = no_dns
        echo = node.call(EchoServer().start(*ECHO_APP))
        try:
            yield node, echo
        finally:
            node.call(echo.stop())


def to_echo(data: bytes) -> tuple[bytes, bytes]:
    """If ``data`` is a complete CONNECT, the same handshake aimed at the echo app (a fuzzed destination could be
    anywhere); returns (bytes to send, bytes expected back before the close)."""
    _, events = feed([data])
    expected = b""
    for ev in events:
        if isinstance(ev, MethodSelected):
            expected += b"\x05\x00"
        elif isinstance(ev, Rejected):
            expected += ev.response
        else:
            # Keep the greeting as fuzzed (2 + NMETHODS bytes); the request becomes an IPv4 CONNECT to the echo app.
            request = b"\x05\x01\x00\x01" + socket.inet_aton(ECHO_APP[0]) + struct.pack("!H", ECHO_APP[1])
            data = data[: 2 + data[1]] + request + ev.leftover
            expected += reply(Reply.SUCCEEDED) + ev.leftover  # the echo app sends the payload back, then EOF
    return data, expected


def exchange(data: bytes) -> bytes:
    """Send ``data`` and EOF to 15080; everything read until ztunnel closes."""
    with socket.create_connection(SOCKS, timeout=5) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
        return got


def good_tunnel_works() -> None:
    with socket.create_connection(SOCKS, timeout=5) as s:
        s.sendall(
            b"\x05\x01\x00" + b"\x05\x01\x00\x01" + socket.inet_aton(ECHO_APP[0]) + struct.pack("!H", ECHO_APP[1])
        )
        assert s.recv(2) == b"\x05\x00"
        head = b""
        while len(head) < 10:
            head += s.recv(10 - len(head))
        assert head == reply(Reply.SUCCEEDED)
        s.sendall(b"still serving")
        got = b""
        while len(got) < 13:
            got += s.recv(13 - len(got))
        assert got == b"still serving"


@pytest.mark.timeout(LIVE_TIMEOUT)
def test_live_socks5_listener_survives_fuzzed_handshakes(
    live: tuple[AppThread, EchoServer], caplog: pytest.LogCaptureFixture
) -> None:
    node, echo = live
    kinds = {"connected": 0, "rejected": 0, "incomplete": 0}

    @fuzz_settings(100)
    @given(st.lists(live_inputs, min_size=BATCH, max_size=BATCH))
    def run(batch: list[bytes]) -> None:
        for raw in batch:
            data, expected = to_echo(raw)
            assert exchange(data) == expected, raw
            last = feed([raw])[1][-1:]
            kinds[
                "connected" if last and isinstance(last[0], ConnectRequested) else "rejected" if last else "incomplete"
            ] += 1
        good_tunnel_works()

    before = echo.connections
    with caplog.at_level(logging.WARNING, logger="ztunnel"):
        run()
    assert sum(kinds.values()) >= 100 * BATCH
    assert all(n >= 3 for n in kinds.values()), kinds  # every path is reached, not only the rejections
    assert echo.connections - before >= kinds["connected"]
    assert not node.errors, node.errors
    assert not errors_logged(caplog.records)
    good_tunnel_works()
