"""CONNECT requests and their responses without h2's frame objects (``thirdparty.H2_HEADERS``), checked against h2.

The oracle is h2 itself: the same exchanges run with the direct path off on both cores (every HEADERS frame through
``H2Connection.send_headers`` / ``receive_data``) and on, on either side or both. Each must give the same events on
both sides, the same frames (type, flags, stream) carrying the same decoded header lists, the same h2 stream states,
and the same protocol errors. The direct path is also checked to be taken: no HEADERS frame object is built or
parsed, and our header blocks leave both HPACK dynamic tables empty.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import hpack
import hyperframe.frame
import pytest

from ztunnel.proxy.hbone.core import (
    FRAME_HEADER_SIZE,
    ConnectRequested,
    DataReceived,
    HboneConnection,
    HboneProtocolError,
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


Script = Callable[[HboneConnection, HboneConnection, Callable[[], None]], None]


@dataclass
class Run:
    client_events: list[object]
    server_events: list[object]
    to_server: bytes  # every byte the client sent, preface excluded
    to_client: bytes
    states: list[tuple[str, int, object, object]]  # (side, stream, h2 state, headers received)
    error: tuple[str, int] | None  # (side, code) of a protocol error


def _cores(client_direct: bool, server_direct: bool) -> tuple[HboneConnection, HboneConnection]:
    client, server = HboneConnection(True), HboneConnection(False)
    client._headers_direct = client_direct
    server._headers_direct = server_direct
    client.initiate()
    server.initiate()
    return client, server


def _run(client_direct: bool, server_direct: bool, script: Script) -> Run:
    client, server = _cores(client_direct, server_direct)
    run = Run([], [], b"", b"", [], None)
    sent_c, sent_s = bytearray(), bytearray()

    def exchange() -> None:
        while True:
            out_c, out_s = client.data_to_send(), server.data_to_send()
            if not out_c and not out_s:
                return
            sent_c.extend(out_c)
            sent_s.extend(out_s)
            if out_c:
                run.server_events.extend(server.receive_data(out_c))
            if out_s:
                run.client_events.extend(client.receive_data(out_s))

    try:
        script(client, server, exchange)
        exchange()
    except HboneProtocolError as e:
        run.error = ("client" if client.closed else "server", int(e.code))
        sent_c.extend(client.data_to_send())
        sent_s.extend(server.data_to_send())
    run.to_server, run.to_client = bytes(sent_c[PREFACE_SIZE:]), bytes(sent_s)
    for side, core in (("client", client), ("server", server)):
        for sid, stream in sorted(core.h2.streams.items()):
            m = stream.state_machine
            run.states.append((side, sid, m.state, m.headers_received))
    return run


def _frames(wire: bytes) -> Iterator[tuple[int, int, int, bytes]]:
    pos = 0
    while pos < len(wire):
        length = int.from_bytes(wire[pos : pos + 3], "big")
        ftype, flags = wire[pos + 3], wire[pos + 4]
        sid = int.from_bytes(wire[pos + 5 : pos + 9], "big") & 0x7FFFFFFF
        yield ftype, flags, sid, wire[pos + FRAME_HEADER_SIZE : pos + FRAME_HEADER_SIZE + length]
        pos += FRAME_HEADER_SIZE + length


def _decoded(wire: bytes) -> list[tuple[int, int, int, object]]:
    """Each frame as (type, flags, stream, payload), a header block (HEADERS + CONTINUATIONs) as its decoded header
    list on the HEADERS frame (one decoder per direction, as a peer has), the CONTINUATIONs' payload left out."""
    decoder = hpack.Decoder(max_header_list_size=1 << 30)
    out: list[tuple[int, int, int, object]] = []
    block = bytearray()
    for ftype, flags, sid, payload in _frames(wire):
        if ftype in (0x1, 0x9):
            block += payload
            out.append((ftype, flags, sid, None))
            if flags & 0x4:
                first = max(i for i, f in enumerate(out) if f[0] == 0x1)
                out[first] = (*out[first][:3], decoder.decode(bytes(block), raw=True))
                block.clear()
        else:
            out.append((ftype, flags, sid, payload))
    return out


MODES = [(c, s) for c, s in itertools.product((False, True), repeat=2) if c or s]


def _check_same(script: Script) -> Run:
    oracle = _run(False, False, script)
    for client_direct, server_direct in MODES:
        run = _run(client_direct, server_direct, script)
        mode = f"direct client={client_direct} server={server_direct}"
        assert run.client_events == oracle.client_events, mode
        assert run.server_events == oracle.server_events, mode
        assert _decoded(run.to_server) == _decoded(oracle.to_server), mode
        assert _decoded(run.to_client) == _decoded(oracle.to_client), mode
        assert run.states == oracle.states, mode
        assert run.error == oracle.error, mode
    return oracle


@pytest.mark.parametrize("name", list(REQUESTS))
def test_request_matches_h2(name: str) -> None:
    authority, headers, method = REQUESTS[name]

    def script(client: HboneConnection, server: HboneConnection, exchange: Callable[[], None]) -> None:
        exchange()  # SETTINGS both ways first
        client.send_connect(authority, headers, method)

    oracle = _check_same(script)
    if name == "connection error: header list over the limit":
        assert oracle.error == ("server", 0xB)  # h2: DenialOfServiceError, ENHANCE_YOUR_CALM
    elif name.startswith("connection error"):
        assert oracle.error == ("server", 0x1)
    else:
        assert oracle.server_events, "the request reached the server"


@pytest.mark.parametrize("name", list(RESPONSES))
def test_response_matches_h2(name: str) -> None:
    def script(client: HboneConnection, server: HboneConnection, exchange: Callable[[], None]) -> None:
        exchange()
        sid = client.send_connect("10.0.0.2:8080", UPSTREAM)
        exchange()
        for status, headers, end in RESPONSES[name]:
            server.send_response(sid, status, headers, end_stream=end)
            exchange()

    oracle = _check_same(script)
    if name.startswith("malformed"):
        assert oracle.error == ("client", 0x1)
    else:
        assert oracle.client_events, "the response reached the client"


def test_many_streams_and_a_block_split_into_continuations_match_h2() -> None:
    """Requests before the peer's SETTINGS (frames of at most 16 KiB, so a 20 KB value takes a CONTINUATION), and
    a hundred streams opened, answered and ended on one connection."""

    def script(client: HboneConnection, server: HboneConnection, exchange: Callable[[], None]) -> None:
        client.send_connect("10.0.0.2:8080", [("baggage", "b" * 20_000)])
        exchange()
        buf = bytearray(FRAME_HEADER_SIZE + 1)
        for i in range(100):
            sid = client.send_connect(f"10.0.{i}.2:8080", UPSTREAM)
            exchange()
            server.send_response(sid, 200 if i % 3 else 503, [], end_stream=not i % 3)
            exchange()
            if i % 3:
                assert client.frame_data(sid, buf, FRAME_HEADER_SIZE, 1) == 1
                server.receive_data(client.data_to_send() + bytes(buf))
                client.end_stream(sid)
                server.end_stream(sid)
                exchange()

    oracle = _check_same(script)
    assert any(f[0] == 0x9 for f in _decoded(oracle.to_server)), "the first block was split"


def test_direct_path_builds_no_headers_frames_and_leaves_hpack_tables_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[int] = []
    original = hyperframe.frame.HeadersFrame.__init__

    def counting(self: hyperframe.frame.HeadersFrame, *args: object, **kwargs: object) -> None:
        built.append(1)
        original(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(hyperframe.frame.HeadersFrame, "__init__", counting)
    client, server = HboneConnection(True), HboneConnection(False)
    client.initiate()
    server.initiate()
    server.receive_data(client.data_to_send())
    client.receive_data(server.data_to_send())
    server.receive_data(client.data_to_send())
    sid = client.send_connect("10.0.0.2:8080", UPSTREAM)
    events = server.receive_data(client.data_to_send())
    assert [type(e) for e in events] == [ConnectRequested]
    server.send_response(sid, 200, [("baggage", "k8s.cluster.name=Kubernetes")])
    client.receive_data(server.data_to_send())
    assert built == [], "h2 built or parsed a HEADERS frame object"
    assert not server.h2.decoder.header_table.dynamic_entries
    assert not client.h2.decoder.header_table.dynamic_entries


def test_literal_block_decodes_to_the_headers() -> None:
    headers = [(":status", "200"), (":method", "CONNECT"), ("baggage", "x" * 300), ("z" * 130, ""), ("é", "ü")]
    decoded: list[tuple[str, str]] = [
        (str(n), str(v)) for n, v in hpack.Decoder().decode(literal_header_block(headers))
    ]
    assert decoded == headers
    # Whole static fields are their one-byte index (":status: 200" is static entry 8).
    assert literal_header_block([(":status", "200")]) == b"\x88"


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "through h2"])
def test_data_in_the_same_read_as_its_connect_is_delivered(direct: bool) -> None:
    """A client may send DATA right behind its CONNECT; both in one read must reach the server's consumer (h2 used to
    see the HEADERS only after the DATA frame had been judged to be on an unknown stream, and the bytes were lost)."""
    client, server = _cores(direct, direct)
    server.receive_data(client.data_to_send())
    client.receive_data(server.data_to_send())
    server.receive_data(client.data_to_send())
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
    """The direct paths (thirdparty.H2_HEADERS, H2_END_STREAM) resolve h2's names once, not with an import statement
    in every call: those cost ~0.4 us per name, ~10 us of a ~100 us stream lifecycle (both sides)."""
    import builtins

    client, server = HboneConnection(True), HboneConnection(False)
    client.initiate()
    server.initiate()
    server.receive_data(client.data_to_send())
    client.receive_data(server.data_to_send())
    server.receive_data(client.data_to_send())
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
