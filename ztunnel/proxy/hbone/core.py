"""Sans-IO HBONE: HTTP/2 CONNECT tunnels on h2, with DATA frames kept off h2's per-frame path.

Theory of operation
-------------------
h2 is the state machine for everything but DATA and GOAWAY: the connection preface and SETTINGS, HEADERS (the CONNECT
request and its response), RST_STREAM, WINDOW_UPDATE and PING all reach ``H2Connection``'s state machines, so stream
states and the protocol checks are h2's. GOAWAY is sent and received here, because h2 stops sending anything
once either happened, and a graceful GOAWAY must let the open streams finish. DATA frames, which carry every
tunnelled byte, are parsed and built here instead, because h2's path for them costs several copies and an eager
``repr`` of each frame (hex-encoding the payload: about 20% of a receiver's CPU, measured on these machines). This
is the split the benchmark needs.

The HEADERS of a CONNECT and of its response (a whole block in one frame) skip h2's frame objects and generic header
pipeline: built and parsed here, then handed to h2's state machines through ``thirdparty.h2_headers_sent`` /
``h2_headers_received`` (version-guarded, h2 the oracle in tests/proxy/hbone/test_headers_direct.py). Our blocks are
HPACK literals without indexing (:func:`literal_header_block`), and such blocks are decoded without hpack
(:func:`decode_plain_block`); any other block (a peer that indexes or Huffman-codes) goes to hpack's decoder. The
sans-IO stream lifecycle went from ~150 to ~100 µs (bench/README.md, "Optimisations").

Receiving: the I/O layer decrypts straight into :meth:`HboneConnection.get_buffer` and calls
:meth:`HboneConnection.buffer_updated`. DATA payloads are delivered *streaming*, as soon as bytes of a frame arrive
(a 1 MiB frame need not be buffered whole), as :class:`DataReceived` events whose ``data`` is a memoryview into the
receive buffer: valid until the next ``get_buffer``; a consumer that keeps it (a transport that could not write it
all) calls :meth:`HboneConnection.pin` and the next read goes to a fresh buffer. Other frames are passed, in wire
order, to h2 whole. A DATA frame on a stream this side does not know (closed, reset) also goes to h2, which answers
it the way RFC 9113 asks.

Flow control: the connection window is released as soon as bytes are taken off the connection (the consumer has
them), so one slow stream cannot stall the others; a stream's window is released by the consumer
(:meth:`ack_data`) once the bytes have left, so a slow reader holds back at most its 4 MiB stream window. Window
updates are batched (sent once a quarter of the window is consumed) so small request/response traffic costs no
extra frames.

Sending: :meth:`frame_data` writes the 9-byte DATA header into the caller's buffer just before the payload, so
header and payload reach TLS as one contiguous write (one record, no copy). Windows and the peer's maximum frame
size are read from, and charged to, h2's own accounting, so h2's WINDOW_UPDATE handling stays authoritative.
Anything h2 has queued (HEADERS, WINDOW_UPDATE, ...) is returned first, so frames leave in the order they were made.
"""

from __future__ import annotations

import contextlib
import enum
import struct
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NoReturn

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import h2.stream
import hpack
import hpack.table

from ztunnel import thirdparty
from ztunnel.errors import ZtunnelError

# Frame header: 24-bit length + 8-bit type packed as one u32, then flags (u8) and stream id (u32).
_HEADER = struct.Struct(">IBI")
_WINDOW_UPDATE = struct.Struct(">IBII")
_GOAWAY = struct.Struct(">IBIII")
FRAME_HEADER_SIZE = 9
DATA = 0x0
HEADERS = 0x1
PRIORITY = 0x2
RST_STREAM = 0x3
SETTINGS = 0x4
PING = 0x6
GOAWAY = 0x7
CONTINUATION = 0x9
FLAG_END_STREAM = 0x1
FLAG_ACK = 0x1
FLAG_END_HEADERS = 0x4
FLAG_PADDED = 0x8
FLAG_PRIORITY = 0x20
# How many recently reset stream ids are remembered, so DATA the peer had in flight when we reset them is not
# mistaken for abuse (one stream window, 4 MiB, can be hundreds of frames).
_RECENT_RESETS = 256
# How many closed streams h2 remembers the ending of (reset or END_STREAM), to answer a late frame on one with
# RST_STREAM instead of a connection error. h2's own bound is 65,536: ~11 MiB of OrderedDict on every pooled
# connection that has carried that many streams, for the connection's life (the soak found it). A late frame comes
# within a round trip, long before another 1,024 streams close; Rust's h2 (upstream) keeps 50 reset streams for 1 s.
_CLOSED_STREAMS_REMEMBERED = 1024
_PREFACE_SIZE = 24
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


@dataclass(slots=True)
class DataReceived:
    """Payload bytes for a stream; ``data`` is a view into the receive buffer (see the module docstring)."""

    stream_id: int
    data: memoryview
    flow_controlled_length: int


@dataclass(slots=True)
class StreamEnded:
    """The peer half-closed the stream (END_STREAM): EOF on this stream's read side."""

    stream_id: int


@dataclass(slots=True)
class StreamReset:
    """The peer reset the stream. NO_ERROR and CANCEL are read as EOF by upstream; others are real resets."""

    stream_id: int
    error_code: int

    @property
    def is_eof(self) -> bool:
        return self.error_code in (ErrorCode.NO_ERROR, ErrorCode.CANCEL)


@dataclass(slots=True)
class WindowOpened:
    """The peer granted more send window (``stream_id`` 0: the whole connection)."""

    stream_id: int


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
class RemoteSettingsChanged:
    max_concurrent_streams: int | None


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
    | RemoteSettingsChanged
    | RequestRefused
)


class HboneProtocolError(ZtunnelError):
    """The peer broke HTTP/2 badly enough that the connection must close; a GOAWAY has been queued."""

    def __init__(self, message: str, code: ErrorCode = ErrorCode.PROTOCOL_ERROR) -> None:
        super().__init__(message)
        self.code = code


@dataclass(slots=True)
class _Stream:
    """What the DATA fast path needs to know of an open stream."""

    recv_window: int
    unacked: int = 0  # received, delivered, not yet released by the consumer
    remote_closed: bool = False
    local_closed: bool = False
    held: int = 0  # released by the consumer while the window update is being batched
    responded: bool = False  # server: response headers sent (a reset before that is "premature")


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
        self._header_block = -1  # bytes of the header block being received; -1: none open
        # Streams reset recently, insertion-ordered and bounded by _RECENT_RESETS: by us (DATA still in flight on
        # them is expected) and by the peer (one RST_STREAM per stream is normal, more is a flood).
        self._reset_by_us: dict[int, None] = {}
        self._reset_by_peer: dict[int, None] = {}
        self.streams_opened = 0  # by the peer (server role)
        self.malformed_requests = 0  # refused with RST_STREAM PROTOCOL_ERROR (server role)
        self.premature_resets = 0
        config = h2.config.H2Configuration(
            client_side=client_side,
            header_encoding=None,
            # A client keeps h2's validation of responses. A server checks requests itself (_request_problem):
            # h2 turns a malformed request into a connection error (GOAWAY), which would cut every other tunnel
            # on the connection, where upstream's h2 crate resets only that stream (RFC 9113 §8.1.1); ours costs
            # ~6 µs for a ztunnel CONNECT's five headers, h2's ~19 µs. Outbound
            # headers are built by this code from known-good values: h2's per-header validation and
            # normalisation were ~40% of send_headers' time on the connection-rate benchmark.
            validate_inbound_headers=client_side,
            validate_outbound_headers=False,
            normalize_outbound_headers=False,
        )
        self.h2 = h2.connection.H2Connection(config=config)
        # At most _CLOSED_STREAMS_REMEMBERED closed streams, header values as plain literals (the numbers: there).
        thirdparty.adjust_h2(self.h2, closed_streams=_CLOSED_STREAMS_REMEMBERED)
        self._end_stream_direct = thirdparty.enabled(thirdparty.H2_END_STREAM)
        # CONNECT requests and their responses sent and received without h2's frame objects (thirdparty.H2_HEADERS).
        self._headers_direct = thirdparty.enabled(thirdparty.H2_HEADERS)
        self.streams: dict[int, _Stream] = {}
        # Allocated at the first receive: a connection still in its TLS handshake (or stalled there) costs none.
        self._buf = bytearray()
        self._view = memoryview(self._buf)
        self._start = 0  # first unparsed byte
        self._end = 0  # end of received bytes
        self._pinned = False
        self._need = 0  # bytes the incomplete frame at _start needs in the buffer
        # A server first reads the 24-byte client preface ("PRI * HTTP/2.0..."), which h2 checks.
        self._preface = 0 if client_side else _PREFACE_SIZE
        self._ack_ready: set[int] = set()  # streams whose held window reached the update threshold
        # The DATA frame being received, if its header has been parsed: stream, payload and padding left.
        self._data_stream = 0
        self._data_state: _Stream | None = None
        self._data_remaining = 0
        self._data_padding = 0
        self._data_end_stream = False
        self._pad_length_pending = False
        self._conn_unacked = 0
        self._out = bytearray()
        self.goaway_received: GoAwayReceived | None = None
        self.goaway_sent: int | None = None  # the last stream id we promised to process
        self.closed = False

    # -- setup -----------------------------------------------------------------------------------------------

    def initiate(self) -> None:
        """Queue the preface and SETTINGS, and raise the connection window from 64 KiB to its configured size."""
        s = self.settings
        local: dict[h2.settings.SettingCodes, int] = {
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: s.stream_window,
            h2.settings.SettingCodes.MAX_FRAME_SIZE: s.max_frame_size,
            h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: s.max_header_list_size,
        }
        if self.client_side:
            local[h2.settings.SettingCodes.ENABLE_PUSH] = 0
        if s.max_concurrent_streams is not None:
            local[h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS] = s.max_concurrent_streams
        self.h2.local_settings = h2.settings.Settings(client=self.client_side, initial_values=local)
        # h2 applies a header list limit to its HPACK decoder only on a SETTINGS ACK; ours is in force at once.
        self.h2.decoder.max_header_list_size = s.max_header_list_size
        self.h2.initiate_connection()
        if s.max_concurrent_streams is not None and not self.client_side:
            # We advertise the limit (above) and enforce it ourselves in _translate: a stream over it is refused
            # alone (RST_STREAM REFUSED_STREAM, as upstream's h2 crate, RFC 9113 §5.1.2), where h2's own check ends
            # the whole connection. Set without sending, h2 takes this (unlimited) value once the peer ACKs.
            self.h2.local_settings[h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS] = 2**31 - 1
        # h2 only applies a bigger inbound frame limit once the peer ACKs our SETTINGS; frames it parses (all but
        # DATA) may legitimately be that large as soon as the peer has seen them, so accept them from the start.
        self.h2.max_inbound_frame_size = s.max_frame_size
        increment = s.connection_window - 65535
        if increment > 0:
            self.h2.increment_flow_control_window(increment)

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
                    ev.data = memoryview(bytes(ev.data))
                events.append(ev)
        return events

    def buffer_updated(self, nbytes: int) -> list[Event]:
        """``nbytes`` were written into the last :meth:`get_buffer`; parse them into events (in wire order)."""
        self._end += nbytes
        events: list[Event] = []
        view = self._view
        pos, end = self._start, self._end
        h2_from = -1  # start of a run of complete non-DATA frames to hand to h2 together
        self._need = 0
        if self._preface:
            if end - pos < self._preface:
                return events
            h2_from = pos
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
            if ftype == DATA:
                if h2_from >= 0:
                    # The frames before may open the stream (its CONNECT in the same read) or end it (a RST_STREAM):
                    # h2 sees them first.
                    events.extend(self._to_h2(view[h2_from:pos]))
                    h2_from = -1
                if stream_id in self.streams:
                    if length == 0 and not flags & FLAG_END_STREAM:
                        self._spend("empty DATA frames")
                    pos = self._start_data(events, pos, length, flags, stream_id)
                    continue
            if ftype in (HEADERS, CONTINUATION) and max(self._header_block, 0) + length > self._header_block_limit:
                # Checked on the frame header, before buffering a frame that may be up to 1 MiB.
                self._fail(
                    f"header block over {self._header_block_limit} bytes (SETTINGS_MAX_HEADER_LIST_SIZE "
                    f"{self.settings.max_header_list_size})",
                    ErrorCode.ENHANCE_YOUR_CALM,
                )
            # A whole non-DATA frame (or DATA for a stream h2 must answer) goes to h2.
            if end - pos < FRAME_HEADER_SIZE + length:
                self._need = FRAME_HEADER_SIZE + length
                break
            if (
                ftype == HEADERS
                and flags & (FLAG_END_HEADERS | FLAG_PADDED | FLAG_PRIORITY) == FLAG_END_HEADERS
                and self._header_block < 0
                and self._headers_direct
                and self._opens_exchange(stream_id)
            ):
                # A whole request or response in one frame: decoded here and handed to h2's state machines
                # directly, not parsed into a frame object (thirdparty.H2_HEADERS). In wire order with the rest.
                if h2_from >= 0:
                    events.extend(self._to_h2(view[h2_from:pos]))
                    h2_from = -1
                start = pos + FRAME_HEADER_SIZE
                events.extend(self._headers_frame(stream_id, bytes(view[start : start + length]), flags))
                pos = start + length
                continue
            if ftype != DATA:
                self._account(ftype, flags, length, stream_id)
            elif stream_id not in self._reset_by_us:
                self._spend("DATA frames on closed streams")
            if ftype == GOAWAY and stream_id == 0 and length >= 8:
                # Handled here, not by h2: h2 moves its state machine to CLOSED on a received GOAWAY and then
                # refuses to send anything (END_STREAM, RST_STREAM, a response), while a graceful GOAWAY lets the
                # open streams finish (RFC 9113 §6.8). A malformed GOAWAY still goes to h2, which rejects it.
                if h2_from >= 0:
                    events.extend(self._to_h2(view[h2_from:pos]))
                    h2_from = -1
                events.append(self._goaway_frame(view[pos + FRAME_HEADER_SIZE : pos + FRAME_HEADER_SIZE + length]))
                pos += FRAME_HEADER_SIZE + length
                continue
            if h2_from < 0:
                h2_from = pos
            pos += FRAME_HEADER_SIZE + length
        if h2_from >= 0:
            events.extend(self._to_h2(view[h2_from:pos]))
        self._start = pos
        self._send_window_updates()
        return events

    def _account(self, ftype: int, flags: int, length: int, stream_id: int) -> None:
        """Charge a complete control frame to the abuse budgets (see :class:`Limits`)."""
        if ftype == HEADERS:
            self._header_block = -1 if flags & FLAG_END_HEADERS else length
        elif ftype == CONTINUATION:
            if self._header_block >= 0:  # else h2 rejects the stray CONTINUATION itself
                self._header_block = -1 if flags & FLAG_END_HEADERS else self._header_block + length
            if length == 0:
                self._spend("empty CONTINUATION frames")
        elif ftype in (PING, SETTINGS):
            if not flags & FLAG_ACK:
                self._spend("PING frames" if ftype == PING else "SETTINGS frames")
        elif ftype == PRIORITY:
            self._spend("PRIORITY frames")
        elif ftype == RST_STREAM:
            # The stream may not be open yet (h2 sees its HEADERS later in this read), so "closed" is judged by
            # whether the peer already reset it.
            if stream_id in self._reset_by_peer:
                self._spend("RST_STREAM frames on closed streams")
            else:
                _remember(self._reset_by_peer, stream_id)
        elif ftype > CONTINUATION:
            self._spend("frames of unknown type")

    def _spend(self, what: str) -> None:
        if not self._control.spend():
            lim = self.limits
            self._fail(
                f"flood of {what}: over {lim.control_frame_burst} payload-free frames at once or "
                f"{lim.control_frames_per_second:g}/s sustained",
                ErrorCode.ENHANCE_YOUR_CALM,
            )

    def _goaway_frame(self, payload: memoryview) -> GoAwayReceived:
        last, code = struct.unpack_from(">II", payload)
        g = GoAwayReceived(code, last & 0x7FFFFFFF, bytes(payload[8:]))
        self.goaway_received = g
        return g

    def _start_data(self, events: list[Event], pos: int, length: int, flags: int, stream_id: int) -> int:
        st: _Stream | None = self.streams[stream_id]
        assert st is not None
        if st.remote_closed or length > st.recv_window:
            # DATA after END_STREAM (RFC 9113 §5.1) or beyond the window (§6.9): a stream error. The payload is
            # still read off the connection (and counted against its window), then dropped.
            self._fail_stream(stream_id, ErrorCode.STREAM_CLOSED if st.remote_closed else ErrorCode.FLOW_CONTROL_ERROR)
            st = None
        else:
            st.recv_window -= length  # flow control counts the whole payload, padding included
        self._conn_unacked += length
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
                events.append(DataReceived(self._data_stream, view[pos : pos + n], n))
            pos += n
        if not self._data_remaining and self._data_padding:
            n = min(self._data_padding, end - pos)
            self._data_padding -= n
            pos += n
            if self._data_state is not None:
                # Padding is flow-controlled but never delivered: release it at once.
                self._data_state.held += n
        if not self._data_remaining and not self._data_padding and not self._pad_length_pending:
            self._finish_data(events)
        return pos

    def _finish_data(self, events: list[Event]) -> None:
        st = self._data_state
        stream_id = self._data_stream
        self._data_state = None
        if st is not None and self._data_end_stream:
            st.remote_closed = True
            # Tell h2 the stream ended with an empty END_STREAM frame so its state machine moves on: handed to its
            # frame handler directly when we may (no serialize and re-parse; thirdparty.H2_END_STREAM).
            if self._end_stream_direct:
                try:
                    h2_events = thirdparty.h2_end_stream_received(self.h2, stream_id)
                except h2.exceptions.ProtocolError as e:
                    self._h2_failed(e)
                events.extend(self._translate(h2_events))
            else:
                events.extend(self._to_h2(_HEADER.pack(DATA, FLAG_END_STREAM, stream_id)))

    def _opens_exchange(self, stream_id: int) -> bool:
        """Whether a HEADERS frame on ``stream_id`` is one h2 would take as a new request (server) or the first
        response to our request (client), never as a frame on a closed stream (which h2 answers its own way)."""
        if self.client_side:
            stream = self.h2.streams.get(stream_id)
            if stream is None:
                return False
            machine = stream.state_machine
            return not machine.headers_received and machine.state in _AWAITING_RESPONSE
        return stream_id & 1 == 1 and stream_id > self.h2.highest_inbound_stream_id and stream_id not in self.h2.streams

    def _headers_frame(self, stream_id: int, block: bytes, flags: int) -> list[Event]:
        try:
            h2_events = thirdparty.h2_headers_received(
                self.h2, stream_id, block, bool(flags & FLAG_END_STREAM), decode_plain_block
            )
        except h2.exceptions.ProtocolError as e:
            self._h2_failed(e)
        return self._translate(h2_events)

    def _to_h2(self, frames: bytes | memoryview) -> list[Event]:
        try:
            h2_events = self.h2.receive_data(frames)
        except h2.exceptions.ProtocolError as e:
            self._h2_failed(e)
        return self._translate(h2_events)

    def _h2_failed(self, e: h2.exceptions.ProtocolError) -> NoReturn:
        self.closed = True
        code = getattr(e, "error_code", ErrorCode.PROTOCOL_ERROR)
        raise HboneProtocolError(f"HTTP/2 protocol error ({type(e).__name__}): {e}", ErrorCode(int(code))) from None

    def _translate(self, h2_events: Iterable[h2.events.Event]) -> list[Event]:
        out: list[Event] = []
        for ev in h2_events:
            if isinstance(ev, h2.events.RequestReceived):
                if self.goaway_sent is not None and ev.stream_id > self.goaway_sent:
                    self.reset_stream(ev.stream_id, ErrorCode.REFUSED_STREAM)  # after our GOAWAY: not processed
                    continue
                # Counted here, request by request (h2 has seen the whole batch of frames already).
                limit = self.settings.max_concurrent_streams
                if limit is not None and len(self.streams) >= limit:
                    self._fail_stream(ev.stream_id, ErrorCode.REFUSED_STREAM)
                    continue
                problem = _request_problem(ev.headers)
                if problem is not None:
                    if problem.startswith(_UNKNOWN_PSEUDO):  # a connection error in the h2 crate too
                        self._fail(f"malformed request on stream {ev.stream_id}: {problem}", ErrorCode.PROTOCOL_ERROR)
                    self.malformed_requests += 1
                    self._fail_stream(ev.stream_id, ErrorCode.PROTOCOL_ERROR)
                    out.append(RequestRefused(ev.stream_id, problem))
                    continue
                headers = _decode_headers(ev.headers)
                self.streams[ev.stream_id] = _Stream(recv_window=self.settings.stream_window)
                self.streams_opened += 1
                out.append(
                    ConnectRequested(ev.stream_id, headers.pop(":method", ""), headers.pop(":authority", ""), headers)
                )
                if ev.stream_ended is not None:
                    self.streams[ev.stream_id].remote_closed = True
                    out.append(StreamEnded(ev.stream_id))
            elif isinstance(ev, h2.events.ResponseReceived):
                headers = _decode_headers(ev.headers)
                status = headers.pop(":status", "0")
                out.append(ConnectResponded(ev.stream_id, int(status) if status.isdigit() else 0, headers))
                if ev.stream_ended is not None:
                    self._remote_closed(ev.stream_id)
                    out.append(StreamEnded(ev.stream_id))
            elif isinstance(ev, h2.events.StreamEnded):
                self._remote_closed(ev.stream_id)
                out.append(StreamEnded(ev.stream_id))
            elif isinstance(ev, h2.events.StreamReset):
                st = self.streams.pop(ev.stream_id, None)
                if st is not None and not self.client_side and not st.responded:
                    self._premature_reset()
                out.append(StreamReset(ev.stream_id, int(ev.error_code or 0)))
            elif isinstance(ev, h2.events.WindowUpdated):
                out.append(WindowOpened(ev.stream_id or 0))
            elif isinstance(ev, h2.events.PingAckReceived):
                out.append(PingAcked(bytes(ev.ping_data or b"")))
            elif isinstance(ev, h2.events.ConnectionTerminated):
                code, last = int(ev.error_code or 0), int(ev.last_stream_id or 0)
                g = GoAwayReceived(code, last, bytes(ev.additional_data or b""))
                self.goaway_received = g
                out.append(g)
            elif isinstance(ev, h2.events.RemoteSettingsChanged):
                changed = ev.changed_settings.get(h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS)
                out.append(RemoteSettingsChanged(changed.new_value if changed is not None else None))
                if h2.settings.SettingCodes.INITIAL_WINDOW_SIZE in ev.changed_settings:
                    out.append(WindowOpened(0))
            elif isinstance(ev, h2.events.DataReceived) and ev.flow_controlled_length:
                # Only reached for DATA on streams the fast path does not track: give h2 its window back.
                self.h2.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
            # TrailersReceived, PriorityUpdated, SettingsAcknowledged, ... need nothing from a tunnel.
        return out

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

    def _fail(self, message: str, code: ErrorCode) -> None:
        self.closed = True
        self.h2.close_connection(error_code=code)
        raise HboneProtocolError(message, code)

    def _fail_stream(self, stream_id: int, code: ErrorCode) -> None:
        # The frame's bytes are still consumed (and counted against the connection window) by the caller.
        self.streams.pop(stream_id, None)
        _remember(self._reset_by_us, stream_id)
        self._spend("stream errors")  # each one costs us a RST_STREAM
        with contextlib.suppress(h2.exceptions.ProtocolError):
            self.h2.reset_stream(stream_id, error_code=code)

    # -- flow control ----------------------------------------------------------------------------------------

    def ack_data(self, stream_id: int, nbytes: int) -> None:
        """The consumer has passed on ``nbytes`` of this stream's data: the peer may send that much more."""
        st = self.streams.get(stream_id)
        if st is None:
            return
        n = min(nbytes, st.unacked)
        st.unacked -= n
        st.held += n
        if st.held >= self.settings.stream_window >> 2:
            self._ack_ready.add(stream_id)

    def _send_window_updates(self) -> None:
        if self._conn_unacked >= self.settings.connection_window >> 2:
            self._out += _WINDOW_UPDATE.pack(4 << 8 | 0x8, 0, 0, self._conn_unacked)
            self._conn_unacked = 0
        if self._ack_ready:
            for sid in self._ack_ready:
                self.flush_acks(sid)
            self._ack_ready.clear()

    def flush_acks(self, stream_id: int) -> None:
        """Release a stream's held window now (a consumer that had paused has caught up)."""
        st = self.streams.get(stream_id)
        if st is not None and st.held and not st.remote_closed:
            self._out += _WINDOW_UPDATE.pack(4 << 8 | 0x8, 0, stream_id, st.held)
            st.recv_window += st.held
            st.held = 0

    # -- sending ---------------------------------------------------------------------------------------------

    def send_connect(self, authority: str, headers: Iterable[tuple[str, str]] = (), method: str = "CONNECT") -> int:
        """Client: open a tunnel to ``authority`` (``ip:port``). Returns the stream id.

        ``method`` exists for conformance tests of servers (a non-CONNECT request must get a 400).
        """
        stream_id = self.h2.get_next_available_stream_id()
        block = [(":method", method), (":authority", authority)]
        if method != "CONNECT":
            block += [(":scheme", "https"), (":path", "/")]
        block += list(headers)
        if self._headers_direct:
            # h2's send_headers without its frame objects and header pipeline (thirdparty.H2_HEADERS).
            thirdparty.h2_headers_sent(
                self.h2, stream_id, block, False, method.encode(), authority.encode(), encode_header_block
            )
        else:
            self.h2.send_headers(stream_id, block)
        self.streams[stream_id] = _Stream(recv_window=self.settings.stream_window)
        return stream_id

    def send_response(
        self, stream_id: int, status: int, headers: Iterable[tuple[str, str]] = (), end_stream: bool = False
    ) -> None:
        """Server: answer a CONNECT. A non-200 status ends the stream (upstream sends errors with END_STREAM)."""
        block = [(":status", str(status)), *headers]
        try:
            if self._headers_direct and status >= 200:
                # h2's send_headers without its frame objects and header pipeline (thirdparty.H2_HEADERS); an
                # informational response goes through h2, which tells it apart.
                thirdparty.h2_headers_sent(self.h2, stream_id, block, end_stream, None, None, encode_header_block)
            else:
                self.h2.send_headers(stream_id, block, end_stream=end_stream)
        except h2.exceptions.ProtocolError:
            # The client reset the stream (or the connection closed) while we were deciding: nothing to answer.
            self.streams.pop(stream_id, None)
            return
        st = self.streams.get(stream_id)
        if st is not None:
            st.responded = True
        if end_stream:
            self._local_closed(stream_id)

    def send_window(self, stream_id: int) -> int:
        """How many payload bytes may be sent on ``stream_id`` now (flow control and frame size)."""
        try:
            window = self.h2.local_flow_control_window(stream_id)
        except (h2.exceptions.StreamClosedError, h2.exceptions.NoSuchStreamError):
            return 0
        return min(window, self.h2.max_outbound_frame_size)

    def frame_data(self, stream_id: int, buf: bytearray | memoryview, offset: int, length: int) -> int:
        """Frame ``buf[offset:offset+length]`` as DATA, writing the header into ``buf[offset-9:offset]``.

        Returns how many payload bytes were framed (limited by the send window and the peer's frame size; 0 when the
        window is closed). The caller then sends :meth:`data_to_send` followed by ``buf[offset-9:offset+n]``.
        """
        st = self.streams.get(stream_id)
        if st is None or st.local_closed:
            return 0
        n = min(length, self.send_window(stream_id))
        if n <= 0:
            return 0
        _HEADER.pack_into(buf, offset - FRAME_HEADER_SIZE, n << 8 | DATA, 0, stream_id)
        # Charge h2's windows exactly as H2Connection.send_data would.
        self.h2.outbound_flow_control_window -= n
        self.h2.streams[stream_id].outbound_flow_control_window -= n
        return n

    def end_stream(self, stream_id: int) -> None:
        """Half-close our side: an empty DATA frame with END_STREAM (upstream's write shutdown)."""
        st = self.streams.get(stream_id)
        if st is None or st.local_closed:
            return
        with contextlib.suppress(h2.exceptions.ProtocolError):
            if self._end_stream_direct:
                # h2's end_stream without its DataFrame built and serialized (thirdparty.H2_END_STREAM).
                thirdparty.h2_end_stream_sent(self.h2, stream_id, _HEADER.pack(DATA, FLAG_END_STREAM, stream_id))
            else:
                self.h2.end_stream(stream_id)
        self._local_closed(stream_id)

    def reset_stream(self, stream_id: int, code: ErrorCode = ErrorCode.CANCEL) -> None:
        self.streams.pop(stream_id, None)
        _remember(self._reset_by_us, stream_id)
        with contextlib.suppress(h2.exceptions.ProtocolError):  # a stream or connection already closed
            self.h2.reset_stream(stream_id, error_code=code)

    def _local_closed(self, stream_id: int) -> None:
        st = self.streams.get(stream_id)
        if st is not None:
            st.local_closed = True
            if st.remote_closed:
                del self.streams[stream_id]

    def ping(self, data: bytes = b"ztunnel!") -> None:
        self.h2.ping(data)

    def goaway(self, code: ErrorCode = ErrorCode.NO_ERROR) -> None:
        """Tell the peer no new streams will be accepted; open ones may finish (graceful drain).

        The frame is written here rather than with ``H2Connection.close_connection``: h2 treats that as the end
        of the connection and refuses to send anything more, while a graceful GOAWAY lets open streams finish.
        """
        if self.goaway_sent is not None:
            return
        last = self.h2.highest_inbound_stream_id
        self.goaway_sent = last
        self._out += _GOAWAY.pack(8 << 8 | 0x7, 0, 0, last, code)

    @property
    def open_streams(self) -> int:
        return len(self.streams)

    def data_to_send(self) -> bytes:
        """Everything queued for the wire before the next DATA frame: h2's frames, then batched window updates."""
        self._send_window_updates()
        pending = self.h2.data_to_send()
        if self._out:
            pending += self._out
            self._out = bytearray()
        return pending


def _remember(recent: dict[int, None], stream_id: int) -> None:
    recent[stream_id] = None
    if len(recent) > _RECENT_RESETS:
        del recent[next(iter(recent))]


# h2 stream states in which our request is out and its response may come.
_AWAITING_RESPONSE = frozenset({h2.stream.StreamState.OPEN, h2.stream.StreamState.HALF_CLOSED_LOCAL})
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


def _decode_headers(raw: Iterable[tuple[bytes | str, bytes | str]]) -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in raw:
        key = k.decode("ascii", "replace") if isinstance(k, bytes) else k
        value = v.decode("utf-8", "replace") if isinstance(v, bytes) else v
        out[key] = value
    return out


# -- header blocks -------------------------------------------------------------------------------------------------
# HBONE header blocks are a handful of fields sent once per stream, most of them with values that differ on every
# stream (:authority, baggage, forwarded, traceparent). hpack's Encoder looks each one up in its tables and inserts
# it into the dynamic table (evicting older ones), and the peer's decoder inserts it again: ~30% of h2's work per
# stream on both sides. A block of literals *without indexing* (RFC 7541 §6.2.2) leaves both dynamic tables alone,
# costs only byte concatenation here and a table-free decode there, and is valid for every HPACK decoder (Rust h2,
# Envoy). Fields in the static table whole (":status: 200") are sent as their one-byte index. Plain octets, no
# Huffman, as thirdparty.HPACK_PLAIN_LITERALS already does for hpack's own encoding.


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
    update (RFC 7541 §4.2, at the start of the next block), which hpack's own encoding then carries."""
    if encoder.header_table.resized:
        return bytes(encoder.encode(headers))
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
