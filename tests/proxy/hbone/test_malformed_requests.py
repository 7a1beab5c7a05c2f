"""A malformed request costs only its own stream, as in upstream's h2 crate: RST_STREAM PROTOCOL_ERROR for it, and the
connection with its other tunnels goes on (found by the conformance checker, ``connect.*``; python-h2 alone answers
with GOAWAY and ends every tunnel on the connection). An unknown pseudo-header stays a connection error, as upstream's.
"""

from __future__ import annotations

import hpack
import pytest
from hyperframe.frame import GoAwayFrame, HeadersFrame, RstStreamFrame, SettingsFrame

from tests.proxy.hbone.test_core import frames
from ztunnel.proxy.hbone.core import (
    ConnectRequested,
    ErrorCode,
    HboneConnection,
    HboneProtocolError,
    RequestRefused,
)

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
GOOD = [(":method", "CONNECT"), (":authority", "10.0.0.1:8080")]

MALFORMED = {
    "scheme and path in CONNECT": [*GOOD, (":scheme", "https"), (":path", "/")],
    "connection header": [*GOOD, ("connection", "keep-alive")],
    "te other than trailers": [*GOOD, ("te", "gzip")],
    "uppercase name": [*GOOD, ("X-Forged", "1")],
    "pseudo-header after a regular one": [(":method", "CONNECT"), ("baggage", "a=b"), (":authority", "10.0.0.1:8080")],
    "duplicate :authority": [*GOOD, (":authority", "10.0.0.2:8080")],
    "GET without :path": [(":method", "GET"), (":scheme", "https"), (":authority", "x")],
    "no :method": [(":authority", "10.0.0.1:8080")],
    "newline in a value": [*GOOD, ("baggage", "a\nforged line")],
    "space in :authority": [(":method", "CONNECT"), (":authority", "10.0.0.1 :8080")],
}


def server_with(blocks: list[list[tuple[str, str]]]) -> tuple[HboneConnection, list[object], bytes]:
    """A server core fed the client preface, SETTINGS and one HEADERS frame per block (streams 1, 3, ...): its
    events and the bytes it answers with."""
    s = HboneConnection(False)
    s.initiate()
    s.data_to_send()
    enc = hpack.Encoder()
    wire = bytearray(PREFACE + SettingsFrame(0).serialize())
    for i, block in enumerate(blocks):
        wire += HeadersFrame(1 + 2 * i, data=enc.encode(block), flags=["END_HEADERS"]).serialize()
    events = s.receive_data(bytes(wire))
    return s, list(events), s.data_to_send()


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_request_resets_only_its_stream(case: str) -> None:
    s, events, out = server_with([MALFORMED[case], GOOD])
    sent = frames(out)
    assert [(f.stream_id, f.error_code) for f in sent if isinstance(f, RstStreamFrame)] == [
        (1, ErrorCode.PROTOCOL_ERROR)
    ]
    assert not [f for f in sent if isinstance(f, GoAwayFrame)]
    assert [e.stream_id for e in events if isinstance(e, RequestRefused)] == [1]
    (req,) = [e for e in events if isinstance(e, ConnectRequested)]
    assert (req.stream_id, req.method, req.authority) == (3, "CONNECT", "10.0.0.1:8080")
    assert s.malformed_requests == 1 and not s.closed
    refused = next(e for e in events if isinstance(e, RequestRefused))
    assert "\n" not in refused.reason and "forged" not in refused.reason  # never a header value in the log


def test_connect_without_authority_reaches_the_handler() -> None:
    """As upstream: not malformed at the HTTP/2 layer, the CONNECT handler answers it 400."""
    _, events, out = server_with([[(":method", "CONNECT")]])
    (req,) = [e for e in events if isinstance(e, ConnectRequested)]
    assert (req.method, req.authority) == ("CONNECT", "")
    assert not [f for f in frames(out) if isinstance(f, RstStreamFrame | GoAwayFrame)]


def test_unknown_pseudo_header_is_a_connection_error() -> None:
    with pytest.raises(HboneProtocolError, match="unknown pseudo-header") as e:
        server_with([[*GOOD, (":tunnel", "1")]])
    assert e.value.code == ErrorCode.PROTOCOL_ERROR


def test_a_stream_over_the_limit_is_refused_alone() -> None:
    """SETTINGS_MAX_CONCURRENT_STREAMS 200 (acknowledged): the 201st open stream gets RST_STREAM REFUSED_STREAM and
    the connection, with its 200 streams, goes on; once one ends, a new one is accepted again."""
    s = HboneConnection(False)
    s.initiate()
    s.data_to_send()
    enc = hpack.Encoder()
    wire = bytearray(PREFACE + SettingsFrame(0).serialize() + SettingsFrame(0, flags=["ACK"]).serialize())
    for i in range(201):
        wire += HeadersFrame(1 + 2 * i, data=enc.encode(GOOD), flags=["END_HEADERS"]).serialize()
    events = s.receive_data(bytes(wire))
    sent = frames(s.data_to_send())
    assert len([e for e in events if isinstance(e, ConnectRequested)]) == 200
    assert [(f.stream_id, f.error_code) for f in sent if isinstance(f, RstStreamFrame)] == [
        (401, ErrorCode.REFUSED_STREAM)
    ]
    assert not [f for f in sent if isinstance(f, GoAwayFrame)] and not s.closed
    s.reset_stream(1)  # one tunnel ends: room for one more
    events = s.receive_data(HeadersFrame(403, data=enc.encode(GOOD), flags=["END_HEADERS"]).serialize())
    assert [e.stream_id for e in events if isinstance(e, ConnectRequested)] == [403]
