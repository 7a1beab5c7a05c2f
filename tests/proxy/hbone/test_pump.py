"""The per-chunk data pump of :class:`HboneTransport` (TLS in and out, the writes), counted exactly.

Two real HBONE connections (real TLS 1.3 handshake, real HTTP/2 preface and CONNECT) joined by in-memory
transports that record every write, each stream relayed to a recording plaintext transport. What a socket read
delivers is fed in one piece, as a transport's read would, so the tests can count what one read or one app chunk
costs: writes to the app, transport writes, TLS records, DATA frames. No wall-clock thresholds: counts and bytes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import struct
import sys
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

import ztunnel
from bench.micro.pipes import MemoryTransport, feed
from ztunnel import tls
from ztunnel.identity.ca import LocalCA
from ztunnel.identity.spiffe import Identity
from ztunnel.proxy.hbone import core as core_module
from ztunnel.proxy.hbone.connection import HboneTransport
from ztunnel.proxy.hbone.core import SERVER_SETTINGS, ConnectRequested, HboneConnection, Settings
from ztunnel.proxy.hbone.stream import HboneStream
from ztunnel.proxy.relay import PlainConnection

TD = "cluster.local"


class Recorder(MemoryTransport):
    """Enough of an asyncio transport for the protocols (the micro benchmarks' in-memory one): records each write
    (a copy) and the FIN, never pushes back."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.eof = False

    def take(self) -> bytes:
        data, self.writes = b"".join(self.writes), []
        return data

    def write(self, data: Any) -> None:
        self.writes.append(bytes(data))

    def writelines(self, items: list[Any]) -> None:
        self.writes.append(b"".join(items))  # one call: one write (uvloop: one writev)

    def write_eof(self) -> None:
        self.eof = True


def tls_records(wire: bytes) -> list[tuple[int, int]]:
    """(content type, length) of each TLS record in ``wire`` (TLS 1.3: application data is type 23)."""
    out = []
    pos = 0
    while pos < len(wire):
        ctype, _version, length = struct.unpack_from(">BHH", wire, pos)
        out.append((ctype, length))
        pos += 5 + length
    assert pos == len(wire)
    return out


class Link:
    """A client and a server HBONE connection, one CONNECT stream relayed to a recording plaintext side each."""

    def __init__(self, server_settings: Settings | None = None, *, own_records: bool = True) -> None:
        ca = LocalCA.generate(TD)
        client_cert = ca.issue(Identity(TD, "default", "client"), timedelta(hours=1))
        server_cert = ca.issue(Identity(TD, "default", "server"), timedelta(hours=1))
        self.client_wire = Recorder()  # what the client sends to the server
        self.server_wire = Recorder()
        self.client_app = Recorder()  # what the client side writes to its app
        self.server_app = Recorder()
        self.accepted: list[HboneStream] = []  # the server's side of each CONNECT
        self.client_plain = PlainConnection()
        self.server_plain = PlainConnection()
        # own_records: the record layer of ztunnel's own after the handshake (the product's default), or OpenSSL's.
        self.client = HboneTransport(
            HboneConnection(True), tls.client_context(client_cert, secrets=own_records), on_handshake=self._ok
        )
        self.server = HboneTransport(
            HboneConnection(False, server_settings),
            tls.server_context(server_cert, secrets=own_records),
            on_handshake=self._ok,
            on_connect_request=self._accept,
        )
        self.server.connection_made(self.server_wire)  # type: ignore[arg-type]
        self.client.connection_made(self.client_wire)  # type: ignore[arg-type]
        self.pump()
        assert self.client.handshake_done and self.server.handshake_done
        self.stream = self.client.open_stream("10.0.0.2:8080")
        self.pump()
        assert len(self.accepted) == 1
        self.client_plain.connection_made(self.client_app)  # type: ignore[arg-type]
        self.stream.attach(self.client_plain)
        self.pump()

    @staticmethod
    def _ok(t: HboneTransport) -> None:
        pass

    def _accept(self, conn: HboneTransport, stream: HboneStream, ev: ConnectRequested) -> None:
        conn.respond(stream, 200)
        self.server_plain.connection_made(self.server_app)  # type: ignore[arg-type]
        stream.attach(self.server_plain)
        self.accepted.append(stream)

    def pump(self) -> None:
        while self.client_wire.writes or self.server_wire.writes:
            if self.client_wire.writes:
                feed(self.server, self.client_wire.take())
            if self.server_wire.writes:
                feed(self.client, self.server_wire.take())

    def app_sends(self, data: bytes) -> None:
        """The client's app wrote ``data``: one read of the client's plaintext socket (or several, when its
        buffer is smaller)."""
        feed(self.client_plain, data)

    def close(self) -> None:
        self.client.abort("test done")
        self.server.abort("test done")


def _built(settings: Settings | None, own_records: bool = True) -> Iterator[Link]:
    # Built inside a running loop (the transports arm their handshake and keepalive timers on it), then driven
    # directly by the tests.
    loop = asyncio.new_event_loop()

    async def build() -> Link:
        return Link(settings, own_records=own_records)

    try:
        made = loop.run_until_complete(build())
        yield made
        made.close()
    finally:
        loop.close()


# Every test on both record layers: ztunnel's own (the default after a TLS 1.3 handshake) and OpenSSL's
# (ZTUNNEL_OPENSSL_RECORD_LAYER=true).
RECORD_LAYERS = pytest.fixture(params=[True, False], ids=["own-records", "openssl-records"])


@RECORD_LAYERS
def link(request: pytest.FixtureRequest) -> Iterator[Link]:
    yield from _built(None, request.param)


@RECORD_LAYERS
def small_frames_link(request: pytest.FixtureRequest) -> Iterator[Link]:
    """The server advertises a 16 KiB SETTINGS_MAX_FRAME_SIZE, so the client sends 16 KiB DATA frames."""
    yield from _built(dataclasses.replace(SERVER_SETTINGS, max_frame_size=16 * 1024), request.param)


def grow(link: Link) -> None:
    """A bulk transfer first, so every buffer on the path has grown to its steady size."""
    for i in range(24):
        link.app_sends(bytes([i]) * 256 * 1024)
        link.pump()
    link.server_app.take()
    assert len(link.client_plain.get_buffer(-1)) == 256 * 1024  # the relay's largest read: one DATA frame each


def test_one_socket_read_of_many_records_is_one_write_to_the_app(link: Link) -> None:
    grow(link)
    payload = bytes(range(256)) * 768  # 192 KiB: one DATA frame, 12 TLS records, one socket read
    link.app_sends(payload)
    wire = link.client_wire.take()
    records = [r for r in tls_records(wire) if r[0] == 23]
    assert len(records) >= 12
    assert feed(link.server, wire) == 1
    # Before: one write to the app per TLS record (SSLObject.read returns one record, and the HTTP/2 receive
    # buffer held 16 KiB): 12 writes for these 12 records.
    assert len(link.server_app.writes) == 1
    assert link.server_app.writes[0] == payload


def test_the_receive_buffer_grows_for_a_bulk_read_and_shrinks_when_reads_are_small_again(link: Link) -> None:
    grow(link)
    link.app_sends(b"x" * 192 * 1024)
    feed(link.server, link.client_wire.take())
    assert len(link.server.core._buf) >= 192 * 1024
    link.app_sends(b"y" * 64)
    feed(link.server, link.client_wire.take())
    # A pooled connection that once carried a bulk transfer gives the memory back with its next small read.
    assert len(link.server.core._buf) <= 16 * 1024
    assert link.server_app.take().endswith(b"x" * 1024 + b"y" * 64)


def test_a_chunk_from_the_app_is_one_transport_write_with_the_control_frames_queued_before_it(link: Link) -> None:
    core = link.client.core
    asked: list[bytes] = []
    real = core.data_to_send

    def data_to_send() -> bytes:
        asked.append(out := real())
        return out

    core.data_to_send = data_to_send  # type: ignore[method-assign]
    core.ping(b"pingpong")  # a control frame queued before the chunk: it must go first, in the same write
    link.app_sends(b"z" * 64)
    # The pump reads the core's queued frames in place (core.out): it never calls data_to_send (2 calls per chunk
    # two changes ago, 1 before this one).
    assert asked == [] and not core.out
    assert len(link.client_wire.writes) == 1
    wire = link.client_wire.take()
    assert [t for t, _ in tls_records(wire)] == [23, 23]  # the PING's record, then the DATA frame's
    feed(link.server, wire)
    assert link.server_app.take() == b"z" * 64
    link.pump()  # the PING's ACK comes back: the server parsed the PING frame before the DATA
    assert link.client._ping_sent_at is None


CORE_FILE = core_module.__file__
PACKAGE_DIR = os.path.dirname(ztunnel.__file__)


def calls_per_round_trip(link: Link, round_trips: int) -> tuple[Counter[str], int, int]:
    """Python function calls (not builtins) during ``round_trips`` 64 B echoes through both sides: the HTTP/2
    core's by name, all of this package's, and code generated at run time (a dataclass ``__init__`` is ``<string>``)."""
    core_calls: Counter[str] = Counter()
    package = generated = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal package, generated
        if event != "call":
            return
        code = frame.f_code
        filename = code.co_filename
        if filename == CORE_FILE:
            core_calls[code.co_name] += 1
        if filename.startswith(PACKAGE_DIR):
            package += 1
        elif filename == "<string>":
            generated += 1

    sys.setprofile(profile)
    try:
        for _ in range(round_trips):
            link.app_sends(b"q" * 64)
            link.pump()
            feed(link.server_plain, b"r" * 64)
            link.pump()
    finally:
        sys.setprofile(None)
    return core_calls, package, generated


def test_a_64_byte_round_trip_costs_few_python_calls_in_the_http2_core(link: Link) -> None:
    for _ in range(20):  # past the first reads' buffer allocations and the PING timers' first turns
        link.app_sends(b"w" * 64)
        link.pump()
        feed(link.server_plain, b"v" * 64)
        link.pump()
    link.client_app.take(), link.server_app.take()
    rounds = 50
    core_calls, package, generated = calls_per_round_trip(link, rounds)
    assert link.server_app.take() == b"q" * 64 * rounds and link.client_app.take() == b"r" * 64 * rounds
    per_rt = {name: n / rounds for name, n in core_calls.items()}
    # Per chunk: the sender frames it (frame_data); the receiver gets a buffer, parses, and the stream releases
    # the window (get_buffer, buffer_updated, ack_data). Before: 12 more per chunk: data_to_send and
    # _send_window_updates twice on the receiver (parse, flush) and once on the sender, _start_data,
    # _continue_data and _finish_data on the receiver, and a DataReceived __init__ (generated code).
    assert per_rt == {"frame_data": 2, "get_buffer": 2, "buffer_updated": 2, "ack_data": 2}
    assert generated == 0
    # All of this package's Python calls per round trip (pump, stream, relay, core): 58 before; 40 with the core's
    # cuts, 32 with the pump's (a lone DATA event to its stream without _dispatch, _to_plain and _flush_tls inline,
    # no flush call after a read that left nothing to send). The record layer of our own is 3 more per chunk, where
    # OpenSSL's are C calls: its write and read, and the sealed records' hand-over (OutBuffer.read).
    assert package / rounds <= (38 if link.client._records is not None else 32)


def test_the_record_layer_after_the_handshake(link: Link, request: pytest.FixtureRequest) -> None:
    own = request.node.callspec.params["link"]
    for end in (link.client, link.server):
        assert (end._records is not None) is own  # secrets reported: ours; not: OpenSSL's
        assert (end._secrets is None) and end.ssl_object is not None and end.ssl_object.version() == "TLSv1.3"
    # Application data goes both ways, and close_notify too: the peer's read sees the end of TLS, not an error.
    link.app_sends(b"ping")
    link.pump()
    assert link.server_app.take() == b"ping"
    link.client.close("test done")
    wire = link.client_wire.take()
    assert tls_records(wire)[-1] == (23, 2 + 1 + 16)  # the last record: a 2-byte alert (inner type 21), sealed
    feed(link.server, wire)
    assert not link.server.closed  # as with OpenSSL's records: the TCP FIN that follows ends it, not the alert


def test_many_chunks_keep_their_order_and_flow_control_holds(link: Link) -> None:
    # More than the 4 MiB stream window, with the server's app taking everything: every byte arrives once, in
    # order, and the client never sends past the window the server gave (the server would reset the stream).
    sent = bytearray()
    for i in range(64):
        chunk = bytes([i % 251]) * (97 * 1024 + i)
        sent += chunk
        link.app_sends(chunk)
        link.pump()
    got = link.server_app.take()
    assert got == bytes(sent)
    assert link.accepted[0].reset_code is None and not link.stream.done


def test_a_read_of_many_small_data_frames_is_one_write_to_the_app(small_frames_link: Link) -> None:
    link = small_frames_link
    # A peer sending 16 KiB frames (Envoy's default): a 192 KiB chunk is 12 DATA frames; read at once, they reach
    # the app in one write (a writev of the 12 payloads), in order.
    grow(link)
    payload = bytes(range(251)) * 784  # 196,784 B: 12 full frames and a partial one
    link.app_sends(payload)
    wire = link.client_wire.take()
    assert feed(link.server, wire) == 1
    # Before: one write to the app per DATA frame (13).
    assert len(link.server_app.writes) == 1
    assert link.server_app.writes[0] == payload
    assert link.accepted[0].bytes_to_plain == link.server_plain.bytes_written


def test_a_read_that_completes_a_record_cut_by_the_previous_one_is_still_one_write(link: Link) -> None:
    # In a bulk transfer a socket read ends inside a TLS record; OpenSSL takes that record's start out of the memory
    # BIO and keeps it. The next read's plaintext is then larger than the BIO's pending ciphertext: its buffer must
    # hold that too, or it fills and the rest comes as a second, smaller write to the app.
    grow(link)
    first = bytes(range(256)) * 600  # 150 KiB
    second = bytes(range(255, -1, -1)) * 900  # 225 KiB
    link.app_sends(first)
    link.app_sends(second)
    wire = link.client_wire.take()
    records = tls_records(wire)
    cut = sum(5 + length for _, length in records[:10]) + 10_000  # inside the 11th record
    feed(link.server, wire[:cut])
    link.server_app.take()
    assert feed(link.server, wire[cut:]) == 1
    # Before: 2 writes (a 256 KiB buffer for the BIO's 256 KiB of ciphertext, plus OpenSSL's 10,000 held bytes).
    assert len(link.server_app.writes) == 1
    assert (first + second).endswith(link.server_app.writes[0])
