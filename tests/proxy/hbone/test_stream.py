"""The HBONE transport's stream-facing API: ``open_stream``, ``respond``, ``reject`` on the connection, and the
stream's own operations (``end``, ``reset``, ``release``, sending through the relay) with the completion callback
given to ``attach``. Two :class:`HboneTransport` over real TLS on loopback; each stream relayed to one end of a
loopback TCP connection, the test talking through the other end.

And the boundary: no module outside ``proxy/hbone/`` reaches into the HTTP/2 core, the stream table or the flush.
"""

from __future__ import annotations

import asyncio
import re
import socket
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import hpack
import pytest
from hyperframe.frame import DataFrame, HeadersFrame, SettingsFrame

from ztunnel import tls
from ztunnel.identity.ca import LocalCA
from ztunnel.identity.spiffe import Identity
from ztunnel.proxy.hbone.connection import HboneTransport
from ztunnel.proxy.hbone.core import ConnectRequested, DataReceived, ErrorCode, HboneConnection
from ztunnel.proxy.hbone.stream import HboneStream
from ztunnel.proxy.relay import PlainConnection
from ztunnel.testing import hbone_transport

from .test_abuse import PREFACE, connect_block

TD = "cluster.local"
ROOT = Path(__file__).resolve().parents[3]


@dataclass
class Pair:
    client: HboneTransport
    requests: asyncio.Queue[tuple[HboneTransport, HboneStream, ConnectRequested]]
    done: list[HboneStream] = field(default_factory=list)
    writers: list[asyncio.StreamWriter] = field(default_factory=list)

    async def app_side(self, stream: HboneStream) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """Attach ``stream`` to one end of a loopback TCP connection (``done`` hears when the stream finishes);
        return the other end (TCP, so that a reset is a real RST)."""
        with socket.create_server(("127.0.0.1", 0)) as listener:
            ours = socket.create_connection(listener.getsockname()[:2])
            theirs, _ = listener.accept()
        plain = PlainConnection()
        await asyncio.get_running_loop().create_connection(lambda: plain, sock=theirs)
        stream.attach(plain, on_done=self.done.append)
        reader, writer = await asyncio.open_connection(sock=ours)
        self.writers.append(writer)
        return reader, writer

    async def request(self, authority: str = "10.0.0.2:8080") -> tuple[HboneStream, HboneTransport, HboneStream]:
        """A CONNECT from the client, and the server's side of it."""
        stream = self.client.open_stream(authority, [("baggage", "k8s.namespace.name=default")])
        server, theirs, ev = await asyncio.wait_for(self.requests.get(), 5)
        assert (ev.method, ev.authority, ev.headers["baggage"]) == ("CONNECT", authority, "k8s.namespace.name=default")
        return stream, server, theirs


@pytest.fixture
async def pair() -> AsyncIterator[Pair]:
    ca = LocalCA.generate(TD)
    client_cert = ca.issue(Identity(TD, "default", "client"), timedelta(hours=1))
    server_cert = ca.issue(Identity(TD, "default", "server"), timedelta(hours=1))
    requests: asyncio.Queue[tuple[HboneTransport, HboneStream, ConnectRequested]] = asyncio.Queue()
    loop = asyncio.get_running_loop()
    server_ctx = tls.server_context(server_cert)
    server = await loop.create_server(
        lambda: HboneTransport(
            HboneConnection(False),
            server_ctx,
            on_handshake=lambda t: None,
            on_connect_request=lambda conn, stream, ev: requests.put_nowait((conn, stream, ev)),
        ),
        "127.0.0.1",
        0,
    )
    done: asyncio.Future[HboneTransport] = loop.create_future()
    addr = server.sockets[0].getsockname()
    await loop.create_connection(lambda: hbone_transport(True, tls.client_context(client_cert), done), *addr)
    p = Pair(await asyncio.wait_for(done, 5), requests)
    try:
        yield p
    finally:
        for w in p.writers:
            w.close()
        p.client.abort("test done")
        server.close()


async def eventually(cond: object, timeout: float = 5.0) -> None:
    assert callable(cond)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def test_open_respond_relay_end(pair: Pair) -> None:
    stream, server, theirs = await pair.request()
    assert pair.client.stream_count == server.stream_count == 1
    server.respond(theirs, 200, [("baggage", "k8s.namespace.name=dest")])
    assert stream.response is not None
    status, headers = await asyncio.wait_for(stream.response, 5)
    assert (status, headers["baggage"]) == (200, "k8s.namespace.name=dest")

    client_r, client_w = await pair.app_side(stream)
    server_r, server_w = await pair.app_side(theirs)
    client_w.write(b"ping" * 1000)
    assert await asyncio.wait_for(server_r.readexactly(4000), 5) == b"ping" * 1000
    server_w.write(b"pong")
    assert await asyncio.wait_for(client_r.readexactly(4), 5) == b"pong"

    # FIN -> END_STREAM -> FIN, each way on its own; the completion callback hears each stream once, at the end.
    client_w.write_eof()
    assert await asyncio.wait_for(server_r.read(), 5) == b""
    assert pair.done == []
    server_w.write_eof()
    assert await asyncio.wait_for(client_r.read(), 5) == b""
    await eventually(lambda: len(pair.done) == 2)
    assert {id(s) for s in pair.done} == {id(stream), id(theirs)}
    assert all(s.error is None for s in pair.done)
    assert (stream.bytes_from_plain, stream.bytes_to_plain) == (4000, 4)
    assert (theirs.bytes_to_plain, theirs.bytes_from_plain) == (4000, 4)
    await eventually(lambda: pair.client.stream_count == server.stream_count == 0)


async def test_reject_answers_and_forgets_the_stream(pair: Pair) -> None:
    stream, server, theirs = await pair.request()
    server.reject(theirs, 403)
    assert server.stream_count == 0
    assert stream.response is not None
    status, _ = await asyncio.wait_for(stream.response, 5)
    assert status == 403
    server.reject(theirs, 403)  # a second answer is never sent: the stream is gone
    await eventually(lambda: stream.remote_ended)  # the 403 ended the stream


async def test_a_refused_stream_is_reset_with_no_error_after_its_answer(pair: Pair) -> None:
    """RFC 9113 §8.1 (as upstream's h2 crate): a refusal is the 4xx/5xx with END_STREAM, then RST_STREAM(NO_ERROR)
    while the client has not ended its side, so it stops sending. Without the reset the stream stayed half-open in
    the core: it counted against MAX_CONCURRENT_STREAMS and every chunk the client sent on it was acknowledged
    (40 MiB accepted on a stream refused with 503)."""
    stream, server, theirs = await pair.request()
    server.reject(theirs, 503)
    assert theirs.stream_id not in server.core.streams  # nothing left of it in the core
    assert stream.response is not None
    status, _ = await asyncio.wait_for(stream.response, 5)
    assert status == 503  # the client reads the answer before the reset
    await eventually(lambda: stream.done)
    assert stream.reset_code == ErrorCode.NO_ERROR
    assert pair.client.stream_count == 0


async def test_reject_of_the_last_stream_of_a_draining_connection_is_still_sent(pair: Pair) -> None:
    # Rejecting the last stream of a draining connection closes it: the answer queued in the core must go out
    # before TLS close_notify (it was dropped: the client saw the connection close and no status).
    stream, server, theirs = await pair.request()
    server.drain_when_idle()  # (a drain: no new streams, close when the open ones are done)
    server.reject(theirs, 401)
    assert server.closed
    assert stream.response is not None
    status, _ = await asyncio.wait_for(stream.response, 5)
    assert status == 401


async def test_reset_reaches_the_peer_as_a_tcp_reset(pair: Pair) -> None:
    stream, server, theirs = await pair.request()
    server.respond(theirs, 200)
    assert stream.response is not None
    await asyncio.wait_for(stream.response, 5)
    await pair.app_side(stream)
    server_r, _ = await pair.app_side(theirs)
    stream.reset(ErrorCode.CONNECT_ERROR)
    assert stream.done and pair.client.stream_count == 0
    with pytest.raises(ConnectionResetError):
        await asyncio.wait_for(server_r.read(), 5)
    await eventually(lambda: theirs.done)
    assert theirs.error == f"stream reset by peer (HTTP/2 error {int(ErrorCode.CONNECT_ERROR)})"
    assert theirs in pair.done


async def test_our_reset_for_a_stream_error_is_not_reported_as_the_peers(pair: Pair) -> None:
    stream, server, theirs = await pair.request()
    server.respond(theirs, 200)
    assert stream.response is not None
    await asyncio.wait_for(stream.response, 5)
    await pair.app_side(theirs)
    # What the connection hands the stream when the core reset it for the peer's flow-control violation.
    theirs.on_reset(ErrorCode.FLOW_CONTROL_ERROR, by_peer=False)
    assert theirs.done
    assert theirs.error == "stream reset by us: the peer broke HTTP/2 on it (FLOW_CONTROL_ERROR)"


async def test_end_half_closes_only_our_side(pair: Pair) -> None:
    stream, server, theirs = await pair.request()
    server.respond(theirs, 200)
    assert stream.response is not None
    await asyncio.wait_for(stream.response, 5)
    server_r, server_w = await pair.app_side(theirs)
    client_r, _ = await pair.app_side(stream)
    stream.end()
    assert await asyncio.wait_for(server_r.read(), 5) == b""  # END_STREAM arrived as FIN
    server_w.write(b"still open this way")
    assert await asyncio.wait_for(client_r.readexactly(19), 5) == b"still open this way"
    assert not stream.done


async def test_a_stream_reset_while_its_app_is_slow_gives_the_connection_window_back(pair: Pair) -> None:
    """The server's app does not read: its stream stops releasing window (the stream's and the connection's) and
    holds the bytes. The client resets the stream: what it held goes back to the connection, or the connection's
    16 MiB window would shrink by that much for good (four such streams and it stalls)."""
    stream, server, theirs = await pair.request()
    server.respond(theirs, 200)
    assert stream.response is not None
    await asyncio.wait_for(stream.response, 5)
    _, client_w = await pair.app_side(stream)
    await pair.app_side(theirs)  # never read
    client_w.write(b"s" * (32 << 20))
    await eventually(lambda: server.core.receive_held > (1 << 20), 20)
    assert theirs._held > 0
    stream.reset(ErrorCode.CANCEL)
    await eventually(lambda: theirs.done)
    assert server.core.receive_held == 0  # all 16 MiB of the connection's window back (sent, or due in a batch)


async def test_a_refused_stream_gives_back_what_arrived_before_the_refusal(pair: Pair) -> None:
    """Bytes that arrive on a stream before its CONNECT is answered wait in the stream (bounded by its window); a
    refusal drops them and gives the connection its window back."""
    stream, server, theirs = await pair.request()
    _, client_w = await pair.app_side(stream)  # the client sends before the answer (a peer may)
    client_w.write(b"e" * 100_000)
    await eventually(lambda: server.core.receive_held == 100_000)
    server.reject(theirs, 503)
    assert server.core.receive_held == 0


async def test_the_peers_stream_limit_has_one_owner(pair: Pair) -> None:
    """The peer's SETTINGS_MAX_CONCURRENT_STREAMS is kept by the HTTP/2 core alone, which enforces it; the
    transport's checkout (``open_stream_within``) reads it there. With a copy of its own, updated only when the
    SETTINGS event was dispatched, the transport let a stream through that the core then refused with
    StreamLimitError (here: a SETTINGS the core has applied and the transport has not seen)."""
    first = pair.client.open_stream_within(100, "10.0.0.2:8080")
    assert first is not None
    # Applied in the core, announced to nobody: no event per SETTINGS frame that nothing would read.
    assert not pair.client.core.receive_data(
        SettingsFrame(0, settings={SettingsFrame.MAX_CONCURRENT_STREAMS: 1}).serialize()
    )
    assert pair.client.core.peer_max_streams == 1
    assert not hasattr(pair.client, "peer_max_streams")  # no second way to read it
    assert pair.client.open_stream_within(100, "10.0.0.2:8080") is None  # full, not StreamLimitError
    pair.client.core.receive_data(SettingsFrame(0, settings={SettingsFrame.MAX_CONCURRENT_STREAMS: 5}).serialize())
    assert pair.client.open_stream_within(100, "10.0.0.2:8080") is not None


# -- the boundary ------------------------------------------------------------------------------------------------

# What only proxy/hbone/ may touch: the HTTP/2 core of a transport, its stream table, its flush, a stream's callback.
INTERNALS = re.compile(r"\.core\.|\.handlers\b|\.streams\[|\._on_done\b|(?<!stdout)(?<!stderr)\.flush\(\)")


def test_nothing_outside_the_hbone_package_touches_its_internals() -> None:
    """Modules that use HBONE objects (they import from ``ztunnel.proxy.hbone``) go through the API above."""
    offenders = []
    for path in sorted((ROOT / "ztunnel").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        text = path.read_text()
        if rel.startswith("ztunnel/proxy/hbone/") or "ztunnel.proxy.hbone" not in text:
            continue
        offenders += [
            f"{rel}:{n}: {line.strip()}" for n, line in enumerate(text.splitlines(), 1) if INTERNALS.search(line)
        ]
    assert offenders == []


# -- receive buffers pinned by a stalled app socket ----------------------------------------------------------------


class _BareWire:
    """A :class:`~ztunnel.proxy.hbone.stream.StreamConnection` over the HTTP/2 core alone: the reads are fed to the
    core as the transport feeds them (``get_buffer`` / ``buffer_updated``), what it would send is dropped (the test
    stays inside the windows it was given)."""

    def __init__(self) -> None:
        self.core = HboneConnection(False)
        self.closed = False
        self.write_paused = False
        self.streams: dict[int, HboneStream] = {}
        self.buffers: list[bytearray] = []  # every receive buffer the core read into, in order

    def write_frame(self, frame: memoryview) -> None:
        pass

    def flush_frames(self) -> None:
        self.core.data_to_send()

    def flush(self) -> None:
        self.core.data_to_send()

    def detach(self, stream_id: int) -> None:
        self.streams.pop(stream_id, None)

    def read(self, data: bytes) -> list[object]:
        """One read of ``data`` off the connection, dispatched as the transport does (a run of one stream's DATA
        in one read is one ``on_data_run``)."""
        buf = self.core.get_buffer(len(data))
        owner = buf.obj
        assert isinstance(owner, bytearray)
        if not self.buffers or self.buffers[-1] is not owner:
            self.buffers.append(owner)
        buf[: len(data)] = data
        events = list(self.core.buffer_updated(len(data)))
        other: list[object] = []
        i = 0
        while i < len(events):
            ev = events[i]
            if isinstance(ev, DataReceived) and ev.stream_id in self.streams:
                j = i + 1
                while j < len(events) and isinstance(e := events[j], DataReceived) and e.stream_id == ev.stream_id:
                    j += 1
                if j - i > 1:
                    self.streams[ev.stream_id].on_data_run(events[i:j])  # type: ignore[arg-type]
                else:
                    self.streams[ev.stream_id].on_data(ev.data, ev.flow_controlled_length)
                i = j
            else:
                other.append(ev)
                i += 1
        return other


async def _plain_pair() -> tuple[PlainConnection, socket.socket]:
    """A PlainConnection on one end of a loopback TCP connection; the other end returned (the app's)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        app = socket.create_connection(listener.getsockname()[:2])
        ours, _ = listener.accept()
    plain = PlainConnection()
    await asyncio.get_running_loop().create_connection(lambda: plain, sock=ours)
    return plain, app


async def test_a_stalled_app_socket_pins_at_most_one_receive_buffer() -> None:
    """A peer alternates a byte for a tunnel whose app does not read with ~250 KB for a tunnel whose app does, one
    pair per read. The stalled socket's transport keeps each byte it cannot write as a view into the receive
    buffer it arrived in, so each read's buffer (>= 256 KiB) stayed alive for a byte: 200 bytes held 200 buffers
    (50 MiB) while no window was held (the socket never reached its high-water mark). A write behind a backlog is a
    copy now (bounded by the window: the app is behind), so the stalled socket pins only the buffer of its first
    partial write, and the memory is one connection window + a high-water mark + one receive buffer per app socket."""
    wire = _BareWire()
    wire.core.initiate()
    enc = hpack.Encoder()
    opening = PREFACE + SettingsFrame(0).serialize()
    for sid in (1, 3):
        h = HeadersFrame(sid, connect_block(enc))
        h.flags.add("END_HEADERS")
        opening += h.serialize()
    requested = [ev.stream_id for ev in wire.read(opening) if isinstance(ev, ConnectRequested)]
    assert requested == [1, 3]
    stalled_plain, stalled_app = await _plain_pair()
    flowing_plain, flowing_app = await _plain_pair()
    # The stalled app's kernel buffers full before the test, so every byte for it stays in the transport.
    stalled_app.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock = stalled_plain.transport.get_extra_info("socket")  # type: ignore[union-attr]
    raw = socket.socket(fileno=sock.fileno())
    try:
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        raw.setblocking(False)
        with pytest.raises(BlockingIOError):
            while True:
                raw.send(b"f" * 65536)
    finally:
        raw.detach()
    try:
        await _alternate(wire, stalled_plain, flowing_plain, flowing_app)
    finally:
        for plain in (stalled_plain, flowing_plain):
            plain.transport.abort()  # type: ignore[union-attr]
        stalled_app.close()
        flowing_app.close()


async def _alternate(
    wire: _BareWire, stalled_plain: PlainConnection, flowing_plain: PlainConnection, flowing_app: socket.socket
) -> None:
    stalled, flowing = HboneStream(wire, 1), HboneStream(wire, 3)
    wire.streams = {1: stalled, 3: flowing}
    for s, plain in ((stalled, stalled_plain), (flowing, flowing_plain)):
        wire.core.send_response(s.stream_id, 200)
        s.attach(plain)
    loop = asyncio.get_running_loop()
    flowing_app.setblocking(False)
    received = 0
    bulk = b"b" * 16384

    rounds, frames_per_bulk = 200, 15  # 245,760 bytes for the flowing tunnel per read
    for i in range(rounds):
        # The byte for the stalled tunnel as one DATA frame (-> write), or two of one byte (-> writelines).
        pair = DataFrame(1, b"s").serialize() * (1 + i % 2)
        pair += DataFrame(3, bulk).serialize() * frames_per_bulk
        wire.read(pair)
        want = (i + 1) * frames_per_bulk * len(bulk)
        while received < want:  # the flowing app reads all of it before the next read (its pins are released)
            received += len(await loop.sock_recv(flowing_app, 1 << 20))
        await eventually(lambda: flowing_plain.transport.get_write_buffer_size() == 0)  # type: ignore[union-attr]
    assert not stalled_plain.write_paused  # a few hundred bytes: under its high-water mark, no window held
    assert stalled_plain.transport.get_write_buffer_size() == rounds * 3 // 2  # type: ignore[union-attr]
    current = wire.buffers[-1]
    # Kept alive by someone other than this list, the loop variable and getrefcount's argument: a transport's view.
    sizes = [len(b) for b in wire.buffers if b is not current and sys.getrefcount(b) > 3]
    print(f"{len(wire.buffers)} receive buffers, {len(sizes)} pinned ({sum(sizes) / 2**20:.1f} MiB)")
    assert len(wire.buffers) >= 2  # the first partial write did pin one (the core moved to a fresh buffer)
    assert len(sizes) <= 1, f"{len(sizes)} receive buffers ({sum(sizes)} bytes) kept alive by the stalled socket"
    assert sum(sizes) <= 512 * 1024  # one read's buffer at most (the core's cap)
