"""The small HTTP servers (admin 15000, stats 15020, readiness 15021) on aiohttp, bound as upstream binds them, and
bounded so that no port other than the data path can hold ztunnel's descriptors.

Sockets are made here rather than by aiohttp's ``TCPSite``: a ``[::]`` site from asyncio is IPv6-only
(``IPV6_V6ONLY=1``), so an IPv4 kubelet probe or Prometheus scrape would never connect. Ours accept both families,
and ``localhost`` binds 127.0.0.1 and ::1, as the proxy listeners do.

Bounds (:class:`HttpLimits`; upstream's ``hyper_util.rs`` serves these ports with hyper's
``header_read_timeout(2s)``, and aiohttp has no head timeout at all: 3,000 half-sent requests stayed open 105 s,
and with a 256-descriptor limit 300 of them made new HBONE connections fail):

* **Head timeout** (2 s, upstream's): a request head must be complete within ``head_timeout`` of the connection
  being accepted, or of its first byte on a kept-alive connection. The deadline is absolute: bytes dribbled one at a
  time do not extend it (slowloris).
* **Idle timeout** (2 s): a kept-alive connection on which no byte of a next request arrives within
  ``idle_timeout`` of the last response is closed. Upstream's hyper starts its 2 s header timer as soon as a
  response is written, so 2 s is also upstream's effective idle timeout.
* **Connection cap**: at most ``max_connections`` connections per server; one more is closed as soon as it is
  accepted (RST). The first refusal of an episode logs a warning, the end of the episode logs how many were refused;
  :attr:`HttpServer.refused` counts them all. The default is a sixteenth of ``RLIMIT_NOFILE`` (at least 16, at most
  1,024; read at each accept, as the limit can change at run time), so the three servers together hold under a
  fifth of the descriptors: 1,024 each under the usual 1,048,576, 16 each under a 256 limit (48 of 256). Probes
  and scrapes need a handful. The trade-off: a client that keeps the cap full (it must re-open a connection every
  2 s per slot) makes probes of that port fail instead of the data path.

A connection that timed out is closed without a response, as hyper does. A request that cannot be parsed is
answered ``HTTP/1.1 400``, as hyper answers it, once :func:`ztunnel.thirdparty.apply` has run (``App.start`` runs it;
aiohttp's own answer says HTTP/1.0).
"""

from __future__ import annotations

import asyncio
import enum
import functools
import logging
import resource
from dataclasses import dataclass
from typing import Any, cast

from ztunnel.config import SocketAddress
from ztunnel.net import format_addr
from ztunnel.sockets import SocketConfig, SocketFactory

log = logging.getLogger("ztunnel.http")

HEAD_TIMEOUT = 2.0  # upstream's hyper header_read_timeout
IDLE_TIMEOUT = 2.0


def default_max_connections() -> int:
    """A sixteenth of the soft ``RLIMIT_NOFILE``, between 16 and 1,024 (see the module docstring)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return 1024
    return max(16, min(1024, soft // 16))


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """Per-server bounds; ``max_connections=None`` is :func:`default_max_connections`, read at each accept."""

    head_timeout: float = HEAD_TIMEOUT
    idle_timeout: float = IDLE_TIMEOUT
    max_connections: int | None = None


class _Phase(enum.Enum):
    HEAD = "waiting for a request head"
    BUSY = "serving a request"
    IDLE = "idle between requests"


class _Guarded(asyncio.Protocol):
    """One accepted connection: aiohttp's protocol inside, the head and idle timers around it.

    aiohttp tells us when a head is complete (the middleware :meth:`HttpServer._mark_head`, the first code that runs
    for a parsed request) and when a response has been written (its access-log hook, called after ``write_eof``)."""

    def __init__(self, server: HttpServer, inner: asyncio.Protocol) -> None:
        self.server = server
        self.inner = inner
        self.transport: asyncio.Transport | None = None
        self.phase = _Phase.HEAD
        self._timer: asyncio.TimerHandle | None = None

    # -- asyncio.Protocol, forwarded ---------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's TCPTransport does not subclass it
        self.server._opened(self)
        self.inner.connection_made(transport)
        self._arm(self.server.limits.head_timeout)  # the first head, as hyper, from the accept

    def data_received(self, data: bytes) -> None:
        if self.phase is _Phase.IDLE and data:
            self.phase = _Phase.HEAD
            self._arm(self.server.limits.head_timeout)
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self.server._closed(self)
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    # -- request life cycle ------------------------------------------------------------------------------------

    def head_done(self) -> None:
        self.phase = _Phase.BUSY
        self._disarm()

    def response_done(self) -> None:
        if self.phase is _Phase.BUSY:
            self.phase = _Phase.IDLE
            self._arm(self.server.limits.idle_timeout)

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._timer = asyncio.get_running_loop().call_later(seconds, self._expired)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self) -> None:
        self._timer = None
        t = self.transport
        if t is None or t.is_closing():
            return
        self.server.timed_out += 1
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s: closing a connection from %s: %s too long", self.server.name, _peer(t), self.phase.value)
        # Nothing is owed to this client: no response, as hyper. abort() if something is still queued for it (a
        # client that stopped reading), so the descriptor does not wait on a flush that may never happen.
        if t.get_write_buffer_size():
            t.abort()
        else:
            t.close()


class _Refused(asyncio.Protocol):
    """A connection over the cap: reset as soon as it is accepted, before aiohttp sees it."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        cast(asyncio.Transport, transport).abort()


def _peer(transport: asyncio.BaseTransport) -> str:
    peer = transport.get_extra_info("peername")
    return format_addr(peer[0], peer[1]) if isinstance(peer, tuple) and len(peer) >= 2 else "?"


class HttpServer:
    """An aiohttp application served on every socket of one :class:`SocketAddress`, within :class:`HttpLimits`."""

    def __init__(self, app: Any, limits: HttpLimits | None = None, name: str = "http") -> None:
        self.app = app
        self.limits = limits or HttpLimits()
        self.name = name
        self.max_connections = 0  # set by start()
        self.refused = 0  # connections closed at accept because the cap was reached
        self.timed_out = 0  # connections closed by the head or idle timer
        self._runner: Any = None
        self._servers: list[asyncio.Server] = []
        self._open: set[_Guarded] = set()
        self._refusing = 0  # refusals in the current episode (0: not refusing)
        self.addresses: list[tuple[str, int]] = []

    @property
    def address(self) -> tuple[str, int] | None:
        return self.addresses[0] if self.addresses else None

    @property
    def open_connections(self) -> int:
        return len(self._open)

    async def start(self, addr: SocketAddress) -> None:
        from aiohttp import web

        cap = self.limits.max_connections
        self.max_connections = default_max_connections() if cap is None else cap
        if self.max_connections < 1:
            raise ValueError(f"{self.name} server: max_connections must be at least 1, got {self.max_connections}")
        self.app.middlewares.append(web.middleware(_mark_head))
        socks = SocketFactory(SocketConfig()).listeners(addr)
        self._runner = web.AppRunner(
            self.app, access_log=log, access_log_class=_response_done_class(), handle_signals=False
        )
        await self._runner.setup()
        loop = asyncio.get_running_loop()
        for sock, _ in socks:
            self._servers.append(await loop.create_server(self._accept, sock=sock))
            host, port = sock.getsockname()[:2]
            self.addresses.append((str(host), int(port)))

    def _accept(self) -> asyncio.Protocol:
        if self._runner is None:  # stopping
            return _Refused()
        if self.limits.max_connections is None:
            # Read per accept (one getrlimit): the limit can change at run time (prlimit), as FdHeadroom notes.
            self.max_connections = default_max_connections()
        if len(self._open) >= self.max_connections:
            self.refused += 1
            self._refusing += 1
            if self._refusing == 1:
                log.warning(
                    "%s server %s: %d connections open, the cap; new connections are closed as soon as they are "
                    "accepted until some close",
                    self.name,
                    self._where(),
                    len(self._open),
                )
            return _Refused()
        return _Guarded(self, self._runner.server())

    def _opened(self, conn: _Guarded) -> None:
        self._open.add(conn)

    def _closed(self, conn: _Guarded) -> None:
        self._open.discard(conn)
        if self._refusing and len(self._open) < self.max_connections:
            log.info(
                "%s server %s: accepting connections again; %d were refused at the cap of %d",
                self.name,
                self._where(),
                self._refusing,
                self.max_connections,
            )
            self._refusing = 0

    def _where(self) -> str:
        return ", ".join(format_addr(h, p) for h, p in self.addresses)

    async def stop(self) -> None:
        for server in self._servers:
            server.close()
        self._servers.clear()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        for conn in list(self._open):
            if conn.transport is not None:
                conn.transport.abort()


async def _mark_head(request: Any, handler: Any) -> Any:
    """aiohttp middleware: the first code that runs once a request head has been parsed."""
    guard = _guard_of(request)
    if guard is not None:
        guard.head_done()
    return await handler(request)


def _guard_of(request: Any) -> _Guarded | None:
    transport = request.transport
    if transport is None:
        return None
    protocol = transport.get_protocol()
    return protocol if isinstance(protocol, _Guarded) else None


@functools.cache
def _response_done_class() -> type:
    from aiohttp.abc import AbstractAccessLogger

    class ResponseDone(AbstractAccessLogger):
        """aiohttp calls its access logger once a response has been written (after ``write_eof``): the moment a
        kept-alive connection turns idle. Nothing is logged (upstream does not log these requests either)."""

        def log(self, request: Any, response: Any, time: float) -> None:
            guard = _guard_of(request)
            if guard is not None:
                guard.response_done()

    return ResponseDone
