"""The I/O adapter for one HBONE connection: TCP + TLS (memory BIO) + :class:`HboneConnection`.

One ``asyncio.BufferedProtocol`` does the TLS itself over ``ssl.MemoryBIO`` rather than using the loop's TLS
transport, so that (a) decrypted bytes land directly in the HTTP/2 receive buffer (``SSLObject.read`` into it), and
(b) a DATA frame built in place in a relay buffer is encrypted by one ``SSLObject.write`` with no copy. Writes made
while events are being dispatched are flushed once at the end, so a read that produces many small frames costs one
``transport.write``.

After a TLS 1.3 handshake, the records are protected by :class:`~ztunnel.proxy.hbone.records.TlsRecords` (the same
read/write/pending, over buffers of its own in place of the BIOs) with the traffic secrets OpenSSL reported, unless
``ZTUNNEL_OPENSSL_RECORD_LAYER`` keeps OpenSSL's (see that module for why).

Backpressure: when the TCP transport's buffer passes its high-water mark (1 MiB), every stream is told to stop
reading its plaintext side; they resume when it drains below 256 KiB. Receive-side backpressure is HTTP/2 flow
control (see ``core``).

Keepalive as upstream: a PING every 10 s; no answer within 20 s closes the connection.

Streams: the transport hands out :class:`~ztunnel.proxy.hbone.stream.HboneStream` objects (``open_stream`` for a
client, one per CONNECT received for a server, answered with ``respond`` or ``reject``) and dispatches each event to
its stream; nothing outside this package touches the HTTP/2 core, the stream table or the flush. Why a connection
closed is a :class:`~ztunnel.proxy.hbone.reason.CloseReason`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import ssl
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol, cast

from ztunnel.config import Config
from ztunnel.identity.spiffe import Identity
from ztunnel.net import format_addr
from ztunnel.proxy.hbone.core import (
    CLIENT_SETTINGS,
    DRAIN_PING,
    SERVER_SETTINGS,
    ConnectRequested,
    ConnectResponded,
    DataReceived,
    ErrorCode,
    Event,
    GoAwayReceived,
    HboneConnection,
    HboneProtocolError,
    PingAcked,
    RequestRefused,
    Settings,
    StreamEnded,
    StreamLimitError,
    StreamReset,
    WindowOpened,
)
from ztunnel.proxy.hbone.reason import CloseKind, CloseReason
from ztunnel.proxy.hbone.records import SUITES, InBuffer, OutBuffer, TlsRecords
from ztunnel.proxy.hbone.stream import HboneStream
from ztunnel.tasks import running_loop
from ztunnel.tls import capture_traffic_secrets

log = logging.getLogger("ztunnel.proxy.h2")

PING_INTERVAL = 10.0
PING_TIMEOUT = 20.0
# A TLS handshake (from TCP accept or connect until it completes, both roles) not finished by then is aborted: a
# peer that connects and sends nothing, or half a ClientHello, or a server that never answers ours, must not hold a
# socket and 60-85 KiB of TLS and HTTP/2 state. Upstream sets none on 15008 (only TCP keepalive, 180 s + 9 x 180 s,
# would ever end such a connection); 10 s is the default of the tls-listener crate upstream uses elsewhere.
# Read when each connection starts, so tests can shorten it.
HANDSHAKE_TIMEOUT = 10.0
# A closing connection whose peer does not read what is left to send (a GOAWAY, the last DATA) is dropped after
# this long rather than holding its socket and buffers forever.
CLOSE_TIMEOUT = 5.0
WRITE_HIGH_WATER = 1024 * 1024
WRITE_LOW_WATER = 256 * 1024
_CIPHER_BUFFER_MIN = 16 * 1024
_TLS_RECORD = 16 * 1024  # the largest TLS record's plaintext
_CIPHER_BUFFER_MAX = 256 * 1024
_DRAINED = CloseReason(CloseKind.DRAINED, "drained")


class _TlsIO(Protocol):
    """The C object under :class:`ssl.SSLObject` (``_ssl._SSLSocket``), or :class:`TlsRecords`: what the pump calls
    per chunk."""

    def read(self, size: int, buffer: memoryview, /) -> int: ...
    def write(self, data: bytes | bytearray | memoryview) -> int: ...
    def pending(self) -> int: ...


def _tls_io(sslobj: ssl.SSLObject) -> _TlsIO:
    # SSLObject.read/write/pending are Python methods that only forward to this object: called directly, each
    # chunk saves their frames (three calls on a 64 B round trip's receiving side, one on its sending side). The
    # same methods, arguments, results and exceptions; the wrapper itself if a Python ever drops the attribute.
    return cast(_TlsIO, getattr(sslobj, "_sslobj", sslobj))


def http2_settings(config: Config, *, client_side: bool) -> Settings:
    """The HTTP/2 settings of an HBONE connection in either role: upstream's per-role values (``h2/client.rs``,
    ``h2/server.rs``: header list size, the server's 200 concurrent streams) with the window and frame sizes of
    ``HTTP2_STREAM_WINDOW_SIZE``, ``HTTP2_CONNECTION_WINDOW_SIZE`` and ``HTTP2_FRAME_SIZE``."""
    return dataclasses.replace(
        CLIENT_SETTINGS if client_side else SERVER_SETTINGS,
        stream_window=config.http2_stream_window_size,
        connection_window=config.http2_connection_window_size,
        max_frame_size=config.http2_frame_size,
    )


class HboneTransport(asyncio.BufferedProtocol):
    """TLS and HTTP/2 for one HBONE connection (either role), and the streams on it (:class:`HboneStream`).

    The client opens streams with :meth:`open_stream`; a server hears of each CONNECT through
    ``on_connect_request`` with its stream made, and answers it with :meth:`respond` or :meth:`reject`.
    """

    def __init__(
        self,
        core: HboneConnection,
        ssl_context: ssl.SSLContext | None,
        *,
        on_handshake: Callable[[HboneTransport], None],
        on_connect_request: Callable[[HboneTransport, HboneStream, ConnectRequested], None] | None = None,
        on_closed: Callable[[HboneTransport], None] | None = None,
        handshake_timeout: float | None = None,
    ) -> None:
        self.core = core
        self._ssl_context = ssl_context
        self._on_handshake = on_handshake
        self._on_connect_request = on_connect_request
        self._on_closed = on_closed
        self._handshake_timeout = HANDSHAKE_TIMEOUT if handshake_timeout is None else handshake_timeout
        self.streams: dict[int, HboneStream] = {}
        self.transport: asyncio.Transport | None = None
        self.peer: tuple[str, int] | None = None
        self.local: tuple[str, int] | None = None
        self.ssl_object: ssl.SSLObject | None = None
        self._tls: _TlsIO | None = None  # ssl_object's I/O methods (_tls_io) or TlsRecords, once the handshake is done
        self._records: TlsRecords | None = None  # the record layer of our own, when it took over from OpenSSL
        self._secrets: dict[bytes, bytes] | None = {}  # TLS 1.3 traffic secrets, while the handshake runs
        self.peer_identity: Identity | None = None  # set once the peer's certificate was verified
        self.handshake_done = False
        self.closed = False
        self.draining = False  # no new streams; close once the last one finishes
        self.close_reason: CloseReason | None = None  # set when closed
        self.write_paused = False
        self.last_active = time.monotonic()
        # The handshake's; replaced by the record layer's buffers when it takes over.
        self._in_bio: ssl.MemoryBIO | InBuffer = ssl.MemoryBIO()
        self._out_bio: ssl.MemoryBIO | OutBuffer = ssl.MemoryBIO()
        # Allocated at the first read: a connection whose peer never sends anything costs no buffer.
        self._cbuf = bytearray()
        self._cview = memoryview(self._cbuf)
        self._dispatching = False
        # How sealed bytes go to the transport: write (OpenSSL's BIO gives one bytes object), or writelines (the
        # record layer's parts, one writev); set when the transport is made and when the record layer takes over.
        self._send: Callable[[Any], None]
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop  # the loop that made the connection (connection_made)
        self._ping_sent_at: float | None = None
        self._turn = 0  # rotation point of _in_turn

    # -- asyncio protocol --------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)
        transport = self.transport
        self._send = transport.write
        transport.set_write_buffer_limits(high=WRITE_HIGH_WATER, low=WRITE_LOW_WATER)
        # No TCP_NODELAY here: asyncio and uvloop set it on every TCP transport they make (accepted or connected),
        # and through the transport's socket it cost a getsockname and a setsockopt per connection.
        self.peer = transport.get_extra_info("peername")
        self.local = transport.get_extra_info("sockname")
        loop = self._loop = running_loop()
        self._timer = loop.call_later(self._handshake_timeout, self._on_handshake_timeout)
        if self._ssl_context is not None:
            self.start_tls(self._ssl_context)

    def start_tls(self, ssl_context: ssl.SSLContext) -> None:
        """Begin the handshake (a server may only know its certificate after the connection arrived)."""
        if self.closed or self.ssl_object is not None:
            return
        self.ssl_object = ssl_context.wrap_bio(
            cast(ssl.MemoryBIO, self._in_bio),  # the handshake's BIOs (the record layer replaces them after it)
            cast(ssl.MemoryBIO, self._out_bio),
            server_side=not self.core.client_side,
            server_hostname=None,
        )
        self._do_handshake()

    def get_buffer(self, sizehint: int) -> memoryview:
        if not self._cbuf:
            self._cbuf = bytearray(_CIPHER_BUFFER_MIN)
            self._cview = memoryview(self._cbuf)
        return self._cview

    def buffer_updated(self, nbytes: int) -> None:
        if self.closed:  # lingering after our close (close()): the peer's last frames are read and dropped
            return
        records = self._records
        if records is not None:
            # The record layer opens the records in place; it keeps a copy of only what a record the read cut
            # left, before the transport reads into this buffer again (InBuffer.keep, called only then).
            incoming = records.incoming
            view = self._cview[:nbytes]
            incoming.pending += nbytes
            if incoming.buf:
                incoming.buf += view  # a record already begun: continued in one buffer
            else:
                incoming.src = view
                incoming.spos = 0
            if nbytes == len(self._cbuf) and nbytes < _CIPHER_BUFFER_MAX:
                self._cbuf = bytearray(nbytes * 4)  # the view borrowed keeps the old one alive
                self._cview = memoryview(self._cbuf)
            try:
                self._read_tls()
            finally:
                if incoming.src is not None:
                    incoming.keep()
            return
        # A read that fills the ciphertext buffer means more is queued: grow it (16 KiB -> 256 KiB).
        if nbytes == len(self._cbuf) and nbytes < _CIPHER_BUFFER_MAX:
            self._in_bio.write(self._cview[:nbytes])
            self._cbuf = bytearray(nbytes * 4)
            self._cview = memoryview(self._cbuf)
        else:
            self._in_bio.write(self._cview[:nbytes])
        if not self.handshake_done:
            if self.ssl_object is not None:
                self._do_handshake()  # reads any application data that came with the last handshake flight
            return
        self._read_tls()

    def eof_received(self) -> bool:
        self._lost(CloseReason(CloseKind.PEER_CLOSED, "peer closed the connection"))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost(CloseReason.lost(exc))

    def pause_writing(self) -> None:
        self.write_paused = True
        for stream in list(self.streams.values()):
            stream.on_write_paused(True)

    def resume_writing(self) -> None:
        self.write_paused = False
        for stream in self._in_turn():
            stream.on_write_paused(False)

    def _in_turn(self) -> list[HboneStream]:
        """Every stream, starting one further along each call.

        Whoever is served first when the transport drains or the connection window opens takes what there is (a
        256 KiB read refills the 1 MiB write buffer in four streams; one window update is a quarter of the 16 MiB
        window): always starting with the same stream let it take 99.5% of the bytes of 8 concurrent streams
        (measured). Rotating the start shares them.
        """
        streams = list(self.streams.values())
        n = len(streams)
        if n < 2:
            return streams
        self._turn = start = (self._turn + 1) % n
        return streams[start:] + streams[:start]

    # -- TLS ---------------------------------------------------------------------------------------------------

    def _do_handshake(self) -> None:
        assert self.ssl_object is not None
        capture_traffic_secrets(self._secrets)  # OpenSSL reports them inside do_handshake (contexts that do)
        try:
            self.ssl_object.do_handshake()
        except ssl.SSLWantReadError:
            self._flush_tls()
            return
        except (ssl.SSLError, OSError) as e:
            self._flush_tls()  # send the alert, if any
            # CRL_PATH: OpenSSL refused the peer chain as revoked (X509_V_ERR_CERT_REVOKED, 23): the CRL metric.
            revoked = isinstance(e, ssl.SSLCertVerificationError) and e.verify_code == 23
            message = f"TLS handshake failed: {_ssl_reason(e)}"
            self.abort(CloseReason(CloseKind.TLS_HANDSHAKE_FAILED, message, revoked=revoked))
            return
        finally:
            capture_traffic_secrets(None)
        self.handshake_done = True
        self._cancel_timer()
        self._flush_tls()  # OpenSSL's last flight, before the record layer may replace its buffers
        self._tls = self._take_over_records() or _tls_io(self.ssl_object)
        self._on_handshake(self)  # verifies the peer; may abort
        if self.closed:
            return
        self.core.initiate()
        self.flush()
        self._schedule_ping()
        if self._in_bio.pending:
            self._read_tls()

    def _take_over_records(self) -> TlsRecords | None:
        """The record layer of our own for this connection, in place of OpenSSL's: for TLS 1.3 with one of the
        suites it knows, when the context reported the traffic secrets (none: OpenSSL's records)."""
        secrets, self._secrets = self._secrets, None
        sslobj = self.ssl_object
        assert sslobj is not None
        if not secrets or sslobj.version() != "TLSv1.3":
            return None
        if not self.core.client_side and sslobj.context.num_tickets:
            # A server sending tickets sealed them under its first write key inside the handshake: the sequence
            # number would not start at 0 (ztunnel's server contexts send none: tls.server_context).
            return None
        suite = sslobj.cipher()
        client = secrets.get(b"CLIENT_TRAFFIC_SECRET_0")
        server = secrets.get(b"SERVER_TRAFFIC_SECRET_0")
        if suite is None or suite[0] not in SUITES or client is None or server is None or sslobj.pending():
            return None
        client_side = self.core.client_side
        records = TlsRecords(
            suite[0], server if client_side else client, client if client_side else server, client_side=client_side
        )
        # Whatever came after the handshake's last record (the peer's first application records) is still in the
        # BIO: OpenSSL reads a record at a time and stopped at the end of the handshake.
        rest = cast(ssl.MemoryBIO, self._in_bio).read()
        if rest:
            records.incoming.write(rest)
        self._in_bio = records.incoming
        self._out_bio = records.outgoing
        self._records = records
        if self.transport is not None:
            self._send = self.transport.writelines
        return records

    def _on_handshake_timeout(self) -> None:
        if not self.handshake_done:
            message = f"TLS handshake timed out after {self._handshake_timeout:g}s"
            self.abort(CloseReason(CloseKind.TLS_HANDSHAKE_TIMEOUT, message, timed_out=True))

    def _read_tls(self) -> None:
        sslobj = self._tls
        assert sslobj is not None
        core = self.core
        in_bio = self._in_bio
        records = self._records is not None
        self._dispatching = True
        # Room for every record this read brought, so they are decrypted into one buffer and parsed once: a 256 KiB
        # socket read is one DATA event and one write to the app, not one per 16 KiB record (70 app writes per MiB
        # before, measured). Plaintext is smaller than its ciphertext, but in a bulk transfer OpenSSL already holds
        # the start of a record the previous read cut (up to 16 KiB, out of the BIO): room for it too, or the buffer
        # fills and a second, smaller one follows.
        hint = in_bio.pending
        if hint > _TLS_RECORD:
            hint += _TLS_RECORD
        try:
            while not self.closed:
                dst = core.get_buffer(hint)
                got = 0
                size = len(dst)
                try:
                    # Drain as many TLS records as fit, then parse once: the per-call cost is paid per read.
                    while got < size:
                        n = sslobj.read(size - got, dst[got:])  # with a buffer: a count
                        if n == 0:
                            break
                        got += n
                        if not in_bio.pending and (records or not sslobj.pending()):
                            # Nothing left to decrypt: asking again would only raise SSLWantReadError (~1.2 us against
                            # ~80 ns for the two checks); a request/response exchange has two such reads per round trip.
                            # (The record layer holds plaintext only when the buffer filled, which ends this loop.)
                            break
                except ssl.SSLWantReadError:
                    pass
                except ssl.SSLZeroReturnError:
                    if got:
                        self._dispatch(core.buffer_updated(got))
                    self.abort(CloseReason(CloseKind.TLS_CLOSE_NOTIFY, "peer sent TLS close_notify"))
                    return
                except ssl.SSLError as e:
                    self.abort(CloseReason(CloseKind.TLS_ERROR, f"TLS error: {_ssl_reason(e)}"))
                    return
                if not got:
                    break
                events = core.buffer_updated(got)
                if (
                    len(events) == 1
                    and type(ev := events[0]) is DataReceived
                    and (h := self.streams.get(ev.stream_id)) is not None
                ):
                    # One chunk of one stream, the usual read of interactive traffic: to its stream without
                    # _dispatch's frame (one Python call less per chunk).
                    h.on_data(ev.data, ev.flow_controlled_length)
                else:
                    self._dispatch(events)
                if got < size:
                    break
                hint = size  # it filled: as much again (never a smaller buffer in the middle of a read)
        except HboneProtocolError as e:
            # The core queued a GOAWAY with the error code: send it, then close politely so it is read.
            self._dispatching = False
            log.warning("closing HTTP/2 connection from %s: %s", _format_peer(self.peer), e)
            self.flush()
            self.close(CloseReason(CloseKind.PROTOCOL_ERROR, f"HTTP/2 protocol error: {e}"))
            return
        finally:
            self._dispatching = False
        # No last_active stamp per read: the pool evicts only connections without streams, idle since detach()
        # stamped the last one's end (so the PINGs both sides send every 10 s never keep one pooled).
        if not self.closed and (core.out or self._out_bio.pending):  # usually neither after a chunk: no flush call
            self.flush()

    def _flush_tls(self) -> None:
        data = self._out_bio.read()
        if data and self.transport is not None and not self.transport.is_closing():
            self._send(data)

    # -- events ------------------------------------------------------------------------------------------------

    def _dispatch(self, events: list[Event]) -> None:
        streams = self.streams
        i, count = 0, len(events)
        while i < count:
            ev = events[i]
            i += 1
            if type(ev) is DataReceived:
                h = streams.get(ev.stream_id)
                if h is None:
                    self.core.ack_data(ev.stream_id, ev.flow_controlled_length)
                elif i < count and type(nxt := events[i]) is DataReceived and nxt.stream_id == ev.stream_id:
                    # Several DATA frames of one stream in this read (a peer sending 16 KiB frames, as Envoy does,
                    # puts 16 in a 256 KiB read): one write of them all to the app (a writev), not one each.
                    run = [ev]
                    while i < count and type(nxt := events[i]) is DataReceived and nxt.stream_id == ev.stream_id:
                        run.append(nxt)
                        i += 1
                    h.on_data_run(run)
                else:
                    h.on_data(ev.data, ev.flow_controlled_length)
            elif type(ev) is WindowOpened:
                if ev.stream_id:
                    h = streams.get(ev.stream_id)
                    if h is not None:
                        h.on_window()
                else:
                    for h in self._in_turn():
                        h.on_window()
            elif type(ev) is ConnectRequested:
                if self.closed:
                    # An earlier event of this read closed the connection (GOAWAY, its last stream detached): a
                    # request after it would start inbound set-up, and a backend connect, on a dead connection.
                    continue
                if self._on_connect_request is not None:
                    stream = HboneStream(self, ev.stream_id)
                    streams[ev.stream_id] = stream
                    self._on_connect_request(self, stream, ev)
                else:
                    self.core.reset_stream(ev.stream_id, ErrorCode.REFUSED_STREAM)
            elif type(ev) is ConnectResponded:
                h = streams.get(ev.stream_id)
                if h is not None:
                    h.on_response(ev.status, ev.headers)
            elif type(ev) is StreamEnded:
                h = streams.get(ev.stream_id)
                if h is not None:
                    h.on_end()
            elif type(ev) is StreamReset:
                h = streams.pop(ev.stream_id, None)
                if h is not None:
                    h.on_reset(ev.error_code, ev.by_peer)
            elif type(ev) is PingAcked:
                self._ping_sent_at = None
                if ev.data == DRAIN_PING and self.core.goaway_sent is not None:  # the final GOAWAY just went out
                    self.draining = True
                    if not streams:
                        self.close(_DRAINED)
            elif type(ev) is GoAwayReceived:
                log.debug("GOAWAY from %s: code %d, last stream %d", self.peer, ev.error_code, ev.last_stream_id)
                # last_stream_id counts streams *we* opened (odd ids for a client, even for a server): ours above
                # it were never processed by the peer; the peer's own streams are unaffected and may finish.
                parity = 1 if self.core.client_side else 0
                for sid in [s for s in streams if s % 2 == parity and s > ev.last_stream_id]:
                    streams.pop(sid).on_reset(ErrorCode.REFUSED_STREAM)
                if not streams:
                    self.close(CloseReason(CloseKind.GOAWAY, "peer sent GOAWAY"))
            elif type(ev) is RequestRefused:
                log.warning(
                    "refused a malformed request from %s on stream %d with RST_STREAM PROTOCOL_ERROR: %s",
                    _format_peer(self.peer),
                    ev.stream_id,
                    ev.reason,
                )

    # -- writing -----------------------------------------------------------------------------------------------

    def flush(self) -> None:
        """Send whatever the HTTP/2 core has queued (now, or at the end of the current dispatch)."""
        tls = self._tls
        if self._dispatching or self.closed or tls is None:
            return
        # The core's queued frames read in place (no call, nothing allocated when, as per chunk, none is queued).
        out = self.core.out
        if out:
            tls.write(out)
            out.clear()
            self._flush_tls()
        # Also what write_frame left in the TLS buffer (DATA frames, written at the stream's flush or, inside a
        # dispatch, at its end): they must go now, not with the next control frame (on a quiet connection, the
        # PING 10 s later).
        elif self._out_bio.pending:
            self._flush_tls()

    def write_frame(self, frame: memoryview) -> None:
        """Encrypt queued control frames, then one DATA frame built in place by ``core.frame_data``; they go out
        with the next :meth:`flush_frames` (one transport write for all the frames of a read, however small the
        peer's frame size)."""
        tls = self._tls
        if self.closed or tls is None:
            return
        out = self.core.out
        if out:
            tls.write(out)
            out.clear()
        tls.write(frame)

    def flush_frames(self) -> None:
        """Send what :meth:`write_frame` encrypted (now, or at the end of the current dispatch, with whatever the
        dispatch queued). The core's queue was emptied by the last ``write_frame`` and framing DATA queues nothing, so
        unlike :meth:`flush` this does not look at it again."""
        if self._dispatching or self.closed:
            return
        # _flush_tls's body, inline: once per chunk sent.
        data = self._out_bio.read()
        if data and self.transport is not None and not self.transport.is_closing():
            self._send(data)

    def detach(self, stream_id: int) -> None:
        """The stream is finished: forget it (its further events are ignored); a draining connection may close."""
        self.streams.pop(stream_id, None)
        if not self.streams:
            self.last_active = time.monotonic()  # idle from now
        if not self.streams and (self.draining or self.core.goaway_received is not None):
            if self.draining:
                self.close(_DRAINED)
            else:
                self.close(CloseReason(CloseKind.GOAWAY, "peer sent GOAWAY and the last stream finished"))

    # -- streams -----------------------------------------------------------------------------------------------

    def open_stream(
        self, authority: str, headers: Iterable[tuple[str, str]] = (), *, method: str = "CONNECT"
    ) -> HboneStream:
        """Client: send a CONNECT to ``authority`` (``ip:port``) with ``headers``; its answer is ``stream.response``.

        ``method`` exists for conformance tests of servers (a non-CONNECT request must get a 400)."""
        stream_id = self.core.send_connect(authority, headers, method)
        stream = HboneStream(self, stream_id, self._loop.create_future())
        self.streams[stream_id] = stream
        self.last_active = time.monotonic()
        self.flush()
        return stream

    def open_stream_within(
        self, limit: int, authority: str, headers: Iterable[tuple[str, str]] = ()
    ) -> HboneStream | None:
        """Client: :meth:`open_stream`, if this connection takes new streams (not closed, draining or sent GOAWAY)
        and has fewer than ``limit`` open (or the peer's ``SETTINGS_MAX_CONCURRENT_STREAMS``, if lower); else
        ``None``. The pool's checkout: the checks and the open in one call per new connection."""
        if self.closed or self.draining or self.core.goaway_received is not None:
            return None
        streams = self.streams
        # The peer's limit is the core's (the one copy; send_connect enforces it), read here, not kept here.
        if len(streams) >= limit or len(streams) >= self.core.peer_max_streams:
            return None
        # open_stream's body (a call fewer per connection; the same CONNECT). No last_active here: the reaper
        # closes only connections without streams, and detach() stamps it when the last one finishes.
        try:
            stream_id = self.core.send_connect(authority, headers, "CONNECT")
        except StreamLimitError:  # its 2^30 stream ids used up: it takes no more, the pool dials another
            self.drain_when_idle()
            return None
        stream = HboneStream(self, stream_id, self._loop.create_future())
        streams[stream_id] = stream
        self.flush()
        return stream

    def respond(self, stream: HboneStream, status: int, headers: Iterable[tuple[str, str]] = ()) -> None:
        """Server: answer a CONNECT (200: the tunnel is up; attach the stream to relay it)."""
        self.core.send_response(stream.stream_id, status, headers)
        self.flush()

    def reject(self, stream: HboneStream, status: int) -> None:
        """Server: refuse a CONNECT with ``status`` and END_STREAM (upstream sends errors so), then RST_STREAM
        (NO_ERROR) if the peer has not ended its side; the stream is forgotten. Nothing is sent for a stream
        already gone (reset by the peer, or the connection lost)."""
        if stream.done or self.closed:
            return
        core = self.core
        stream_id = stream.stream_id
        core.send_response(stream_id, status, end_stream=True)
        # RFC 9113 §8.1, as upstream's h2 crate: after a complete response, RST_STREAM(NO_ERROR) asks the client to
        # stop sending. Without it the stream stayed half-open: it counted against MAX_CONCURRENT_STREAMS and each
        # chunk the client kept sending was acknowledged (40 MiB accepted on a stream refused with 503). The reset
        # comes after the answer in the same write, so a client reads the status first.
        if stream_id in core.streams:  # still there: the peer has not ended its side (END_STREAM would close it)
            core.reset_stream(stream_id, ErrorCode.NO_ERROR)
        stream.give_back()  # after the reset: the connection's window back, and no WINDOW_UPDATE for the stream
        self.detach(stream.stream_id)
        self.flush()

    @property
    def stream_count(self) -> int:
        """Streams open on this connection."""
        return len(self.streams)

    @property
    def goaway_received(self) -> bool:
        """The peer sent GOAWAY: it takes no new streams from us."""
        return self.core.goaway_received is not None

    def drain_when_idle(self) -> None:
        """Take no new streams and close when the open ones are done (a client's side of a drain)."""
        self.draining = True
        if not self.streams:
            self.close(_DRAINED)

    # -- lifecycle ---------------------------------------------------------------------------------------------

    def _schedule_ping(self) -> None:
        self._cancel_timer()
        self._timer = self._loop.call_later(PING_INTERVAL, self._on_ping_timer)

    def _on_ping_timer(self) -> None:
        if self.closed:
            return
        now = time.monotonic()
        if self._ping_sent_at is not None and now - self._ping_sent_at >= PING_TIMEOUT:
            # Upstream: keepalive timeout -> abrupt GOAWAY NO_ERROR, then drop the connection.
            self.core.goaway(ErrorCode.NO_ERROR)
            self.flush()
            self.abort(CloseReason(CloseKind.KEEPALIVE_TIMEOUT, f"no PING response within {PING_TIMEOUT:g}s"))
            return
        if self._ping_sent_at is None:
            self._ping_sent_at = now
            self.core.ping()
            self.flush()
        self._schedule_ping()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def goaway(self) -> None:
        """Graceful drain: no new streams; close once the open ones finish. A server announces it first (GOAWAY
        2^31-1 and a PING) and closes the door once the peer answered the PING, as upstream's h2 crate, so a CONNECT
        already on its way is served rather than refused; a client (closing an idle pooled connection) at once."""
        if self.closed:
            return
        if not self.core.client_side:
            self.core.goaway_gracefully()
            self.flush()
            return
        self.core.goaway(ErrorCode.NO_ERROR)
        self.flush()
        if not self.streams:
            self.close(_DRAINED)

    def close(self, reason: CloseReason | str) -> None:
        """Close politely: TLS close_notify, then TCP FIN once the write buffer drains. A ``str`` is ztunnel's own
        reason (:attr:`CloseKind.ABORTED`)."""
        if self.closed:
            return
        if self.ssl_object is not None and self.handshake_done:
            # What the core still holds (the answer to the stream whose end closes a draining connection, a
            # GOAWAY) goes out before close_notify, even mid-dispatch when flush() would defer it.
            pending = self.core.data_to_send()
            records = self._records
            if records is not None:
                if pending:
                    records.write(pending)
                records.close_notify()
            else:
                if pending:
                    self.ssl_object.write(pending)
                with contextlib.suppress(ssl.SSLError):
                    self.ssl_object.unwrap()
            self._flush_tls()
        self._lost(reason if isinstance(reason, CloseReason) else CloseReason.aborted(reason))
        transport = self.transport
        if transport is not None:
            if transport.can_write_eof():
                # A lingering close: FIN after what is left to send, and keep reading (and dropping) until the peer
                # closes too. Closing the socket at once would answer the peer's late frames (WINDOW_UPDATEs for
                # the last DATA, a PING) with a TCP reset, and a reset makes the peer's kernel drop what it had not
                # read yet: the last DATA, its END_STREAM, close_notify (seen on the conformance check of a
                # client's GOAWAY, 2 to 8 runs in 40).
                transport.write_eof()
                self._loop.call_later(CLOSE_TIMEOUT, transport.abort)
            else:
                transport.close()
                if transport.get_write_buffer_size():
                    self._loop.call_later(CLOSE_TIMEOUT, transport.abort)

    def abort(self, reason: CloseReason | str) -> None:
        """Close at once (protocol error, timeout, failed verification). A ``str`` is ztunnel's own reason
        (:attr:`CloseKind.ABORTED`), such as a shutdown's."""
        if self.closed:
            return
        self._lost(reason if isinstance(reason, CloseReason) else CloseReason.aborted(reason))
        if self.transport is not None:
            self.transport.abort()

    def _lost(self, reason: CloseReason) -> None:
        if self.closed:
            return
        self.closed = True
        self.close_reason = reason
        self.core.closed = True
        self._cancel_timer()
        streams, self.streams = self.streams, {}
        for stream in streams.values():
            stream.on_connection_lost(reason)
        if self._on_closed is not None:
            self._on_closed(self)


def _format_peer(peer: tuple[str, int] | None) -> str:
    if peer is None:
        return "an unknown peer"
    return format_addr(peer[0], peer[1])


def _ssl_reason(e: BaseException) -> str:
    if isinstance(e, ssl.SSLCertVerificationError) and e.verify_message:
        # "certificate has expired", "unable to get local issuer certificate": what the operator needs to know.
        return f"{e.reason}: {e.verify_message}"
    if isinstance(e, ssl.SSLError):
        return e.reason or e.strerror or str(e)
    return str(e)
