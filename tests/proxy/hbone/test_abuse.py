"""HTTP/2 abuse against the sans-IO core (server role): each flood ends the connection with the right GOAWAY code.

Frames are built with hyperframe and hpack (independent of the code under test). Every case also runs with the
protection turned off (limits too large to reach), where the same input must *not* close the connection: proof
that the test exercises the protection rather than something else.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import hpack
import pytest
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    Frame,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
    PriorityFrame,
    RstStreamFrame,
    SettingsFrame,
    WindowUpdateFrame,
)

from ztunnel.proxy.hbone.core import (
    DEFAULT_LIMITS,
    ConnectRequested,
    ErrorCode,
    HboneConnection,
    HboneProtocolError,
    Limits,
    StreamReset,
)

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
OFF = Limits(control_frame_burst=10**9, control_frames_per_second=1e9, premature_reset_min_streams=10**9)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def server(limits: Limits = DEFAULT_LIMITS, clock: Callable[[], float] | None = None) -> HboneConnection:
    s = HboneConnection(False, limits=limits, clock=clock) if clock else HboneConnection(False, limits=limits)
    s.initiate()
    s.receive_data(PREFACE + SettingsFrame(0).serialize())
    s.data_to_send()
    return s


def connect_block(encoder: hpack.Encoder, authority: str = "10.0.0.1:8080") -> bytes:
    return bytes(encoder.encode([(":method", "CONNECT"), (":authority", authority)]))


def frames_of(data: bytes) -> list[Frame]:
    out = []
    pos = 0
    while pos + 9 <= len(data):
        f, length = Frame.parse_frame_header(memoryview(data[pos : pos + 9]))
        f.parse_body(memoryview(data[pos + 9 : pos + 9 + length]))
        out.append(f)
        pos += 9 + length
    return out


def goaway_code(s: HboneConnection) -> int | None:
    for f in frames_of(s.data_to_send()):
        if isinstance(f, GoAwayFrame):
            return int(f.error_code)
    return None


def feed(s: HboneConnection, chunks: Iterator[bytes]) -> HboneProtocolError | None:
    """Feed frames in 64 KiB reads (as a socket would); the error that ended the connection, if any."""
    pending = bytearray()
    try:
        for chunk in chunks:
            pending += chunk
            if len(pending) >= 64 * 1024:
                s.receive_data(bytes(pending))
                pending.clear()
        if pending:
            s.receive_data(bytes(pending))
    except HboneProtocolError as e:
        return e
    return None


def rapid_reset(n: int) -> Iterator[bytes]:
    enc = hpack.Encoder()
    for i in range(n):
        sid = 2 * i + 1
        h = HeadersFrame(sid, connect_block(enc))
        h.flags.add("END_HEADERS")
        yield h.serialize() + RstStreamFrame(sid, error_code=ErrorCode.CANCEL).serialize()


def pings(n: int) -> Iterator[bytes]:
    for i in range(n):
        yield PingFrame(0, opaque_data=i.to_bytes(8, "big")).serialize()


def settings(n: int) -> Iterator[bytes]:
    for _ in range(n):
        yield SettingsFrame(0, settings={SettingsFrame.INITIAL_WINDOW_SIZE: 65535}).serialize()


def priorities(n: int) -> Iterator[bytes]:
    for i in range(n):
        yield PriorityFrame(2 * i + 1, depends_on=0, stream_weight=16).serialize()


def unknown_frames(n: int) -> Iterator[bytes]:
    for _ in range(n):
        yield b"\x00\x00\x00\xfa\x00\x00\x00\x00\x00"  # type 0xfa, empty: must be ignored, costs a parse


def empty_data(n: int) -> Iterator[bytes]:
    enc = hpack.Encoder()
    h = HeadersFrame(1, connect_block(enc))
    h.flags.add("END_HEADERS")
    yield h.serialize()
    for _ in range(n):
        yield DataFrame(1, b"").serialize()


def data_on_closed_stream(n: int) -> Iterator[bytes]:
    enc = hpack.Encoder()
    h = HeadersFrame(1, connect_block(enc))
    h.flags.add("END_HEADERS")
    yield h.serialize() + RstStreamFrame(1, error_code=ErrorCode.CANCEL).serialize()
    for _ in range(n):
        yield DataFrame(1, b"x").serialize()


def rst_on_closed_streams(n: int) -> Iterator[bytes]:
    enc = hpack.Encoder()
    h = HeadersFrame(1, connect_block(enc))
    h.flags.add("END_HEADERS")
    yield h.serialize()
    for _ in range(n):  # the first resets the stream; the rest are on a closed stream, which h2 ignores
        yield RstStreamFrame(1, error_code=ErrorCode.CANCEL).serialize()


def continuation_flood(frame_size: int, n: int) -> Iterator[bytes]:
    enc = hpack.Encoder()
    yield HeadersFrame(1, connect_block(enc)).serialize()  # no END_HEADERS: CONTINUATION must follow
    for _ in range(n):
        yield ContinuationFrame(1, b"\x00" * frame_size).serialize()


FLOODS: dict[str, tuple[Callable[[], Iterator[bytes]], set[int]]] = {
    "rapid reset": (lambda: rapid_reset(2000), {ErrorCode.ENHANCE_YOUR_CALM}),
    "PING flood": (lambda: pings(2000), {ErrorCode.ENHANCE_YOUR_CALM}),
    "SETTINGS flood": (lambda: settings(2000), {ErrorCode.ENHANCE_YOUR_CALM}),
    "PRIORITY flood": (lambda: priorities(2000), {ErrorCode.ENHANCE_YOUR_CALM}),
    "unknown frame flood": (lambda: unknown_frames(2000), {ErrorCode.ENHANCE_YOUR_CALM}),
    "empty DATA flood": (lambda: empty_data(2000), {ErrorCode.ENHANCE_YOUR_CALM}),
    "DATA on a closed stream": (lambda: data_on_closed_stream(2000), {ErrorCode.ENHANCE_YOUR_CALM}),
    "RST_STREAM on closed streams": (lambda: rst_on_closed_streams(2000), {ErrorCode.ENHANCE_YOUR_CALM}),
    # 16 KiB CONTINUATIONs: our header-block cap (64 KiB + padding) trips after 4, long before h2's backlog of 64.
    "CONTINUATION flood": (lambda: continuation_flood(16 * 1024, 60), {ErrorCode.ENHANCE_YOUR_CALM}),
}


@pytest.mark.parametrize("name", list(FLOODS))
def test_flood_closes_the_connection_with_goaway(name: str) -> None:
    make, codes = FLOODS[name]
    s = server()
    err = feed(s, make())
    assert err is not None, f"{name}: connection survived"
    assert err.code in codes, str(err)
    assert goaway_code(s) in codes
    assert s.closed


@pytest.mark.parametrize("name", [n for n in FLOODS if n != "CONTINUATION flood"])
def test_flood_is_survived_with_the_protection_off(name: str) -> None:
    """The control: without the limits the same input does not end the connection (so the test above can fail).

    The header-block cap is not tunable; its control is test_header_block_just_under_the_cap_reaches_h2.
    """
    make, _codes = FLOODS[name]
    s = server(OFF)
    assert feed(s, make()) is None
    assert goaway_code(s) is None


def test_rapid_reset_counts_only_streams_reset_before_the_response() -> None:
    s = server()
    enc = hpack.Encoder()
    # 600 streams answered, then reset by the client: normal cancellation, never abuse.
    for i in range(600):
        sid = 2 * i + 1
        h = HeadersFrame(sid, connect_block(enc))
        h.flags.add("END_HEADERS")
        s.receive_data(h.serialize())
        s.send_response(sid, 200)
        s.receive_data(RstStreamFrame(sid, error_code=ErrorCode.CANCEL).serialize())
    assert s.premature_resets == 0
    # Then 600 premature resets: half of 1,200 streams, and the connection goes.
    err = feed(s, (f for i, f in enumerate(rapid_reset(1200)) if i >= 600))
    assert err is not None and err.code == ErrorCode.ENHANCE_YOUR_CALM
    assert "rapid reset" in str(err)
    assert s.streams_opened == 1200


def test_some_premature_resets_are_fine() -> None:
    """A client cancelling a few connects before the answer (its app went away) is normal."""
    s = server()
    events = []
    for frame in rapid_reset(400):
        events += s.receive_data(frame)
    assert s.premature_resets == 400 and not s.closed
    assert sum(isinstance(e, StreamReset) for e in events) == 400
    assert sum(isinstance(e, ConnectRequested) for e in events) == 400


def test_control_budget_refills_over_time() -> None:
    clock = Clock()
    s = server(clock=clock)
    for i in range(10):
        # 100 PINGs every 2 s is the sustained 50/s: never over budget.
        assert feed(s, pings(100)) is None, f"round {i}"
        clock.now += 2.0
    # The same 100 PINGs every 1 s is 100/s: over the burst within a few seconds.
    with pytest.raises(HboneProtocolError, match="flood of PING frames"):
        for _ in range(10):
            s.receive_data(b"".join(pings(100)))
            clock.now += 1.0


def test_ping_and_settings_acks_are_not_charged() -> None:
    s = server()
    acks = b"".join(PingFrame(0, flags=["ACK"]).serialize() for _ in range(1000))
    acks += b"".join(SettingsFrame(0, flags=["ACK"]).serialize() for _ in range(1000))
    s.receive_data(acks)
    assert not s.closed


def test_header_block_cap_checked_before_buffering() -> None:
    """One HEADERS frame of 512 KiB (under the 1 MiB frame limit) is refused from its 9-byte header."""
    s = server()
    header = (512 * 1024).to_bytes(3, "big") + b"\x01\x04" + (1).to_bytes(4, "big")
    with pytest.raises(HboneProtocolError, match="header block over") as e:
        s.receive_data(header)  # no payload yet: nothing was buffered
    assert e.value.code == ErrorCode.ENHANCE_YOUR_CALM
    assert goaway_code(s) == ErrorCode.ENHANCE_YOUR_CALM


def test_header_block_just_under_the_cap_reaches_the_decoder() -> None:
    """The control for the cap: a block of exactly the limit is the HPACK decoder's to judge (and it refuses the
    list it decodes to, over 64 KiB)."""
    s = server()
    limit = 64 * 1024 + 261
    first = HeadersFrame(1, b"\x00" * (limit - 16 * 1024)).serialize()
    with pytest.raises(HboneProtocolError) as e:
        s.receive_data(first + ContinuationFrame(1, b"\x00" * (16 * 1024), flags=["END_HEADERS"]).serialize())
    assert "header block over" not in str(e.value)  # not our cap: the decoder parsed the block and judged it
    assert "header list over the limit" in str(e.value)
    assert e.value.code == ErrorCode.ENHANCE_YOUR_CALM


def test_header_list_over_the_limit_after_decompression() -> None:
    """A small HPACK block that decodes to more than SETTINGS_MAX_HEADER_LIST_SIZE (64 KiB): h2's decoder refuses."""
    big = ("x-big", "v" * 4000)
    # Once in the dynamic table, each repeat of the 4 KB header costs one byte: 20 of them decode to 80 KiB.
    block = bytes(hpack.Encoder().encode([(":method", "CONNECT"), (":authority", "10.0.0.1:1")] + [big] * 20))
    assert len(block) < 8 * 1024  # far under the compressed-size cap: only the decoder can catch it
    s = server()
    h = HeadersFrame(1, block)
    h.flags.add("END_HEADERS")
    with pytest.raises(HboneProtocolError) as e:
        s.receive_data(h.serialize())
    assert e.value.code == ErrorCode.ENHANCE_YOUR_CALM
    assert goaway_code(s) == ErrorCode.ENHANCE_YOUR_CALM


def test_client_header_list_limit_is_in_force_before_the_settings_ack() -> None:
    c = HboneConnection(True)
    c.initiate()
    assert c._decoder.max_header_list_size == 16 * 1024


def test_more_streams_than_max_concurrent_streams() -> None:
    """SETTINGS_MAX_CONCURRENT_STREAMS 200, before the client has acknowledged it: the 201st stream is refused
    alone (RST_STREAM REFUSED_STREAM, RFC 9113 §5.1.2), the connection and its 200 streams go on. (With h2 keeping
    the streams, this was a connection error until the client's SETTINGS ACK.)"""
    s = server()
    enc = hpack.Encoder()
    opened = []
    for i in range(201):  # SETTINGS_MAX_CONCURRENT_STREAMS is 200
        h = HeadersFrame(2 * i + 1, connect_block(enc))
        h.flags.add("END_HEADERS")
        opened += [e.stream_id for e in s.receive_data(h.serialize()) if isinstance(e, ConnectRequested)]
    assert opened == list(range(1, 400, 2))
    refused = [f for f in frames_of(s.data_to_send()) if isinstance(f, RstStreamFrame)]
    assert [(f.stream_id, f.error_code) for f in refused] == [(401, ErrorCode.REFUSED_STREAM)]
    assert not s.closed


def test_window_update_overflow() -> None:
    s = server()
    # The connection send window starts at 65,535: adding 2^31-1 overflows it (RFC 9113 §6.9.1).
    with pytest.raises(HboneProtocolError) as e:
        s.receive_data(WindowUpdateFrame(0, window_increment=2**31 - 1).serialize())
    assert e.value.code == ErrorCode.FLOW_CONTROL_ERROR
    assert goaway_code(s) == ErrorCode.FLOW_CONTROL_ERROR


def test_data_in_flight_after_our_reset_is_not_abuse() -> None:
    """After we reset a stream the peer may still have its whole window in flight: that is not a flood."""
    s = server()
    enc = hpack.Encoder()
    for i in range(5):
        sid = 2 * i + 1
        h = HeadersFrame(sid, connect_block(enc))
        h.flags.add("END_HEADERS")
        s.receive_data(h.serialize())
        s.send_response(sid, 200)
        s.reset_stream(sid, ErrorCode.CANCEL)
        # 4 MiB in flight in 1 KiB frames: 4,096 frames per stream, 20,480 in all.
        assert feed(s, (DataFrame(sid, b"x" * 1024).serialize() for _ in range(4096))) is None
    assert not s.closed
