"""Checks of an HBONE *originator* (a ztunnel's outbound side, Envoy's tunnelling ``tcp_proxy``): the checker is the
HBONE server.

The checker listens with mTLS and HTTP/2 as upstream's inbound does (its certificate must carry the identity the
originator expects of its destination), and makes the originator open tunnels to it through a *driver*: a plain TCP
connection to an entry the originator tunnels (``tcp:HOST:PORT``: Envoy's listener, an address ztunnel captures) or
a SOCKS5 CONNECT through it (``socks5:HOST:PORT:DEST_HOST:DEST_PORT``: ztunnel's 15080, where DEST is a workload
whose HBONE address is ours). Each check drives its own downstream connections and answers the tunnels they make as
it needs (echo, 401, RST_STREAM, GOAWAY, a stalled reader).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import re
import socket
import ssl
import struct
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509

from ztunnel.conformance.checks import Check, CheckError, Outcome, Result, Verdict, judge, run_checks
from ztunnel.conformance.target import (
    UPSTREAM_CONNECTION_WINDOW,
    UPSTREAM_MAX_FRAME,
    UPSTREAM_SERVER_MAX_HEADER_LIST,
    UPSTREAM_SERVER_MAX_STREAMS,
    UPSTREAM_STREAM_WINDOW,
    judge_setting,
    payload_of,
    uris,
)
from ztunnel.conformance.wire import (
    CANCEL,
    ENABLE_PUSH,
    INITIAL_WINDOW_SIZE,
    MAX_CONCURRENT_STREAMS,
    MAX_FRAME_SIZE,
    MAX_HEADER_LIST_SIZE,
    NO_ERROR,
    SETTING_NAMES,
    Stream,
    Wire,
    tls_facts,
)

# As upstream's HBONE server (src/proxy/h2/server.rs::serve_connection).
SERVER_SETTINGS = {
    INITIAL_WINDOW_SIZE: UPSTREAM_STREAM_WINDOW,
    MAX_FRAME_SIZE: UPSTREAM_MAX_FRAME,
    MAX_CONCURRENT_STREAMS: UPSTREAM_SERVER_MAX_STREAMS,
    MAX_HEADER_LIST_SIZE: UPSTREAM_SERVER_MAX_HEADER_LIST,
}
TRACEPARENT = re.compile(r"^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")


# -- drivers --------------------------------------------------------------------------------------------------------


SocketFactory = Callable[[int], socket.socket]  # address family -> a new TCP socket (e.g. made in a netns)


def _plain_socket(family: int) -> socket.socket:
    return socket.socket(family, socket.SOCK_STREAM)


@dataclass(frozen=True)
class Driver:
    """Opens a downstream connection that the originator tunnels to us.

    ``kind`` ``tcp``: connect to ``host:port``. ``socks5``: connect to the SOCKS5 proxy at ``host:port`` and ask it
    for ``dest``. ``socket_factory`` makes the client socket (default: a plain one in this network namespace).
    """

    kind: str
    host: str
    port: int
    dest: tuple[str, int] | None = None
    socket_factory: SocketFactory = _plain_socket

    @classmethod
    def parse(cls, spec: str) -> Driver:
        """``tcp:HOST:PORT`` or ``socks5:HOST:PORT:DEST_HOST:DEST_PORT`` (IPv6 hosts in brackets). ValueError with
        what is wrong otherwise."""
        kind, _, rest = spec.partition(":")
        parts = re.findall(r"\[[^\]]+\]|[^:]+", rest)
        hosts = [p.strip("[]") for p in parts]
        if kind == "tcp" and len(hosts) == 2 and hosts[1].isdigit():
            return cls("tcp", hosts[0], int(hosts[1]))
        if kind == "socks5" and len(hosts) == 4 and hosts[1].isdigit() and hosts[3].isdigit():
            return cls("socks5", hosts[0], int(hosts[1]), (hosts[2], int(hosts[3])))
        raise ValueError(f"--drive {spec!r}: expected tcp:HOST:PORT or socks5:HOST:PORT:DEST_HOST:DEST_PORT")

    async def open(self, timeout: float) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = self.socket_factory(family)
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        try:
            await asyncio.wait_for(loop.sock_connect(sock, (self.host, self.port)), timeout)
        except BaseException:
            sock.close()
            raise
        reader, writer = await asyncio.open_connection(sock=sock)
        if self.kind == "socks5":
            assert self.dest is not None
            await asyncio.wait_for(_socks5(reader, writer, self.dest), timeout)
        return reader, writer

    def __str__(self) -> str:
        return f"{self.kind}:{self.host}:{self.port}" + (f" -> {self.dest[0]}:{self.dest[1]}" if self.dest else "")


async def _socks5(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, dest: tuple[str, int]) -> None:
    """RFC 1928 CONNECT, no authentication."""
    writer.write(b"\x05\x01\x00")
    if await reader.readexactly(2) != b"\x05\x00":
        raise CheckError("the SOCKS5 proxy refused no-authentication")
    ip = ipaddress.ip_address(dest[0])
    atyp = b"\x01" if ip.version == 4 else b"\x04"
    writer.write(b"\x05\x01\x00" + atyp + ip.packed + struct.pack("!H", dest[1]))
    head = await reader.readexactly(4)
    if head[1] != 0:
        raise CheckError(f"the SOCKS5 proxy answered CONNECT with reply code {head[1]}")
    await reader.readexactly({1: 4, 4: 16}.get(head[3], 0) + 2)


# -- the server -----------------------------------------------------------------------------------------------------


@dataclass
class OriginSpec:
    ca: Path  # roots that verify the originator's client certificate
    cert: Path  # our chain: the identity the originator expects of its destination
    key: Path
    expect_identity: str  # the SPIFFE id the originator must present
    driver: Driver
    timeout: float = 10.0


@dataclass
class OriginContext:
    """The listening HBONE server and the requests it received, for the checks."""

    spec: OriginSpec
    wires: list[Wire] = field(default_factory=list)
    requests: asyncio.Queue[tuple[Wire, Stream]] = field(default_factory=asyncio.Queue)
    handshake_failures: list[str] = field(default_factory=list)
    _sni: dict[int, str | None] = field(default_factory=dict)
    _server: asyncio.Server | None = None
    _tasks: set[asyncio.Task[object]] = field(default_factory=set)

    def tls_context(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2  # accept 1.2 too: the originator must pick 1.3
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(cafile=str(self.spec.ca))
        ctx.load_cert_chain(str(self.spec.cert), str(self.spec.key))
        ctx.set_alpn_protocols(["h2"])

        def sni(obj: ssl.SSLObject, name: str | None, _ctx: ssl.SSLContext) -> None:
            self._sni[id(obj)] = name

        ctx.sni_callback = sni
        return ctx

    async def start(self, sock: socket.socket) -> None:
        self._server = await asyncio.start_server(self._accept, sock=sock, ssl=self.tls_context())

    async def stop(self) -> None:
        for wire in self.wires:
            await wire.close()
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)
        for task in list(self._tasks):
            task.cancel()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        obj = writer.get_extra_info("ssl_object")
        sni = self._sni.pop(id(obj), None) if obj is not None else None
        wire = Wire(
            reader,
            writer,
            client=False,
            tls=tls_facts(writer, sni),
            settings=SERVER_SETTINGS,
            connection_window=UPSTREAM_CONNECTION_WINDOW,
        )
        wire.on_stream = lambda stream: self.requests.put_nowait((wire, stream))
        self.wires.append(wire)
        wire.start()
        await wire.wait_for(lambda: wire.closed, 1e9)

    def spawn(self, coro: Coroutine[object, object, object], name: str) -> None:
        task: asyncio.Task[object] = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- helpers for the checks ---------------------------------------------------------------------------------------

    def forget(self) -> None:
        """Drop requests a previous check left behind."""
        while not self.requests.empty():
            self.requests.get_nowait()

    async def drive(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        try:
            return await self.spec.driver.open(self.spec.timeout)
        except (OSError, TimeoutError) as e:
            raise CheckError(f"driver {self.spec.driver}: cannot connect: {e}") from e

    async def next_request(self) -> tuple[Wire, Stream]:
        try:
            return await asyncio.wait_for(self.requests.get(), self.spec.timeout)
        except TimeoutError:
            raise CheckError(
                f"no CONNECT arrived within {self.spec.timeout:g} s of driving {self.spec.driver}"
                + (f" (TLS handshakes failed: {self.handshake_failures[-1]})" if self.handshake_failures else "")
            ) from None

    def start_drive(self) -> asyncio.Task[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
        """Open a downstream connection in the background: a SOCKS5 proxy answers only once the tunnel is up, that
        is once we answered the CONNECT."""
        return asyncio.get_running_loop().create_task(self.drive(), name="conformance-drive")

    async def driven(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, Wire, Stream]:
        """One downstream connection and the request it made, answered 200."""
        self.forget()
        task = self.start_drive()
        try:
            wire, stream = await self.next_request()
        except BaseException:
            task.cancel()
            with contextlib.suppress(BaseException):
                close((await task)[1])
            raise
        wire.send_headers(stream, [(":status", "200")])
        reader, writer = await task
        return reader, writer, wire, stream

    async def echo(self, wire: Wire, stream: Stream) -> None:
        """Echo the stream's bytes (the 200 is sent), ending our side after the client's END_STREAM."""
        sent = 0

        def more() -> bool:
            return len(stream.data) > sent or stream.ended or stream.reset is not None

        while True:
            await wire.wait_for(more, self.spec.timeout)
            if stream.reset is not None or wire.closed:
                return
            if len(stream.data) > sent:
                chunk = bytes(stream.data[sent:])
                sent += len(chunk)
                await wire.send_data(stream, chunk, timeout=self.spec.timeout)
            elif stream.ended:
                await wire.send_data(stream, b"", end_stream=True)
                return
            else:
                return  # nothing for a whole timeout: the check reports what it saw


async def read_all(reader: asyncio.StreamReader, timeout: float) -> tuple[bytes, str]:
    """Read to EOF; (bytes, how it ended: ``EOF``, ``reset``, ``timeout``)."""
    data = bytearray()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    try:
        while True:
            chunk = await asyncio.wait_for(reader.read(1 << 16), max(0.01, deadline - loop.time()))
            if not chunk:
                return bytes(data), "EOF"
            data += chunk
    except TimeoutError:
        return bytes(data), "timeout"
    except (ConnectionError, OSError) as e:
        return bytes(data), f"reset ({e})"


def close(writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(Exception):
        writer.close()


# -- checks ---------------------------------------------------------------------------------------------------------


async def tls_version(ctx: OriginContext) -> Outcome:
    _, writer, wire, _ = await ctx.driven()
    close(writer)
    ok = wire.tls.version == "TLSv1.3"
    return judge(f"{wire.tls.version}, {wire.tls.cipher}", like_upstream=ok)


async def tls_alpn(ctx: OriginContext) -> Outcome:
    _, writer, wire, _ = await ctx.driven()
    close(writer)
    return judge(f"ALPN {wire.tls.alpn!r}", like_upstream=wire.tls.alpn == "h2")


async def tls_sni(ctx: OriginContext) -> Outcome:
    _, writer, wire, _ = await ctx.driven()
    close(writer)
    sni = wire.tls.sni
    return judge(f"SNI {sni!r}" if sni else "no SNI", like_upstream=sni is None, acceptable=True)


async def client_identity(ctx: OriginContext) -> Outcome:
    _, writer, wire, _ = await ctx.driven()
    close(writer)
    der = wire.tls.peer_cert_der
    found = uris(x509.load_der_x509_certificate(der)) if der else []
    return judge(f"client URI SANs {found}", like_upstream=ctx.spec.expect_identity in found)


def origin_setting(setting: int, upstream: int, rfc_default: int | None) -> Check[OriginContext]:
    name = SETTING_NAMES[setting]

    async def run(ctx: OriginContext) -> Outcome:
        _, writer, wire, _ = await ctx.driven()
        close(writer)
        return judge_setting(wire, setting, name, upstream, rfc_default)

    return Check(
        id=f"origin.h2.settings.{name.lower()}",
        title=f"the originator's SETTINGS_{name} as upstream's client",
        sends="a driven connection; we read the originator's first SETTINGS",
        upstream=f"{name} = {upstream} (src/proxy/h2/client.rs::spawn_connection)",
        rule="PASS on upstream's value; DIFF otherwise (a tuning choice)",
        run=run,
    )


async def connection_window(ctx: OriginContext) -> Outcome:
    _, writer, wire, _ = await ctx.driven()
    close(writer)
    window = 65535 + sum(wire.connection_window_updates)
    return judge(
        f"connection window {window} (WINDOW_UPDATEs {wire.connection_window_updates[:4]})",
        like_upstream=window >= UPSTREAM_CONNECTION_WINDOW,
        acceptable=True,
    )


async def connect_request(ctx: OriginContext) -> Outcome:
    _, writer, _wire, stream = await ctx.driven()
    close(writer)
    headers = stream.headers or []
    pseudo = {k: v for k, v in headers if k.startswith(":")}
    problems = []
    if pseudo.get(":method") != "CONNECT":
        problems.append(f":method {pseudo.get(':method')!r}")
    authority = pseudo.get(":authority", "")
    host, sep, port = authority.rpartition(":")
    if not sep or not port.isdigit() or not host:
        problems.append(f":authority {authority!r} is not host:port")
    extra = sorted(set(pseudo) - {":method", ":authority"})
    if extra:
        problems.append(f"extra pseudo-headers {extra} (CONNECT carries only :method and :authority)")
    if stream.ended:
        problems.append("END_STREAM on the request headers: no tunnel can follow")
    return judge(
        f":method {pseudo.get(':method')}, :authority {authority}" + (f"; {'; '.join(problems)}" if problems else ""),
        like_upstream=not problems,
    )


def header_check(name: str, valid: Callable[[str], bool], what: str) -> Check[OriginContext]:
    async def run(ctx: OriginContext) -> Outcome:
        _, writer, _wire, stream = await ctx.driven()
        close(writer)
        value = stream.header(name)
        if value is None:
            return judge(f"no {name} header", like_upstream=False, acceptable=True)
        return judge(f"{name}: {value}", like_upstream=valid(value), acceptable=True)

    return Check(
        id=f"origin.headers.{name}",
        title=f"the CONNECT carries {name}",
        sends="a driven connection; we read the CONNECT's headers",
        upstream=f"{what} (src/proxy/outbound.rs::create_hbone_request)",
        rule="PASS if present and well-formed; DIFF otherwise (telemetry, not the tunnel, depends on it)",
        run=run,
    )


async def echo_half_close(ctx: OriginContext) -> Outcome:
    reader, writer, wire, stream = await ctx.driven()
    ctx.spawn(ctx.echo(wire, stream), "echo")
    payload = payload_of(256 * 1024, 11)
    try:
        writer.write(payload)
        await writer.drain()
        writer.write_eof()
        data, end = await read_all(reader, ctx.spec.timeout)
    finally:
        close(writer)
    ok = data == payload and end == "EOF"
    return judge(
        f"{len(data)} of {len(payload)} bytes echoed {'intact' if ok else 'wrong'}, then {end}", like_upstream=ok
    )


async def server_closes_first(ctx: OriginContext) -> Outcome:
    reader, writer, wire, stream = await ctx.driven()
    await wire.send_data(stream, b"bye\n", end_stream=True)
    try:
        greeting, end = await read_all(reader, ctx.spec.timeout)
        if greeting != b"bye\n" or end != "EOF":
            return judge(f"downstream got {greeting!r} then {end}, not our bytes then EOF", like_upstream=False)
        payload = payload_of(64 * 1024, 12)
        writer.write(payload)
        await writer.drain()
        writer.write_eof()
        await wire.wait_for(lambda: stream.ended or stream.reset is not None, ctx.spec.timeout)
    finally:
        close(writer)
    got = bytes(stream.data)
    ok = got == payload and stream.ended
    return judge(
        f"after our END_STREAM the client still sent {len(got)} of {len(payload)} bytes"
        + (", then END_STREAM" if stream.ended else f" ({'reset' if stream.reset is not None else 'no END_STREAM'})"),
        like_upstream=ok,
    )


async def non_200(ctx: OriginContext) -> Outcome:
    ctx.forget()
    task = ctx.start_drive()
    wire, stream = await ctx.next_request()
    wire.send_headers(stream, [(":status", "401")], end_stream=True)
    try:
        reader, writer = await task
    except CheckError as e:  # the SOCKS5 proxy reported the failure: the downstream never got a byte
        return judge(f"downstream refused: {e}", like_upstream=True)
    try:
        writer.write(b"must not arrive")
        data, end = await read_all(reader, ctx.spec.timeout)
    finally:
        close(writer)
    leaked = bytes(stream.data)
    ok = not data and end != "timeout"
    return judge(
        f"downstream got {len(data)} bytes, then {end}; {len(leaked)} bytes reached us after the 401",
        like_upstream=ok and not leaked,
        acceptable=ok,
    )


async def rst_from_server(ctx: OriginContext) -> Outcome:
    reader, writer, wire, stream = await ctx.driven()
    try:
        writer.write(b"x" * 1024)
        await writer.drain()
        await wire.wait_for(lambda: len(stream.data) >= 1024, ctx.spec.timeout)
        wire.send_rst(stream, CANCEL)
        data, end = await read_all(reader, ctx.spec.timeout)
    finally:
        close(writer)
    return judge(f"downstream ended: {end} after {len(data)} bytes", like_upstream=end != "timeout")


async def ping(ctx: OriginContext) -> Outcome:
    _, writer, wire, _ = await ctx.driven()
    try:
        payload = os.urandom(8)
        wire.send_ping(payload)
        ok = await wire.wait_for(lambda: payload in wire.ping_acks, ctx.spec.timeout)
    finally:
        close(writer)
    return judge(f"PING ACK {'with the same payload' if ok else 'missing'}", like_upstream=ok)


async def goaway(ctx: OriginContext) -> Outcome:
    reader, writer, wire, stream = await ctx.driven()
    ctx.spawn(ctx.echo(wire, stream), "echo")
    try:
        writer.write(b"a" * 1024)
        await writer.drain()
        await wire.wait_for(lambda: len(stream.data) >= 1024, ctx.spec.timeout)
        wire.send_goaway(stream.id, NO_ERROR)
        await wire.drain()
        writer.write(b"b" * 1024)
        writer.write_eof()
        data, end = await read_all(reader, ctx.spec.timeout)
    finally:
        close(writer)
    first_ok = data == b"a" * 1024 + b"b" * 1024 and end == "EOF"
    reader2, writer2, wire2, stream2 = await ctx.driven()
    ctx.spawn(ctx.echo(wire2, stream2), "echo")
    try:
        writer2.write(b"c" * 100)
        writer2.write_eof()
        data2, _ = await read_all(reader2, ctx.spec.timeout)
    finally:
        close(writer2)
    new_conn = wire2 is not wire
    return judge(
        f"the open tunnel {'completed' if first_ok else f'ended after {len(data)} of 2048 bytes ({end})'} across our "
        f"GOAWAY; the next tunnel came on {'a new' if new_conn else 'the same'} connection"
        + ("" if data2 == b"c" * 100 else " and was not echoed intact"),
        like_upstream=first_ok and new_conn and data2 == b"c" * 100,
    )


async def respects_window(ctx: OriginContext) -> Outcome:
    _, writer, wire, stream = await ctx.driven()
    stream.stalled = True
    window = stream.recv_window
    payload = payload_of(window + 1024 * 1024, 13)
    writer.write(payload)
    try:
        await wire.wait_for(lambda: len(stream.data) >= window or wire.violations, ctx.spec.timeout)
        wire.send_ping(b"barrier!")
        await wire.wait_for(lambda: b"barrier!" in wire.ping_acks, ctx.spec.timeout)
        held = len(stream.data)
        stream.stalled = False
        wire.release(stream, held)
        writer.write_eof()
        await wire.wait_for(lambda: stream.ended or stream.reset is not None, ctx.spec.timeout + 2)
    finally:
        close(writer)
    over = [v for v in wire.violations if f"stream {stream.id}" in v]
    intact = bytes(stream.data) == payload and stream.ended
    return judge(
        f"held at {held} bytes with a {window}-byte window; after release {len(stream.data)} of {len(payload)} "
        f"bytes{', intact' if intact else ''}" + (f"; {over[0]}" if over else ""),
        like_upstream=intact and not over and held <= window,
    )


async def concurrent(ctx: OriginContext) -> Outcome:
    count = 20
    ctx.forget()
    conns: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    tasks = [ctx.start_drive() for _ in range(count)]
    try:
        pairs = [await ctx.next_request() for _ in range(count)]
        for wire, stream in pairs:
            wire.send_headers(stream, [(":status", "200")])
            ctx.spawn(ctx.echo(wire, stream), "echo")
        conns = [await t for t in tasks]
        payloads = [payload_of(32 * 1024, 20 + i) for i in range(count)]
        for (_, w), p in zip(conns, payloads, strict=True):
            w.write(p)
            w.write_eof()
        results = await asyncio.gather(*(read_all(r, ctx.spec.timeout) for r, _ in conns))
    finally:
        for t in tasks:
            t.cancel()
        for _, w in conns:
            close(w)
    # Which payload belongs to which request is unknown (the order of arrival is the originator's): compare sets.
    intact = sorted(d for d, _ in results) == sorted(payloads)
    connections = len({id(w) for w, _ in pairs})
    return judge(
        f"{count} concurrent tunnels {'all echoed intact' if intact else 'not all intact'}, over {connections} "
        "HBONE connection(s)",
        like_upstream=intact,
    )


CHECKS: list[Check[OriginContext]] = [
    Check(
        "origin.tls.version",
        "the originator negotiates TLS 1.3",
        "a driven connection; we accept TLS 1.2 and 1.3",
        "TLS 1.3 only (src/tls/lib.rs)",
        "PASS on TLS 1.3, FAIL otherwise",
        tls_version,
    ),
    Check(
        "origin.tls.alpn",
        "the originator offers ALPN h2",
        "a driven connection; we select h2",
        "ALPN h2 (src/tls/workload.rs)",
        "PASS if h2 was negotiated",
        tls_alpn,
    ),
    Check(
        "origin.tls.no_sni",
        "the originator sends no SNI",
        "a driven connection; we record the SNI",
        "no SNI (cc.enable_sni = false, src/tls/workload.rs)",
        "PASS without SNI; DIFF with one (servers must ignore it)",
        tls_sni,
    ),
    Check(
        "origin.tls.client_identity",
        "the originator presents the expected client identity",
        "a driven connection; the client chain is verified against --ca",
        "the source workload's own SPIFFE certificate (src/proxy.rs::LocalWorkloadInformation)",
        "PASS if a URI SAN equals --expect-identity",
        client_identity,
    ),
    origin_setting(INITIAL_WINDOW_SIZE, UPSTREAM_STREAM_WINDOW, 65535),
    origin_setting(MAX_FRAME_SIZE, UPSTREAM_MAX_FRAME, 16384),
    origin_setting(ENABLE_PUSH, 0, 1),
    origin_setting(MAX_HEADER_LIST_SIZE, 16 * 1024, None),
    Check(
        "origin.h2.connection_window",
        "the originator raises its connection window",
        "a driven connection; we read its stream-0 WINDOW_UPDATEs",
        "16 MiB (HTTP2_CONNECTION_WINDOW_SIZE, src/proxy/h2/client.rs)",
        "PASS if at least 16 MiB; DIFF otherwise",
        connection_window,
    ),
    Check(
        "origin.connect.request",
        "the CONNECT request is well-formed",
        "a driven connection; we read the request",
        ":method CONNECT and :authority host:port only, no :scheme or :path (src/proxy/outbound.rs)",
        "PASS if so, FAIL otherwise",
        connect_request,
    ),
    header_check("traceparent", lambda v: bool(TRACEPARENT.match(v)), "W3C 00-<32 hex>-<16 hex>-<2 hex>"),
    header_check("baggage", lambda v: "k8s." in v or "service." in v, "k8s.* and service.* members"),
    header_check("forwarded", lambda v: v.startswith("for="), 'for="<downstream ip:port>"'),
    Check(
        "origin.data.echo_half_close",
        "data both ways, and the reply survives the client's half-close",
        "we answer 200 and echo; the downstream sends 256 KiB and FIN, then reads to EOF",
        "the downstream FIN becomes END_STREAM; the reply keeps flowing until ours (src/proxy/h2.rs)",
        "PASS if the downstream reads its 256 KiB back, then EOF",
        echo_half_close,
    ),
    Check(
        "origin.data.server_closes_first",
        "the client keeps sending after the server's END_STREAM",
        "we answer 200, 4 bytes and END_STREAM at once; the downstream reads to EOF, then sends 64 KiB and FIN",
        "both directions are independent (src/copy.rs, src/proxy/h2.rs)",
        "PASS if all 64 KiB reach us, then END_STREAM",
        server_closes_first,
    ),
    Check(
        "origin.status.non_200",
        "a non-200 answer closes the downstream connection",
        "we answer 401 with END_STREAM; the downstream writes and reads",
        "any status but 200 is Error::HttpStatus: the downstream connection is closed (src/proxy/h2/client.rs)",
        "PASS if the downstream is closed without data and nothing reached us; DIFF if some bytes reached us meanwhile",
        non_200,
    ),
    Check(
        "origin.streams.rst",
        "RST_STREAM from the server ends the downstream connection",
        "we answer 200, read 1 KiB, then RST_STREAM CANCEL",
        "RST_STREAM NO_ERROR/CANCEL ends the stream's input; the copy ends (src/proxy/h2.rs::poll_bytes)",
        "PASS if the downstream connection ends (EOF or reset)",
        rst_from_server,
    ),
    Check(
        "origin.h2.ping",
        "PING is answered",
        "a PING with 8 random bytes",
        "the h2 crate ACKs every PING",
        "PASS if a PING ACK with the same payload arrives",
        ping,
    ),
    Check(
        "origin.streams.goaway",
        "after GOAWAY, open tunnels finish and new ones use a new connection",
        "an echo tunnel, GOAWAY(last_stream_id = its stream) mid-way; then a second driven connection",
        "the pool discards a connection that got GOAWAY (src/proxy/pool.rs, test server_goaway)",
        "PASS if the first tunnel completes and the second comes on a new connection",
        goaway,
    ),
    Check(
        "origin.flow.respects_window",
        "the originator never sends beyond our window, and loses nothing",
        "we stall a tunnel (no WINDOW_UPDATE) while the downstream sends window + 1 MiB; then we release",
        "the h2 crate sends within the peer's window (upstream's server grants 4 MiB per stream)",
        "PASS if no DATA exceeds the window and every byte arrives after the release",
        respects_window,
    ),
    Check(
        "origin.streams.concurrent",
        "concurrent tunnels",
        "20 driven connections at once, 32 KiB echoed on each",
        "one pooled connection carries up to 100 streams (POOL_MAX_STREAMS_PER_CONNECTION)",
        "PASS if every tunnel echoes intact (the report says over how many connections)",
        concurrent,
    ),
]


async def run_originator(
    spec: OriginSpec,
    sock: socket.socket,
    checks: list[Check[OriginContext]] | None = None,
    on_result: Callable[[Result], None] = lambda r: None,
) -> list[Result]:
    """Serve HBONE on the listening ``sock`` and run ``checks`` (default: all) against the originator."""
    ctx = OriginContext(spec)
    loop = asyncio.get_running_loop()
    previous = loop.get_exception_handler()

    def failed(_loop: asyncio.AbstractEventLoop, context: dict[str, object]) -> None:
        # A refused handshake (the originator's certificate, its TLS version) is a finding, not a log line.
        ctx.handshake_failures.append(f"{context.get('message')}: {context.get('exception')}")

    loop.set_exception_handler(failed)
    await ctx.start(sock)

    async def violations() -> str | None:
        found = [v for w in ctx.wires for v in w.violations]
        for w in ctx.wires:
            w.violations.clear()
        return "; ".join(dict.fromkeys(found)) or None

    try:
        return await run_checks(
            checks if checks is not None else CHECKS,
            ctx,
            limit=max(60.0, 6 * spec.timeout),
            violations=violations,
            on_result=on_result,
        )
    finally:
        await ctx.stop()
        loop.set_exception_handler(previous)


__all__ = ["CHECKS", "Driver", "OriginContext", "OriginSpec", "Verdict", "run_originator"]
