"""The HBONE connection pool (upstream ``proxy/pool.rs``, ``WorkloadHBONEPool``).

Connections are keyed by (source identity, expected destination identities, destination address, source IP), so a
pooled connection is only ever reused for exactly the identities it was verified for. A new stream takes a
connection of its key with room for one more stream; room is ``min(POOL_MAX_STREAMS_PER_CONNECTION, the peer's
SETTINGS_MAX_CONCURRENT_STREAMS)``. Concurrent requests for a key whose connection is being dialled wait for that
dial instead of starting their own (one TLS handshake, not N). A connection that received GOAWAY, or failed, takes
no new streams; one unused for ``POOL_UNUSED_RELEASE_TIMEOUT`` is closed.

A stream costs no handshake, which is what makes connection rate: a TLS handshake per connection caps a Python
proxy at ~500 connections/s on these machines; a stream on a pooled connection is several times cheaper.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from ztunnel import tls
from ztunnel.config import Config
from ztunnel.crl import REPORTER_OUTBOUND, Tracked
from ztunnel.identity.manager import CertificateProvider, CertificateUnavailable
from ztunnel.identity.spiffe import Identity
from ztunnel.net import format_addr
from ztunnel.proxy.common import (
    CONNECTION_TIMEOUT,
    ProxyError,
    ResponseFlag,
    TlsContextCache,
    is_timeout,
    os_error_reason,
)
from ztunnel.proxy.hbone.connection import HboneTransport, http2_settings
from ztunnel.proxy.hbone.core import HboneConnection
from ztunnel.proxy.hbone.reason import CloseKind, CloseReason
from ztunnel.proxy.hbone.stream import HboneStream
from ztunnel.sockets import SocketFactory, connect, family_of, sockaddr
from ztunnel.state.workload import IPAddress
from ztunnel.tasks import running_loop

log = logging.getLogger("ztunnel.proxy.pool")


@dataclass(frozen=True, slots=True)
class WorkloadKey:
    src_id: Identity
    dst_id: tuple[Identity, ...]
    dst: tuple[IPAddress, int]
    src: IPAddress

    def __str__(self) -> str:
        return f"{self.src_id}->{format_addr(*self.dst)} (expecting {', '.join(map(str, self.dst_id))})"


class WorkloadHBONEPool:
    """HBONE client connections of one proxy, by :class:`WorkloadKey`."""

    def __init__(
        self,
        config: Config,
        certs: CertificateProvider,
        sockets: SocketFactory,
        contexts: TlsContextCache,
    ) -> None:
        self.max_streams = config.pool_max_streams_per_connection
        self.idle_timeout = config.pool_unused_release_timeout
        self.settings = http2_settings(config, client_side=True)
        self._certs = certs
        self._sockets = sockets
        self._contexts = contexts
        self._conns: dict[WorkloadKey, list[HboneTransport]] = {}
        self._dialing: dict[WorkloadKey, asyncio.Future[HboneTransport]] = {}
        self._reaper: asyncio.TimerHandle | None = None
        self.closed = False
        self.dials = 0  # connections established, for tests and the admin view
        # CRL_PATH: what closes a connection whose server a CRL update revoked (the proxy's connection manager, which
        # ends its streams with CERT_REVOKED first); by default the connection is just aborted.
        self.on_revoked: Callable[[HboneTransport, str], None] = _abort_revoked
        self._crl_tracked: dict[HboneTransport, Tracked | None] = {}

    def __len__(self) -> int:
        return sum(len(v) for v in self._conns.values())

    def connections(self, key: WorkloadKey | None = None) -> list[HboneTransport]:
        if key is not None:
            return list(self._conns.get(key, ()))
        return [c for conns in self._conns.values() for c in conns]

    # -- checkout ----------------------------------------------------------------------------------------------

    def try_open_stream(self, key: WorkloadKey, authority: str, headers: list[tuple[str, str]]) -> HboneStream | None:
        """Open a CONNECT stream on a pooled connection of ``key`` with room for one more, if there is one (else
        ``None``: :meth:`open_stream` dials or waits for a dial). The response is ``stream.response``.

        The common case of every new connection once the pool is warm, so plain calls: no coroutine to await, and
        the room checked by the connection as it opens the stream, not through three helpers and two properties
        (2 Python calls instead of 7)."""
        conns = self._conns.get(key)
        if conns and not self.closed:
            for conn in conns:
                stream = conn.open_stream_within(self.max_streams, authority, headers)
                if stream is not None:
                    return stream
        return None

    async def open_stream(self, key: WorkloadKey, authority: str, headers: list[tuple[str, str]]) -> HboneStream:
        """Open a CONNECT stream on a pooled (or new) connection for ``key``; the response is ``stream.response``."""
        if self.closed:
            raise ProxyError("proxy is shutting down")
        while True:
            stream = self.try_open_stream(key, authority, headers)
            if stream is not None:
                return stream
            pending = self._dialing.get(key)
            if pending is not None:
                # Someone is already dialling this key: share that handshake.
                await asyncio.shield(pending)
                continue
            loop = running_loop()
            fut: asyncio.Future[HboneTransport] = loop.create_future()
            self._dialing[key] = fut
            try:
                conn = await self._dial(key)
            except BaseException as e:
                fut.set_exception(e if isinstance(e, Exception) else ProxyError("dial cancelled"))
                fut.exception()  # mark retrieved: waiters re-raise their own copy
                raise
            finally:
                del self._dialing[key]
            self._conns.setdefault(key, []).append(conn)
            fut.set_result(conn)
            self._schedule_reaper()
            stream = conn.open_stream_within(self.max_streams, authority, headers)
            if stream is None:  # the new connection ended (or was told GOAWAY) before this resumed
                raise ProxyError.stream_failed(
                    ConnectionError(f"HBONE connection to {format_addr(*key.dst)} closed"), False
                )
            return stream

    async def _dial(self, key: WorkloadKey) -> HboneTransport:
        loop = running_loop()
        try:
            cert = await self._certs.fetch_certificate(key.src_id)
        except Exception as e:
            # No certificate (CA down, renewal failed, expired): fail this connection with the reason, as upstream.
            why = e.reason if isinstance(e, CertificateUnavailable) else e
            raise ProxyError.no_certificate(key.src_id, why) from None
        ctx = self._contexts.client(key.src_id, cert)
        ip, port = key.dst
        sock = self._sockets.tcp(family_of(ip))
        try:
            await connect(sock, sockaddr(ip, port), timeout=CONNECTION_TIMEOUT)  # a loop timer, no timeout scope
        except TimeoutError:
            sock.close()
            raise ProxyError(
                f"connection to {format_addr(ip, port)} timed out, maybe a NetworkPolicy is blocking HBONE port {port}",
                ResponseFlag.NETWORK_POLICY,
                timed_out=True,
            ) from None
        except OSError as e:
            sock.close()
            raise ProxyError(
                f"failed to connect to {format_addr(ip, port)}: {os_error_reason(e)}", timed_out=is_timeout(e)
            ) from None
        done: asyncio.Future[HboneTransport] = loop.create_future()

        def on_handshake(t: HboneTransport) -> None:
            assert t.ssl_object is not None
            try:
                server_id = tls.verify_server_identity(t.ssl_object, key.dst_id)
            except tls.TlsError as e:
                # Report first: abort() runs on_closed, which would otherwise claim the failure as CONNECT.
                if not done.done():
                    done.set_exception(ProxyError.server_rejected(f"TLS to {format_addr(ip, port)}", e))
                t.abort(CloseReason(CloseKind.PEER_REJECTED, str(e)))
                return
            crl = self._contexts.crl
            if crl is not None:
                self._crl_tracked[t] = crl.track(
                    tls.peer_chain(t.ssl_object),
                    REPORTER_OUTBOUND,
                    f"{format_addr(ip, port)} ({server_id})",
                    partial(self.on_revoked, t),
                )
            if not done.done():
                done.set_result(t)

        def on_closed(t: HboneTransport) -> None:
            reason = t.close_reason
            crl = self._contexts.crl
            if crl is not None:
                crl.untrack(self._crl_tracked.pop(t, None))
                if reason is not None and reason.revoked and crl.metrics is not None:
                    crl.metrics.rejected(REPORTER_OUTBOUND)
            if not done.done() and reason is not None:
                done.set_exception(
                    ProxyError.closed_before_ready(f"HBONE connection to {format_addr(ip, port)}", reason)
                )
            self._remove(key, t)

        try:
            await loop.create_connection(
                lambda: HboneTransport(
                    HboneConnection(True, self.settings), ctx, on_handshake=on_handshake, on_closed=on_closed
                ),
                sock=sock,
            )
        except OSError as e:
            sock.close()
            raise ProxyError(f"failed to connect to {format_addr(ip, port)}: {e}", timed_out=is_timeout(e)) from None
        conn = await done
        self.dials += 1
        log.debug("new HBONE connection for %s", key)
        return conn

    def _remove(self, key: WorkloadKey, conn: HboneTransport) -> None:
        conns = self._conns.get(key)
        if conns is not None and conn in conns:
            conns.remove(conn)
            if not conns:
                del self._conns[key]

    # -- idle eviction -----------------------------------------------------------------------------------------

    def _schedule_reaper(self) -> None:
        if self._reaper is None and not self.closed:
            interval = max(0.05, min(self.idle_timeout / 2, 30.0))
            self._reaper = running_loop().call_later(interval, self._reap)

    def _reap(self) -> None:
        self._reaper = None
        now = time.monotonic()
        for key, conns in list(self._conns.items()):
            for conn in list(conns):
                if conn.closed:
                    self._remove(key, conn)
                elif not conn.stream_count and now - conn.last_active >= self.idle_timeout:
                    log.debug("closing idle HBONE connection for %s", key)
                    self._remove(key, conn)
                    conn.goaway()
        if self._conns:
            self._schedule_reaper()

    def close(self) -> None:
        """Drain: no new streams; each connection closes when its last stream finishes (idle ones at once)."""
        self.closed = True
        if self._reaper is not None:
            self._reaper.cancel()
            self._reaper = None
        for conns in list(self._conns.values()):
            for conn in list(conns):
                conn.drain_when_idle()

    def abort(self, reason: str) -> None:
        for conns in list(self._conns.values()):
            for conn in list(conns):
                conn.abort(reason)
        self._conns.clear()


def _abort_revoked(conn: HboneTransport, reason: str) -> None:
    conn.abort(CloseReason(CloseKind.PEER_REJECTED, reason))
