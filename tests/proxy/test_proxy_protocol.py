"""The PROXY protocol v2 codec (``ztunnel/proxy/proxy_protocol.py``) against the bytes the specification gives."""

from __future__ import annotations

import ipaddress

import pytest

from ztunnel.proxy.proxy_protocol import (
    TLV_PEER_IDENTITY,
    ProxyProtocolError,
    app_tunnel_header,
    encode_v2,
    parse_v2,
)

V4 = ipaddress.IPv4Address
V6 = ipaddress.IPv6Address
SIG = bytes.fromhex("0d0a0d0a000d0a515549540a")


def test_ipv4_header_is_byte_exact() -> None:
    # Written out by hand from haproxy's proxy-protocol.txt section 2.2, not from the encoder.
    got = app_tunnel_header((V4("10.0.0.1"), 40000), (V4("10.0.0.2"), 8080), "spiffe://td/ns/a/sa/b")
    ident = b"spiffe://td/ns/a/sa/b"
    want = (
        SIG
        + b"\x21"  # version 2, command PROXY
        + b"\x11"  # AF_INET, STREAM
        + (12 + 3 + len(ident)).to_bytes(2, "big")
        + bytes([10, 0, 0, 1, 10, 0, 0, 2])
        + (40000).to_bytes(2, "big")
        + (8080).to_bytes(2, "big")
        + b"\xd0"
        + len(ident).to_bytes(2, "big")
        + ident
    )
    assert got == want


def test_ipv6_round_trip_and_no_identity() -> None:
    raw = app_tunnel_header((V6("fd00::1"), 1), (V6("fd00::2"), 2), None)
    assert raw[13] == 0x21 and int.from_bytes(raw[14:16], "big") == 36  # INET6 STREAM, addresses only
    h = parse_v2(raw + b"payload")
    assert h is not None and h.length == len(raw)
    assert h.src == (V6("fd00::1"), 1) and h.dst == (V6("fd00::2"), 2) and h.tlvs == ()


def test_mixed_families_are_written_as_mapped_ipv6() -> None:
    h = parse_v2(encode_v2((V4("10.0.0.1"), 5), (V6("fd00::2"), 6), [(TLV_PEER_IDENTITY, b"x")]))
    assert h is not None
    assert h.src == (V6("::ffff:10.0.0.1"), 5) and h.dst == (V6("fd00::2"), 6)
    assert h.tlv(TLV_PEER_IDENTITY) == b"x"


def test_partial_input_asks_for_more() -> None:
    raw = app_tunnel_header((V4("1.2.3.4"), 1), (V4("5.6.7.8"), 2), "spiffe://td/ns/a/sa/b")
    for cut in range(len(raw)):
        assert parse_v2(raw[:cut]) is None
    assert parse_v2(raw) is not None


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"GET / HTTP/1.1\r\n", "bad signature"),
        (SIG + b"\x11\x11\x00\x00", "version 1 is not 2"),
        (SIG + b"\x25\x11\x00\x00", "unknown PROXY v2 command 5"),
        (SIG + b"\x21\x31\x00\x00", "address family 0x3"),
        (SIG + b"\x21\x11\x00\x04" + b"\x00" * 4, "too short"),
        (SIG + b"\x21\x11\x00\x0e" + b"\x00" * 12 + b"\xd0\x00", "truncated TLV at byte 28"),
        (SIG + b"\x21\x11\x00\x0f" + b"\x00" * 12 + b"\xd0\x00\x09", "runs past the header"),
    ],
)
def test_malformed_headers_say_what(data: bytes, match: str) -> None:
    with pytest.raises(ProxyProtocolError, match=match):
        parse_v2(data)


def test_oversized_tlv_is_refused() -> None:
    with pytest.raises(ProxyProtocolError, match="exceeds 65535"):
        encode_v2((V4("1.2.3.4"), 1), (V4("5.6.7.8"), 2), [(0xD0, b"x" * 70000)])
