"""CONNECT requests and their responses, built and parsed by the HBONE core without h2, checked against h2.

The oracle is h2 itself: what our client sends is received by this core's server and by an ``H2Connection`` server
(validating inbound headers), and what our server sends by this core's client and an ``H2Connection`` client; both
must give the same events and the same protocol errors (a malformed request aside: refused alone here, as
upstream's h2 crate does, where h2 ends the connection). Our header blocks are HPACK literals that leave both
dynamic tables empty, and no HEADERS frame object is built or parsed on the way.
"""

from __future__ import annotations

import random

import hpack
import hyperframe.frame
import pytest
from hyperframe.frame import RstStreamFrame

from tests.proxy.hbone.test_stream_states import Oracle, Ours, Subject
from ztunnel.proxy.hbone.core import (
    CLIENT_SETTINGS,
    FRAME_HEADER_SIZE,
    SERVER_SETTINGS,
    ConnectRequested,
    DataReceived,
    HboneConnection,
    decode_plain_block,
    literal_header_block,
)

PREFACE_SIZE = 24
UPSTREAM = [
    ("baggage", "k8s.cluster.name=Kubernetes,k8s.namespace.name=default,k8s.deployment.name=client,service.name=c"),
    ("forwarded", 'for="10.0.0.1:40000"'),
    ("traceparent", "00-0123456789abcdef0123456789abcdef-0123456789abcdef-00"),
]

# (authority, extra headers, method) of each request, sent one after the other on one connection.
REQUESTS: dict[str, tuple[str, list[tuple[str, str]], str]] = {
    "upstream's three headers": ("10.0.0.2:8080", UPSTREAM, "CONNECT"),
    "no headers": ("[fd00::2]:80", [], "CONNECT"),
    "static-table names": ("10.0.0.2:8080", [("user-agent", "zt"), ("accept", "*/*"), ("cookie", "a=1")], "CONNECT"),
    "two cookies (h2 joins them)": ("10.0.0.2:8080", [("cookie", "a=1"), ("cookie", "b=2")], "CONNECT"),
    "content-length (h2 tracks it)": ("10.0.0.2:8080", [("content-length", "0")], "CONNECT"),
    "long name and value (multi-byte lengths)": ("10.0.0.2:8080", [("x-" + "n" * 200, "v" * 5000)], "CONNECT"),
    "GET (answered 400 by the handler)": ("10.0.0.2:8080", [], "GET"),
    "malformed: :path in a CONNECT": ("10.0.0.2:8080", [(":path", "/")], "CONNECT"),
    "malformed: connection header": ("10.0.0.2:8080", [("connection", "close")], "CONNECT"),
    "connection error: unknown pseudo-header": ("10.0.0.2:8080", [(":bogus", "1")], "CONNECT"),
    # 2,100 fields of 33 bytes each by RFC 7541's count: over the server's 64 KiB list, in a ~6 KB block.
    "connection error: header list over the limit": ("10.0.0.2:8080", [("x", "")] * 2100, "CONNECT"),
}

# (status, headers, end_stream) answers, one per request, in order.
RESPONSES: dict[str, list[tuple[int, list[tuple[str, str]], bool]]] = {
    "200": [(200, [], False)],
    "200 with baggage": [(200, [("baggage", "k8s.cluster.name=Kubernetes")], False)],
    "503 ending the stream": [(503, [], True)],
    "401 with a header, ending": [(401, [("www-authenticate", "x")], True)],
    "100 then 200": [(100, [], False), (200, [], False)],
    "200 with content-length": [(200, [("content-length", "0")], False)],
    # Our server does not validate what it sends, so these reach the client's checks (h2's: a connection error).
    "malformed: uppercase name": [(200, [("Baggage", "x")], False)],
    "malformed: connection header": [(200, [("connection", "close")], False)],
    "malformed: request pseudo-header": [(200, [(":path", "/")], False)],
    "malformed: value with a newline": [(200, [("baggage", "a\nb")], False)],
}


def _connected() -> tuple[HboneConnection, HboneConnection]:
    """A client and a server core past the preface and both SETTINGS exchanges (ACKs included)."""
    client, server = HboneConnection(True), HboneConnection(False)
    client.initiate()
    server.initiate()
    server.receive_data(client.data_to_send())
    client.receive_data(server.data_to_send())
    server.receive_data(client.data_to_send())
    return client, server


def _frames(wire: bytes) -> list[tuple[int, int, int]]:
    """(type, flags, stream) of each frame in ``wire``."""
    out = []
    pos = 0
    while pos < len(wire):
        length = int.from_bytes(wire[pos : pos + 3], "big")
        out.append((wire[pos + 3], wire[pos + 4], int.from_bytes(wire[pos + 5 : pos + 9], "big") & 0x7FFFFFFF))
        pos += FRAME_HEADER_SIZE + length
    return out


def _handshake(sender: HboneConnection, receivers: list[Subject]) -> None:
    """The sender's preface and SETTINGS to each receiver, and each receiver's SETTINGS (and ACK) back."""
    first = sender.data_to_send()
    back = b""
    for r in receivers:
        r.receive(first)
        back = bytes(r.sent)  # the same SETTINGS (and ACK) from either receiver: h2 writes both
        r.sent.clear()
        r.events.clear()
    sender.receive_data(back)
    sender.data_to_send()


def _receivers(client: bool) -> list[Subject]:
    settings = CLIENT_SETTINGS if client else SERVER_SETTINGS
    return [Ours(client, settings), Oracle(client, settings)]


# Requests the oracle (h2, validating inbound headers) ends the connection for, and this core refuses alone (RST_STREAM
# PROTOCOL_ERROR, as upstream's h2 crate: RFC 9113 §8.1.1); the other streams on the connection go on.
REFUSED_ALONE = {"malformed: :path in a CONNECT", "malformed: connection header"}


@pytest.mark.parametrize("name", list(REQUESTS))
def test_request_is_received_as_h2_receives_it(name: str) -> None:
    """Our client's CONNECT, received by this core's server and by h2's: the same request (or error)."""
    authority, headers, method = REQUESTS[name]
    client = HboneConnection(True)
    client.initiate()
    ours, oracle = receivers = _receivers(False)
    _handshake(client, receivers)
    sid = client.send_connect(authority, headers, method)
    wire = client.data_to_send()
    for r in receivers:
        r.receive(wire)
    if name in REFUSED_ALONE:
        assert oracle.error == ("connection", 0x1)
        assert ours.error is None and bytes(ours.sent) == RstStreamFrame(sid, error_code=0x1).serialize()
        return
    assert (ours.events, ours.error) == (oracle.events, oracle.error)
    if name == "connection error: header list over the limit":
        assert ours.error == ("connection", 0xB)  # ENHANCE_YOUR_CALM
    elif name.startswith("connection error"):
        assert ours.error == ("connection", 0x1)
    else:
        assert ours.events and ours.events[0][:2] == ("request", sid), "the request reached the server"


@pytest.mark.parametrize("name", list(RESPONSES))
def test_response_is_received_as_h2_receives_it(name: str) -> None:
    """Our server's answers to a CONNECT, received by this core's client and by h2's: the same events or error."""
    ours, oracle = receivers = _receivers(True)
    server = HboneConnection(False)
    server.initiate()
    ours_sid = ours.connect([(":method", "CONNECT"), (":authority", "10.0.0.2:8080"), *UPSTREAM])
    oracle_sid = oracle.connect([(":method", "CONNECT"), (":authority", "10.0.0.2:8080"), *UPSTREAM])
    assert ours_sid == oracle_sid == 1
    wire = bytes(ours.sent)
    server.receive_data(wire)  # preface, SETTINGS, window update, CONNECT
    back = server.data_to_send()
    for r in receivers:
        r.sent.clear()
        r.receive(back)
    for status, headers, end in RESPONSES[name]:
        server.send_response(1, status, headers, end_stream=end)
        wire = server.data_to_send()
        for r in receivers:
            if r.error is None:
                r.receive(wire)
    assert (ours.events, ours.error) == (oracle.events, oracle.error)
    if name.startswith("malformed"):
        assert ours.error == ("connection", 0x1)
    else:
        assert ours.events, "the response reached the client"


def test_many_streams_and_a_block_split_into_continuations_reach_h2() -> None:
    """Requests before the peer's SETTINGS (frames of at most 16 KiB, so a 20 KB value takes a CONTINUATION), and
    a hundred streams opened, answered and ended on one connection: h2, as the server, sees what our server sees."""
    client = HboneConnection(True)
    client.initiate()
    ours, oracle = receivers = _receivers(False)
    first = client.send_connect("10.0.0.2:8080", [("baggage", "b" * 20_000)])
    wire = client.data_to_send()
    assert any(f[0] == 0x9 for f in _frames(wire[PREFACE_SIZE:])), "the first block was split"
    for r in receivers:
        r.receive(wire)
    client.receive_data(bytes(ours.sent))
    server = ours  # answers come from our server; h2 only receives
    buf = bytearray(FRAME_HEADER_SIZE + 1)
    for i in range(100):
        sid = client.send_connect(f"10.0.{i}.2:8080", UPSTREAM)
        wire = client.data_to_send()
        for r in receivers:
            r.receive(wire)
        server.respond(sid, [(":status", "200" if i % 3 else "503")], not i % 3)
        client.receive_data(bytes(server.sent))
        server.sent.clear()
        if i % 3:
            assert client.frame_data(sid, buf, FRAME_HEADER_SIZE, 1) == 1
            client.end_stream(sid)
            wire = client.data_to_send() + bytes(buf) + client.data_to_send()
            for r in receivers:
                r.receive(wire)
    assert first == 1 and ours.error is None and oracle.error is None
    assert ours.events == oracle.events
    assert sum(e[0] == "request" for e in ours.events) == 101


def test_no_headers_frame_objects_and_hpack_tables_left_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[int] = []
    original = hyperframe.frame.HeadersFrame.__init__

    def counting(self: hyperframe.frame.HeadersFrame, *args: object, **kwargs: object) -> None:
        built.append(1)
        original(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(hyperframe.frame.HeadersFrame, "__init__", counting)
    client, server = _connected()
    sid = client.send_connect("10.0.0.2:8080", UPSTREAM)
    events = server.receive_data(client.data_to_send())
    assert [type(e) for e in events] == [ConnectRequested]
    server.send_response(sid, 200, [("baggage", "k8s.cluster.name=Kubernetes")])
    client.receive_data(server.data_to_send())
    assert built == [], "h2 built or parsed a HEADERS frame object"
    assert not server._decoder.header_table.dynamic_entries
    assert not client._decoder.header_table.dynamic_entries


def test_a_block_after_the_peer_resized_its_table_carries_the_update_in_plain_literals() -> None:
    """After the peer's SETTINGS_HEADER_TABLE_SIZE the next block must start with a dynamic table size update
    (RFC 7541 §4.2): hpack encodes that block, with plain (not Huffman-coded) values; the one after is ours again."""
    client = HboneConnection(True)
    client.initiate()
    client.data_to_send()
    client.receive_data(hyperframe.frame.SettingsFrame(0, settings={0x1: 1024}).serialize())
    client.data_to_send()
    sid = client.send_connect("10.0.0.2:8080", [("x-probe", "abcdefghijkl")])
    first = client.data_to_send()[FRAME_HEADER_SIZE:]
    assert first[0] & 0xE0 == 0x20, "a dynamic table size update first"
    assert b"abcdefghijkl" in first
    decoder = hpack.Decoder()
    assert [(str(n), str(v)) for n, v in decoder.decode(first)][2] == ("x-probe", "abcdefghijkl")
    assert sid == 1
    client.send_connect("10.0.0.2:8080", [("x-probe", "abcdefghijkl")])
    second = client.data_to_send()[FRAME_HEADER_SIZE:]
    assert second == literal_header_block(
        [(":method", "CONNECT"), (":authority", "10.0.0.2:8080"), ("x-probe", "abcdefghijkl")]
    )


def test_literal_block_decodes_to_the_headers() -> None:
    headers = [(":status", "200"), (":method", "CONNECT"), ("baggage", "x" * 300), ("z" * 130, ""), ("é", "ü")]
    decoded: list[tuple[str, str]] = [
        (str(n), str(v)) for n, v in hpack.Decoder().decode(literal_header_block(headers))
    ]
    assert decoded == headers
    # Whole static fields are their one-byte index (":status: 200" is static entry 8).
    assert literal_header_block([(":status", "200")]) == b"\x88"


def test_data_in_the_same_read_as_its_connect_is_delivered() -> None:
    """A client may send DATA right behind its CONNECT; both in one read must reach the server's consumer (h2 used to
    see the HEADERS only after the DATA frame had been judged to be on an unknown stream, and the bytes were lost)."""
    client, server = _connected()
    sid = client.send_connect("10.0.0.2:8080", UPSTREAM)
    buf = bytearray(FRAME_HEADER_SIZE + 5)
    buf[FRAME_HEADER_SIZE:] = b"hello"
    assert client.frame_data(sid, buf, FRAME_HEADER_SIZE, 5) == 5
    events = server.receive_data(client.data_to_send() + bytes(buf))
    assert [type(e) for e in events] == [ConnectRequested, DataReceived]
    assert bytes(events[1].data) == b"hello"  # type: ignore[union-attr]


def _hpack_decode(block: bytes) -> list[tuple[bytes, bytes]] | str:
    try:
        return [(bytes(n), bytes(v)) for n, v in hpack.Decoder(max_header_list_size=4096).decode(block, raw=True)]
    except hpack.HPACKError as e:
        return type(e).__name__


def test_plain_block_decoder_agrees_with_hpack() -> None:
    """Every block the plain decoder accepts decodes to what hpack's does; blocks that use the dynamic table or
    Huffman coding, or that hpack rejects, are left to hpack (None). Blocks: ours, hpack's own encodings, and
    random corruptions of both (fixed seed)."""
    headers = [(":method", "CONNECT"), (":authority", "10.0.0.2:8080"), *UPSTREAM, ("user-agent", "u" * 140)]
    ours = literal_header_block(headers)
    assert decode_plain_block(hpack.Decoder(), ours) == _hpack_decode(ours)
    indexed = hpack.Encoder().encode(headers)  # literals with indexing, Huffman-coded
    assert decode_plain_block(hpack.Decoder(), indexed) is None
    assert decode_plain_block(hpack.Decoder(), b"\x80") is None  # index 0
    assert decode_plain_block(hpack.Decoder(), b"\xbe") is None  # index 62: dynamic table (empty)
    assert decode_plain_block(hpack.Decoder(), ours[:-1]) is None  # truncated
    assert decode_plain_block(hpack.Decoder(max_header_list_size=100), ours) is None  # over the list limit
    rng = random.Random(17)
    accepted = 0
    for _ in range(5000):
        block = bytearray(rng.choice((ours, indexed)))
        for _ in range(rng.randint(1, 3)):
            block[rng.randrange(len(block))] = rng.randrange(256)
        if rng.random() < 0.3:
            del block[rng.randrange(len(block)) :]
        plain = decode_plain_block(hpack.Decoder(max_header_list_size=4096), bytes(block))
        if plain is not None:
            accepted += 1
            assert plain == _hpack_decode(bytes(block)), bytes(block).hex()
    assert accepted > 500, "the corruptions left too few blocks to compare"


def _lifecycle(client: HboneConnection, server: HboneConnection) -> None:
    """One stream's whole life: CONNECT, 200, END_STREAM both ways (the connection-rate benchmark's shape)."""
    sid = client.send_connect("10.0.0.2:8080", UPSTREAM)
    assert [type(e) for e in server.receive_data(client.data_to_send())] == [ConnectRequested]
    server.send_response(sid, 200, [("baggage", "k8s.cluster.name=Kubernetes")])
    client.receive_data(server.data_to_send())
    client.end_stream(sid)
    server.end_stream(sid)
    server.receive_data(client.data_to_send())
    client.receive_data(server.data_to_send())
    assert not client.streams and not server.streams


def test_stream_lifecycle_runs_no_import_statements(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream's life runs no import statement (one costs ~0.4 us per name, ~10 % of a stream lifecycle when the
    HEADERS and END_STREAM paths imported h2's names in each call)."""
    import builtins

    client, server = _connected()
    _lifecycle(client, server)  # first use: whatever is imported lazily is imported now
    imports: list[str] = []
    original = builtins.__import__

    def counting(name: str, *args: object, **kwargs: object) -> object:
        imports.append(name)
        return original(name, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(builtins, "__import__", counting)
    _lifecycle(client, server)
    monkeypatch.undo()
    assert imports == []


def test_many_table_size_changes_owe_one_update() -> None:
    """A peer alternating SETTINGS_HEADER_TABLE_SIZE between 0 and 1 (thousands of entries) costs one pending size
    update, not one per entry, and a repeated value does not cancel the update owed (RFC 7541 §4.2: the smallest
    size since the last block is signalled)."""
    client = HboneConnection(True)
    client.initiate()
    client.data_to_send()
    for _ in range(5):
        entries = {0x1: 0}
        client.receive_data(hyperframe.frame.SettingsFrame(0, settings=entries).serialize())
        client.receive_data(hyperframe.frame.SettingsFrame(0, settings={0x1: 1}).serialize())
        client.receive_data(hyperframe.frame.SettingsFrame(0, settings={0x1: 0}).serialize())
    client.data_to_send()
    client.send_connect("10.0.0.2:8080")
    block = client.data_to_send()[FRAME_HEADER_SIZE:]
    assert block[0] == 0x20, "one size update to 0 first"
    assert block[1] & 0xE0 != 0x20, "and only one"
    decoder = hpack.Decoder()
    assert [(str(n), str(v)) for n, v in decoder.decode(block)][:1] == [(":method", "CONNECT")]
