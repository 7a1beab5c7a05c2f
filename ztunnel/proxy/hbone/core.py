"""Sans-IO HBONE: HTTP/2 CONNECT tunnels, the whole HTTP/2 connection kept here (HPACK from ``hpack``).

Theory of operation
-------------------
Streams live here: each open stream is a :class:`_Stream` in :attr:`HboneConnection.streams` with its RFC 9113
§5.1 state (open, half-closed local or remote: two flags; closed: dropped, and how it closed remembered in a
bounded map so a late frame is answered as RFC 9113 and h2 answer it), its send window (from the peer's
SETTINGS_INITIAL_WINDOW_SIZE, moved by later SETTINGS per §6.9.2 and by WINDOW_UPDATE) and its receive window.
Stream ids are checked here (a client's are odd and increasing; a server refuses a HEADERS at or below one already
opened, §5.1.1). Every frame type is parsed and built here, the connection-level ones too (the preface, SETTINGS
and their ACKs, PING, WINDOW_UPDATE on stream 0, GOAWAY): a stream costs a dict entry and one small object, a
connection no ``h2`` object at all. The python-h2 library is the oracle in tests:
tests/proxy/hbone/test_stream_states.py feeds the same frame sequences to this core and to an ``H2Connection`` and
compares events, answers and errors (the documented differences: stream errors where RFC 9113 and upstream's h2
crate give them and h2 ends the connection).

Header blocks: ours are HPACK literals without indexing (:func:`literal_header_block`), and such blocks are decoded
without hpack (:func:`decode_plain_block`); any other block (a peer that indexes or Huffman-codes) goes to hpack's
decoder. A server checks requests itself (:func:`_request_problem`: a malformed request is refused alone with
RST_STREAM PROTOCOL_ERROR, as upstream's h2 crate does, RFC 9113 §8.1.1); a client checks responses as h2 does
(:func:`plainly_valid_response` for the usual case, :func:`_response_problem` otherwise).

Receiving: the I/O layer decrypts straight into :meth:`HboneConnection.get_buffer` and calls
:meth:`HboneConnection.buffer_updated`. DATA payloads are delivered *streaming*, as soon as bytes of a frame arrive
(a 1 MiB frame need not be buffered whole), as :class:`DataReceived` events whose ``data`` is a memoryview into the
receive buffer: valid until the next ``get_buffer``; a consumer that keeps it (a transport that could not write it
all) calls :meth:`HboneConnection.pin` and the next read goes to a fresh buffer. Other frames are handled whole, in
wire order.

Flow control, as upstream's h2 crate (ztunnel's ``h2.rs`` releases capacity when it takes bytes off a stream): a
stream's window and the connection's are both released by the consumer (:meth:`ack_data`) once the bytes have left
(written to the app), so a slow reader holds back at most its 4 MiB stream window, and all the streams of a
connection together at most the 16 MiB connection window (``HTTP2_CONNECTION_WINDOW_SIZE``; upstream sets it to 4
stream windows so that one stalled stream cannot starve the others). A DATA frame past the connection window is a
connection error FLOW_CONTROL_ERROR (GOAWAY); past a stream's window, a stream error. Bytes that are not delivered
(padding, DATA on a closed stream or one we reset for a stream error) are released at once; a consumer that drops
a stream with bytes it had not passed on acknowledges them all the same (``ack_data`` of a closed stream gives the
connection its share back). Window updates are batched: a stream's once a quarter of its window is released; the
connection's once a quarter of its window is released, or half of what remains of it (h2's rule: when stalled
streams hold most of the window, the rest is not held back by the batching), so small request/response traffic
costs no extra frames.

Sending: :meth:`frame_data` writes the 9-byte DATA header into the caller's buffer just before the payload, so
header and payload reach TLS as one contiguous write (one record, no copy). Anything queued (SETTINGS and PING
ACKs, HEADERS, RST_STREAM, END_STREAM, WINDOW_UPDATE, GOAWAY) is in :attr:`HboneConnection.out` and is sent first,
so frames leave in the order they were made; the I/O layer reads and clears it in place (per chunk it is empty, and
looking costs no call), tests and slow paths take it with :meth:`HboneConnection.data_to_send`.
"""

from __future__ import annotations

import enum
import re
import struct
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple, NoReturn

import hpack
import hpack.table

from ztunnel.errors import ZtunnelError

# Frame header: 24-bit length + 8-bit type packed as one u32, then flags (u8) and stream id (u32).
_HEADER = struct.Struct(">IBI")
_WINDOW_UPDATE = struct.Struct(">IBII")
_RST_STREAM = _WINDOW_UPDATE
_GOAWAY = struct.Struct(">IBIII")
FRAME_HEADER_SIZE = 9
DATA = 0x0
HEADERS = 0x1
PRIORITY = 0x2
RST_STREAM = 0x3
SETTINGS = 0x4
PUSH_PROMISE = 0x5
PING = 0x6
GOAWAY = 0x7
WINDOW_UPDATE = 0x8
CONTINUATION = 0x9
FLAG_END_STREAM = 0x1
FLAG_ACK = 0x1
FLAG_END_HEADERS = 0x4
FLAG_PADDED = 0x8
FLAG_PRIORITY = 0x20
# How many closed streams are remembered with how they ended (reset or END_STREAM), to answer a late frame on one
# with RST_STREAM instead of a connection error. h2's own bound was 65,536: ~11 MiB on every pooled connection that
# has carried that many streams, for the connection's life (the soak found it). A late frame comes within a round
# trip, long before another 1,024 streams close; Rust's h2 (upstream) keeps 50 reset streams for 1 s.
_CLOSED_STREAMS_REMEMBERED = 1024
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_PREFACE_SIZE = 24
# Entries per SETTINGS frame: a peer has 7 defined settings to send; nghttp2 refuses more than 32 (its max_settings).
_MAX_SETTINGS_ENTRIES = 32
# SETTINGS identifiers (RFC 9113 §6.5.2, RFC 8441 §3).
_HEADER_TABLE_SIZE = 0x1
_ENABLE_PUSH = 0x2
_MAX_CONCURRENT_STREAMS = 0x3
_INITIAL_WINDOW_SIZE = 0x4
_MAX_FRAME_SIZE = 0x5
_MAX_HEADER_LIST_SIZE = 0x6
_ENABLE_CONNECT_PROTOCOL = 0x8
_SETTING = struct.Struct(">HI")
_DEFAULT_WINDOW = 65535  # RFC 9113 §6.9.2, for streams and the connection
_DEFAULT_FRAME_SIZE = 16384
# Receive buffers start small and grow with traffic: an idle connection should cost little memory, a busy one
# should read a socket's worth (256 KiB) per call.
_MIN_BUFFER = 16 * 1024
_READ_CHUNK = 256 * 1024


class ErrorCode(enum.IntEnum):
    NO_ERROR = 0x0
    PROTOCOL_ERROR = 0x1
    INTERNAL_ERROR = 0x2
    FLOW_CONTROL_ERROR = 0x3
    STREAM_CLOSED = 0x5
    FRAME_SIZE_ERROR = 0x6
    REFUSED_STREAM = 0x7
    CANCEL = 0x8
    CONNECT_ERROR = 0xA
    ENHANCE_YOUR_CALM = 0xB


@dataclass(frozen=True, slots=True)
class Settings:
    """HTTP/2 settings as upstream ztunnel uses them (``h2/client.rs``, ``h2/server.rs``)."""

    stream_window: int = 4 * 1024 * 1024
    connection_window: int = 16 * 1024 * 1024
    max_frame_size: int = 1024 * 1024
    max_concurrent_streams: int | None = None  # server: 200; client: not advertised
    max_header_list_size: int = 16 * 1024  # client 16 KiB, server 64 KiB


CLIENT_SETTINGS = Settings(max_header_list_size=16 * 1024)
SERVER_SETTINGS = Settings(max_concurrent_streams=200, max_header_list_size=64 * 1024)


@dataclass(frozen=True, slots=True)
class Limits:
    """What a peer may make this side do for nothing; past it the connection ends with GOAWAY ENHANCE_YOUR_CALM.

    HTTP/2 lets a peer cost us work without sending any payload: frames we must answer (PING, SETTINGS), frames we
    must parse and drop (PRIORITY, unknown types, empty DATA, CONTINUATION), streams opened and reset before they
    are served (CVE-2023-44487, "rapid reset"), and frames on closed streams that we answer with RST_STREAM. Legit
    peers send few of these: upstream ztunnel PINGs once per 10 s per connection, and SETTINGS once or twice.
    """

    # Payload-free frames: a token bucket of 200 that refills at 50/s (so a burst of 200, then 50/s sustained;
    # a keepalive needs 0.1/s).
    control_frame_burst: int = 200
    control_frames_per_second: float = 50.0
    # Rapid reset, with Envoy's numbers (overload.premature_reset_total_stream_count = 500): once a connection has
    # opened 500 streams, half or more of them reset by the peer before we answered closes it.
    premature_reset_min_streams: int = 500


DEFAULT_LIMITS = Limits()


class _Budget:
    """A token bucket refilled lazily: the clock is read only when the tokens run out, not per frame."""

    __slots__ = ("burst", "clock", "rate", "stamp", "tokens")

    def __init__(self, burst: int, rate: float, clock: Callable[[], float]) -> None:
        self.burst = burst
        self.rate = rate
        self.clock = clock
        self.tokens = float(burst)
        self.stamp = clock()

    def spend(self) -> bool:
        self.tokens -= 1
        if self.tokens >= 0:
            return True
        now = self.clock()
        self.tokens = min(float(self.burst), self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        return self.tokens >= 0


# -- events (past tense) -----------------------------------------------------------------------------------------


@dataclass(slots=True)
class ConnectRequested:
    """Server: a CONNECT (or another method, which the server must refuse with 400) opened ``stream_id``."""

    stream_id: int
    method: str
    authority: str
    headers: dict[str, str]


@dataclass(slots=True)
class ConnectResponded:
    """Client: the response to our CONNECT arrived."""

    stream_id: int
    status: int
    headers: dict[str, str]


class DataReceived(NamedTuple):
    """Payload bytes for a stream; ``data`` is a view into the receive buffer (see the module docstring).

    A named tuple, made by the parser with ``tuple.__new__`` (``_new_tuple``): a C call per DATA frame instead of a
    Python ``__init__`` frame, for the commonest event (one per chunk)."""

    stream_id: int
    data: memoryview
    flow_controlled_length: int


_new_tuple = tuple.__new__


@dataclass(slots=True)
class StreamEnded:
    """The peer half-closed the stream (END_STREAM): EOF on this stream's read side."""

    stream_id: int


@dataclass(slots=True)
class StreamReset:
    """The stream was reset: by the peer (its RST_STREAM; NO_ERROR and CANCEL are read as EOF by upstream, others
    are real resets), or by this side for a stream error of the peer's (``by_peer`` False: flow control broken,
    DATA after END_STREAM, bad trailers; our RST_STREAM is queued)."""

    stream_id: int
    error_code: int
    by_peer: bool = True

    @property
    def is_eof(self) -> bool:
        return self.error_code in (ErrorCode.NO_ERROR, ErrorCode.CANCEL)


@dataclass(slots=True)
class WindowOpened:
    """The peer granted more send window (``stream_id`` 0: the whole connection)."""

    stream_id: int


# The one event for the connection's window opening: consecutive WINDOW_UPDATEs on stream 0 share it.
_CONNECTION_WINDOW_OPENED = WindowOpened(0)


@dataclass(slots=True)
class PingAcked:
    data: bytes


@dataclass(slots=True)
class GoAwayReceived:
    """The peer will accept no streams above ``last_stream_id``."""

    error_code: int
    last_stream_id: int
    debug: bytes


@dataclass(slots=True)
class RequestRefused:
    """A malformed request was refused with RST_STREAM PROTOCOL_ERROR; the connection and its other streams go on.
    ``reason`` quotes names with ``repr`` (one log line, whatever the peer sent) and never a header value."""

    stream_id: int
    reason: str


Event = (
    ConnectRequested
    | ConnectResponded
    | DataReceived
    | StreamEnded
    | StreamReset
    | WindowOpened
    | PingAcked
    | GoAwayReceived
    | RequestRefused
)


class HboneProtocolError(ZtunnelError):
    """The peer broke HTTP/2 badly enough that the connection must close; a GOAWAY has been queued."""

    def __init__(self, message: str, code: ErrorCode = ErrorCode.PROTOCOL_ERROR) -> None:
        super().__init__(message)
        self.code = code


# How a stream we no longer track ended, for frames that arrive on it late (see _closed_frame).
_ENDED = 0  # END_STREAM both ways
_RESET_BY_US = 1
_RESET_BY_PEER = 2
_MAX_WINDOW = 2**31 - 1  # RFC 9113 §6.9.1
_MAX_STREAM_ID = 2**31 - 1
# The payload of the PING that follows the first GOAWAY of a graceful drain; its ACK sends the final GOAWAY. Any 8
# bytes do (the peer only echoes them); distinct from the keepalive's b"ztunnel!" so the two are told apart.
DRAIN_PING = b"draining"


@dataclass(slots=True)
class _Stream:
    """One open stream: its RFC 9113 §5.1 state is open, half-closed (local or remote) by the two flags; a closed
    stream is dropped from ``HboneConnection.streams`` and remembered in ``_closed``."""

    recv_window: int
    send_window: int  # from the peer's SETTINGS_INITIAL_WINDOW_SIZE, moved by its SETTINGS and WINDOW_UPDATEs
    unacked: int = 0  # received, delivered, not yet released by the consumer
    remote_closed: bool = False
    local_closed: bool = False
    held: int = 0  # released by the consumer while the window update is being batched
    # Server: final response headers sent (a reset before that is "premature"). Client: final response received
    # (a later HEADERS is trailers).
    responded: bool = False


class StreamLimitError(ZtunnelError):
    """A client cannot open a stream now: the peer's SETTINGS_MAX_CONCURRENT_STREAMS is reached, stream ids are
    exhausted, or the connection has failed."""


class HboneConnection:
    """One HBONE HTTP/2 connection, client or server role. No I/O: bytes and buffers in, events and bytes out."""

    def __init__(
        self,
        client_side: bool,
        settings: Settings | None = None,
        limits: Limits = DEFAULT_LIMITS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client_side = client_side
        self.settings = settings or (CLIENT_SETTINGS if client_side else SERVER_SETTINGS)
        self.limits = limits
        self._control = _Budget(limits.control_frame_burst, limits.control_frames_per_second, clock)
        # A compressed header block is never larger than the header list it decodes to (HPACK spends at most ~8
        # bytes of framing per field, the list size counts 32), plus HEADERS padding (256) and priority (5).
        self._header_block_limit = self.settings.max_header_list_size + 261
        # The header block being received (HEADERS without END_HEADERS, then CONTINUATIONs): its stream, the
        # fragments so far (None: no block open), and whether its HEADERS carried END_STREAM.
        self._block_stream = 0
        self._block: bytearray | None = None
        self._block_end_stream = False
        self._block_size = 0  # frame bytes of the open block, padding included (checked against the limit); 0: none
        # Streams that closed, by how (_ENDED, _RESET_BY_US, _RESET_BY_PEER), insertion-ordered and bounded by
        # _CLOSED_STREAMS_REMEMBERED: a late frame on one is answered as RFC 9113 §5.1 and h2 answer it.
        self._closed: dict[int, int] = {}
        self._highest_inbound = 0  # server: the highest stream id the client opened (RFC 9113 §5.1.1)
        self._next_stream_id = 1  # client: the next stream id we open (odd, increasing)
        self.streams_opened = 0  # by the peer (server role)
        self.malformed_requests = 0  # refused with RST_STREAM PROTOCOL_ERROR (server role)
        self.premature_resets = 0
        # HPACK contexts: the encoder only encodes the block that must carry a table size update after the peer
        # resized its table (encode_header_block); the decoder takes every block that is not plain literals.
        self._encoder = hpack.Encoder()
        self._decoder = hpack.Decoder(max_header_list_size=self.settings.max_header_list_size)
        # What the peer's SETTINGS said, RFC 9113's defaults until they come.
        self._peer_initial_window = _DEFAULT_WINDOW
        self._peer_max_frame = _DEFAULT_FRAME_SIZE
        # The peer's SETTINGS_MAX_CONCURRENT_STREAMS, unlimited until it says otherwise: kept here only (send_connect
        # enforces it, the transport's open_stream_within and the pool read it from here).
        self.peer_max_streams = 2**31
        self._send_window = _DEFAULT_WINDOW  # the connection's, towards the peer
        self.streams: dict[int, _Stream] = {}
        # Allocated at the first receive: a connection still in its TLS handshake (or stalled there) costs none.
        self._buf = bytearray()
        self._view = memoryview(self._buf)
        self._start = 0  # first unparsed byte
        self._end = 0  # end of received bytes
        self._pinned = False
        self._need = 0  # bytes the incomplete frame at _start needs in the buffer
        # A server first reads the 24-byte client preface ("PRI * HTTP/2.0...").
        self._preface = 0 if client_side else _PREFACE_SIZE
        # The DATA frame being received, if its header has been parsed: stream, payload and padding left.
        self._data_stream = 0
        self._data_state: _Stream | None = None
        self._data_remaining = 0
        self._data_padding = 0
        self._data_end_stream = False
        self._pad_length_pending = False
        # The connection's receive window: what the peer may still send (we raise it to the configured size at once,
        # initiate; a window below RFC 9113's initial 65,535 cannot be advertised). Taken by every DATA frame, given
        # back by _conn_released once a batch of it is due (ack_data).
        self._conn_max = max(self.settings.connection_window, _DEFAULT_WINDOW)
        self._conn_window = self._conn_max
        self._conn_released = 0  # consumed and released, not yet sent as WINDOW_UPDATE
        # Frames queued for the wire (control frames, HEADERS, window updates), in the order they were made. Public
        # so the I/O layer looks at it without a call: per chunk the pump asks "anything queued?" (almost always
        # not), encrypts it straight from here when there is, and clears it (no bytes or bytearray made per call).
        self.out = bytearray()
        # Window updates are due once a quarter of a window is consumed (RFC 9113 §6.9: batched, not per frame).
        self._conn_threshold = self._conn_max >> 2
        # A release is due at _conn_due released bytes: the quarter above, or half of what is left of the window when
        # that is less (h2's rule: held bytes never leave the rest stuck behind the batching). Kept as one number so
        # ack_data, once per chunk, compares once; lowered at the end of a parse that left the window below half.
        self._conn_due = self._conn_threshold
        self._stream_threshold = self.settings.stream_window >> 2
        self.goaway_received: GoAwayReceived | None = None
        self.goaway_sent: int | None = None  # the last stream id we promised to process
        self.goaway_announced = False  # the first GOAWAY of a graceful one (2^31-1) sent, its PING not yet answered
        self._initiated = False  # our SETTINGS are queued: the first frame a server sends (RFC 9113 §3.4)
        self._drain_on_initiate = False  # a graceful GOAWAY asked for before that: sent right after them
        self.closed = False

    # -- setup -----------------------------------------------------------------------------------------------

    def initiate(self) -> None:
        """Queue the preface (a client's) and SETTINGS, and raise the connection window from 64 KiB to its
        configured size. Our settings are in force at once: every one of them only widens what we accept (frame
        size, windows) or is enforced by us alone (header list size, concurrent streams), so nothing waits for the
        peer's ACK."""
        s = self.settings
        local = [(_INITIAL_WINDOW_SIZE, s.stream_window), (_MAX_FRAME_SIZE, s.max_frame_size)]
        if self.client_side:
            local.insert(0, (_ENABLE_PUSH, 0))
            self.out += PREFACE
        if s.max_concurrent_streams is not None:
            local.append((_MAX_CONCURRENT_STREAMS, s.max_concurrent_streams))
        local.append((_MAX_HEADER_LIST_SIZE, s.max_header_list_size))
        self.out += _HEADER.pack(6 * len(local) << 8 | SETTINGS, 0, 0)
        for ident, value in local:
            self.out += _SETTING.pack(ident, value)
        increment = s.connection_window - _DEFAULT_WINDOW
        if increment > 0:
            self.out += _WINDOW_UPDATE.pack(4 << 8 | WINDOW_UPDATE, 0, 0, increment)
        self._initiated = True
        if self._drain_on_initiate:
            self.goaway_gracefully()

    # -- receiving -------------------------------------------------------------------------------------------

    def get_buffer(self, size_hint: int = -1) -> memoryview:
        """Where the next received bytes go: room for at least ``size_hint`` bytes (at most 512 KiB; the
        reader's estimate of what it has to deliver, so a read's records land in one buffer and come out as one
        event). Views from earlier events are invalid after this call."""
        start, end = self._start, self._end
        pending = end - start
        need = max(self._need, pending + min(max(size_hint, _MIN_BUFFER), 2 * _READ_CHUNK))
        size = len(self._buf)
        if self._pinned or size < need or (pending == 0 and size > 8 * need):
            # A consumer still holds views into the old buffer (leave it to them), a frame or the read needs more
            # room, or a bulk transfer's buffer is idle while reads are small again (give the memory back).
            self._pinned = False
            # In whole 16 KiB steps, not powers of two: a 256 KiB read plus a partial frame header must not take
            # 512 KiB.
            size = -(-need // _MIN_BUFFER) * _MIN_BUFFER
            new = bytearray(size)
            new[:pending] = self._view[start:end]
            self._buf = new
            self._view = memoryview(new)
            self._start, self._end = 0, pending
        elif pending == 0:
            self._start = self._end = 0
        elif size - end < _MIN_BUFFER:
            # Move the partial frame to the front: at most one frame header or control frame.
            self._view[:pending] = self._view[start:end]
            self._start, self._end = 0, pending
        return self._view[self._end :]

    def pin(self) -> None:
        """A consumer kept a view into the receive buffer (a transport buffered it): don't overwrite it."""
        self._pinned = True

    def receive_data(self, data: bytes | memoryview) -> list[Event]:
        """Convenience for tests and slow paths: copy ``data`` in and parse it."""
        events: list[Event] = []
        view = memoryview(data)
        while view:
            buf = self.get_buffer()
            n = min(len(buf), len(view))
            buf[:n] = view[:n]
            view = view[n:]
            for ev in self.buffer_updated(n):
                if type(ev) is DataReceived:
                    # Views die at the next get_buffer; this convenience path hands out copies.
                    events.append(DataReceived(ev.stream_id, memoryview(bytes(ev.data)), ev.flow_controlled_length))
                else:
                    events.append(ev)
        return events

    def buffer_updated(self, nbytes: int) -> list[Event]:
        """``nbytes`` were written into the last :meth:`get_buffer`; parse them into events (in wire order)."""
        self._end += nbytes
        events: list[Event] = []
        view = self._view
        pos, end = self._start, self._end
        self._need = 0
        streams = self.streams
        client_side = self.client_side
        if self._preface:
            if end - pos < self._preface:
                return events
            if view[pos : pos + _PREFACE_SIZE] != PREFACE:
                # A connection error without GOAWAY: the peer does not speak HTTP/2 (RFC 9113 §3.4 allows it).
                self.closed = True
                raise HboneProtocolError("not an HTTP/2 connection preface", ErrorCode.PROTOCOL_ERROR)
            pos += self._preface
            self._preface = 0
        while pos < end:
            if self._data_remaining or self._data_padding or self._pad_length_pending:
                pos = self._continue_data(events, view, pos, end)
                continue
            if end - pos < FRAME_HEADER_SIZE:
                break
            len_type, flags, stream_id = _HEADER.unpack_from(view, pos)
            length = len_type >> 8
            ftype = len_type & 0xFF
            stream_id &= 0x7FFFFFFF
            if length > self.settings.max_frame_size:
                self._fail(f"frame of {length} bytes exceeds SETTINGS_MAX_FRAME_SIZE", ErrorCode.FRAME_SIZE_ERROR)
            if self._block is not None and (ftype != CONTINUATION or stream_id != self._block_stream):
                # RFC 9113 §6.10: a header block is a contiguous sequence of frames on its stream.
                self._fail(
                    f"{_frame_name(ftype)} frame on stream {stream_id} inside the header block of stream "
                    f"{self._block_stream}, where only its CONTINUATION may come",
                    ErrorCode.PROTOCOL_ERROR,
                )
            if ftype == DATA:
                start = pos + FRAME_HEADER_SIZE
                if length and not flags & FLAG_PADDED and end - start >= length:
                    # The usual DATA frame, whole in the buffer on an open stream that may receive it: handled here,
                    # with no call (a 64 B chunk took four: _start_data, _continue_data, _finish_data and the
                    # event's __init__). Anything else (padded, empty, split across reads, on a closed stream, over
                    # the window) goes the general way below.
                    st = streams.get(stream_id)
                    if (
                        st is not None
                        and not st.remote_closed
                        and length <= st.recv_window
                        and length <= self._conn_window
                        and (st.responded or not client_side)
                    ):
                        pos = start + length
                        st.recv_window -= length
                        st.unacked += length
                        self._conn_window -= length
                        events.append(_new_tuple(DataReceived, (stream_id, view[start:pos], length)))
                        if flags & FLAG_END_STREAM:
                            self._remote_closed(stream_id)
                            events.append(StreamEnded(stream_id))
                        continue
                pos = self._start_data(events, pos, length, flags, stream_id)
                continue
            # The header block's size is checked on the frame header, before buffering a frame of up to 1 MiB.
            if ftype in (HEADERS, CONTINUATION) and self._block_size + length > self._header_block_limit:
                self._fail(
                    f"header block over {self._header_block_limit} bytes (SETTINGS_MAX_HEADER_LIST_SIZE "
                    f"{self.settings.max_header_list_size})",
                    ErrorCode.ENHANCE_YOUR_CALM,
                )
            if end - pos < FRAME_HEADER_SIZE + length:
                self._need = FRAME_HEADER_SIZE + length
                break
            start = pos + FRAME_HEADER_SIZE
            pos = start + length
            if ftype == HEADERS:
                self._headers_frame(events, stream_id, flags, view[start:pos])
            elif ftype == CONTINUATION:
                self._continuation_frame(events, stream_id, flags, view[start:pos])
            elif ftype == RST_STREAM:
                self._rst_stream_frame(events, stream_id, view[start:pos])
            elif ftype == WINDOW_UPDATE:
                self._window_update_frame(events, stream_id, view[start:pos])
            elif ftype == SETTINGS:
                self._settings_frame(events, stream_id, flags, view[start:pos])
            elif ftype == PING:
                self._ping_frame(events, stream_id, flags, view[start:pos])
            elif ftype == PRIORITY:
                self._priority_frame(stream_id, view[start:pos])
            elif ftype == GOAWAY:
                events.append(self._goaway_frame(stream_id, view[start:pos]))
            elif ftype == PUSH_PROMISE:
                # A client advertises SETTINGS_ENABLE_PUSH 0 and a server is never pushed to (RFC 9113 §8.4).
                self._fail("PUSH_PROMISE received, push is not enabled", ErrorCode.PROTOCOL_ERROR)
            else:
                # Unknown types (and ALTSVC, ORIGIN, ...) are ignored (RFC 9113 §5.5), but cost us the parse.
                self._spend("frames of unknown type")
        self._start = pos
        if self._conn_window < self._conn_threshold << 1:
            # Held bytes (slow apps) have most of the window: a smaller release is due (h2's rule).
            self._conn_due = self._conn_window >> 1
            if self._conn_released and self._conn_released >= self._conn_due:
                self._release_connection(self._conn_released)
        elif self._conn_released >= self._conn_threshold:
            # Bytes this parse dropped (padding, DATA on closed streams): nobody will acknowledge them.
            self._release_connection(self._conn_released)
        return events

    def _release_connection(self, released: int) -> None:
        """Send the connection's released window (a WINDOW_UPDATE on stream 0)."""
        self.out += _WINDOW_UPDATE.pack(4 << 8 | WINDOW_UPDATE, 0, 0, released)
        window = self._conn_window + released
        self._conn_window = window
        self._conn_released = 0
        threshold = self._conn_threshold
        self._conn_due = threshold if window >= threshold << 1 else window >> 1

    def _spend(self, what: str) -> None:
        if not self._control.spend():
            lim = self.limits
            self._fail(
                f"flood of {what}: over {lim.control_frame_burst} payload-free frames at once or "
                f"{lim.control_frames_per_second:g}/s sustained",
                ErrorCode.ENHANCE_YOUR_CALM,
            )

    def _idle(self, stream_id: int) -> bool:
        """Whether ``stream_id`` was never opened (RFC 9113 §5.1 "idle"): by the client, above the highest it opened;
        a server opens none (HBONE has no push), so any even id is idle too."""
        if self.client_side:
            return stream_id & 1 == 0 or stream_id >= self._next_stream_id
        return stream_id & 1 == 0 or stream_id > self._highest_inbound

    def _closed_as(self, stream_id: int, how: int) -> None:
        closed = self._closed
        closed[stream_id] = how
        if len(closed) > _CLOSED_STREAMS_REMEMBERED:
            del closed[next(iter(closed))]

    def _goaway_frame(self, stream_id: int, payload: memoryview) -> GoAwayReceived:
        # Handled here, not by h2: h2 moves its state machine to CLOSED on a received GOAWAY and then refuses to
        # send anything, while a graceful GOAWAY lets the open streams finish (RFC 9113 §6.8).
        if stream_id:
            self._fail(f"GOAWAY on stream {stream_id}", ErrorCode.PROTOCOL_ERROR)
        if len(payload) < 8:
            self._fail(f"GOAWAY of {len(payload)} bytes (at least 8)", ErrorCode.FRAME_SIZE_ERROR)
        last, code = struct.unpack_from(">II", payload)
        g = GoAwayReceived(code, last & 0x7FFFFFFF, bytes(payload[8:]))
        self.goaway_received = g
        return g

    def _rst_stream_frame(self, events: list[Event], stream_id: int, payload: memoryview) -> None:
        if len(payload) != 4:
            self._fail(f"RST_STREAM of {len(payload)} bytes (4)", ErrorCode.FRAME_SIZE_ERROR)
        if not stream_id:
            self._fail("RST_STREAM on stream 0", ErrorCode.PROTOCOL_ERROR)
        code = int.from_bytes(payload, "big")
        st = self.streams.pop(stream_id, None)
        if st is not None:
            self._closed_as(stream_id, _RESET_BY_PEER)
            if not self.client_side and not st.responded:
                self._premature_reset()
            events.append(StreamReset(stream_id, code))
            return
        if self._idle(stream_id):
            # RFC 9113 §6.4 (h2 ignores it; upstream's h2 crate and the RFC end the connection).
            self._fail(f"RST_STREAM on idle stream {stream_id}", ErrorCode.PROTOCOL_ERROR)
        # A closed stream: one RST_STREAM may cross our END_STREAM or RST_STREAM; a second one is a flood.
        if self._closed.get(stream_id) == _RESET_BY_PEER:
            self._spend("RST_STREAM frames on closed streams")
        else:
            self._closed_as(stream_id, _RESET_BY_PEER)

    def _window_update_frame(self, events: list[Event], stream_id: int, payload: memoryview) -> None:
        if len(payload) != 4:
            self._fail(f"WINDOW_UPDATE of {len(payload)} bytes (4)", ErrorCode.FRAME_SIZE_ERROR)
        increment = int.from_bytes(payload, "big") & 0x7FFFFFFF
        if not stream_id:
            if not increment:
                self._fail("WINDOW_UPDATE of 0 on the connection", ErrorCode.PROTOCOL_ERROR)
            self._send_window += increment
            if self._send_window > _MAX_WINDOW:
                self._fail("WINDOW_UPDATE past 2^31-1 on the connection", ErrorCode.FLOW_CONTROL_ERROR)
            if not events or events[-1] is not _CONNECTION_WINDOW_OPENED:
                # One event for a run of them (each wakes every waiting stream; a flood of 1-byte updates would
                # wake them all per frame).
                events.append(_CONNECTION_WINDOW_OPENED)
            return
        st = self.streams.get(stream_id)
        if st is None:
            if self._idle(stream_id):
                self._fail(f"WINDOW_UPDATE on idle stream {stream_id}", ErrorCode.PROTOCOL_ERROR)
            return  # a closed stream: the peer may not know yet (RFC 9113 §6.9)
        if not increment:
            # RFC 9113 §6.9: a stream error (h2 ends the connection, as for a zero increment on stream 0).
            self._spend("stream errors")
            events.append(self._reset(stream_id, ErrorCode.PROTOCOL_ERROR))
            return
        window = st.send_window + increment
        if window > _MAX_WINDOW:
            # RFC 9113 §6.9.1: a stream error FLOW_CONTROL_ERROR (as h2, which reports it as a reset).
            self._spend("stream errors")
            events.append(self._reset(stream_id, ErrorCode.FLOW_CONTROL_ERROR))
            return
        st.send_window = window
        events.append(WindowOpened(stream_id))

    def _priority_frame(self, stream_id: int, payload: memoryview) -> None:
        if len(payload) != 5:
            self._fail(f"PRIORITY of {len(payload)} bytes (5)", ErrorCode.FRAME_SIZE_ERROR)
        if not stream_id:
            self._fail("PRIORITY on stream 0", ErrorCode.PROTOCOL_ERROR)
        if int.from_bytes(payload[:4], "big") & 0x7FFFFFFF == stream_id:
            self._fail(f"stream {stream_id} depends on itself", ErrorCode.PROTOCOL_ERROR)
        self._spend("PRIORITY frames")

    def _headers_frame(self, events: list[Event], stream_id: int, flags: int, payload: memoryview) -> None:
        if not stream_id:
            self._fail("HEADERS on stream 0", ErrorCode.PROTOCOL_ERROR)
        start, end = 0, len(payload)
        if flags & FLAG_PADDED:
            if not end:
                self._fail("PADDED HEADERS frame without a pad length", ErrorCode.FRAME_SIZE_ERROR)
            start = 1
            end -= payload[0]
            if end < start:
                self._fail("HEADERS padding longer than the frame", ErrorCode.PROTOCOL_ERROR)
        if flags & FLAG_PRIORITY:
            if end - start < 5:
                self._fail("HEADERS with PRIORITY too short for it", ErrorCode.FRAME_SIZE_ERROR)
            if int.from_bytes(payload[start : start + 4], "big") & 0x7FFFFFFF == stream_id:
                self._fail(f"stream {stream_id} depends on itself", ErrorCode.PROTOCOL_ERROR)
            start += 5
        end_stream = bool(flags & FLAG_END_STREAM)
        if flags & FLAG_END_HEADERS:
            self._header_block(events, stream_id, bytes(payload[start:end]), end_stream)
        else:
            self._block_stream = stream_id
            self._block = bytearray(payload[start:end])
            self._block_end_stream = end_stream
            self._block_size = len(payload)

    def _continuation_frame(self, events: list[Event], stream_id: int, flags: int, payload: memoryview) -> None:
        block = self._block
        if block is None:
            self._fail(f"CONTINUATION on stream {stream_id} without a HEADERS before it", ErrorCode.PROTOCOL_ERROR)
        if not payload and not flags & FLAG_END_HEADERS:
            self._spend("empty CONTINUATION frames")
        block += payload
        self._block_size += len(payload)
        if flags & FLAG_END_HEADERS:
            self._block = None
            self._block_size = 0
            self._header_block(events, stream_id, bytes(block), self._block_end_stream)

    def _decode(self, block: bytes) -> list[tuple[bytes, bytes]]:
        """The header list of a received block: HBONE's plain literals here, any other block by hpack (whose
        errors end the connection, as h2 maps them)."""
        headers = decode_plain_block(self._decoder, block)
        if headers is not None:
            return headers
        try:
            return list(self._decoder.decode(block, raw=True))
        except hpack.OversizedHeaderListError as e:
            self._fail(f"header list over the limit: {e}", ErrorCode.ENHANCE_YOUR_CALM)
        except (hpack.HPACKError, IndexError, TypeError, UnicodeDecodeError) as e:
            self._fail(f"bad header block: {e}", ErrorCode.PROTOCOL_ERROR)

    def _header_block(self, events: list[Event], stream_id: int, block: bytes, end_stream: bool) -> None:
        # Decoded first, whatever becomes of the stream: the HPACK context must take every block (RFC 7541 §2.2).
        headers = self._decode(block)
        st = self.streams.get(stream_id)
        if st is None:
            if self._closed_frame(stream_id, "HEADERS"):
                return
            if self.client_side:
                self._fail(f"HEADERS on stream {stream_id}, which this client did not open", ErrorCode.PROTOCOL_ERROR)
            self._request(events, stream_id, headers, end_stream)
            return
        if st.remote_closed:
            # RFC 9113 §5.1, half-closed (remote): a stream error (h2 ends the whole connection).
            self._spend("stream errors")
            events.append(self._reset(stream_id, ErrorCode.STREAM_CLOSED))
            return
        if self.client_side and not st.responded:
            self._response(events, stream_id, st, headers, end_stream)
            return
        # Trailers: they must end the stream and carry no pseudo-header (RFC 9113 §8.1); a tunnel drops them.
        if not end_stream or any(name[:1] == b":" for name, _ in headers):
            self._spend("stream errors")
            events.append(self._reset(stream_id, ErrorCode.PROTOCOL_ERROR))
            return
        self._remote_closed(stream_id)
        events.append(StreamEnded(stream_id))

    def _closed_frame(self, stream_id: int, what: str) -> bool:
        """A HEADERS or DATA frame on ``stream_id``, which is not open: True if it was answered (a stream that we or
        the peer reset gets RST_STREAM STREAM_CLOSED, as h2 answers it); a stream closed by END_STREAM both ways or
        forgotten ends the connection (STREAM_CLOSED, PROTOCOL_ERROR: RFC 9113 §5.1 and h2); False for a new id."""
        if self._idle(stream_id):
            return False
        how = self._closed.get(stream_id)
        if how in (_RESET_BY_US, _RESET_BY_PEER):
            self._spend(f"{what} frames on closed streams")
            self.out += _RST_STREAM.pack(4 << 8 | RST_STREAM, 0, stream_id, ErrorCode.STREAM_CLOSED)
            return True
        if how == _ENDED:
            self._fail(f"{what} on stream {stream_id}, closed by END_STREAM both ways", ErrorCode.STREAM_CLOSED)
        self._fail(f"{what} on stream {stream_id}, at or below a stream already opened", ErrorCode.PROTOCOL_ERROR)

    def _request(self, events: list[Event], stream_id: int, headers: list[tuple[bytes, bytes]], end: bool) -> None:
        """Server: a HEADERS block opening ``stream_id`` (odd, above every stream opened before: _idle)."""
        if stream_id & 1 == 0:
            self._fail(f"HEADERS on even stream {stream_id} from a client", ErrorCode.PROTOCOL_ERROR)
        self._highest_inbound = stream_id
        if self.goaway_sent is not None and stream_id > self.goaway_sent:
            self._refuse(stream_id, ErrorCode.REFUSED_STREAM)  # after our GOAWAY: not processed
            return
        limit = self.settings.max_concurrent_streams
        if limit is not None and len(self.streams) >= limit:
            # Refused alone (RST_STREAM REFUSED_STREAM, as upstream's h2 crate, RFC 9113 §5.1.2).
            self._spend("stream errors")
            self._refuse(stream_id, ErrorCode.REFUSED_STREAM)
            return
        problem = _request_problem(headers)
        if problem is not None:
            if problem.startswith(_UNKNOWN_PSEUDO):  # a connection error in the h2 crate too
                self._fail(f"malformed request on stream {stream_id}: {problem}", ErrorCode.PROTOCOL_ERROR)
            self.malformed_requests += 1
            self._spend("stream errors")
            self._refuse(stream_id, ErrorCode.PROTOCOL_ERROR)
            events.append(RequestRefused(stream_id, problem))
            return
        fields = _decode_headers(headers)
        st = _Stream(self.settings.stream_window, self._peer_initial_window)
        self.streams[stream_id] = st
        self.streams_opened += 1
        events.append(ConnectRequested(stream_id, fields.pop(":method", ""), fields.pop(":authority", ""), fields))
        if end:
            st.remote_closed = True
            events.append(StreamEnded(stream_id))

    def _response(
        self, events: list[Event], stream_id: int, st: _Stream, headers: list[tuple[bytes, bytes]], end: bool
    ) -> None:
        """Client: a HEADERS block on a stream of ours that has no final response yet."""
        if not plainly_valid_response(headers):
            problem = _response_problem(headers)
            if problem is not None:
                # As h2 (validate_inbound_headers): a connection error.
                self._fail(f"malformed response on stream {stream_id}: {problem}", ErrorCode.PROTOCOL_ERROR)
        fields = _decode_headers(headers)
        status = fields.pop(":status", "0")
        # Three ASCII digits only: str.isdigit() also holds for "²" (int() then raises) and for other scripts' digits.
        code = int(status) if len(status) == 3 and status.isascii() and status.isdigit() else 0
        if 100 <= code < 200:
            if end:
                self._fail(f"informational response ending stream {stream_id}", ErrorCode.PROTOCOL_ERROR)
            return  # 1xx: the final response is still to come
        st.responded = True
        events.append(ConnectResponded(stream_id, code, fields))
        if end:
            self._remote_closed(stream_id)
            events.append(StreamEnded(stream_id))

    def _settings_frame(self, events: list[Event], stream_id: int, flags: int, payload: memoryview) -> None:
        """The peer's SETTINGS (RFC 9113 §6.5): all values checked first, then applied, then acknowledged. An ACK
        of ours needs nothing: our settings were in force from the start (:meth:`initiate`)."""
        if stream_id:
            self._fail(f"SETTINGS on stream {stream_id}", ErrorCode.PROTOCOL_ERROR)
        if flags & FLAG_ACK:
            if payload:
                self._fail("SETTINGS ACK with a payload", ErrorCode.FRAME_SIZE_ERROR)
            return
        if len(payload) % 6:
            self._fail(f"SETTINGS of {len(payload)} bytes (a multiple of 6)", ErrorCode.FRAME_SIZE_ERROR)
        if len(payload) > _MAX_SETTINGS_ENTRIES * 6:
            # One budget token per frame, whatever its size: a 1 MiB frame is 174,762 entries to parse.
            self._fail(
                f"SETTINGS with {len(payload) // 6} entries (at most {_MAX_SETTINGS_ENTRIES})",
                ErrorCode.ENHANCE_YOUR_CALM,
            )
        self._spend("SETTINGS frames")
        values = [_SETTING.unpack_from(payload, at) for at in range(0, len(payload), 6)]
        for ident, value in values:
            if ident in (_ENABLE_PUSH, _ENABLE_CONNECT_PROTOCOL) and value > 1:
                self._fail(f"SETTINGS {ident:#x} of {value} (0 or 1)", ErrorCode.PROTOCOL_ERROR)
            elif ident == _INITIAL_WINDOW_SIZE and value > _MAX_WINDOW:
                self._fail(f"SETTINGS_INITIAL_WINDOW_SIZE of {value}", ErrorCode.FLOW_CONTROL_ERROR)
            elif ident == _MAX_FRAME_SIZE and not _DEFAULT_FRAME_SIZE <= value <= 2**24 - 1:
                self._fail(f"SETTINGS_MAX_FRAME_SIZE of {value}", ErrorCode.PROTOCOL_ERROR)
        initial_window: int | None = None
        for ident, value in values:
            if ident == _INITIAL_WINDOW_SIZE:
                initial_window = value
            elif ident == _MAX_FRAME_SIZE:
                self._peer_max_frame = value
            elif ident == _MAX_CONCURRENT_STREAMS:
                self.peer_max_streams = value
            elif ident == _HEADER_TABLE_SIZE:
                self._header_table_size_changed(value)
            # SETTINGS_MAX_HEADER_LIST_SIZE is advisory (our blocks are a few hundred bytes); others are unknown.
        if initial_window is not None:
            # The frame's last value counts (§6.5.3: processed in order); the open streams move once, by the total.
            self._initial_window_changed(initial_window - self._peer_initial_window)
            self._peer_initial_window = initial_window
        self.out += _HEADER.pack(SETTINGS, FLAG_ACK, 0)
        if initial_window is not None:
            events.append(WindowOpened(0))

    def _header_table_size_changed(self, value: int) -> None:
        """The peer's SETTINGS_HEADER_TABLE_SIZE. Our blocks never insert into the dynamic table, so only a limit
        below the encoder's current size is owed a size update (RFC 7541 §4.2) at the start of our next block; the
        smallest since that block is the one to signal. hpack's encoder would queue every value it is given (and
        forget the update when one value is set twice), so it is told only of reductions, one pending at a time."""
        encoder = self._encoder
        if value < encoder.header_table_size:
            encoder.table_size_changes.clear()
            encoder.header_table_size = value

    def _ping_frame(self, events: list[Event], stream_id: int, flags: int, payload: memoryview) -> None:
        if stream_id:
            self._fail(f"PING on stream {stream_id}", ErrorCode.PROTOCOL_ERROR)
        if len(payload) != 8:
            self._fail(f"PING of {len(payload)} bytes (8)", ErrorCode.FRAME_SIZE_ERROR)
        if flags & FLAG_ACK:
            data = bytes(payload)
            if self.goaway_announced and data == DRAIN_PING:  # the peer has seen the first GOAWAY: the final one
                self.goaway_announced = False
                self.goaway()
            events.append(PingAcked(data))
            return
        self._spend("PING frames")
        self.out += _HEADER.pack(8 << 8 | PING, FLAG_ACK, 0)
        self.out += payload

    def _initial_window_changed(self, delta: int) -> None:
        """RFC 9113 §6.9.2: a new SETTINGS_INITIAL_WINDOW_SIZE moves every open stream's send window by the
        difference; one pushed over 2^31-1 is a connection error FLOW_CONTROL_ERROR."""
        for st in self.streams.values():
            st.send_window += delta
            if st.send_window > _MAX_WINDOW:
                self._fail("SETTINGS_INITIAL_WINDOW_SIZE overflows a stream's window", ErrorCode.FLOW_CONTROL_ERROR)

    def _premature_reset(self) -> None:
        self.premature_resets += 1
        opened = self.streams_opened
        if opened >= self.limits.premature_reset_min_streams and self.premature_resets * 2 >= opened:
            self._fail(
                f"rapid reset: {self.premature_resets} of {opened} streams reset by the peer before they were answered",
                ErrorCode.ENHANCE_YOUR_CALM,
            )

    def _remote_closed(self, stream_id: int) -> None:
        st = self.streams.get(stream_id)
        if st is not None:
            st.remote_closed = True
            if st.local_closed:
                del self.streams[stream_id]
                self._closed_as(stream_id, _ENDED)

    def _fail(self, message: str, code: ErrorCode) -> NoReturn:
        """A connection error: GOAWAY with ``code`` queued, the connection marked closed, the error raised."""
        if not self.closed:
            self.closed = True
            self.out += _GOAWAY.pack(8 << 8 | GOAWAY, 0, 0, self._highest_inbound, code)
        raise HboneProtocolError(message, code)

    def _reset(self, stream_id: int, code: ErrorCode) -> StreamReset:
        """A stream error on an open stream: RST_STREAM sent, the stream closed; the event tells its consumer."""
        self.streams.pop(stream_id, None)
        self._refuse(stream_id, code)
        return StreamReset(stream_id, code, by_peer=False)

    def _refuse(self, stream_id: int, code: ErrorCode) -> None:
        self._closed_as(stream_id, _RESET_BY_US)
        self.out += _RST_STREAM.pack(4 << 8 | RST_STREAM, 0, stream_id, code)

    def _start_data(self, events: list[Event], pos: int, length: int, flags: int, stream_id: int) -> int:
        if length > self._conn_window:
            # RFC 9113 §6.9.1: the sender broke the connection's flow control, a connection error (as h2 and the
            # Rust h2 crate): what it sent past the window would be buffered on no one's account.
            self._fail(
                f"DATA of {length} bytes on stream {stream_id} past the connection's receive window "
                f"({self._conn_window} bytes left of {self._conn_max})",
                ErrorCode.FLOW_CONTROL_ERROR,
            )
        self._conn_window -= length
        st = self.streams.get(stream_id)
        if st is None:
            if not stream_id:
                self._fail("DATA on stream 0", ErrorCode.PROTOCOL_ERROR)
            if self._idle(stream_id):
                self._fail(f"DATA on idle stream {stream_id}", ErrorCode.PROTOCOL_ERROR)
            # A closed stream. The payload is read off the connection (and counted against its window) and dropped.
            # DATA that was in flight when we reset the stream is expected (a stream window can be hundreds of
            # frames) and ignored, as RFC 9113 §5.1 asks (h2 answers each with a RST_STREAM: a peer could make us
            # queue 13 bytes per 9 it sends); only empty frames, which carry nothing in flight, cost budget there.
            # On a stream closed otherwise, RST_STREAM STREAM_CLOSED, as h2 answers it, for budget.
            if self._closed.get(stream_id) == _RESET_BY_US:
                if length == 0:
                    self._spend("empty DATA frames on reset streams")
            else:
                self._spend("DATA frames on closed streams")
                self.out += _RST_STREAM.pack(4 << 8 | RST_STREAM, 0, stream_id, ErrorCode.STREAM_CLOSED)
            self._conn_released += length  # dropped: nobody holds it
        elif st.remote_closed or length > st.recv_window or (self.client_side and not st.responded):
            # DATA after END_STREAM (RFC 9113 §5.1), beyond the window (§6.9), or before the response (§8.1.1: a
            # malformed response): a stream error. The payload is still read off the connection (and counted
            # against its window), then dropped.
            self._spend("stream errors")
            if st.remote_closed:
                code = ErrorCode.STREAM_CLOSED
            elif length > st.recv_window:
                code = ErrorCode.FLOW_CONTROL_ERROR
            else:
                code = ErrorCode.PROTOCOL_ERROR
            events.append(self._reset(stream_id, code))
            self._conn_released += length  # dropped: nobody holds it
            st = None
        else:
            if length == 0 and not flags & FLAG_END_STREAM:
                self._spend("empty DATA frames")
            st.recv_window -= length  # flow control counts the whole payload, padding included
        self._data_stream = stream_id
        self._data_state = st
        self._data_end_stream = bool(flags & FLAG_END_STREAM)
        self._data_remaining = length  # with PADDED: the pad length byte + payload + padding until resolved
        self._data_padding = 0
        self._pad_length_pending = bool(flags & FLAG_PADDED)
        if length == 0 and self._pad_length_pending:
            self._fail("PADDED DATA frame without a pad length", ErrorCode.FRAME_SIZE_ERROR)
        if length == 0:
            self._finish_data(events)
        return pos + FRAME_HEADER_SIZE

    def _continue_data(self, events: list[Event], view: memoryview, pos: int, end: int) -> int:
        if self._pad_length_pending:
            pad = view[pos]
            pos += 1
            self._pad_length_pending = False
            if self._data_state is not None:
                self._data_state.held += 1  # the pad length byte is flow-controlled too
                self._conn_released += 1
            total = self._data_remaining - 1
            if pad > total:
                self._fail("DATA padding longer than the frame", ErrorCode.PROTOCOL_ERROR)
            self._data_remaining = total - pad
            self._data_padding = pad
        if self._data_remaining:
            n = min(self._data_remaining, end - pos)
            self._data_remaining -= n
            st = self._data_state
            if st is not None and n:
                st.unacked += n
                events.append(_new_tuple(DataReceived, (self._data_stream, view[pos : pos + n], n)))
            pos += n
        if not self._data_remaining and self._data_padding:
            n = min(self._data_padding, end - pos)
            self._data_padding -= n
            pos += n
            if self._data_state is not None:
                # Padding is flow-controlled but never delivered: release it at once.
                self._data_state.held += n
                self._conn_released += n
        if not self._data_remaining and not self._data_padding and not self._pad_length_pending:
            self._finish_data(events)
        return pos

    def _finish_data(self, events: list[Event]) -> None:
        st = self._data_state
        self._data_state = None
        if st is not None and self._data_end_stream:
            stream_id = self._data_stream
            self._remote_closed(stream_id)
            events.append(StreamEnded(stream_id))

    # -- flow control ----------------------------------------------------------------------------------------

    def ack_data(self, stream_id: int, nbytes: int) -> None:
        """The consumer has passed on (or dropped) ``nbytes`` of this stream's data: the peer may send that much
        more, on the stream and on the connection. Also for a stream already closed: the connection gets its share
        back (a consumer that drops a stream acknowledges what it held, or the connection would starve)."""
        st = self.streams.get(stream_id)
        if st is None:
            # Bounded by what is outstanding on the connection: a consumer's mistake cannot widen the window past
            # what we advertised.
            n = min(nbytes, self._conn_max - self._conn_window - self._conn_released)
        else:
            n = min(nbytes, st.unacked)
            st.unacked -= n
            held = st.held + n
            if held >= self._stream_threshold and not st.remote_closed:
                # Due: queued now (it leaves with the next flush, as the consumer's flush follows its acks), not kept
                # in a set for a later pass, so asking the core for output is just looking at ``out``.
                self.out += _WINDOW_UPDATE.pack(4 << 8 | WINDOW_UPDATE, 0, stream_id, held)
                st.recv_window += held
                st.held = 0
            else:
                st.held = held
        released = self._conn_released + n
        if released >= self._conn_due and released:
            self._release_connection(released)
        else:
            self._conn_released = released

    def flush_acks(self, stream_id: int) -> None:
        """Release a stream's held window now (a consumer that had paused has caught up)."""
        st = self.streams.get(stream_id)
        if st is not None and st.held and not st.remote_closed:
            self.out += _WINDOW_UPDATE.pack(4 << 8 | WINDOW_UPDATE, 0, stream_id, st.held)
            st.recv_window += st.held
            st.held = 0

    # -- sending ---------------------------------------------------------------------------------------------

    def send_connect(self, authority: str, headers: Iterable[tuple[str, str]] = (), method: str = "CONNECT") -> int:
        """Client: open a tunnel to ``authority`` (``ip:port``). Returns the stream id.

        ``method`` exists for conformance tests of servers (a non-CONNECT request must get a 400). Raises
        :class:`StreamLimitError` when no stream can be opened now."""
        if self.closed:
            raise StreamLimitError("the HTTP/2 connection has failed")
        limit = self.peer_max_streams
        if len(self.streams) >= limit:
            raise StreamLimitError(f"the peer allows {limit} concurrent streams, {len(self.streams)} are open")
        stream_id = self._next_stream_id
        if stream_id > _MAX_STREAM_ID:
            raise StreamLimitError("stream ids exhausted on this connection")
        self._next_stream_id = stream_id + 2
        block = [(":method", method), (":authority", authority)]
        if method != "CONNECT":
            block += [(":scheme", "https"), (":path", "/")]
        block += headers
        self._send_headers(stream_id, block, 0)
        self.streams[stream_id] = _Stream(self.settings.stream_window, self._peer_initial_window)
        return stream_id

    def send_response(
        self, stream_id: int, status: int, headers: Iterable[tuple[str, str]] = (), end_stream: bool = False
    ) -> None:
        """Server: answer a CONNECT. A non-200 status ends the stream (upstream sends errors with END_STREAM).
        Nothing is sent on a stream that is no longer open (the client reset it, or the connection failed)."""
        st = self.streams.get(stream_id)
        if st is None or st.local_closed or self.closed:
            return
        self._send_headers(stream_id, [(":status", str(status)), *headers], FLAG_END_STREAM if end_stream else 0)
        if status >= 200:
            st.responded = True
        if end_stream:
            self._local_closed(stream_id)

    def _send_headers(self, stream_id: int, headers: list[tuple[str, str]], flags: int) -> None:
        """A header block as HEADERS (+ CONTINUATIONs past the peer's frame size) queued for the wire."""
        block = encode_header_block(self._encoder, headers)
        size = self._peer_max_frame
        out = self.out
        if len(block) <= size:
            out += _HEADER.pack(len(block) << 8 | HEADERS, flags | FLAG_END_HEADERS, stream_id)
            out += block
            return
        out += _HEADER.pack(size << 8 | HEADERS, flags, stream_id)
        out += block[:size]
        for at in range(size, len(block), size):
            piece = block[at : at + size]
            last = at + size >= len(block)
            out += _HEADER.pack(len(piece) << 8 | CONTINUATION, FLAG_END_HEADERS if last else 0, stream_id)
            out += piece

    def send_window(self, stream_id: int) -> int:
        """How many payload bytes may be sent on ``stream_id`` now (flow control and frame size)."""
        st = self.streams.get(stream_id)
        if st is None or st.local_closed:
            return 0
        return min(st.send_window, self._send_window, self._peer_max_frame)

    def frame_data(self, stream_id: int, buf: bytearray | memoryview, offset: int, length: int) -> int:
        """Frame ``buf[offset:offset+length]`` as DATA, writing the header into ``buf[offset-9:offset]``.

        Returns how many payload bytes were framed (limited by the send window and the peer's frame size; 0 when the
        window is closed). The caller then sends :meth:`data_to_send` followed by ``buf[offset-9:offset+n]``.
        """
        st = self.streams.get(stream_id)
        if st is None or st.local_closed:
            return 0
        n = min(length, st.send_window, self._send_window, self._peer_max_frame)
        if n <= 0:
            return 0
        _HEADER.pack_into(buf, offset - FRAME_HEADER_SIZE, n << 8 | DATA, 0, stream_id)
        self._send_window -= n
        st.send_window -= n
        return n

    def end_stream(self, stream_id: int) -> None:
        """Half-close our side: an empty DATA frame with END_STREAM (upstream's write shutdown)."""
        st = self.streams.get(stream_id)
        if st is None or st.local_closed or self.closed:
            return
        self.out += _HEADER.pack(DATA, FLAG_END_STREAM, stream_id)
        self._local_closed(stream_id)

    def reset_stream(self, stream_id: int, code: ErrorCode = ErrorCode.CANCEL) -> None:
        """Reset a stream (RST_STREAM ``code``); nothing is sent for one already closed, or on a failed
        connection."""
        st = self.streams.pop(stream_id, None)
        if self.closed or (st is None and (stream_id in self._closed or self._idle(stream_id))):
            return
        self._refuse(stream_id, code)

    def _local_closed(self, stream_id: int) -> None:
        st = self.streams.get(stream_id)
        if st is not None:
            st.local_closed = True
            if st.remote_closed:
                del self.streams[stream_id]
                self._closed_as(stream_id, _ENDED)

    def ping(self, data: bytes = b"ztunnel!") -> None:
        """Queue a PING with ``data`` (8 bytes); its ACK arrives as :class:`PingAcked`."""
        if len(data) != 8:
            raise ValueError(f"PING data is 8 bytes, not {len(data)}")
        self.out += _HEADER.pack(8 << 8 | PING, 0, 0)
        self.out += data

    def goaway(self, code: ErrorCode = ErrorCode.NO_ERROR) -> None:
        """Tell the peer no new streams will be accepted (above the last one it opened); open ones may finish."""
        if self.goaway_sent is not None:
            return
        self.goaway_announced = False
        last = self._highest_inbound
        self.goaway_sent = last
        self.out += _GOAWAY.pack(8 << 8 | GOAWAY, 0, 0, last, code)

    def goaway_gracefully(self) -> None:
        """A server's graceful drain in two steps (RFC 9113 §6.8, as upstream's h2 crate): GOAWAY with the last
        stream id 2^31-1 and a PING; the final GOAWAY (:meth:`goaway`, the last stream the peer opened) once that
        PING is answered. A CONNECT the peer sent before it saw the first GOAWAY is then served, not refused: the
        PING's answer comes after every frame the peer sent before it."""
        if self.goaway_sent is not None or self.goaway_announced:
            return
        if not self._initiated:  # a drain during the TLS handshake: SETTINGS go first, the GOAWAY right after
            self._drain_on_initiate = True
            return
        self.goaway_announced = True
        self.out += _GOAWAY.pack(8 << 8 | GOAWAY, 0, 0, _MAX_STREAM_ID, ErrorCode.NO_ERROR)
        self.ping(DRAIN_PING)

    @property
    def open_streams(self) -> int:
        return len(self.streams)

    @property
    def receive_window(self) -> int:
        """How many more DATA bytes the peer may send on the whole connection (what it was told; a batch of window
        released but not yet sent as WINDOW_UPDATE is not in it)."""
        return self._conn_window

    @property
    def receive_held(self) -> int:
        """DATA bytes delivered to consumers whose connection window they have not released yet (they are still on
        their way to the app): at most the connection window."""
        return self._conn_max - self._conn_window - self._conn_released

    def data_to_send(self) -> bytes:
        """Everything queued for the wire before the next DATA frame, in the order it was made (the preface and
        SETTINGS first, window updates when they fell due). The I/O layer reads and clears :attr:`out` instead."""
        out = self.out
        if not out:
            return b""
        data = bytes(out)
        out.clear()
        return data


def _frame_name(ftype: int) -> str:
    return _FRAME_NAMES.get(ftype, f"type {ftype:#x}")


_FRAME_NAMES = {
    DATA: "DATA",
    HEADERS: "HEADERS",
    PRIORITY: "PRIORITY",
    RST_STREAM: "RST_STREAM",
    SETTINGS: "SETTINGS",
    PUSH_PROMISE: "PUSH_PROMISE",
    PING: "PING",
    GOAWAY: "GOAWAY",
    WINDOW_UPDATE: "WINDOW_UPDATE",
    CONTINUATION: "CONTINUATION",
}


_REQUEST_PSEUDO = frozenset({b":method", b":scheme", b":authority", b":path", b":protocol"})
# RFC 9113 §8.2.2: connection-specific fields make a request malformed.
_CONNECTION_SPECIFIC = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade"})
_UNKNOWN_PSEUDO = "unknown pseudo-header"
# What RFC 3986 §3.2 lets an authority hold (userinfo@host:port, IP literals in brackets, %-escapes).
_AUTHORITY_BYTES = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-._~%!$&'()*+,;=:@[]"


def _request_problem(raw: Iterable[tuple[bytes | str, bytes | str]]) -> str | None:
    """Why a request's header list is malformed (RFC 9113 §8.3), or None. As upstream's h2 crate: a CONNECT
    without :authority is *not* malformed here (the handler answers it 400), one with :scheme or :path is."""
    pseudo: dict[bytes, bytes] = {}
    regular = False
    for k, v in raw:
        name = k.encode() if isinstance(k, str) else k
        value = v.encode() if isinstance(v, str) else v
        if name.startswith(b":"):
            if name not in _REQUEST_PSEUDO:
                return f"{_UNKNOWN_PSEUDO} {name!r}"
            if regular:
                return f"pseudo-header {name!r} after a regular header"
            if name in pseudo:
                return f"duplicate {name!r}"
            pseudo[name] = value
            continue
        regular = True
        if not name or name != name.lower():
            return f"header name {name!r} is empty or not lowercase"
        if name in _CONNECTION_SPECIFIC or (name == b"te" and value != b"trailers"):
            return f"connection-specific header {name!r}"
        if b"\r" in value or b"\n" in value or b"\0" in value:
            return f"header {name!r} has CR, LF or NUL in its value"
    method = pseudo.get(b":method")
    if method is None:
        return "no :method"
    authority = pseudo.get(b":authority")
    if authority is not None and authority.strip(_AUTHORITY_BYTES):
        return "an :authority with characters a URI authority cannot hold (RFC 3986 §3.2)"
    if method == b"CONNECT" and b":protocol" not in pseudo:
        if b":scheme" in pseudo or b":path" in pseudo:
            return ":scheme or :path in a CONNECT request"
    elif b":scheme" not in pseudo or b":path" not in pseudo:
        return f"{method!r} request without :scheme or :path"
    return None


def _decode_headers(raw: Iterable[tuple[bytes, bytes]]) -> dict[str, str]:
    """Header fields by name (the last of repeated ones), crumbs of a split ``cookie`` joined with "; " (RFC 9113
    §8.2.3, as h2 joins them)."""
    out: dict[str, str] = {}
    for k, v in raw:
        key = k.decode("ascii", "replace")
        value = v.decode("utf-8", "replace")
        if key == "cookie" and key in out:
            value = out[key] + "; " + value
        out[key] = value
    return out


# A header name of lowercase token characters (RFC 9110 §5.6.2; no colon, no upper case) and a value of visible ASCII
# and inner spaces/tabs that neither starts nor ends with whitespace: what h2's validate_headers accepts of each field
# of a response (its rules: RFC 9113 §8.2.1), in a form a regular expression checks at C speed.
_PLAIN_NAME = re.compile(rb"[a-z0-9!#$%&'*+\-.^_`|~]+")
_PLAIN_VALUE = re.compile(rb"(?:[\x21-\x7e](?:[\x20-\x7e\t]*[\x21-\x7e])?)?")
_RESPONSE_PSEUDO = frozenset({b":method", b":scheme", b":authority", b":path", b":protocol", b":status"})


def plainly_valid_response(headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether a received response's header list is certainly valid (one ``:status`` first, no other pseudo-header,
    plain lowercase names, no connection-specific field or TE, values of visible ASCII not surrounded by
    whitespace): two C regex matches per field. False means "check it with :func:`_response_problem`", not
    "invalid"."""
    if not headers or headers[0][0] != b":status" or not _PLAIN_VALUE.fullmatch(headers[0][1]):
        return False
    for name, value in headers[1:]:
        if (
            not _PLAIN_NAME.fullmatch(name)
            or not _PLAIN_VALUE.fullmatch(value)
            or name in _CONNECTION_SPECIFIC
            or name == b"te"
        ):
            return False
    return True


def _response_problem(headers: list[tuple[bytes, bytes]]) -> str | None:
    """Why a response's header list is malformed (RFC 9113 §8.2, §8.3.2), or None: what h2 checks of a response
    when it validates inbound headers (``h2.utilities.validate_headers``; tests/proxy/hbone/test_stream_states.py
    holds the two to the same verdicts)."""
    pseudo: set[bytes] = set()
    regular = False
    for name, value in headers:
        if not name:
            return "empty header name"
        for c in name:
            if 0x41 <= c <= 0x5A or c <= 0x20 or c >= 0x7F:
                return f"header name {name!r} has an upper-case or illegal character"
        if name.find(b":", 1) != -1:
            return f"header name {name!r} has a colon"
        if value:
            if b"\0" in value or b"\n" in value or b"\r" in value:
                return f"header {name!r} has CR, LF or NUL in its value"
            if value[0] in b" \t" or value[-1] in b" \t":
                return f"header {name!r} has a value surrounded by whitespace"
        if name == b"te" and value.lower() != b"trailers":
            return "TE other than trailers"
        if name in _CONNECTION_SPECIFIC:
            return f"connection-specific header {name!r}"
        if name[0] == 0x3A:  # ':'
            if name in pseudo:
                return f"duplicate {name!r}"
            if regular:
                return f"pseudo-header {name!r} after a regular header"
            if name not in _RESPONSE_PSEUDO:
                return f"{_UNKNOWN_PSEUDO} {name!r}"
            pseudo.add(name)
        else:
            regular = True
    if b":status" not in pseudo:
        return "no :status"
    if len(pseudo) > 1:
        return f"request pseudo-headers {sorted(pseudo - {b':status'})!r} in a response"
    return None


# -- header blocks -------------------------------------------------------------------------------------------------
# HBONE header blocks are a handful of fields sent once per stream, most of them with values that differ on every
# stream (:authority, baggage, forwarded, traceparent). hpack's Encoder looks each one up in its tables and inserts
# it into the dynamic table (evicting older ones), and the peer's decoder inserts it again: ~30% of h2's work per
# stream on both sides. A block of literals *without indexing* (RFC 7541 §6.2.2) leaves both dynamic tables alone,
# costs only byte concatenation here and a table-free decode there, and is valid for every HPACK decoder (Rust h2,
# Envoy). Fields in the static table whole (":status: 200") are sent as their one-byte index. Plain octets, no
# Huffman: hpack's pure-Python Huffman decoder was the largest single cost of a CONNECT on the receiving side.


def _hpack_int(value: int, prefix_bits: int, first: int = 0) -> bytes:
    """RFC 7541 §5.1: ``value`` with an N-bit prefix, ``first`` holding the representation's high bits."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first | value,))
    out = bytearray((first | limit,))
    value -= limit
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _static_tables() -> tuple[dict[tuple[bytes, bytes], bytes], dict[bytes, bytes]]:
    whole: dict[tuple[bytes, bytes], bytes] = {}
    names: dict[bytes, bytes] = {}
    for index, (name, value) in enumerate(hpack.table.HeaderTable.STATIC_TABLE, start=1):
        if value:
            whole.setdefault((name, value), _hpack_int(index, 7, 0x80))  # indexed field (§6.1)
        names.setdefault(name, _hpack_int(index, 4))  # literal without indexing, indexed name (§6.2.2)
    return whole, names


_STATIC_WHOLE, _STATIC_NAME = _static_tables()
# Lengths below 127 (all but very long values) are one byte: H bit clear, 7-bit prefix.
_SHORT_LENGTH = [bytes((n,)) for n in range(127)]


def literal_header_block(headers: Iterable[tuple[str, str]]) -> bytes:
    """An HPACK header block of ``headers`` (UTF-8) that uses no dynamic table: static-table indexes for whole
    static fields, otherwise literals without indexing with the name from the static table where it is there."""
    out = bytearray()
    for name, value in headers:
        n = name.encode()
        v = value.encode()
        whole = _STATIC_WHOLE.get((n, v))
        if whole is not None:
            out += whole
            continue
        prefix = _STATIC_NAME.get(n)
        if prefix is None:
            out += b"\x00"
            out += _SHORT_LENGTH[len(n)] if len(n) < 127 else _hpack_int(len(n), 7)
            out += n
        else:
            out += prefix
        out += _SHORT_LENGTH[len(v)] if len(v) < 127 else _hpack_int(len(v), 7)
        out += v
    return bytes(out)


def encode_header_block(encoder: hpack.Encoder, headers: list[tuple[str, str]]) -> bytes:
    """The header block for ``headers`` on a connection whose HPACK encoder is ``encoder``: literal (see
    :func:`literal_header_block`) unless the peer changed the dynamic table size and the encoder owes it a size
    update (RFC 7541 §4.2, at the start of the next block), which hpack's own encoding then carries (values as
    plain literals: hpack's pure-Python Huffman coding costs more than the few bytes it saves)."""
    if encoder.header_table.resized:
        return bytes(encoder.encode(headers, huffman=False))
    return literal_header_block(headers)


_STATIC_ENTRIES: tuple[tuple[bytes, bytes], ...] = hpack.table.HeaderTable.STATIC_TABLE


def _hpack_int_at(block: bytes, pos: int, mask: int) -> tuple[int, int]:
    """RFC 7541 §5.1: the integer with a ``mask``-sized prefix at ``block[pos]``, and the position after it. Raises
    IndexError when the block ends inside it, ValueError when it is longer than any header list we accept."""
    value = block[pos] & mask
    pos += 1
    if value < mask:
        return value, pos
    shift = 0
    while True:
        byte = block[pos]
        pos += 1
        value += (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
        if shift > 28:
            raise ValueError("HPACK integer too long")


def decode_plain_block(decoder: hpack.Decoder, block: bytes) -> list[tuple[bytes, bytes]] | None:
    """The header list of a block that leaves the dynamic table alone and has no Huffman-coded string (static-table
    indexes and literals without indexing: what :func:`literal_header_block` makes), or None for any other block, or
    one hpack would reject (too large, truncated, a bad index): ``decoder`` (hpack's) then decodes it, with its
    errors. Decoding such a block with hpack changes nothing in ``decoder``, so declining costs nothing but time."""
    if decoder.header_table_size > decoder.max_allowed_table_size:
        return None  # hpack would refuse the block until the peer shrinks its table
    limit = decoder.max_header_list_size
    out: list[tuple[bytes, bytes]] = []
    size = 0
    pos, end = 0, len(block)
    try:
        while pos < end:
            first = block[pos]
            if first & 0x80:  # indexed field (§6.1): static entries only
                index, pos = _hpack_int_at(block, pos, 0x7F)
                if not 0 < index <= len(_STATIC_ENTRIES):
                    return None
                name, value = _STATIC_ENTRIES[index - 1]
            elif first & 0xF0:  # indexing, never-indexed or a table size update: hpack's
                return None
            else:  # literal without indexing (§6.2.2)
                index, pos = _hpack_int_at(block, pos, 0x0F)
                if index:
                    if index > len(_STATIC_ENTRIES):
                        return None
                    name = _STATIC_ENTRIES[index - 1][0]
                else:
                    if block[pos] & 0x80:  # Huffman-coded
                        return None
                    length, pos = _hpack_int_at(block, pos, 0x7F)
                    name = block[pos : pos + length]
                    pos += length
                if block[pos] & 0x80:
                    return None
                length, pos = _hpack_int_at(block, pos, 0x7F)
                value = block[pos : pos + length]
                pos += length
                if pos > end:
                    return None
            size += len(name) + len(value) + 32  # RFC 7541 §4.1, as hpack counts the list against its limit
            if size > limit:
                return None
            out.append((name, value))
    except (IndexError, ValueError):
        return None
    return out
