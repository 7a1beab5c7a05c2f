"""SOCKS5 (port 15080, ``UNSTABLE_ENABLE_SOCKS5=true``): an explicit way into the outbound path.

Upstream ``proxy/socks5.rs`` supports no authentication and CONNECT only, with IPv4, IPv6 and domain-name
addresses (domains resolved through ztunnel's resolver). :class:`Socks5Parser` is the sans-IO protocol core
(RFC 1928); :class:`Socks5` is the listener.

Two deliberate differences from upstream, both toward RFC 1928: a greeting without the no-auth method gets
``05 FF`` ("no acceptable methods") rather than a command-not-supported reply, and the success reply is sent once
the tunnel is actually established (upstream replies before connecting, per its own TODO), so a refused destination
is reported to the client with a real reply code (``05`` connection refused, ``02`` not allowed by policy).
"""

from __future__ import annotations

import asyncio
import enum
import ipaddress
import logging
import socket
import struct
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from ztunnel.net import format_addr
from ztunnel.proxy.common import HttpStatusError, ProxyError, ResponseFlag
from ztunnel.proxy.connection_manager import Direction, log_failed
from ztunnel.proxy.inputs import ProxyInputs
from ztunnel.proxy.listener import Listener
from ztunnel.proxy.metrics import OpenSocket
from ztunnel.proxy.relay import PlainConnection
from ztunnel.sockets import ipv4_from_packed, set_accepted_options, transport_peer
from ztunnel.state.workload import IPAddress, canonical_ip

log = logging.getLogger("ztunnel.proxy.socks5")

VERSION = 0x05
NO_AUTH = 0x00
NO_ACCEPTABLE_METHODS = 0xFF
CMD_CONNECT = 0x01
ATYP_IPV4 = 0x01
ATYP_DOMAIN = 0x03
ATYP_IPV6 = 0x04
# A request is at most 4 + 1 + 255 + 2 bytes; a greeting at most 2 + 255. Anything longer buffered is garbage.
_MAX_BUFFERED = 1024


class Reply(enum.IntEnum):
    """SOCKS5 reply codes (RFC 1928 §6)."""

    SUCCEEDED = 0x00
    GENERAL_FAILURE = 0x01
    NOT_ALLOWED = 0x02
    NETWORK_UNREACHABLE = 0x03
    HOST_UNREACHABLE = 0x04
    CONNECTION_REFUSED = 0x05
    TTL_EXPIRED = 0x06
    COMMAND_NOT_SUPPORTED = 0x07
    ADDRESS_TYPE_NOT_SUPPORTED = 0x08


@dataclass(frozen=True, slots=True)
class MethodSelected:
    """Answer ``05 00`` (no authentication)."""


@dataclass(frozen=True, slots=True)
class ConnectRequested:
    """The client asks to CONNECT to ``host`` (an IP, or a domain name to resolve) and ``port``."""

    host: IPAddress | str
    port: int
    leftover: bytes  # bytes the client sent after the request (pipelined payload)


@dataclass(frozen=True, slots=True)
class Rejected:
    """A malformed or unsupported exchange: send ``response`` (if any) and close."""

    response: bytes
    reason: str


Event = MethodSelected | ConnectRequested | Rejected


def reply(code: Reply, bound: tuple[IPAddress, int] | None = None) -> bytes:
    """``VER REP RSV ATYP BND.ADDR BND.PORT``; the bound address defaults to 0.0.0.0:0, as upstream sends."""
    if bound is None:
        return _DEFAULT_REPLIES[code]
    ip, port = bound
    atyp = ATYP_IPV6 if ip.version == 6 else ATYP_IPV4
    return bytes([VERSION, code, 0x00, atyp]) + ip.packed + struct.pack("!H", port)


# Every reply the proxy sends names 0.0.0.0:0: made once, not per connection (an IPv4Address, its packing and a
# struct.pack were 7 Python calls per SOCKS5 connection).
_DEFAULT_REPLIES = {code: bytes([VERSION, code, 0x00, ATYP_IPV4, 0, 0, 0, 0, 0, 0]) for code in Reply}


class Socks5Parser:
    """RFC 1928 server side, no authentication, CONNECT only. Bytes in, events out; no I/O."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._state = "greeting"

    @property
    def done(self) -> bool:
        return self._state in ("done", "failed")

    def receive(self, data: bytes) -> list[Event]:
        if self._state in ("done", "failed"):
            return []
        self._buf += data
        events: list[Event] = []
        while self._state not in ("done", "failed"):
            ev = self._greeting() if self._state == "greeting" else self._request()
            if ev is None:
                if len(self._buf) > _MAX_BUFFERED:
                    events.append(self._fail(reply(Reply.GENERAL_FAILURE), "SOCKS5 message too long"))
                break
            events.append(ev)
        return events

    def _fail(self, response: bytes, reason: str) -> Rejected:
        self._state = "failed"
        return Rejected(response, reason)

    def _greeting(self) -> Event | None:
        buf = self._buf
        if len(buf) < 2:
            return None
        if buf[0] != VERSION:
            # Not SOCKS5 (a SOCKS4 client, or not SOCKS at all): nothing sensible to answer in v5 terms.
            return self._fail(b"", f"unsupported SOCKS version {buf[0]}")
        nmethods = buf[1]
        if nmethods == 0:
            return self._fail(bytes([VERSION, NO_ACCEPTABLE_METHODS]), "no authentication methods offered")
        if len(buf) < 2 + nmethods:
            return None
        methods = bytes(buf[2 : 2 + nmethods])
        del buf[: 2 + nmethods]
        if NO_AUTH not in methods:
            return self._fail(bytes([VERSION, NO_ACCEPTABLE_METHODS]), "only unauthenticated SOCKS5 is supported")
        self._state = "request"
        return MethodSelected()

    def _request(self) -> Event | None:
        buf = self._buf
        if len(buf) < 4:
            return None
        if buf[0] != VERSION:
            return self._fail(reply(Reply.GENERAL_FAILURE), f"unsupported SOCKS version {buf[0]} in request")
        if buf[1] != CMD_CONNECT:
            return self._fail(reply(Reply.COMMAND_NOT_SUPPORTED), f"unsupported command {buf[1]}")
        atyp = buf[3]
        host: IPAddress | str
        if atyp == ATYP_IPV4:
            if len(buf) < 10:
                return None
            host, end = ipv4_from_packed(bytes(buf[4:8])), 8
        elif atyp == ATYP_IPV6:
            if len(buf) < 22:
                return None
            host, end = canonical_ip(ipaddress.IPv6Address(bytes(buf[4:20]))), 20
        elif atyp == ATYP_DOMAIN:
            if len(buf) < 5:
                return None
            n = buf[4]
            if len(buf) < 5 + n + 2:
                return None
            try:
                host = bytes(buf[5 : 5 + n]).decode("ascii")
            except UnicodeDecodeError:
                return self._fail(reply(Reply.GENERAL_FAILURE), "domain name is not ASCII")
            if not host:
                return self._fail(reply(Reply.HOST_UNREACHABLE), "empty domain name")
            end = 5 + n
        else:
            return self._fail(reply(Reply.ADDRESS_TYPE_NOT_SUPPORTED), f"unsupported address type {atyp}")
        (port,) = struct.unpack_from("!H", buf, end)
        leftover = bytes(buf[end + 2 :])
        buf.clear()
        self._state = "done"
        return ConnectRequested(host, port, leftover)


# How the outbound path reports back: None when the tunnel is up, else the error.
ProxyTo = Callable[
    [PlainConnection, tuple[IPAddress, int], tuple[IPAddress, int], Callable[[ProxyError | None], None]],
    Coroutine[Any, Any, None],
]
Resolver = Callable[[str], Awaitable[list[IPAddress]]]


async def system_resolve(name: str) -> list[IPAddress]:
    infos = await asyncio.get_running_loop().getaddrinfo(name, None, type=socket.SOCK_STREAM)
    return [canonical_ip(ipaddress.ip_address(i[4][0])) for i in infos]


def reply_for(error: ProxyError) -> Reply:
    """The reply for a failed CONNECT, from what the error is: denied by policy (a 401 from the destination, or
    DENY here) is ``02``, a destination that did not answer in time ``04``, anything else ``05``."""
    if error.flag is ResponseFlag.DENY or (isinstance(error, HttpStatusError) and error.status == 401):
        return Reply.NOT_ALLOWED
    if error.timed_out:
        return Reply.HOST_UNREACHABLE
    return Reply.CONNECTION_REFUSED


_METHOD_REPLY = bytes([VERSION, NO_AUTH])
_SUCCEEDED = reply(Reply.SUCCEEDED)


class _Handshake(asyncio.Protocol):
    def __init__(self, owner: Socks5) -> None:
        self.owner = owner
        self.parser = Socks5Parser()
        self.transport: asyncio.Transport | None = None
        self.src: tuple[IPAddress, int] | None = None
        self.socket: OpenSocket | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it (no typing.cast: a Python call).
        self.transport = transport  # type: ignore[assignment]
        self.socket = OpenSocket(self.owner.pi.connections.traffic, "source")
        set_accepted_options(transport.get_extra_info("socket"), self.owner.pi.sockets.cfg, keepalive=False)
        try:
            self.src = transport_peer(transport)
        except TypeError:  # reset before it was served: the transport kept no peer address, nothing to answer
            transport.close()

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None and self.src is not None
        # A client that pipelines its greeting and request (as curl and the benchmark do) gets the method reply in
        # the same write as the request's reply: one loopback send per connection saved (~10% of the outbound
        # side's CPU per new connection); the bytes and their order are unchanged.
        method_reply = b""
        for ev in self.parser.receive(data):
            if isinstance(ev, MethodSelected):
                method_reply = _METHOD_REPLY
            elif isinstance(ev, Rejected):
                if method_reply or ev.response:
                    self.transport.write(method_reply + (ev.response or b""))
                method_reply = b""
                self.transport.close()
                log_failed(Direction.OUTBOUND, self.src, None, f"SOCKS5: {ev.reason}")
            else:
                self._hand_over(ev, method_reply)
                method_reply = b""
        if method_reply:
            self.transport.write(method_reply)

    def _hand_over(self, ev: ConnectRequested, method_reply: bytes) -> None:
        """Turn the socket into a relay endpoint; bytes already sent after the request are kept."""
        transport = self.transport
        assert transport is not None and self.src is not None
        transport.pause_reading()
        plain = PlainConnection()
        if ev.leftover:
            plain.preload(ev.leftover)
        plain.reading_paused = True
        if self.socket is not None:
            plain.on_lost = self.socket.closed  # the socket is the relay's now, and counted until it closes
            self.socket = None
        plain._pause_reasons |= 1  # resumed when the relay is attached
        transport.set_protocol(plain)
        plain.connection_made(transport)
        owner = self.owner
        if isinstance(ev.host, str):
            owner.pi.tasks.spawn(owner.connect(plain, self.src, ev, method_reply), "socks5")
            return
        # An IP (what most clients and the benchmark send): the outbound path is this connection's task itself,
        # without a coroutine around it (a coroutine object, a frame and two resumptions per connection).
        dst = (ev.host, ev.port)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("SOCKS5 %s -> %s", format_addr(*self.src), format_addr(*dst))
        owner.pi.tasks.spawn(owner.proxy_to(plain, self.src, dst, _ready(transport, method_reply)), "socks5")

    def connection_lost(self, exc: Exception | None) -> None:
        if self.socket is not None:  # closed during the handshake
            self.socket.closed()


class Socks5(Listener):
    """The SOCKS5 listener (``127.0.0.1:15080``) feeding the outbound path."""

    def __init__(self, pi: ProxyInputs, proxy_to: ProxyTo, resolve: Resolver = system_resolve) -> None:
        super().__init__(pi, pi.config.socks5_addr, captured=False)
        self.proxy_to = proxy_to
        self.resolve = resolve

    def new_protocol(self) -> _Handshake:
        return _Handshake(self)

    async def connect(
        self, plain: PlainConnection, src: tuple[IPAddress, int], ev: ConnectRequested, method_reply: bytes = b""
    ) -> None:
        """Resolve a request for a hostname and proxy it (a request for an IP goes straight to ``proxy_to``, see
        ``_hand_over``); ``method_reply`` (not yet sent) goes out in front of the request's reply."""
        transport = plain.transport
        assert transport is not None and isinstance(ev.host, str)
        try:
            ips = await self.resolve(ev.host)
        except OSError as e:
            ips = []
            log.debug("resolving %s failed: %s", ev.host, e)
        if not ips:
            transport.write(method_reply + reply(Reply.HOST_UNREACHABLE))
            transport.close()
            log_failed(Direction.OUTBOUND, src, None, f"SOCKS5: cannot resolve {ev.host}")
            return
        dst = (next((i for i in ips if i.version == 4), ips[0]), ev.port)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("SOCKS5 %s -> %s", format_addr(*src), format_addr(*dst))
        await self.proxy_to(plain, src, dst, _ready(transport, method_reply))


def _ready(transport: asyncio.Transport, method_reply: bytes) -> Callable[[ProxyError | None], None]:
    """What the outbound path calls once the tunnel is up (None) or failed (the error): the request's reply, with
    the method reply (if not sent yet) in front of it."""

    def ready(error: ProxyError | None) -> None:
        if transport.is_closing():
            return
        transport.write(method_reply + (_SUCCEEDED if error is None else reply(reply_for(error))))

    return ready
