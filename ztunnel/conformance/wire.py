"""A raw HTTP/2 endpoint over TLS for the conformance checks: frames go out exactly as a check builds them and come
in exactly as the peer sent them.

Built on hyperframe (framing) and hpack (header compression) and the standard library's ``ssl``, and on nothing of
the proxy's own HBONE code, so a check really tests the peer and not a shared implementation. A protocol library
such as h2 would refuse to send malformed requests (the checks need them) and hides what the checks look at: the
exact SETTINGS values, every WINDOW_UPDATE, frame sizes, RST_STREAM codes. Everything the peer does wrong at the
HTTP/2 level (a frame larger than we allowed, DATA beyond the window we granted) is recorded in
:attr:`Wire.violations` rather than raised, so a check can report it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field

import hpack
from hyperframe.exceptions import HyperframeError
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    Frame,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
    RstStreamFrame,
    SettingsFrame,
    WindowUpdateFrame,
)

from ztunnel.errors import ZtunnelError

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# SETTINGS identifiers (RFC 9113 §6.5.2).
HEADER_TABLE_SIZE = 0x1
ENABLE_PUSH = 0x2
MAX_CONCURRENT_STREAMS = 0x3
INITIAL_WINDOW_SIZE = 0x4
MAX_FRAME_SIZE = 0x5
MAX_HEADER_LIST_SIZE = 0x6
SETTING_NAMES = {
    HEADER_TABLE_SIZE: "HEADER_TABLE_SIZE",
    ENABLE_PUSH: "ENABLE_PUSH",
    MAX_CONCURRENT_STREAMS: "MAX_CONCURRENT_STREAMS",
    INITIAL_WINDOW_SIZE: "INITIAL_WINDOW_SIZE",
    MAX_FRAME_SIZE: "MAX_FRAME_SIZE",
    MAX_HEADER_LIST_SIZE: "MAX_HEADER_LIST_SIZE",
}

# Error codes (RFC 9113 §7).
NO_ERROR = 0x0
PROTOCOL_ERROR = 0x1
INTERNAL_ERROR = 0x2
FLOW_CONTROL_ERROR = 0x3
STREAM_CLOSED = 0x5
REFUSED_STREAM = 0x7
CANCEL = 0x8
CONNECT_ERROR = 0xA
ERROR_NAMES = {
    0x0: "NO_ERROR",
    0x1: "PROTOCOL_ERROR",
    0x2: "INTERNAL_ERROR",
    0x3: "FLOW_CONTROL_ERROR",
    0x4: "SETTINGS_TIMEOUT",
    0x5: "STREAM_CLOSED",
    0x6: "FRAME_SIZE_ERROR",
    0x7: "REFUSED_STREAM",
    0x8: "CANCEL",
    0x9: "COMPRESSION_ERROR",
    0xA: "CONNECT_ERROR",
    0xB: "ENHANCE_YOUR_CALM",
    0xC: "INADEQUATE_SECURITY",
    0xD: "HTTP_1_1_REQUIRED",
}

DEFAULT_WINDOW = 65535  # RFC 9113 §6.9.2: every window starts here until SETTINGS / WINDOW_UPDATE change it
DEFAULT_MAX_FRAME = 16384  # RFC 9113 §6.5.2: SETTINGS_MAX_FRAME_SIZE until the peer says otherwise


def error_name(code: int | None) -> str:
    """``CANCEL (0x8)`` for an error code; ``-`` for None."""
    if code is None:
        return "-"
    return f"{ERROR_NAMES.get(code, 'UNKNOWN')} ({code:#x})"


class WireClosed(ZtunnelError, ConnectionError):
    """The connection closed while a check waited on it; the message says how."""


@dataclass
class Stream:
    """What one stream carried, as received."""

    id: int
    headers: list[tuple[str, str]] | None = None  # the first header block (request or response)
    trailers: list[tuple[str, str]] | None = None
    data: bytearray = field(default_factory=bytearray)
    ended: bool = False  # END_STREAM received
    reset: int | None = None  # RST_STREAM error code received
    send_window: int = DEFAULT_WINDOW
    recv_window: int = DEFAULT_WINDOW
    data_frames: int = 0
    largest_frame: int = 0
    sent_end: bool = False
    stalled: bool = False  # received DATA is not released to the peer (a reader that stopped reading)

    def header(self, name: str) -> str | None:
        """The first value of header ``name`` in the first header block, or None."""
        for k, v in self.headers or ():
            if k == name:
                return v
        return None

    @property
    def status(self) -> str | None:
        return self.header(":status")


@dataclass(frozen=True, slots=True)
class TlsFacts:
    """What the TLS handshake settled."""

    version: str | None
    alpn: str | None
    cipher: str | None
    peer_cert_der: bytes | None
    sni: str | None = None  # server side: the name the client sent (None: none)


class Wire:
    """One HTTP/2 connection over an established TLS stream, as client (``client=True``) or server.

    A background task reads frames and keeps the books: SETTINGS are applied and acknowledged, PINGs answered
    (unless ``auto_ping_ack`` is False), received DATA is released back to the peer at once (unless
    ``auto_release`` is False: the peer then sees a reader that stalled), windows are tracked both ways. Checks
    send frames with the ``send_*`` methods and wait on the state with :meth:`wait_for`.
    """

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        client: bool,
        tls: TlsFacts,
        settings: dict[int, int] | None = None,
        connection_window: int = DEFAULT_WINDOW,
        auto_release: bool = True,
        auto_ping_ack: bool = True,
    ) -> None:
        self.reader = reader
        self.writer = writer
        self.client = client
        self.tls = tls
        self.local_settings = dict(settings or {})
        self.local_initial_window = self.local_settings.get(INITIAL_WINDOW_SIZE, DEFAULT_WINDOW)
        self.local_max_frame = self.local_settings.get(MAX_FRAME_SIZE, DEFAULT_MAX_FRAME)
        self.local_connection_window = connection_window
        self.auto_release = auto_release
        self.auto_ping_ack = auto_ping_ack
        self.encoder = hpack.Encoder()
        self.decoder = hpack.Decoder()
        self.streams: dict[int, Stream] = {}
        self.new_streams: asyncio.Queue[Stream] = asyncio.Queue()  # server side: requests as they arrive
        self.next_stream_id = 1 if client else 2
        self.peer_settings: dict[int, int] | None = None  # the first SETTINGS frame, as sent
        self.peer_settings_now: dict[int, int] = {}
        self.peer_settings_first_frame = False  # the peer's first frame was SETTINGS
        self.settings_acked = False
        self.peer_initial_window = DEFAULT_WINDOW
        self.peer_max_frame = DEFAULT_MAX_FRAME
        self.send_window = DEFAULT_WINDOW  # connection level, towards the peer
        self.recv_window = DEFAULT_WINDOW  # connection level, what the peer may still send us
        self.connection_window_updates: list[int] = []  # increments the peer sent on stream 0
        self.pings: list[bytes] = []  # PINGs the peer sent
        self.ping_acks: list[bytes] = []
        self.goaway: GoAwayFrame | None = None
        self.violations: list[str] = []
        self.frames_in = 0
        self.closed = False
        self.close_reason = ""
        self._preface_seen = client  # a server first reads the client's preface
        self._header_block: tuple[int, bytearray, bool] | None = None  # (stream, block, END_STREAM) in progress
        self._changed = asyncio.Event()
        self._reader_task: asyncio.Task[None] | None = None
        self.on_stream: Callable[[Stream], None] | None = None  # server side: called for every new request

    # -- life cycle ---------------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Send our preface (client) and SETTINGS, raise the connection window, and start reading."""
        out = bytearray(PREFACE if self.client else b"")
        out += SettingsFrame(0, settings=self.local_settings).serialize()
        if self.local_connection_window > DEFAULT_WINDOW:
            increment = self.local_connection_window - DEFAULT_WINDOW
            out += WindowUpdateFrame(0, window_increment=increment).serialize()
            self.recv_window += increment
        self.writer.write(bytes(out))
        self._reader_task = asyncio.get_running_loop().create_task(self._read_loop(), name="conformance-wire-reader")

    async def close(self) -> None:
        """Close the socket (no GOAWAY: a check that wants one sends it) and stop reading."""
        if self._reader_task is not None:
            self._reader_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader_task
        self.writer.close()
        try:
            # TLS close_notify both ways; a peer that does not answer it in 0.2 s (some never do) is cut off,
            # or every check would wait for it (asyncio's TLS shutdown timeout is 30 s).
            await asyncio.wait_for(self.writer.wait_closed(), 0.2)
        except (TimeoutError, ConnectionError, OSError, ssl.SSLError):
            self.writer.transport.abort()

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def wait_for(self, predicate: Callable[[], object], timeout: float) -> bool:
        """Wait until ``predicate()`` holds (True) or ``timeout`` seconds pass or the connection closes (False,
        unless the predicate holds by then)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            if predicate():
                return True
            if self.closed:
                return bool(predicate())
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)

    async def drain(self) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            await self.writer.drain()

    # -- sending ------------------------------------------------------------------------------------------------------

    def send_frame(self, frame: Frame) -> None:
        if not self.writer.is_closing():
            self.writer.write(frame.serialize())

    def send_raw(self, data: bytes) -> None:
        if not self.writer.is_closing():
            self.writer.write(data)

    def open_stream(self) -> Stream:
        sid = self.next_stream_id
        self.next_stream_id += 2
        stream = Stream(sid, send_window=self.peer_initial_window, recv_window=self.local_initial_window)
        self.streams[sid] = stream
        return stream

    def send_headers(self, stream: Stream, headers: list[tuple[str, str]], end_stream: bool = False) -> None:
        """One HEADERS frame with END_HEADERS (the blocks the checks send are small)."""
        flags = ["END_HEADERS"] + (["END_STREAM"] if end_stream else [])
        self.send_frame(HeadersFrame(stream.id, data=self.encoder.encode(headers), flags=flags))
        if end_stream:
            stream.sent_end = True

    async def send_data(self, stream: Stream, data: bytes, end_stream: bool = False, timeout: float = 30.0) -> None:
        """Send ``data`` as DATA frames within the peer's windows and frame size, waiting for WINDOW_UPDATEs.

        Raises :class:`WireClosed` if the stream is reset or the connection closes first, TimeoutError if the
        peer grants no window for ``timeout`` seconds."""
        view = memoryview(data)
        while view or end_stream:
            if stream.reset is not None:
                raise WireClosed(f"stream {stream.id} was reset ({error_name(stream.reset)}) while sending")
            if self.closed:
                raise WireClosed(f"connection closed while sending: {self.close_reason}")
            size = min(len(view), self.peer_max_frame, self.send_window, stream.send_window)
            if size <= 0 and view:
                granted = await self.wait_for(
                    lambda: min(self.send_window, stream.send_window) > 0 or stream.reset is not None or self.closed,
                    timeout,
                )
                if not granted:
                    raise TimeoutError(
                        f"no flow-control window from the peer for {timeout:g} s on stream {stream.id} "
                        f"(connection window {self.send_window}, stream window {stream.send_window})"
                    )
                continue
            chunk, view = view[:size], view[size:]
            last = end_stream and not view
            self.send_frame(DataFrame(stream.id, data=bytes(chunk), flags=["END_STREAM"] if last else []))
            self.send_window -= size
            stream.send_window -= size
            await self.drain()
            if last:
                stream.sent_end = True
                return
            if not view and not end_stream:
                return

    def send_rst(self, stream: Stream, code: int) -> None:
        self.send_frame(RstStreamFrame(stream.id, error_code=code))

    def send_goaway(self, last_stream_id: int, code: int = NO_ERROR) -> None:
        self.send_frame(GoAwayFrame(0, last_stream_id=last_stream_id, error_code=code))

    def send_ping(self, payload: bytes) -> None:
        self.send_frame(PingFrame(0, opaque_data=payload))

    def release(self, stream: Stream, amount: int) -> None:
        """Grant the peer ``amount`` more bytes on ``stream`` and on the connection."""
        self.send_frame(WindowUpdateFrame(0, window_increment=amount))
        self.send_frame(WindowUpdateFrame(stream.id, window_increment=amount))
        self.recv_window += amount
        stream.recv_window += amount

    # -- receiving ----------------------------------------------------------------------------------------------------

    async def _read_loop(self) -> None:
        try:
            if not self._preface_seen:
                preface = await self.reader.readexactly(len(PREFACE))
                if preface != PREFACE:
                    self.violations.append(f"the client preface is {preface!r}, not the HTTP/2 preface")
                    raise WireClosed("bad client preface")
                self._preface_seen = True
            while True:
                head = await self.reader.readexactly(9)
                frame, length = Frame.parse_frame_header(memoryview(head))
                if length > self.local_max_frame:
                    self.violations.append(
                        f"{type(frame).__name__} of {length} bytes on stream {frame.stream_id}, above our "
                        f"SETTINGS_MAX_FRAME_SIZE {self.local_max_frame}"
                    )
                body = await self.reader.readexactly(length)
                frame.parse_body(memoryview(body))
                self.frames_in += 1
                self._handle(frame)
                self._notify()
        except asyncio.IncompleteReadError as e:
            self.close_reason = "peer closed the connection" + (" mid-frame" if e.partial else "")
        except ssl.SSLError as e:
            self.close_reason = f"TLS: {e.reason or e}"
        except (ConnectionError, OSError) as e:
            self.close_reason = f"connection lost: {e}"
        except HyperframeError as e:
            self.violations.append(f"unparsable frame: {e}")
            self.close_reason = f"unparsable frame: {e}"
        except WireClosed as e:
            self.close_reason = str(e)
        finally:
            self.closed = True
            self._notify()

    def _handle(self, frame: Frame) -> None:
        if self.frames_in == 1:
            self.peer_settings_first_frame = isinstance(frame, SettingsFrame) and "ACK" not in frame.flags
        if self._header_block is not None and not isinstance(frame, ContinuationFrame):
            self.violations.append(f"{type(frame).__name__} inside a header block (CONTINUATION expected)")
        if isinstance(frame, SettingsFrame):
            self._on_settings(frame)
        elif isinstance(frame, HeadersFrame):
            self._header_block = (frame.stream_id, bytearray(frame.data), "END_STREAM" in frame.flags)
            if "END_HEADERS" in frame.flags:
                self._end_headers()
        elif isinstance(frame, ContinuationFrame):
            if self._header_block is None:
                self.violations.append("CONTINUATION without a header block")
            else:
                self._header_block[1].extend(frame.data)
                if "END_HEADERS" in frame.flags:
                    self._end_headers()
        elif isinstance(frame, DataFrame):
            self._on_data(frame)
        elif isinstance(frame, WindowUpdateFrame):
            if frame.stream_id == 0:
                self.send_window += frame.window_increment
                self.connection_window_updates.append(frame.window_increment)
            elif (stream := self.streams.get(frame.stream_id)) is not None:
                stream.send_window += frame.window_increment
        elif isinstance(frame, PingFrame):
            if "ACK" in frame.flags:
                self.ping_acks.append(bytes(frame.opaque_data))
            else:
                self.pings.append(bytes(frame.opaque_data))
                if self.auto_ping_ack:
                    self.send_frame(PingFrame(0, opaque_data=frame.opaque_data, flags=["ACK"]))
        elif isinstance(frame, RstStreamFrame):
            self._stream(frame.stream_id).reset = frame.error_code
        elif isinstance(frame, GoAwayFrame):
            self.goaway = frame

    def _stream(self, sid: int) -> Stream:
        stream = self.streams.get(sid)
        if stream is None:
            stream = Stream(sid, send_window=self.peer_initial_window, recv_window=self.local_initial_window)
            self.streams[sid] = stream
        return stream

    def _on_settings(self, frame: SettingsFrame) -> None:
        if "ACK" in frame.flags:
            self.settings_acked = True
            return
        values = dict(frame.settings)
        if self.peer_settings is None:
            self.peer_settings = dict(values)
        self.peer_settings_now.update(values)
        if INITIAL_WINDOW_SIZE in values:
            delta = values[INITIAL_WINDOW_SIZE] - self.peer_initial_window
            self.peer_initial_window = values[INITIAL_WINDOW_SIZE]
            for stream in self.streams.values():
                stream.send_window += delta
        if MAX_FRAME_SIZE in values:
            self.peer_max_frame = values[MAX_FRAME_SIZE]
        self.send_frame(SettingsFrame(0, flags=["ACK"]))

    def _end_headers(self) -> None:
        assert self._header_block is not None
        sid, block, end_stream = self._header_block
        self._header_block = None
        try:
            headers = [(str(k), str(v)) for k, v in self.decoder.decode(bytes(block))]
        except hpack.HPACKError as e:
            self.violations.append(f"undecodable header block on stream {sid}: {e}")
            headers = []
        is_new = sid not in self.streams
        stream = self._stream(sid)
        if stream.headers is None:
            stream.headers = headers
        else:
            stream.trailers = headers
        if end_stream:
            stream.ended = True
        if is_new and not self.client:
            self.new_streams.put_nowait(stream)
            if self.on_stream is not None:
                self.on_stream(stream)

    def _on_data(self, frame: DataFrame) -> None:
        stream = self._stream(frame.stream_id)
        size = frame.flow_controlled_length
        self.recv_window -= size
        stream.recv_window -= size
        if self.recv_window < 0:
            self.violations.append(
                f"DATA beyond the connection window: {-self.recv_window} bytes more than granted "
                f"(stream {frame.stream_id})"
            )
            self.recv_window = 0
        if stream.recv_window < 0:
            self.violations.append(
                f"DATA beyond the stream window on stream {frame.stream_id}: {-stream.recv_window} bytes "
                "more than granted"
            )
            stream.recv_window = 0
        if stream.ended:
            self.violations.append(f"DATA on stream {frame.stream_id} after its END_STREAM")
        stream.data += frame.data
        stream.data_frames += 1
        stream.largest_frame = max(stream.largest_frame, len(frame.data))
        if "END_STREAM" in frame.flags:
            stream.ended = True
        if self.auto_release and size and not stream.stalled:
            self.release(stream, size)


def tls_facts(writer: asyncio.StreamWriter, sni: str | None = None) -> TlsFacts:
    """The facts of ``writer``'s finished TLS handshake."""
    obj = writer.get_extra_info("ssl_object")
    if obj is None:
        return TlsFacts(None, None, None, None, sni)
    cipher = obj.cipher()
    try:
        peer = obj.getpeercert(binary_form=True)
    except ValueError:  # the peer ended the handshake's last step (TLS 1.3: it refused our certificate)
        peer = None
    return TlsFacts(
        version=obj.version(),
        alpn=obj.selected_alpn_protocol(),
        cipher=cipher[0] if cipher else None,
        peer_cert_der=peer,
        sni=sni,
    )
