"""The sans-IO HBONE core against raw frames (hyperframe as the independent encoder) and against itself."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hyperframe.frame import (
    DataFrame,
    Frame,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
    RstStreamFrame,
    SettingsFrame,
    WindowUpdateFrame,
)

from ztunnel.proxy.hbone.core import (
    DRAIN_PING,
    FRAME_HEADER_SIZE,
    ConnectRequested,
    ConnectResponded,
    DataReceived,
    ErrorCode,
    GoAwayReceived,
    HboneConnection,
    HboneProtocolError,
    Settings,
    StreamEnded,
    StreamReset,
    WindowOpened,
    literal_header_block,
)


def frames(data: bytes) -> list[Frame]:
    out = []
    pos = 0
    if data.startswith(b"PRI * HTTP/2.0"):
        pos = 24
    while pos < len(data):
        f, length = Frame.parse_frame_header(memoryview(data[pos : pos + 9]))
        f.parse_body(memoryview(data[pos + 9 : pos + 9 + length]))
        out.append(f)
        pos += 9 + length
    return out


def pump(a: HboneConnection, b: HboneConnection) -> list[object]:
    data = a.data_to_send()
    return list(b.receive_data(data)) if data else []


def connected() -> tuple[HboneConnection, HboneConnection, int]:
    c, s = HboneConnection(True), HboneConnection(False)
    c.initiate()
    s.initiate()
    pump(c, s)
    pump(s, c)
    pump(c, s)  # settings ACK
    sid = c.send_connect("10.0.0.1:8080", [("traceparent", "00-x")])
    pump(c, s)
    s.send_response(sid, 200)
    pump(s, c)
    return c, s, sid


def send(c: HboneConnection, sid: int, payload: bytes) -> bytes:
    buf = bytearray(FRAME_HEADER_SIZE + len(payload))
    buf[FRAME_HEADER_SIZE:] = payload
    n = c.frame_data(sid, buf, FRAME_HEADER_SIZE, len(payload))
    return c.data_to_send() + bytes(buf[: FRAME_HEADER_SIZE + n])


def data_of(events: Sequence[object]) -> bytes:
    return b"".join(bytes(e.data) for e in events if isinstance(e, DataReceived))


def test_settings_as_upstream() -> None:
    s = HboneConnection(False)
    s.initiate()
    fs = frames(s.data_to_send())
    settings = next(f for f in fs if isinstance(f, SettingsFrame))
    assert settings.settings[SettingsFrame.INITIAL_WINDOW_SIZE] == 4 * 1024 * 1024
    assert settings.settings[SettingsFrame.MAX_FRAME_SIZE] == 1024 * 1024
    assert settings.settings[SettingsFrame.MAX_CONCURRENT_STREAMS] == 200
    assert settings.settings[SettingsFrame.MAX_HEADER_LIST_SIZE] == 64 * 1024
    wu = next(f for f in fs if isinstance(f, WindowUpdateFrame))
    assert wu.stream_id == 0 and wu.window_increment == 16 * 1024 * 1024 - 65535
    c = HboneConnection(True)
    c.initiate()
    cf = next(f for f in frames(c.data_to_send()) if isinstance(f, SettingsFrame))
    assert cf.settings[SettingsFrame.MAX_HEADER_LIST_SIZE] == 16 * 1024
    assert cf.settings[SettingsFrame.ENABLE_PUSH] == 0
    assert SettingsFrame.MAX_CONCURRENT_STREAMS not in cf.settings


def test_connect_has_authority_and_no_scheme_or_path() -> None:
    c, s = HboneConnection(True), HboneConnection(False)
    c.initiate()
    s.initiate()
    pump(c, s)
    pump(s, c)
    sid = c.send_connect("[fd00::1]:8080", [("forwarded", 'for="1.2.3.4:5"')])
    events = pump(c, s)
    req = next(e for e in events if isinstance(e, ConnectRequested))
    assert (req.stream_id, req.method, req.authority) == (sid, "CONNECT", "[fd00::1]:8080")
    assert ":scheme" not in req.headers and ":path" not in req.headers
    assert req.headers["forwarded"] == 'for="1.2.3.4:5"'


def test_response_and_data_both_ways_with_end_stream() -> None:
    c, s, sid = connected()
    got = s.receive_data(send(c, sid, b"hello"))
    assert data_of(got) == b"hello"
    got = c.receive_data(send(s, sid, b"world"))
    assert data_of(got) == b"world"
    c.end_stream(sid)
    assert [type(e) for e in pump(c, s)] == [StreamEnded]
    s.end_stream(sid)
    assert [type(e) for e in pump(s, c)] == [StreamEnded]
    assert c.streams == {} and s.streams == {}


def test_half_close_is_empty_data_with_end_stream() -> None:
    c, _s, sid = connected()
    c.end_stream(sid)
    (f,) = frames(c.data_to_send())
    assert isinstance(f, DataFrame) and f.data == b"" and "END_STREAM" in f.flags and f.stream_id == sid


def test_raw_data_frames_padded_and_split_across_reads() -> None:
    _c, s, sid = connected()
    f = DataFrame(sid, b"abcdef" * 1000)
    f.flags.add("PADDED")
    f.pad_length = 20
    wire = f.serialize()
    events: list[object] = []
    for i in range(0, len(wire), 7):  # 7-byte reads: headers and payload split everywhere
        events += s.receive_data(wire[i : i + 7])
    assert data_of(events) == b"abcdef" * 1000
    # Flow control counted payload + pad length byte + padding.
    assert s.streams[sid].recv_window == 4 * 1024 * 1024 - (6000 + 1 + 20)


def test_data_end_stream_flag_on_payload_frame() -> None:
    _c, s, sid = connected()
    f = DataFrame(sid, b"last")
    f.flags.add("END_STREAM")
    events = s.receive_data(f.serialize())
    assert data_of(events) == b"last"
    assert isinstance(events[-1], StreamEnded)


def test_frame_data_respects_window_and_peer_frame_size() -> None:
    c, s = HboneConnection(True), HboneConnection(False, Settings(stream_window=100_000, max_concurrent_streams=200))
    c.initiate()
    s.initiate()
    pump(c, s)
    pump(s, c)
    sid = c.send_connect("10.0.0.1:80")
    pump(c, s)
    payload = bytearray(9 + 300_000)
    n = c.frame_data(sid, payload, 9, 300_000)
    assert n == 100_000  # the stream window the server advertised
    assert c.frame_data(sid, payload, 9 + n, 300_000 - n) == 0  # closed until a WINDOW_UPDATE arrives
    c.receive_data(WindowUpdateFrame(sid, window_increment=5).serialize())
    assert c.frame_data(sid, payload, 9 + n, 10) == 5


def test_window_updates_are_batched_and_released_by_consumer() -> None:
    c, s, sid = connected()
    chunk = b"x" * 1024 * 1024
    for _ in range(3):
        ev = s.receive_data(send(c, sid, chunk))
        s.ack_data(sid, sum(e.flow_controlled_length for e in ev if isinstance(e, DataReceived)))
    # 3 MiB consumed: each MiB reaches a quarter of the 4 MiB stream window and is released; the 16 MiB
    # connection window's quarter (4 MiB) is not reached yet, so no connection-level update.
    wus = [f for f in frames(s.data_to_send()) if isinstance(f, WindowUpdateFrame)]
    assert {f.stream_id for f in wus} == {sid}
    assert sum(f.window_increment for f in wus) == 3 * 1024 * 1024
    # Unacknowledged data holds the stream window and the connection's back (a slow reader): nothing is released,
    # though the connection's quarter has now been taken off it (the client, which has not seen the updates, sends
    # the last 1 MiB of its window: 4 MiB in all). Before, the connection's window was released on receipt, so 200
    # slow streams could buffer 200 stream windows.
    ev = s.receive_data(send(c, sid, chunk * 2))
    assert sum(e.flow_controlled_length for e in ev if isinstance(e, DataReceived)) == 1024 * 1024
    assert [f.stream_id for f in frames(s.data_to_send()) if isinstance(f, WindowUpdateFrame)] == []
    # Once the consumer has passed it on, both come back: the stream's quarter and the connection's 4 MiB.
    s.ack_data(sid, 1024 * 1024)
    wus = [f for f in frames(s.data_to_send()) if isinstance(f, WindowUpdateFrame)]
    assert sorted((f.stream_id, f.window_increment) for f in wus) == [(0, 4 * 1024 * 1024), (sid, 1024 * 1024)]


def test_flow_control_violation_resets_the_stream() -> None:
    _c, s, sid = connected()
    s.streams[sid].recv_window = 10
    events = s.receive_data(DataFrame(sid, b"x" * 11).serialize())
    assert data_of(events) == b""
    rst = [f for f in frames(s.data_to_send()) if isinstance(f, RstStreamFrame)]
    assert rst and rst[0].error_code == ErrorCode.FLOW_CONTROL_ERROR
    # Reported to the stream's consumer as our reset, not the peer's (the access log says who broke what).
    assert [e for e in events if isinstance(e, StreamReset)] == [
        StreamReset(sid, ErrorCode.FLOW_CONTROL_ERROR, by_peer=False)
    ]


def test_reset_no_error_and_cancel_are_eof_others_are_resets() -> None:
    c, _s, sid = connected()
    (ev,) = c.receive_data(RstStreamFrame(sid, error_code=ErrorCode.CANCEL).serialize())
    assert isinstance(ev, StreamReset) and ev.is_eof
    c2, _s2, sid2 = connected()
    (ev2,) = c2.receive_data(RstStreamFrame(sid2, error_code=ErrorCode.CONNECT_ERROR).serialize())
    assert isinstance(ev2, StreamReset) and not ev2.is_eof


def test_goaway_received_and_sent() -> None:
    c, s, sid = connected()
    s.goaway()
    events = pump(s, c)
    g = next(e for e in events if isinstance(e, GoAwayReceived))
    assert g.last_stream_id == sid and g.error_code == 0
    assert c.goaway_received is g


def promised(s: HboneConnection) -> int | None:
    """The last stream id our GOAWAY promised to process (read through a call: the state moves under mypy's eyes)."""
    return s.goaway_sent


def test_graceful_goaway_serves_a_connect_sent_before_the_peer_saw_it() -> None:
    """A server's drain in two steps, as upstream's h2 crate: GOAWAY 2^31-1 and a PING; a CONNECT the client sent
    before it read them is served; once the PING is answered, the final GOAWAY names the last stream the client
    opened, and a CONNECT after that is refused (REFUSED_STREAM)."""
    c, s, sid = connected()
    s.goaway_gracefully()
    first, ping = frames(s.data_to_send())
    assert isinstance(first, GoAwayFrame) and isinstance(ping, PingFrame)
    assert first.last_stream_id == 2**31 - 1 and first.error_code == 0
    assert ping.opaque_data == DRAIN_PING and "ACK" not in ping.flags
    assert promised(s) is None
    s.goaway_gracefully()  # once
    assert s.data_to_send() == b""

    racing = c.send_connect("10.0.0.1:8081")  # in flight while the GOAWAY travels
    assert [type(e) for e in pump(c, s)] == [ConnectRequested]
    s.send_response(racing, 200)
    assert any(isinstance(e, ConnectResponded) and e.status == 200 for e in pump(s, c))

    other = s.receive_data(PingFrame(0, b"ztunnel!", flags=["ACK"]).serialize())  # not the drain's PING
    assert promised(s) is None and s.data_to_send() == b"" and len(other) == 1
    s.receive_data(PingFrame(0, DRAIN_PING, flags=["ACK"]).serialize())
    (final,) = frames(s.data_to_send())
    assert isinstance(final, GoAwayFrame) and final.last_stream_id == racing > sid and final.error_code == 0
    assert promised(s) == racing

    late = c.send_connect("10.0.0.1:8082")  # the client has not read the final GOAWAY yet
    assert pump(c, s) == []
    (refused,) = frames(s.data_to_send())
    assert isinstance(refused, RstStreamFrame) and refused.stream_id == late
    assert refused.error_code == ErrorCode.REFUSED_STREAM


def test_graceful_goaway_before_initiate_follows_the_settings() -> None:
    """A drain while the TLS handshake is still running: SETTINGS stay the server's first frame (RFC 9113 §3.4), the
    GOAWAY 2^31-1 and its PING come right after."""
    s = HboneConnection(False)
    s.goaway_gracefully()
    assert s.data_to_send() == b""
    s.initiate()
    sent = frames(s.data_to_send())
    assert isinstance(sent[0], SettingsFrame)
    assert [type(f) for f in sent[-2:]] == [GoAwayFrame, PingFrame]
    assert all(not isinstance(f, GoAwayFrame) for f in sent[:-2])


def test_after_goaway_received_open_streams_can_still_end_and_reset() -> None:
    """A graceful GOAWAY lets open streams finish: the receiver must still be able to half-close and reset them
    (h2 alone would refuse to send anything once it saw the GOAWAY)."""
    c, s, sid = connected()
    sid2 = c.send_connect("10.0.0.1:8081")
    pump(c, s)
    s.send_response(sid2, 200)
    pump(s, c)
    s.goaway()
    assert any(isinstance(e, GoAwayReceived) for e in pump(s, c))
    assert data_of(s.receive_data(send(c, sid, b"after"))) == b"after"
    c.end_stream(sid)
    wire = c.data_to_send()
    assert any(isinstance(f, DataFrame) and f.stream_id == sid and "END_STREAM" in f.flags for f in frames(wire))
    assert any(isinstance(e, StreamEnded) and e.stream_id == sid for e in s.receive_data(wire))
    c.reset_stream(sid2, ErrorCode.CANCEL)
    assert any(isinstance(f, RstStreamFrame) and f.stream_id == sid2 for f in frames(c.data_to_send()))


def test_data_on_a_stream_we_reset_is_ignored() -> None:
    """RFC 9113 §5.1: frames in flight when we reset a stream are ignored (h2 answers each with a RST_STREAM, so a
    peer could make us queue 13 bytes per 9 received); their bytes still count against the connection window."""
    _c, s, sid = connected()
    s.reset_stream(sid, ErrorCode.CANCEL)
    s.data_to_send()
    for _ in range(300):  # more than the control budget's burst: in-flight DATA is no abuse
        assert s.receive_data(DataFrame(sid, b"z" * 1000).serialize()) == []
    out = frames(s.data_to_send())
    assert not any(isinstance(f, RstStreamFrame) for f in out)
    # 300,000 bytes taken off the connection: its window is given back (a quarter of 16 MiB is not reached yet,
    # so with more the WINDOW_UPDATE comes).
    for _ in range(5000):
        s.receive_data(DataFrame(sid, b"z" * 1000).serialize())
    assert any(isinstance(f, WindowUpdateFrame) and f.stream_id == 0 for f in frames(s.data_to_send()))


def test_empty_data_frames_on_a_stream_we_reset_cost_budget() -> None:
    _c, s, sid = connected()
    s.reset_stream(sid, ErrorCode.CANCEL)
    s.data_to_send()
    with pytest.raises(HboneProtocolError) as e:
        for _ in range(1000):
            s.receive_data(DataFrame(sid, b"").serialize())
    assert e.value.code is ErrorCode.ENHANCE_YOUR_CALM


def test_data_on_idle_stream_is_a_connection_error() -> None:
    _c, s, _sid = connected()
    with pytest.raises(HboneProtocolError):
        s.receive_data(DataFrame(99, b"zz").serialize())
    assert any(isinstance(f, GoAwayFrame) for f in frames(s.data_to_send()))


def test_oversized_frame_is_a_connection_error() -> None:
    _c, s, sid = connected()
    header = (2 * 1024 * 1024).to_bytes(3, "big") + b"\x00\x00" + sid.to_bytes(4, "big")
    with pytest.raises(HboneProtocolError) as e:
        s.receive_data(header)
    assert e.value.code == ErrorCode.FRAME_SIZE_ERROR
    assert any(isinstance(f, GoAwayFrame) for f in frames(s.data_to_send()))


def test_garbage_preface_is_a_protocol_error() -> None:
    s = HboneConnection(False)
    s.initiate()
    with pytest.raises(HboneProtocolError):
        s.receive_data(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")


def test_non_connect_request_is_reported_for_a_400() -> None:
    c, s = HboneConnection(True), HboneConnection(False)
    c.initiate()
    s.initiate()
    pump(c, s)
    pump(s, c)
    sid = c.send_connect("x", method="GET")
    req = next(e for e in pump(c, s) if isinstance(e, ConnectRequested))
    assert req.method == "GET"
    s.send_response(sid, 400, end_stream=True)
    ev = pump(s, c)
    assert isinstance(ev[0], ConnectResponded) and ev[0].status == 400
    assert isinstance(ev[1], StreamEnded)


@pytest.mark.parametrize("status", ["\u00b2\u00b2\u00b2", "\u0662\u0660\u0660", "2000", "20"])
def test_a_status_of_other_digits_is_no_status_and_no_crash(status: str) -> None:
    """``str.isdigit`` holds for superscripts (int() then raises) and for other scripts' digits (Arabic-Indic
    two-zero-zero is not 200): only three ASCII digits are a status."""
    c, s = HboneConnection(True), HboneConnection(False)
    c.initiate()
    s.initiate()
    pump(c, s)
    pump(s, c)
    sid = c.send_connect("10.0.0.1:8080")
    pump(c, s)
    frame = HeadersFrame(sid, flags=["END_HEADERS"])
    frame.data = literal_header_block([(":status", status)])
    events = c.receive_data(frame.serialize())
    [answer] = [e for e in events if isinstance(e, ConnectResponded)]
    assert answer.status == 0


def test_receive_buffer_views_and_pin() -> None:
    c, s, sid = connected()
    wire = send(c, sid, b"a" * 5000)
    buf = s.get_buffer()
    buf[: len(wire)] = wire
    (ev,) = [e for e in s.buffer_updated(len(wire)) if isinstance(e, DataReceived)]
    kept = ev.data
    s.pin()  # the consumer keeps the view: the next read must not overwrite it
    wire2 = send(c, sid, b"b" * 5000)
    buf2 = s.get_buffer()
    buf2[: len(wire2)] = wire2
    s.buffer_updated(len(wire2))
    assert bytes(kept) == b"a" * 5000


def test_window_opened_event_on_peer_update() -> None:
    c, _s, sid = connected()
    events = c.receive_data(WindowUpdateFrame(sid, window_increment=100).serialize())
    assert events == [WindowOpened(sid)]


def test_headers_continuation_reassembled_by_h2() -> None:
    c, s = HboneConnection(True), HboneConnection(False)
    c.initiate()
    s.initiate()
    pump(c, s)
    pump(s, c)
    c.send_connect("10.0.0.1:80", [("x-big", "v" * 30000)])
    events = pump(c, s)
    # A 30 KB header block does not fit one 16 KiB frame: it arrived as HEADERS + CONTINUATION.
    assert any(isinstance(e, ConnectRequested) and e.headers["x-big"] == "v" * 30000 for e in events)


def test_a_settings_frame_of_many_entries_is_refused() -> None:
    """One budget token per SETTINGS frame whatever its size: a frame of more than 32 entries (a peer has 7
    settings to send) ends the connection before it is parsed."""
    _c, s, _sid = connected()
    payload = b"".join((0x4).to_bytes(2, "big") + (65535 + i).to_bytes(4, "big") for i in range(33))
    frame = len(payload).to_bytes(3, "big") + b"\x04\x00\x00\x00\x00\x00" + payload
    with pytest.raises(HboneProtocolError) as e:
        s.receive_data(frame)
    assert e.value.code is ErrorCode.ENHANCE_YOUR_CALM


def test_a_run_of_connection_window_updates_is_one_event() -> None:
    c, _s, _sid = connected()
    updates = b"".join(WindowUpdateFrame(0, window_increment=1).serialize() for _ in range(1000))
    events = c.receive_data(updates)
    assert [e for e in events if isinstance(e, WindowOpened)] == [WindowOpened(0)]


# -- the connection's receive window (as upstream's h2 crate: released when the consumer passes bytes on) ----------

MiB = 1024 * 1024


def _open(c: HboneConnection, s: HboneConnection) -> int:
    sid = c.send_connect("10.0.0.1:8080")
    pump(c, s)
    s.send_response(sid, 200)
    pump(s, c)
    return sid


def _raw_data(sid: int, nbytes: int, *flags: str) -> bytes:
    """DATA frames of ``nbytes`` in all, built by hyperframe (a peer that keeps no flow control of its own)."""
    out = b""
    while nbytes > 0:
        n = min(nbytes, 1 * MiB)
        nbytes -= n
        out += DataFrame(sid, b"d" * n, flags=set(flags) if nbytes <= 0 else set()).serialize()
    return out


def _connection_updates(s: HboneConnection) -> list[int]:
    return [
        f.window_increment for f in frames(s.data_to_send()) if isinstance(f, WindowUpdateFrame) and not f.stream_id
    ]


def test_data_past_the_connection_window_is_a_connection_error() -> None:
    """Four streams hold their 4 MiB stream windows unreleased (apps that do not read): the 16 MiB connection window
    is used up, and one byte more on a fifth stream, within its own window, ends the connection with GOAWAY
    FLOW_CONTROL_ERROR (RFC 9113 §6.9.1). Before, the connection window was released on receipt: five, or 200,
    streams could each buffer a stream window."""
    c, s, first = connected()
    sids = [first] + [_open(c, s) for _ in range(4)]
    for sid in sids[:4]:
        assert len(data_of(s.receive_data(_raw_data(sid, 4 * MiB)))) == 4 * MiB
    assert (s.receive_window, s.receive_held) == (0, 16 * MiB)
    assert _connection_updates(s) == []  # nothing released: the consumers still hold it all
    with pytest.raises(HboneProtocolError) as e:
        s.receive_data(_raw_data(sids[4], 1))
    assert e.value.code is ErrorCode.FLOW_CONTROL_ERROR
    assert "past the connection's receive window" in str(e.value)
    (goaway,) = [f for f in frames(s.data_to_send()) if isinstance(f, GoAwayFrame)]
    assert goaway.error_code == ErrorCode.FLOW_CONTROL_ERROR


def test_a_slow_stream_gets_its_bytes_and_the_others_proceed_once_it_releases_them() -> None:
    """Three streams hold 12 MiB; a fourth takes the last 4 MiB and passes it on at once. Its 4 MiB is due at the
    quarter-window batch; then, with the window nearly used up by the held streams, even a smaller release is sent
    at once (h2's rule: half of what remains), so the active stream is never stuck behind the batching. When the
    held streams' apps read, their 12 MiB comes back."""
    c, s, first = connected()
    sids = [first] + [_open(c, s) for _ in range(3)]
    for sid in sids[:3]:
        s.receive_data(_raw_data(sid, 4 * MiB))
    got = data_of(s.receive_data(_raw_data(sids[3], 3 * MiB)))
    assert len(got) == 3 * MiB  # delivered whatever the others hold
    assert s.receive_window == 1 * MiB
    s.ack_data(sids[3], 3 * MiB)  # 3 MiB released, under the 4 MiB batch but over half of the 1 MiB left
    assert _connection_updates(s) == [3 * MiB]
    assert s.receive_window == 4 * MiB
    for sid in sids[:3]:
        s.ack_data(sid, 4 * MiB)
    assert sum(_connection_updates(s)) == 12 * MiB
    assert (s.receive_window, s.receive_held) == (16 * MiB, 0)


@pytest.mark.parametrize("how", ["reset by the peer", "reset by us", "ended both ways"])
def test_a_stream_closed_with_unreleased_bytes_gives_them_back(how: str) -> None:
    """A stream that closes while its consumer still holds bytes (its app was slow): the consumer acknowledges them
    once it drops them, after the core has forgotten the stream, and the connection gets its window back (else
    every such stream would shrink it for good, and the connection would starve)."""
    _c, s, sid = connected()
    s.receive_data(_raw_data(sid, 4 * MiB, *(["END_STREAM"] if how == "ended both ways" else [])))
    assert s.receive_held == 4 * MiB
    if how == "reset by the peer":
        s.receive_data(RstStreamFrame(sid, error_code=ErrorCode.CANCEL).serialize())
    elif how == "reset by us":
        s.reset_stream(sid, ErrorCode.CONNECT_ERROR)
    else:
        s.end_stream(sid)
    assert sid not in s.streams
    s.data_to_send()
    s.ack_data(sid, 4 * MiB)
    assert _connection_updates(s) == [4 * MiB]
    assert (s.receive_window, s.receive_held) == (16 * MiB, 0)
    # A consumer that acknowledges too much cannot widen the window past what was advertised.
    s.ack_data(sid, 1 * MiB)
    assert _connection_updates(s) == [] and s.receive_window == 16 * MiB


def test_dropped_data_gives_the_connection_window_back_at_once() -> None:
    """DATA nobody will consume (on a stream we reset, its padding) is released by the core itself."""
    c, s, sid = connected()
    s.reset_stream(sid, ErrorCode.CANCEL)
    s.data_to_send()
    s.receive_data(_raw_data(sid, 8 * MiB))
    assert sum(_connection_updates(s)) == 8 * MiB
    assert (s.receive_window, s.receive_held) == (16 * MiB, 0)
    sid2 = _open(c, s)
    padded = DataFrame(sid2, b"p" * 100, flags={"PADDED"}, pad_length=200).serialize()
    assert data_of(s.receive_data(padded)) == b"p" * 100
    assert s.receive_held == 100  # the payload, held by its consumer; the pad length byte and padding released


def test_a_connection_window_below_the_initial_one_acts_as_it() -> None:
    """RFC 9113 §6.9.2: the connection window starts at 65,535 and no SETTINGS lowers it, so a configured window
    below that is 65,535 (docs/configuration.md says so)."""
    s = HboneConnection(False, Settings(connection_window=1000, max_concurrent_streams=200))
    s.initiate()
    assert not [f for f in frames(s.data_to_send()) if isinstance(f, WindowUpdateFrame)]
    assert s.receive_window == 65_535
