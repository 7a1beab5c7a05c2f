"""One HBONE stream relayed to one plaintext socket: the stream object :class:`HboneTransport` hands out.

A tunnel in either role: the client's (outbound, from :meth:`HboneTransport.open_stream`) or the server's (inbound,
one per CONNECT the transport receives). The stream talks only to its connection, as httpcore's HTTP/2 stream does:
each operation makes the core call and the flush together, so no caller touches the HTTP/2 core or flushes by hand:

* :meth:`HboneStream.send_from_plain` (the relay's ``send``): DATA framed in place in the plaintext socket's read
  buffer (the 9 bytes kept free before each payload take the frame header) and written to TLS in one call;
* :meth:`HboneStream.end`: END_STREAM, our half-close;
* :meth:`HboneStream.reset`: RST_STREAM, and a TCP reset to the plaintext side;
* :meth:`HboneStream.release`: flow-control window given back to the peer once the plaintext side caught up;
  :meth:`HboneStream.give_back` for bytes a finished stream still held (the connection's window must not shrink).

The connection's events arrive as the ``on_*`` callbacks; the plaintext socket's as the ``plain_*`` ones
(:class:`~ztunnel.proxy.relay.PlainPeer`). The completion callback is passed to :meth:`HboneStream.attach`.

Relay semantics (upstream ``copy.rs`` and ``h2.rs``):

* Backpressure: when the HBONE send window is closed, or the TLS connection's socket buffer is above its high-water
  mark, the plaintext socket stops being read; when the plaintext socket's write buffer fills, the stream stops
  releasing flow-control window (the stream's and the connection's), so the peer stops at the 4 MiB stream window,
  and all the streams of a connection at its 16 MiB window. Memory per tunnel and per connection is bounded.
* Half-close is carried end to end: FIN -> END_STREAM -> FIN, in each direction independently. A TCP reset becomes
  RST_STREAM(CONNECT_ERROR) and an RST_STREAM other than NO_ERROR/CANCEL becomes a TCP reset (RFC 9113 §8.5);
  upstream reads NO_ERROR and CANCEL as EOF.
* Byte counts are plain ints on the stream; metrics read them at close (no per-chunk label lookups or logging).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

from ztunnel.proxy.hbone.core import FRAME_HEADER_SIZE, DataReceived, ErrorCode, HboneConnection
from ztunnel.proxy.hbone.reason import CloseReason
from ztunnel.proxy.relay import HDR, PlainConnection

# The relay keeps HDR bytes free before every payload it reads; a DATA frame header must fit there.
assert HDR >= FRAME_HEADER_SIZE


class StreamConnection(Protocol):
    """What a stream needs of its connection (:class:`~ztunnel.proxy.hbone.connection.HboneTransport`)."""

    core: HboneConnection
    closed: bool
    write_paused: bool

    def write_frame(self, frame: memoryview) -> None: ...
    def flush_frames(self) -> None: ...
    def flush(self) -> None: ...
    def detach(self, stream_id: int) -> None: ...


class HboneStream:
    """A tunnel: one HBONE stream relayed to one plaintext socket. Client (outbound) or server (inbound) role.

    Made by the connection, never directly: ``response`` is the client's future of the CONNECT's answer
    (``(status, headers)``, or ConnectionResetError), ``setup`` the server's task that authorizes and connects the
    stream (cancelled if the peer resets it, or the connection is lost, first).
    """

    # One per tunnel, held as long as the tunnel: slots instead of a per-instance dict.
    __slots__ = (
        "_core",
        "_early",
        "_held",
        "_on_done",
        "bytes_from_plain",
        "bytes_to_plain",
        "conn",
        "done",
        "error",
        "local_ended",
        "lost",
        "plain",
        "remote_ended",
        "reset_code",
        "response",
        "setup",
        "stream_id",
    )

    def __init__(
        self,
        conn: StreamConnection,
        stream_id: int,
        response: asyncio.Future[tuple[int, dict[str, str]]] | None = None,
    ) -> None:
        self.conn = conn
        self._core = conn.core
        self.stream_id = stream_id
        self.plain: PlainConnection | None = None
        self._on_done: Callable[[HboneStream], None] | None = None
        self.response = response
        self.remote_ended = False  # END_STREAM received (and passed on as FIN)
        self.local_ended = False  # END_STREAM sent
        self.reset_code: int | None = None
        self.lost: CloseReason | None = None  # why the connection went away under the stream, if it did
        self.error: str | None = None
        self.done = False
        self.bytes_to_plain = 0
        self.bytes_from_plain = 0
        self._held = 0  # received while the plaintext socket could not take more: window not yet released
        self._early: list[bytes] | None = None  # data that arrived before a plaintext socket was attached (rare)
        # Server role: the task authorizing and connecting this stream. A peer that resets the stream first (or
        # loses the connection) cancels it, so a rapid-reset loop costs no backend connections.
        self.setup: asyncio.Task[None] | None = None

    # -- setup -------------------------------------------------------------------------------------------------

    def attach(self, plain: PlainConnection, on_done: Callable[[HboneStream], None] | None = None) -> None:
        """Start relaying to ``plain``; ``on_done(stream)`` runs once when the tunnel is finished (both directions
        closed, or reset, or the connection lost)."""
        self._on_done = on_done
        self.plain = plain
        if self._early is not None:
            for chunk in self._early:
                # Straight to the socket (self.plain is set); their window is already in _held (flow 0 here, or it
                # would be released twice: the connection's window past what was advertised).
                self.on_data(memoryview(chunk), 0)
            self._early = None
        if self.remote_ended:
            plain.write_eof()
        if self.conn.write_paused:
            plain.pause_reading()
        plain.attach(self)
        if self.remote_ended and self.local_ended:  # both ended before the attach (rare): finish now
            self._maybe_done()

    # -- for the connection record: bound methods, not per-tunnel closures (~150 B less each, 6 per tunnel) -----

    def count_from_plain(self) -> int:
        """Bytes read from the plaintext socket and sent on the stream so far."""
        return self.bytes_from_plain

    def count_to_plain(self) -> int:
        """Bytes received on the stream and written to the plaintext socket so far."""
        return self.bytes_to_plain

    def cancel(self, reason: str) -> None:
        """A ``closer``: reset with CANCEL (a policy change or a drain ended the tunnel; ``reason`` is logged by
        the connection manager)."""
        self.reset(ErrorCode.CANCEL)

    def abort(self, reason: str) -> None:
        """A ``closer``: reset with CONNECT_ERROR."""
        self.reset()

    # -- operations: the core call and the flush together -------------------------------------------------------

    def end(self) -> None:
        """Half-close our side: END_STREAM (upstream's write shutdown)."""
        if not self.local_ended:
            self.local_ended = True
            self._core.end_stream(self.stream_id)
            self.conn.flush()

    def reset(self, code: ErrorCode = ErrorCode.CONNECT_ERROR) -> None:
        """Abort the tunnel: RST_STREAM to the peer and a TCP reset to the plaintext side."""
        if self.done:
            return
        self._send_reset(code)
        if self.plain is not None:
            self.plain.reset()
        self._finish()

    def release(self, nbytes: int) -> None:
        """The plaintext side took ``nbytes`` more: give the peer that much window now, not at the next batch."""
        core = self._core
        core.ack_data(self.stream_id, nbytes)
        core.flush_acks(self.stream_id)
        self.conn.flush()

    def _send_reset(self, code: ErrorCode) -> None:
        self._core.reset_stream(self.stream_id, code)
        self.conn.flush()

    # -- HBONE -> plaintext ------------------------------------------------------------------------------------

    def on_response(self, status: int, headers: dict[str, str]) -> None:
        if self.response is not None and not self.response.done():
            self.response.set_result((status, headers))

    def on_data(self, data: memoryview, flow_controlled_length: int) -> None:
        plain = self.plain
        if plain is None:
            # Rare: bytes before the 200 was handled; bounded by the window.
            if self._early is None:
                self._early = []
            self._early.append(bytes(data))
            self._held += flow_controlled_length
            return
        # Runs once per chunk received: the write, pin and window release inline (no helper call per chunk).
        self.bytes_to_plain += len(data)
        if plain.write(data):
            self._core.pin()
        if plain.write_paused:
            self._held += flow_controlled_length
        else:
            self._core.ack_data(self.stream_id, flow_controlled_length + self._held)
            self._held = 0

    def on_data_run(self, run: list[DataReceived]) -> None:
        """Consecutive DATA of this stream from one read (wire order): one write to the plaintext side."""
        plain = self.plain
        if plain is None:
            for ev in run:
                self.on_data(ev.data, ev.flow_controlled_length)
            return
        views = [ev.data for ev in run]
        flow = nbytes = 0
        for ev in run:
            flow += ev.flow_controlled_length
            nbytes += len(ev.data)
        self.bytes_to_plain += nbytes
        if plain.writelines(views, nbytes):
            self._core.pin()
        if plain.write_paused:
            self._held += flow
        else:
            self._core.ack_data(self.stream_id, flow + self._held)
            self._held = 0

    def plain_write_paused(self, plain: PlainConnection, paused: bool) -> None:
        if not paused and self._held:
            held, self._held = self._held, 0
            self.release(held)

    def on_end(self) -> None:
        self.remote_ended = True
        plain = self.plain
        if plain is not None:
            plain.write_eof()
        if self.local_ended:  # checked here, not in a call per half-close: the stream finishes with this one
            self._maybe_done()

    def on_reset(self, error_code: int, by_peer: bool = True) -> None:
        self.reset_code = error_code
        if not by_peer:
            # Our RST_STREAM for a stream error of the peer's: the log says who broke what.
            self.error = f"stream reset by us: the peer broke HTTP/2 on it ({_error_name(error_code)})"
            if self.plain is not None:
                self.plain.reset()
        elif error_code in (ErrorCode.NO_ERROR, ErrorCode.CANCEL):
            # Upstream reads these as EOF; the stream is gone, so our side is finished too.
            self.remote_ended = True
            self.local_ended = True
            if self.plain is not None:
                self.plain.write_eof()
                if self.plain.eof_received_:
                    self.plain.close()
        else:
            self.error = f"stream reset by peer (HTTP/2 error {error_code})"
            if self.plain is not None:
                self.plain.reset()
        if self.response is not None and not self.response.done():
            self.response.set_exception(ConnectionResetError(f"stream reset before response (code {error_code})"))
        self._finish()

    def on_window(self) -> None:
        if self.plain is not None and self.plain.start != self.plain.end:
            self.plain.push()

    def on_write_paused(self, paused: bool) -> None:
        if self.plain is not None:
            if paused:
                self.plain.pause_reading()
            else:
                self.plain.resume_reading()

    def on_connection_lost(self, reason: CloseReason) -> None:
        if self.done:
            return
        self.lost = reason
        self.error = f"HBONE connection lost: {reason}"
        if self.response is not None and not self.response.done():
            self.response.set_exception(ConnectionResetError(self.error))
        if self.plain is not None:
            self.plain.reset()
        self._finish()

    # -- plaintext -> HBONE ------------------------------------------------------------------------------------

    def send_from_plain(self, plain: PlainConnection, offset: int, length: int) -> int:
        """Send ``plain``'s bytes ``[offset, offset+length)``: as many DATA frames as the windows allow, each framed
        in place and written with the control frames queued before it, then flushed once. Returns the bytes taken."""
        core = self._core
        conn = self.conn
        if conn.closed:
            return 0
        sent = 0
        view = plain.view
        while sent < length:
            # Each DATA header goes in the 9 bytes before its payload: bytes already encrypted, so free to reuse.
            n = core.frame_data(self.stream_id, plain.buf, offset + sent, length - sent)
            if n == 0:
                break
            start = offset + sent - FRAME_HEADER_SIZE
            conn.write_frame(view[start : offset + sent + n])
            sent += n
        if sent:
            # Every frame of this read in one transport write (at the end of a dispatch, if in one).
            conn.flush_frames()
        self.bytes_from_plain += sent
        return sent

    def plain_eof(self, plain: PlainConnection) -> None:
        # end(), inline: the plaintext side's FIN is END_STREAM once per stream.
        if not self.local_ended:
            self.local_ended = True
            self._core.end_stream(self.stream_id)
            self.conn.flush()
        if self.remote_ended:
            self._maybe_done()

    def plain_lost(self, plain: PlainConnection, exc: Exception | None) -> None:
        if self.done:
            return
        if exc is not None:
            # The app's connection broke (reset): carry it as a reset, as RFC 9113 §8.5 asks of a CONNECT proxy.
            self.error = f"connection reset: {exc}"
            self._send_reset(ErrorCode.CONNECT_ERROR)
            self._finish()
            return
        self.end()
        if not self.remote_ended:
            # The socket is fully closed, so nothing more can be delivered: stop the stream.
            self._send_reset(ErrorCode.CANCEL)
        self._finish()

    # -- lifecycle ---------------------------------------------------------------------------------------------

    def _maybe_done(self) -> None:
        plain = self.plain
        if self.remote_ended and self.local_ended and plain is not None and plain.eof_written:
            plain.close()
            # Finished both ways: the socket's connection_lost need not call back (plain_lost would return at once;
            # a call per stream saved).
            plain.peer = None
            self._finish()

    def give_back(self) -> None:
        """The stream is dropped with bytes whose window it had not released (its socket was paused, or it never
        got one): release them now. The stream's own window no longer matters; the connection's does, or every
        stream that ends this way would shrink it for good (upstream's h2 crate releases a dropped stream's
        buffered bytes to the connection the same way)."""
        held = self._held
        if held:
            self._held = 0
            self._early = None
            self._core.ack_data(self.stream_id, held)
            self.conn.flush()

    def _finish(self) -> None:
        if self.done:
            return
        self.done = True
        if self._held:
            self.give_back()
        if self.setup is not None and self.plain is None:
            self.setup.cancel()
        on_done = self._on_done
        if on_done is not None:
            # Dropped once called: the record it closes over holds this stream's bound methods (its byte counters,
            # its closer), a reference cycle that only the cyclic collector would free.
            self._on_done = None
            on_done(self)
        self.conn.detach(self.stream_id)


def _error_name(code: int) -> str:
    try:
        return ErrorCode(code).name
    except ValueError:
        return f"HTTP/2 error {code}"
