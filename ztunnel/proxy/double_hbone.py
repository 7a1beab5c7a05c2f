"""Double HBONE: an inner HBONE connection (mTLS + HTTP/2 CONNECT) carried inside one stream of an outer one.

Upstream ``outbound.rs`` (``proxy_to_double_hbone``). To reach a workload on another network, the outer CONNECT
goes to that network's east-west gateway (pooled, verified against the gateway's identity); the gateway terminates
only the outer tunnel and forwards its bytes to the destination's port 15008. Inside the outer stream the client
runs a second, end-to-end TLS handshake with the source workload's certificate, verified against the destination's
identities, and a second HTTP/2 connection with one CONNECT. The gateway sees only ciphertext.

The inner connection is an ordinary :class:`~ztunnel.proxy.hbone.connection.HboneTransport` (its TLS is already a
memory BIO) whose transport is :class:`StreamPipe`'s inner end rather than a socket; the outer stream is attached
to the pipe's outer end, a :class:`~ztunnel.proxy.relay.PlainConnection` like any plaintext socket. So the pipe is
the whole adapter, and neither the HTTP/2 code nor the relay knows it is nested:

* inner → outer: what the inner connection writes (TLS records) is put into the outer end's read buffer, exactly
  as a socket read would, and the outer stream frames it in place; when the outer stream cannot take more (its
  window, or the outer connection's socket buffer), the outer end pauses "reading", the pipe keeps what is left
  and tells the inner connection to stop writing above 1 MiB (as a TCP transport would), and resumes it below
  256 KiB;
* outer → inner: DATA of the outer stream written to the outer end goes straight into the inner connection's
  ciphertext buffer (``get_buffer``/``buffer_updated``), which always takes it (receive backpressure is the inner
  HTTP/2 flow control, which bounds it at the inner windows);
* ends: the inner connection's close becomes END_STREAM on the outer stream (after the last byte); its abort a
  reset; the outer stream's END_STREAM is EOF for the inner TLS; its reset, or the outer connection's loss, aborts
  the inner connection (and so the tunnel inside it).

Each hop's bytes are copied once, as a socket read would copy them: no extra buffering on the hot path.

Upstream keeps the inner connection out of the pool (one per client connection): a pooled inner connection would
pin every connection to the one workload behind the gateway that the first handshake reached.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import Any, cast

from ztunnel import tls
from ztunnel.identity.spiffe import Identity
from ztunnel.proxy.common import ProxyError
from ztunnel.proxy.hbone.connection import CLOSE_TIMEOUT, WRITE_HIGH_WATER, WRITE_LOW_WATER, HboneTransport
from ztunnel.proxy.hbone.core import HboneConnection, Settings
from ztunnel.proxy.hbone.reason import CloseKind, CloseReason
from ztunnel.proxy.hbone.stream import HboneStream
from ztunnel.proxy.relay import PlainConnection
from ztunnel.tasks import running_loop

log = logging.getLogger("ztunnel.proxy.outbound")


class StreamPipe:
    """Joins an outer HBONE stream (through :attr:`outer`, its plaintext side) to an inner connection's protocol
    (through :attr:`inner_transport`, its transport). Made by :func:`open_inner`."""

    def __init__(self, inner: asyncio.BufferedProtocol, peer: tuple[str, int] | None) -> None:
        self.inner = inner
        self.peer = peer
        self.outer = PlainConnection()
        self.inner_transport = _InnerEnd(self)
        self._queue: deque[memoryview] = deque()  # inner's writes the outer stream could not take yet
        self._queued = 0
        self._outer_paused = False  # the outer end stopped "reading" (the outer stream cannot take more)
        self._inner_write_paused = False
        self._feeding = False  # inside a delivery to the outer end: the inner's writes wait (order, reentrancy)
        self._inner_closing = False  # the inner connection closed: END_STREAM once the queue is empty
        # Inside a call from the outer stream (its connection is dispatching what it read): what the inner connection
        # writes meanwhile is fed to the outer stream on the next loop turn instead. A DATA frame the outer
        # connection writes while it dispatches waits for its end-of-dispatch flush, which sends only when it has
        # control frames of its own to send: fed from here, the inner bytes stalled until the next PING (64 MiB took
        # 20 s instead of 0.6 s).
        self._in_outer = False
        self._drain_scheduled = False
        self.closed = False
        self.outer.connection_made(cast(asyncio.BaseTransport, _OuterEnd(self)))  # a transport without a socket

    # -- inner -> outer ------------------------------------------------------------------------------------------

    def inner_wrote(self, data: bytes | bytearray | memoryview) -> None:
        if self.closed or not data:
            return
        # TLS output is a fresh bytes object per write, so a view of it may be kept; anything else is copied.
        view = memoryview(data if isinstance(data, bytes) else bytes(data))
        if self._feeding or self._queue or self._outer_paused or self._in_outer:
            self._enqueue(view)  # after what is already waiting (order), or once the outer stream takes more
            if self._in_outer:
                self._schedule_drain()
            return
        rest = self._feed(view)
        if rest:
            self._queue.appendleft(rest)
            self._queued += len(rest)
        self._drain_queue()

    def _enqueue(self, view: memoryview) -> None:
        self._queue.append(view)
        self._queued += len(view)
        if not self._inner_write_paused and self._queued > WRITE_HIGH_WATER:
            self._inner_write_paused = True
            self.inner.pause_writing()

    def _feed(self, view: memoryview) -> memoryview:
        """Put ``view`` into the outer end's read buffer, as a socket read would; returns what it cannot take now.
        Writes the inner connection makes meanwhile (the outer stream's progress can make it write) are queued."""
        outer = self.outer
        self._feeding = True
        try:
            while view and not self._outer_paused and not outer.closed:
                buf = outer.get_buffer(len(view))
                n = min(len(buf), len(view))
                if n == 0:
                    break
                buf[:n] = view[:n]
                view = view[n:]
                outer.buffer_updated(n)
        finally:
            self._feeding = False
        return view

    def _drain_queue(self) -> None:
        """Feed what waits while the outer stream takes it; then the inner connection's write pause and end."""
        queue = self._queue
        while queue and not self._outer_paused and not self.outer.closed and not self.closed:
            view = queue.popleft()
            self._queued -= len(view)
            rest = self._feed(view)
            if rest:
                queue.appendleft(rest)
                self._queued += len(rest)
                break
        if self._inner_write_paused and self._queued < WRITE_LOW_WATER:
            self._inner_write_paused = False
            self.inner.resume_writing()
        if self._inner_closing and not queue and not self.closed and not self.outer.eof_received_:
            self.outer.eof_received()  # END_STREAM after the last byte
            # The gateway ends its side once the destination closed; one that does not would hold the outer stream
            # (and a slot on the pooled connection) forever: reset it after CLOSE_TIMEOUT, as a socket close would.
            running_loop().call_later(CLOSE_TIMEOUT, self._linger_expired)

    def _linger_expired(self) -> None:
        if not self.closed:
            self.outer.reset()

    def _schedule_drain(self) -> None:
        if not self._drain_scheduled and not self.closed:
            self._drain_scheduled = True
            running_loop().call_soon(self._scheduled_drain)

    def _scheduled_drain(self) -> None:
        self._drain_scheduled = False
        if not self._feeding and not self.closed:
            self._drain_queue()

    def outer_pause(self) -> None:
        self._outer_paused = True

    def outer_resume(self) -> None:
        # From the outer stream (its window opened, its connection drained): feed on the next turn (see _in_outer).
        self._outer_paused = False
        self._schedule_drain()

    def inner_close(self) -> None:
        """The inner connection closed politely (close_notify written): end the outer stream after its bytes."""
        if self.closed or self._inner_closing:
            return
        self._inner_closing = True
        self._schedule_drain()

    # -- outer -> inner ------------------------------------------------------------------------------------------

    def outer_wrote(self, data: bytes | bytearray | memoryview) -> None:
        inner = self.inner
        view = memoryview(data)
        self._in_outer = True
        try:
            while view and not self.closed:
                buf = cast(memoryview, inner.get_buffer(len(view)))
                n = min(len(buf), len(view))
                buf[:n] = view[:n]
                view = view[n:]
                inner.buffer_updated(n)
        finally:
            self._in_outer = False

    def outer_eof(self) -> None:
        if not self.closed:
            self._in_outer = True
            try:
                self.inner.eof_received()
            finally:
                self._in_outer = False

    # -- teardown ------------------------------------------------------------------------------------------------

    def close(self, exc: Exception | None) -> None:
        """Either end is gone: both protocols hear of it once (on the next loop turn, as a transport would)."""
        if self.closed:
            return
        self.closed = True
        self._queue.clear()
        self._queued = 0
        loop = running_loop()
        loop.call_soon(self.outer.connection_lost, exc)
        loop.call_soon(self.inner.connection_lost, exc)


class _TransportBase:
    """What both protocols call on a transport that is not a socket."""

    def __init__(self, pipe: StreamPipe) -> None:
        self.pipe = pipe
        self._closing = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "peername":
            return self.pipe.peer
        return default  # no socket: callers that set socket options skip it

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass  # the pipe applies the TCP transport's 1 MiB / 256 KiB itself

    def get_write_buffer_size(self) -> int:
        return 0

    def is_closing(self) -> bool:
        return self._closing or self.pipe.closed

    def can_write_eof(self) -> bool:
        return True


class _OuterEnd(_TransportBase):
    """The outer end's transport: writes go into the inner connection; read pauses stop the inner's output."""

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.pipe.outer_wrote(data)

    def writelines(self, items: list[memoryview]) -> None:
        # The relay's write of several DATA frames of one read (PlainConnection.writelines).
        for data in items:
            self.pipe.outer_wrote(data)

    def write_eof(self) -> None:
        self.pipe.outer_eof()

    def pause_reading(self) -> None:
        self.pipe.outer_pause()

    def resume_reading(self) -> None:
        self.pipe.outer_resume()

    def close(self) -> None:
        self._closing = True
        self.pipe.close(None)

    def abort(self) -> None:
        self._closing = True
        self.pipe.close(ConnectionResetError("outer HBONE stream reset"))


class _InnerEnd(_TransportBase):
    """The inner connection's transport: writes go to the outer stream."""

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.pipe.inner_wrote(data)

    def writelines(self, items: list[bytes]) -> None:
        # The record layer's sealed parts (headers and ciphertexts): one write of them all, in order.
        self.pipe.inner_wrote(b"".join(items))

    def get_write_buffer_size(self) -> int:
        return self.pipe._queued

    def write_eof(self) -> None:
        self.pipe.inner_close()

    def pause_reading(self) -> None:
        pass  # receive backpressure is the inner HTTP/2 flow control

    def resume_reading(self) -> None:
        pass

    def close(self) -> None:
        self._closing = True
        self.pipe.inner_close()

    def abort(self) -> None:
        self._closing = True
        self.pipe.close(ConnectionResetError("inner HBONE connection aborted"))


async def open_inner(
    outer: HboneStream,
    ssl_context: Any,
    settings: Settings,
    expected: tuple[Identity, ...],
    describe: str,
    peer: tuple[str, int] | None = None,
) -> tuple[HboneTransport, StreamPipe]:
    """Run an HBONE client connection inside the established ``outer`` stream: the TLS handshake with
    ``ssl_context`` (the source's certificate), the server verified against ``expected``; returns the connection
    once verified. ``describe`` names the destination in errors. Raises ProxyError (flag as the pool's)."""
    loop = running_loop()
    done: asyncio.Future[HboneTransport] = loop.create_future()

    def on_handshake(t: HboneTransport) -> None:
        assert t.ssl_object is not None
        try:
            t.peer_identity = tls.verify_server_identity(t.ssl_object, expected)
        except tls.TlsError as e:
            if not done.done():
                done.set_exception(ProxyError.server_rejected(f"inner TLS to {describe}", e))
            t.abort(CloseReason(CloseKind.PEER_REJECTED, str(e)))
            return
        if not done.done():
            done.set_result(t)

    def on_closed(t: HboneTransport) -> None:
        reason = t.close_reason
        if not done.done() and reason is not None:
            done.set_exception(ProxyError.closed_before_ready(f"inner HBONE connection to {describe}", reason))

    inner = HboneTransport(HboneConnection(True, settings), ssl_context, on_handshake=on_handshake, on_closed=on_closed)
    pipe = StreamPipe(inner, peer)
    outer.attach(pipe.outer, on_done=_on_outer_done(pipe))
    inner.connection_made(cast(asyncio.BaseTransport, pipe.inner_transport))
    try:
        return await done, pipe
    except asyncio.CancelledError:
        inner.abort("cancelled")
        raise


def _on_outer_done(pipe: StreamPipe) -> Callable[[HboneStream], None]:
    def done(stream: HboneStream) -> None:
        if not pipe.closed:
            pipe.close(ConnectionResetError(stream.error) if stream.error else None)

    return done


__all__ = ["StreamPipe", "open_inner"]
