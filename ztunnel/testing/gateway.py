"""An east-west network gateway for tests: terminates the *outer* tunnel of double HBONE and forwards its bytes.

What Istio's east-west gateway does for ambient multi-network traffic, and no more: it accepts HBONE (mTLS with the
gateway's own certificate, a client certificate from the mesh's trust domain required, HTTP/2 CONNECT); for each
CONNECT it looks the ``:authority``'s host (``<service hostname>:<port>``) up in its routes, connects to the
destination it names (a ztunnel's port 15008 on the gateway's network), answers 200 and relays the stream's bytes
both ways. Those bytes are the client's *inner* TLS session with the destination ztunnel: the gateway holds no key
for it, so it never sees plaintext. Unknown hosts get 503, as a gateway without a route would answer.

Each stream is recorded (:class:`GatewayStream`: authority, headers, peer identity, byte counts) so a test can show
what the gateway saw. ``python -m ztunnel.testing.gateway`` runs one as a process (see :func:`main`).
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import logging
import signal
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from ztunnel import tls
from ztunnel.config import parse_socket_address
from ztunnel.identity.ca import LocalCA
from ztunnel.identity.certificate import WorkloadCertificate
from ztunnel.identity.spiffe import Identity
from ztunnel.proxy.connect import connect_plain
from ztunnel.proxy.hbone.connection import HboneTransport
from ztunnel.proxy.hbone.core import SERVER_SETTINGS, ConnectRequested, HboneConnection
from ztunnel.proxy.hbone.reason import CloseKind, CloseReason
from ztunnel.proxy.hbone.stream import HboneStream
from ztunnel.proxy.inbound import parse_authority
from ztunnel.proxy.relay import PlainConnection
from ztunnel.sockets import SocketConfig, SocketFactory

log = logging.getLogger("ztunnel.testing.gateway")


@dataclass
class GatewayStream:
    """One CONNECT the gateway served (or refused)."""

    authority: str
    headers: dict[str, str]
    peer: str
    peer_identity: str | None
    status: int = 0
    upstream: str | None = None
    bytes_in: int = 0  # from the client, toward the destination
    bytes_out: int = 0
    done: bool = False
    error: str | None = None

    def to_json(self) -> dict[str, object]:
        return dict(self.__dict__)


@dataclass
class TestGateway:
    """The gateway: ``routes`` maps a service hostname to the destination ztunnel's HBONE address."""

    __test__ = False  # not a pytest class

    cert: WorkloadCertificate
    routes: Mapping[str, tuple[str, int]]
    trust_domain: str = "cluster.local"
    # A misbehaving gateway: never ends its side of a stream (the destination's FIN is not passed on).
    hold_open: bool = False
    streams: list[GatewayStream] = field(default_factory=list)
    server: asyncio.Server | None = None
    _conns: set[HboneTransport] = field(default_factory=set)

    async def start(self, host: str, port: int = 0) -> TestGateway:
        ctx = tls.server_context(self.cert)
        # The destination sees the gateway's address as the TCP peer, as on a real network.
        self._sockets = SocketFactory(SocketConfig(source_ip=host))
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(lambda: self._accepted(ctx), host, port, reuse_address=True)
        return self

    @property
    def address(self) -> tuple[str, int]:
        assert self.server is not None
        host, port = self.server.sockets[0].getsockname()[:2]
        return host, port

    def _accepted(self, ctx: object) -> HboneTransport:
        conn = HboneTransport(
            HboneConnection(False, SERVER_SETTINGS),
            ctx,  # type: ignore[arg-type]
            on_handshake=self._verified,
            on_connect_request=self._on_request,
            on_closed=self._conns.discard,
        )
        self._conns.add(conn)
        return conn

    def _verified(self, conn: HboneTransport) -> None:
        assert conn.ssl_object is not None
        try:
            conn.peer_identity = tls.verify_client_identity(conn.ssl_object, self.trust_domain)
        except tls.TlsError as e:
            conn.abort(CloseReason(CloseKind.PEER_REJECTED, str(e)))

    def _on_request(self, conn: HboneTransport, stream: HboneStream, ev: ConnectRequested) -> None:
        rec = GatewayStream(
            ev.authority,
            dict(ev.headers),
            f"{conn.peer[0]}:{conn.peer[1]}" if conn.peer else "?",
            str(conn.peer_identity) if conn.peer_identity else None,
        )
        self.streams.append(rec)
        stream.setup = asyncio.get_running_loop().create_task(self._serve(conn, stream, ev, rec))

    async def _serve(self, conn: HboneTransport, stream: HboneStream, ev: ConnectRequested, rec: GatewayStream) -> None:
        try:
            host, _port = parse_authority(ev.authority)
        except ValueError as e:
            rec.status, rec.error = 400, str(e)
            conn.reject(stream, 400)
            return
        target = self.routes.get(str(host))
        if ev.method != "CONNECT" or target is None:
            rec.status, rec.error = 503, f"no route for {host}"
            conn.reject(stream, 503)
            return
        try:
            upstream = await connect_plain(self._sockets, (ipaddress.ip_address(target[0]), target[1]))
        except Exception as e:
            rec.status, rec.error = 503, str(e)
            conn.reject(stream, 503)
            return
        rec.status, rec.upstream = 200, f"{target[0]}:{target[1]}"
        conn.respond(stream, 200)

        def done(s: HboneStream) -> None:
            rec.bytes_in, rec.bytes_out, rec.done, rec.error = s.bytes_to_plain, s.bytes_from_plain, True, s.error

        stream.attach(upstream, on_done=done)
        if self.hold_open:
            upstream.peer = _NoEof(stream)

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
        for conn in list(self._conns):
            conn.abort("gateway stopped")


class _NoEof:
    """Relays like the stream it wraps, but swallows the destination's FIN (``TestGateway.hold_open``)."""

    def __init__(self, stream: HboneStream) -> None:
        self.stream = stream

    def send_from_plain(self, plain: PlainConnection, offset: int, length: int) -> int:
        return self.stream.send_from_plain(plain, offset, length)

    def plain_eof(self, plain: PlainConnection) -> None:
        pass

    def plain_lost(self, plain: PlainConnection, exc: Exception | None) -> None:
        if exc is not None:
            self.stream.plain_lost(plain, exc)

    def plain_write_paused(self, plain: PlainConnection, paused: bool) -> None:
        self.stream.plain_write_paused(plain, paused)


async def _run(args: argparse.Namespace) -> list[GatewayStream]:
    ca = LocalCA.load_or_create(Path(args.ca_dir), args.trust_domain)
    identity = Identity.parse(args.identity)
    cert = ca.issue(identity, timedelta(hours=1))
    gw = await TestGateway(cert, args.routes, args.trust_domain).start(args.listen.host, args.listen.port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(json.dumps({"listening": list(gw.address)}), flush=True)
    await stop.wait()
    await gw.stop()
    return gw.streams


def main(argv: list[str] | None = None) -> int:
    """``python -m ztunnel.testing.gateway --ca-dir D --identity spiffe://... --listen IP:PORT
    --route HOSTNAME=IP:15008 [--record FILE]``: serve until SIGTERM, then write what it saw to FILE (JSON)."""
    p = argparse.ArgumentParser(prog="python -m ztunnel.testing.gateway")
    p.add_argument("--ca-dir", required=True)
    p.add_argument("--trust-domain", default="cluster.local")
    p.add_argument("--identity", required=True)
    p.add_argument("--listen", required=True)
    p.add_argument("--route", action="append", default=[])
    p.add_argument("--record")
    args = p.parse_args(argv)
    # Addresses parsed as the proxy's own settings are ([v6]:port too); a bad one names its flag, no traceback.
    try:
        args.listen = parse_socket_address(args.listen)
    except ValueError as e:
        p.error(f"--listen {args.listen!r}: {e}")
    args.routes = {}
    for r in args.route:
        hostname, sep, addr = r.partition("=")
        try:
            if not sep or not hostname:
                raise ValueError("expected HOSTNAME=IP:PORT")
            target = parse_socket_address(addr)
        except ValueError as e:
            p.error(f"--route {r!r}: {e}")
        args.routes[hostname] = (target.host, target.port)
    logging.basicConfig(level=logging.WARNING)
    try:
        import uvloop

        streams = uvloop.run(_run(args))
    except KeyboardInterrupt:
        return 1
    if args.record:
        Path(args.record).write_text(json.dumps([s.to_json() for s in streams], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
