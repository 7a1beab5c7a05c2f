"""The relay: plaintext sockets read into buffers an HBONE stream can frame in place, and two plaintext sockets
relayed to each other.

Upstream's ``copy.rs``, shaped for asyncio (the HBONE side of a tunnel is ``hbone.stream``, which implements
:class:`PlainPeer`, as upstream's ``h2.rs`` implements ``copy.rs``'s traits):

* Plaintext sockets are read with ``BufferedProtocol`` into a buffer whose first 9 bytes are kept free, so the
  HBONE side can write the HTTP/2 DATA header in place and hand header + payload to TLS as one write (no copy).
  Buffers start at 1 KiB and double whenever a read fills them, up to 256 KiB: idle tunnels stay small, bulk
  transfers reach large reads within a few calls (growing only on full reads avoids istio/ztunnel#1630's growth
  on connections that never needed it).
* Backpressure at every hop: a peer that cannot take more bytes leaves them in the buffer and the socket stops
  being read until it can; when a plaintext socket's write buffer fills, its peer is told (``plain_write_paused``)
  and stops feeding it. Memory per tunnel is bounded whatever the speeds.
* Half-close is carried end to end (FIN in, FIN out, in each direction independently); a TCP reset is passed on
  as a reset.
* Byte counts are plain ints on the objects; metrics read them at close (no per-chunk label lookups or logging).

A view handed to ``transport.write`` may be kept by the transport when the socket cannot take it all; the writer
then lets go of that buffer (``pin``) and continues in a fresh one, so bytes are never overwritten while queued.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import Callable
from typing import Protocol

# Bytes kept free before every payload read: room for the 9-byte header of an HTTP/2 DATA frame (RFC 9113 §4.1).
HDR = 9
_INITIAL_BUFFER = 1024
_MAX_BUFFER = 256 * 1024
# A read buffer exists only between a read and the moment its bytes are passed on: an idle socket holds none (10,000
# idle tunnels held 2 x 1.3 KiB each in buffers, ~18 % of their memory), and one that once streamed at 256 KiB reads
# gives it back. Reads that fill it double it; a drained read under 1/8 of it halves it (interactive traffic after a
# bulk transfer is back to 1 KiB in 8 reads), so a busy stream keeps its size and allocates only when it drains.
_NO_BUFFER = bytearray()
_NO_VIEW = memoryview(_NO_BUFFER)
# Largest-size read buffers given back by drained sockets, taken by the next socket that needs one: a bulk stream
# whose reads do not fill 256 KiB gives its buffer back after each read, and a fresh one cost a 256 KiB malloc and
# memset per read (1.5 % of the sending ztunnel's samples). At most 4 per process (1 MiB), never a buffer a transport
# may still hold a view of (pin() drops those without recycling); idle tunnels still hold none.
_SPARES: list[bytearray] = []
_SPARES_KEPT = 4
_LINGER_RST = struct.pack("ii", 1, 0)
# Plaintext socket write buffer limits: enough to keep a fast socket busy, small enough to bound memory.
PLAIN_HIGH_WATER = 512 * 1024
PLAIN_LOW_WATER = 128 * 1024


class PlainPeer(Protocol):
    """The other end of a plaintext socket's relay: an HBONE stream or another plaintext socket."""

    def send_from_plain(self, plain: PlainConnection, offset: int, length: int) -> int: ...
    def plain_eof(self, plain: PlainConnection) -> None: ...
    def plain_lost(self, plain: PlainConnection, exc: Exception | None) -> None: ...
    def plain_write_paused(self, plain: PlainConnection, paused: bool) -> None: ...


class PlainConnection(asyncio.BufferedProtocol):
    """One plaintext TCP socket in a relay. Bytes read before a peer is attached are kept (bounded) until it is."""

    # One per tunnel and side, held as long as the tunnel: slots instead of a per-instance dict.
    __slots__ = (
        "_on_made",
        "_pause_reasons",
        "backlog",
        "buf",
        "bytes_read",
        "bytes_written",
        "close_error",
        "closed",
        "end",
        "eof_received_",
        "eof_written",
        "on_lost",
        "peer",
        "reading_paused",
        "size",
        "start",
        "transport",
        "view",
        "write_paused",
    )

    def __init__(self, on_made: Callable[[PlainConnection], None] | None = None) -> None:
        self.peer: PlainPeer | None = None
        self.transport: asyncio.Transport | None = None
        self._on_made = on_made
        self.size = _INITIAL_BUFFER  # payload capacity of the next buffer
        self.buf = _NO_BUFFER
        self.view = _NO_VIEW
        self.start = HDR  # first byte read but not yet passed on
        self.end = HDR  # end of bytes read
        self.bytes_read = 0
        self.bytes_written = 0
        self.backlog = False  # the last write left bytes in the transport (a view, or more): see write()
        self.reading_paused = False
        self._pause_reasons = 0
        self.eof_received_ = False
        self.eof_written = False
        self.write_paused = False
        self.closed = False
        self.close_error: Exception | None = None
        self.on_lost: Callable[[], None] | None = None  # called once, when the socket is gone (metrics)

    # -- asyncio -----------------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it (said to mypy without a call:
        # typing.cast is a Python function, one call per connection and side).
        self.transport = transport  # type: ignore[assignment]
        transport.set_write_buffer_limits(high=PLAIN_HIGH_WATER, low=PLAIN_LOW_WATER)  # type: ignore[attr-defined]
        if self._on_made is not None:
            self._on_made(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        view = self.view
        if not view:
            size = HDR + self.size
            self.buf = _SPARES.pop() if _SPARES and size == HDR + _MAX_BUFFER else bytearray(size)
            view = self.view = memoryview(self.buf)
        return view[self.end :]

    def buffer_updated(self, nbytes: int) -> None:
        self.bytes_read += nbytes
        self.end += nbytes
        if self.peer is None:
            if self.end == len(self.buf):
                # Nowhere to send yet (the tunnel is being set up) and the buffer is full: stop reading until then.
                self._pause(1)
            return
        filled = self.end == len(self.buf)
        self.push()
        if self.start == self.end and self.view:  # drained, and not pinned (pin() already let go of it)
            if filled:
                if self.size < _MAX_BUFFER:
                    self.size = min(_MAX_BUFFER, self.size * 2)
                    self._release()
            else:
                if nbytes < self.size // 8 and self.size > _INITIAL_BUFFER:
                    self.size //= 2
                self._release()

    def _release(self, recycle: bool = True) -> None:
        buf = self.buf
        if recycle and len(buf) == HDR + _MAX_BUFFER and len(_SPARES) < _SPARES_KEPT:
            # Not pinned: every byte was passed on and no transport kept a view (the same invariant that lets a
            # socket read into its own buffer again), so the next reader may overwrite it.
            _SPARES.append(buf)
        self.buf = _NO_BUFFER
        self.view = _NO_VIEW
        self.start = self.end = HDR

    def preload(self, data: bytes) -> None:
        """Bytes read by someone else before this protocol took the socket (SOCKS5 pipelining): relayed first."""
        self.buf = bytearray(HDR + max(self.size, len(data)))
        self.view = memoryview(self.buf)
        self.buf[HDR : HDR + len(data)] = data
        self.end = HDR + len(data)

    def push(self) -> None:
        """Offer buffered bytes to the peer; what it cannot take now stays, and reading pauses until it can."""
        peer = self.peer
        if peer is None or self.start == self.end:
            return
        buf = self.buf
        n = peer.send_from_plain(self, self.start, self.end - self.start)
        if self.buf is buf:
            self.start += n
        # else the peer pinned the buffer (its transport kept a view of what it took): pin() started a fresh, empty
        # one, so everything offered is gone and start == end already.
        if self.start == self.end:
            self.start = self.end = HDR
            if self._pause_reasons or self.reading_paused:  # the usual chunk was never paused: no call
                self._resume(1)
            if self.eof_received_:
                peer.plain_eof(self)
        else:
            self._pause(1)

    def eof_received(self) -> bool:
        self.eof_received_ = True
        if self.peer is not None and self.start == self.end:
            self.peer.plain_eof(self)
        if self.eof_written and self.transport is not None:
            self.transport.close()  # both directions are finished
        return True  # otherwise keep the write side open: half-close

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.close_error = exc
        if self.on_lost is not None:
            self.on_lost()
        peer = self.peer
        if peer is not None:
            # Let go of the peer: a PlainRelay holds both its connections, so a kept reference would be a cycle
            # freed only by the cyclic collector (nothing reaches the peer through a closed connection).
            self.peer = None
            peer.plain_lost(self, exc)

    def pause_writing(self) -> None:
        self.write_paused = True
        if self.peer is not None:
            self.peer.plain_write_paused(self, True)

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.peer is not None:
            self.peer.plain_write_paused(self, False)

    # -- control -----------------------------------------------------------------------------------------------

    def attach(self, peer: PlainPeer) -> None:
        """Connect the relay; bytes already read are passed on now."""
        self.peer = peer
        if self.start != self.end:
            self.push()
        elif self.eof_received_:
            peer.plain_eof(self)
        if self.start == self.end and self.view:
            # Drained (the SOCKS5 request's pipelined first bytes, bytes read before the tunnel was up): an idle
            # tunnel holds no buffer (the 1 KiB one preloaded for the pipelined byte was ~9 % of a tunnel's heap).
            self._release()
        self._resume(1)

    def pin(self) -> None:
        """The transport of the other side kept a view into our buffer: continue reading into a fresh one.

        Only for a peer that took everything it was offered (``send_from_plain`` returned the whole length)."""
        self._release(recycle=False)  # the next read allocates a fresh one; this one is the transport's now

    def pause_reading(self, reason: int = 2) -> None:
        self._pause(reason)

    def resume_reading(self, reason: int = 2) -> None:
        self._resume(reason)

    def _pause(self, reason: int) -> None:
        # Several reasons can pause reading at once (own buffer full = 1, peer backpressure = 2); read resumes when
        # none is left.
        self._pause_reasons |= reason
        if not self.reading_paused and self.transport is not None and not self.closed:
            self.reading_paused = True
            self.transport.pause_reading()

    def _resume(self, reason: int) -> None:
        self._pause_reasons &= ~reason
        if self.reading_paused and not self._pause_reasons and self.transport is not None and not self.closed:
            self.reading_paused = False
            self.transport.resume_reading()

    def write(self, data: memoryview) -> bool:
        """Write ``data``; True if the transport kept a reference to it (the caller must not reuse the memory).

        Behind a backlog (an earlier write kept its view and the transport has not drained), ``data`` is written as
        a copy and False returned: uvloop keeps the view of every write it cannot finish, and each view keeps the
        caller's whole read buffer (>= 256 KiB) alive, so a peer alternating 1 byte for a stalled socket with a full
        read for another stream pinned a buffer per byte (200 bytes held 50 MiB, the socket far below its
        high-water mark, so no window was held). The copies are bounded by flow control (past the high-water mark
        the socket pauses and the caller stops releasing window); the backlog pins one buffer, its first partial
        write's."""
        transport = self.transport
        if transport is None or self.closed or self.eof_written:
            return False
        # The usual path (nothing buffered the last time: the flag) adds no call; a backlog is checked only after a
        # write that left one.
        if self.backlog and transport.get_write_buffer_size():
            transport.write(bytes(data))
            self.bytes_written += len(data)
            return False
        transport.write(data)
        self.bytes_written += len(data)
        self.backlog = kept = transport.get_write_buffer_size() > 0
        return kept

    def writelines(self, views: list[memoryview], nbytes: int) -> bool:
        """Write ``views`` (``nbytes`` in all, which the caller has summed already) in order with one transport call
        (uvloop: one ``writev``); True as :meth:`write` (behind a backlog: one copy of them all, False)."""
        transport = self.transport
        if transport is None or self.closed or self.eof_written:
            return False
        if self.backlog and transport.get_write_buffer_size():
            transport.write(b"".join(views))
            self.bytes_written += nbytes
            return False
        transport.writelines(views)
        self.bytes_written += nbytes
        self.backlog = kept = transport.get_write_buffer_size() > 0
        return kept

    def write_eof(self) -> None:
        """FIN after everything written so far (the transport flushes first)."""
        if self.eof_written or self.closed or self.transport is None:
            return
        self.eof_written = True
        if self.transport.can_write_eof():
            self.transport.write_eof()
        if self.eof_received_:
            self.transport.close()

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.close()

    def reset(self) -> None:
        """Close with a TCP RST (SO_LINGER 0), so the peer sees a reset rather than a clean FIN."""
        transport = self.transport
        if transport is None or self.closed:
            return
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RST)
        transport.abort()


class PlainRelay:
    """Two plaintext sockets relayed to each other (TCP passthrough, inbound plaintext)."""

    def __init__(self, a: PlainConnection, b: PlainConnection, on_done: Callable[[PlainRelay], None] | None = None):
        self.a = a
        self.b = b
        self._when_done = on_done
        self.done = False
        self.error: str | None = None

    def start(self) -> None:
        self.a.attach(self)
        self.b.attach(self)

    def _other(self, plain: PlainConnection) -> PlainConnection:
        return self.b if plain is self.a else self.a

    def send_from_plain(self, plain: PlainConnection, offset: int, length: int) -> int:
        other = self._other(plain)
        if other.closed or other.eof_written:
            return length  # nowhere to go: drop, as the socket is closing
        if other.write(plain.view[offset : offset + length]):
            plain.pin()  # the other transport kept the view
        if other.write_paused:
            plain.pause_reading()
        return length

    def plain_eof(self, plain: PlainConnection) -> None:
        self._other(plain).write_eof()
        self._maybe_done()

    def plain_write_paused(self, plain: PlainConnection, paused: bool) -> None:
        other = self._other(plain)
        if paused:
            other.pause_reading()
        else:
            other.resume_reading()

    def plain_lost(self, plain: PlainConnection, exc: Exception | None) -> None:
        other = self._other(plain)
        if exc is not None:
            self.error = f"connection reset: {exc}"
            other.reset()
        elif not other.eof_written:
            other.write_eof()
        if other.closed or exc is not None:
            self._finish()

    def reset(self) -> None:
        """Abort both sides with a TCP reset (policy change, forced drain)."""
        self.a.reset()
        self.b.reset()
        self._finish()

    def _maybe_done(self) -> None:
        if self.a.eof_written and self.b.eof_written:
            self._finish()

    def _finish(self) -> None:
        if not self.done:
            self.done = True
            when_done = self._when_done
            if when_done is not None:
                # Dropped once called: it closes over the connection's record, whose closer holds this relay (a
                # reference cycle only the cyclic collector would free).
                self._when_done = None
                when_done(self)
