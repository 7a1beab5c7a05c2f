"""In-memory plumbing for the micro-benchmarks: the real protocol objects, with no sockets and no event loop turns.

:class:`MemoryTransport` is enough of an asyncio transport for ztunnel's protocols: writes are queued (or
dropped, for a sink). :class:`HbonePair` connects a client and a server :class:`HboneTransport` through two such
transports, completes a real TLS 1.3 handshake and the HTTP/2 preface, and opens one CONNECT stream whose two ends
are relayed to plaintext :class:`PlainConnection` objects. :meth:`HbonePair.pump` delivers queued bytes both ways
until both sides are quiet, so one call moves a chunk from the client's plaintext side, through the client's HBONE
framing and TLS encryption, the server's TLS decryption and HBONE parsing, to the server's plaintext side, and
brings the flow-control window updates back.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from ztunnel import tls
from ztunnel.identity.ca import LocalCA
from ztunnel.identity.certificate import WorkloadCertificate
from ztunnel.identity.spiffe import Identity
from ztunnel.proxy.hbone.connection import HboneTransport
from ztunnel.proxy.hbone.core import ConnectRequested, HboneConnection
from ztunnel.proxy.hbone.stream import HboneStream
from ztunnel.proxy.relay import PlainConnection

TRUST_DOMAIN = "cluster.local"
CLIENT_ID = Identity(TRUST_DOMAIN, "default", "client")
SERVER_ID = Identity(TRUST_DOMAIN, "default", "server")


def certificates() -> tuple[WorkloadCertificate, WorkloadCertificate]:
    """A fresh CA's client and server workload certificates."""
    ca = LocalCA.generate(TRUST_DOMAIN)
    return ca.issue(CLIENT_ID, timedelta(hours=1)), ca.issue(SERVER_ID, timedelta(hours=1))


class MemoryTransport:
    """A transport whose writes go to ``deliver`` (or nowhere); it never applies backpressure."""

    def __init__(self, deliver: Callable[[bytes], None] | None = None) -> None:
        self.deliver = deliver
        self.written = 0
        self.closing = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += len(data)
        if self.deliver is not None:
            self.deliver(bytes(data))  # a transport copies what it cannot send at once; this one always does

    def writelines(self, items: list[bytes]) -> None:
        for item in items:
            self.write(item)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0

    def is_closing(self) -> bool:
        return self.closing

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        pass

    def close(self) -> None:
        self.closing = True

    def abort(self) -> None:
        self.closing = True


def feed(protocol: asyncio.BufferedProtocol, data: bytes | memoryview) -> int:
    """Deliver ``data`` to a buffered protocol the way a transport does (into its buffers, in pieces); returns
    how many ``buffer_updated`` calls it took."""
    view = memoryview(data)
    calls = 0
    while view:
        buf = memoryview(protocol.get_buffer(len(view)))
        n = min(len(buf), len(view))
        buf[:n] = view[:n]
        view = view[n:]
        protocol.buffer_updated(n)
        calls += 1
    return calls


def sink_plain() -> PlainConnection:
    """A plaintext endpoint whose transport drops what is written to it."""
    plain = PlainConnection()
    plain.connection_made(MemoryTransport())  # type: ignore[arg-type]
    return plain


class HbonePair:
    """A client and a server HBONE connection over in-memory TLS, with one relayed CONNECT stream.

    Build it inside a running event loop (the transports arm their handshake and keepalive timers); after that,
    :meth:`send` and :meth:`pump` need no loop.
    """

    def __init__(self, client_ctx: ssl.SSLContext, server_ctx: ssl.SSLContext) -> None:
        self._to_server: deque[bytes] = deque()
        self._to_client: deque[bytes] = deque()
        self.client = HboneTransport(HboneConnection(True), client_ctx, on_handshake=lambda t: None)
        self.server = HboneTransport(
            HboneConnection(False), server_ctx, on_handshake=lambda t: None, on_connect_request=self._accept
        )
        self.server_stream: HboneStream | None = None
        self.server_plain = sink_plain()
        self.client_plain = sink_plain()
        self.server.connection_made(MemoryTransport(self._to_client.append))  # type: ignore[arg-type]
        self.client.connection_made(MemoryTransport(self._to_server.append))  # type: ignore[arg-type]
        self.pump()
        if not (self.client.handshake_done and self.server.handshake_done):
            raise RuntimeError(
                f"in-memory TLS handshake failed: {self.client.close_reason or self.server.close_reason}"
            )
        self.client_stream = self.client.open_stream("10.0.0.2:8080", [("baggage", "k8s.namespace.name=default")])
        self.pump()
        if not self._accepted():
            raise RuntimeError("the CONNECT did not reach the server")
        self.client_stream.attach(self.client_plain)

    def _accepted(self) -> bool:
        return self.server_stream is not None

    def _accept(self, conn: HboneTransport, stream: HboneStream, ev: ConnectRequested) -> None:
        conn.respond(stream, 200)
        stream.attach(self.server_plain)
        self.server_stream = stream

    def pump(self) -> None:
        """Deliver queued bytes both ways until neither side has anything more to say."""
        while self._to_server or self._to_client:
            while self._to_server:
                feed(self.server, self._to_server.popleft())
            while self._to_client:
                feed(self.client, self._to_client.popleft())

    def send(self, payload: memoryview) -> int:
        """Bytes "read" from the client's plaintext socket: into its buffer, through both proxies, then pump."""
        plain = self.client_plain
        buf = plain.get_buffer(len(payload))
        n = min(len(buf), len(payload))
        buf[:n] = payload[:n]
        plain.buffer_updated(n)
        self.pump()
        return n

    def close(self) -> None:
        self.client.abort("benchmark done")
        self.server.abort("benchmark done")


def hbone_pair() -> HbonePair:
    """An :class:`HbonePair` with fresh certificates (built on a temporary event loop)."""
    client_cert, server_cert = certificates()

    async def build() -> HbonePair:
        return HbonePair(tls.client_context(client_cert), tls.server_context(server_cert))

    # The handshake and keepalive timers belong to this loop and die with it; the benchmark drives the protocols
    # directly afterwards.
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(build())
    finally:
        loop.close()
