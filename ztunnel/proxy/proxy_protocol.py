"""PROXY protocol version 2 (haproxy's proxy-protocol.txt, section 2.2): the header an application tunnel starts with.

Sans-IO. Upstream (``proxy.rs``, ``write_proxy_protocol``) writes it on the inbound side when the local workload has
``applicationTunnel{protocol: PROXY}`` (a waypoint in the "sandwich"): command PROXY, transport STREAM, the client's
address as source, the HBONE target as destination, and one TLV of type ``0xD0`` holding the client's SPIFFE
identity when the client presented one. :func:`encode_v2` builds exactly that; :func:`parse_v2` reads any v2 header
(tests, and an app that wants to check what it was sent).

Layout (all integers big-endian)::

    12 bytes  signature \\r\\n\\r\\n\\0\\r\\nQUIT\\n
    1 byte    version (high nibble, 2) | command (low nibble: 0 LOCAL, 1 PROXY)
    1 byte    family (high nibble: 1 INET, 2 INET6) | transport (low nibble: 1 STREAM)
    2 bytes   length of what follows
    INET:  src addr (4), dst addr (4), src port (2), dst port (2)
    INET6: src addr (16), dst addr (16), src port (2), dst port (2)
    TLVs:  type (1), length (2), value
"""

from __future__ import annotations

import ipaddress
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field

from ztunnel.errors import ZtunnelError

SIGNATURE = b"\r\n\r\n\x00\r\nQUIT\n"
# Upstream's ``PROXY_PROTOCOL_AUTHORITY_TLV``: the source workload's SPIFFE identity (``spiffe://td/ns/x/sa/y``).
TLV_PEER_IDENTITY = 0xD0
_VERSION_2 = 0x20
CMD_LOCAL = 0x0
CMD_PROXY = 0x1
_AF_INET = 0x10
_AF_INET6 = 0x20
_STREAM = 0x01
_PREFIX = struct.Struct("!12sBBH")  # signature, version|command, family|transport, length
_INET = struct.Struct("!4s4sHH")
_INET6 = struct.Struct("!16s16sHH")
HEADER_MIN = _PREFIX.size  # 16 bytes: enough to know the whole header's length
# The length field is 16 bits, so no header is longer than this.
HEADER_MAX = _PREFIX.size + 0xFFFF

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
SocketAddr = tuple[IPAddress, int]


class ProxyProtocolError(ZtunnelError, ValueError):
    """A header that is not PROXY v2, or is malformed; the message says which byte or field."""


@dataclass(frozen=True, slots=True)
class ProxyHeader:
    """A parsed v2 header. ``src``/``dst`` are None for LOCAL, or for an address family other than INET/INET6."""

    command: int
    src: SocketAddr | None
    dst: SocketAddr | None
    tlvs: tuple[tuple[int, bytes], ...] = field(default=())
    length: int = 0  # bytes the header took, signature included

    def tlv(self, kind: int) -> bytes | None:
        """The value of the first TLV of type ``kind``, or None."""
        return next((v for t, v in self.tlvs if t == kind), None)


def _family_pair(src: IPAddress, dst: IPAddress) -> tuple[IPAddress, IPAddress]:
    """Both addresses in one family: v2 has one family field. A pair of mixed families (an IPv4 client reaching an
    IPv6 target through a dual-stack service) is written as INET6 with the IPv4 one mapped (``::ffff:a.b.c.d``), so
    neither address is lost."""
    if src.version == dst.version:
        return src, dst

    def v6(ip: IPAddress) -> ipaddress.IPv6Address:
        return ip if isinstance(ip, ipaddress.IPv6Address) else ipaddress.IPv6Address(f"::ffff:{ip}")

    return v6(src), v6(dst)


def encode_v2(src: SocketAddr, dst: SocketAddr, tlvs: Iterable[tuple[int, bytes]] = ()) -> bytes:
    """A v2 PROXY/STREAM header from ``src`` to ``dst`` with ``tlvs`` (type, value) in order.

    Raises ProxyProtocolError if a TLV type is not a byte or a value or the whole header is too long for the
    16-bit length fields."""
    s_ip, d_ip = _family_pair(src[0], dst[0])
    if isinstance(s_ip, ipaddress.IPv4Address):
        family = _AF_INET
        body = _INET.pack(s_ip.packed, d_ip.packed, src[1], dst[1])
    else:
        family = _AF_INET6
        body = _INET6.pack(s_ip.packed, d_ip.packed, src[1], dst[1])
    parts = [body]
    for kind, value in tlvs:
        if not 0 <= kind <= 0xFF:
            raise ProxyProtocolError(f"TLV type {kind} is not a byte")
        if len(value) > 0xFFFF:
            raise ProxyProtocolError(f"TLV 0x{kind:02X} value of {len(value)} bytes exceeds 65535")
        parts.append(struct.pack("!BH", kind, len(value)))
        parts.append(value)
    payload = b"".join(parts)
    if len(payload) > 0xFFFF:
        raise ProxyProtocolError(f"PROXY v2 header of {len(payload)} bytes exceeds 65535")
    return _PREFIX.pack(SIGNATURE, _VERSION_2 | CMD_PROXY, family | _STREAM, len(payload)) + payload


def app_tunnel_header(src: SocketAddr, dst: SocketAddr, identity: str | None) -> bytes:
    """Upstream's header for an application tunnel: ``src`` the client, ``dst`` the HBONE target, and the client's
    SPIFFE identity (if it has one) in TLV ``0xD0``."""
    tlvs = [(TLV_PEER_IDENTITY, identity.encode())] if identity is not None else []
    return encode_v2(src, dst, tlvs)


def parse_v2(data: bytes | bytearray | memoryview) -> ProxyHeader | None:
    """The v2 header at the start of ``data``; None if more bytes are needed to know (``length`` says how many it
    took when it returns one). Raises ProxyProtocolError for anything that is not a well-formed v2 header."""
    view = memoryview(data)
    n = min(len(view), len(SIGNATURE))
    if bytes(view[:n]) != SIGNATURE[:n]:
        raise ProxyProtocolError("not a PROXY protocol v2 header: bad signature")
    if len(view) < HEADER_MIN:
        return None
    _, ver_cmd, fam, length = _PREFIX.unpack_from(view)
    if ver_cmd >> 4 != 2:
        raise ProxyProtocolError(f"PROXY protocol version {ver_cmd >> 4} is not 2 (byte 12)")
    command = ver_cmd & 0x0F
    if command not in (CMD_LOCAL, CMD_PROXY):
        raise ProxyProtocolError(f"unknown PROXY v2 command {command} (byte 12)")
    total = HEADER_MIN + length
    if len(view) < total:
        return None
    body = view[HEADER_MIN:total]
    src: SocketAddr | None = None
    dst: SocketAddr | None = None
    family = fam & 0xF0
    if family == _AF_INET:
        fmt: struct.Struct | None = _INET
        make: type[ipaddress.IPv4Address] | type[ipaddress.IPv6Address] = ipaddress.IPv4Address
    elif family == _AF_INET6:
        fmt, make = _INET6, ipaddress.IPv6Address
    else:
        fmt = None
    offset = 0
    if fmt is not None:
        if length < fmt.size:
            raise ProxyProtocolError(f"PROXY v2 length {length} too short for its address family (byte 14)")
        s, d, sp, dp = fmt.unpack_from(body)
        if command == CMD_PROXY:
            src, dst = (make(s), sp), (make(d), dp)
        offset = fmt.size
    elif family != 0:
        raise ProxyProtocolError(f"unknown PROXY v2 address family 0x{family >> 4:X} (byte 13)")
    else:
        offset = length  # UNSPEC: the receiver ignores what follows (section 2.2)
    tlvs: list[tuple[int, bytes]] = []
    while offset < length:
        if length - offset < 3:
            raise ProxyProtocolError(f"truncated TLV at byte {HEADER_MIN + offset}")
        kind, size = struct.unpack_from("!BH", body, offset)
        offset += 3
        if offset + size > length:
            raise ProxyProtocolError(f"TLV 0x{kind:02X} at byte {HEADER_MIN + offset - 3} runs past the header")
        tlvs.append((kind, bytes(body[offset : offset + size])))
        offset += size
    return ProxyHeader(command, src, dst, tuple(tlvs), total)


__all__ = [
    "TLV_PEER_IDENTITY",
    "ProxyHeader",
    "ProxyProtocolError",
    "app_tunnel_header",
    "encode_v2",
    "parse_v2",
]
