"""Backpressure end to end: a fast sender through SOCKS5 -> HBONE to a reader that stops reading (the app for an
upload, the client for a download).

What ztunnel holds must stay bounded by its design, not by what the sender offers (ztunnel-facts.md §3.4, relay.py):
the ztunnel next to the stalled reader keeps writing to its socket only until the 4 MiB stream window is used up
(it stops releasing window once the socket's write buffer passes its high-water mark), and the one next to the
sender stops reading it once the window is closed or its TLS socket's buffer is above 1 MiB. So both ztunnels
together hold about one stream window plus the write high-water marks, whatever is sent (64 MiB here); the rest
waits in the sender and the kernels' socket buffers. When the reader reads again every byte arrives, in order (sha256).

Two in-process ztunnels on loopback, so their connections can be inspected; RSS is this whole process's.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from ztunnel.proxy.hbone.connection import WRITE_HIGH_WATER, HboneTransport
from ztunnel.proxy.hbone.stream import HboneStream
from ztunnel.proxy.relay import PLAIN_HIGH_WATER, PlainConnection
from ztunnel.testing import TwoNodeMesh, running_app

MiB = 1024 * 1024
TOTAL = 64 * MiB
STREAM_WINDOW = 4 * MiB
# One stream window in flight to node B's app socket, plus the write high-water marks of the plaintext socket and of
# the TLS socket, plus a relay read buffer (256 KiB) and a frame of slack.
BOUND = STREAM_WINDOW + PLAIN_HIGH_WATER + WRITE_HIGH_WATER + 2 * MiB


class AppSocket:
    """The app: a plain socket, read (``sock_recv``) or written (``sock_sendall``) only when the test says so, so
    nothing reads it behind the test's back (an event-loop transport would start reading at once)."""

    def __init__(self, addr: tuple[str, int]) -> None:
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(addr)
        self.listener.listen()
        self.listener.setblocking(False)
        self.conn: socket.socket | None = None

    async def accept(self) -> None:
        self.conn, _ = await asyncio.get_running_loop().sock_accept(self.listener)

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.listener.close()


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def plain_held(plain: PlainConnection | None) -> int:
    """Bytes a plaintext side holds: its transport's write buffer plus what it read but could not pass on yet."""
    if plain is None or plain.transport is None:
        return 0
    return plain.transport.get_write_buffer_size() + (plain.end - plain.start)


def held(conns: list[HboneTransport]) -> int:
    """What ztunnel buffers for these HBONE connections and their tunnels."""
    total = 0
    for conn in conns:
        if conn.transport is not None:
            total += conn.transport.get_write_buffer_size()
        for h in conn.streams.values():
            total += plain_held(h.plain) + sum(map(len, h._early or ()))
    return total


@pytest.fixture
async def nodes(tmp_path: Path) -> AsyncIterator[tuple[TwoNodeMesh, Any, Any]]:
    m = TwoNodeMesh(tmp_path)
    async with running_app(m.env_a()) as a, running_app(m.env_b()) as b:
        yield m, a, b


def stream_of(conns: list[HboneTransport]) -> HboneStream:
    (conn,) = conns
    (stream,) = conn.streams.values()
    assert stream.plain is not None
    return stream


@pytest.mark.parametrize("direction", ["upload", "download"])
async def test_stalled_reader_bounds_what_ztunnel_holds(nodes: tuple[TwoNodeMesh, Any, Any], direction: str) -> None:
    """upload: the client sends, the app stops reading; download: the app sends, the client stops reading."""
    m, a, b = nodes
    loop = asyncio.get_running_loop()
    app = AppSocket(m.server_app)
    reader, writer = await m.socks5()
    await asyncio.wait_for(app.accept(), 10)
    assert app.conn is not None
    app_sock = app.conn

    def conns_a() -> list[HboneTransport]:
        return a.proxy.pi.pool.connections()  # type: ignore[no-any-return]

    def conns_b() -> list[HboneTransport]:
        return list(b.proxy.inbound.connections)

    block = os.urandom(MiB)
    chunks = [block[i * 4096 :] + block[: i * 4096] for i in range(8)]  # 8 distinct MiB, reused round-robin
    sent_sha, got_sha = hashlib.sha256(), hashlib.sha256()
    sent = received = 0

    async def send() -> None:
        nonlocal sent
        for i in range(TOTAL // MiB):
            chunk = chunks[i % len(chunks)]
            sent_sha.update(chunk)
            if direction == "upload":
                writer.write(chunk)
                await writer.drain()
            else:
                await loop.sock_sendall(app_sock, chunk)
            sent += len(chunk)
        if direction == "upload":
            writer.write_eof()
        else:
            app_sock.shutdown(socket.SHUT_WR)

    async def receive() -> None:
        """The stalled side reads again: everything, until EOF."""
        nonlocal received
        while True:
            data = await (loop.sock_recv(app_sock, MiB) if direction == "upload" else reader.read(MiB))
            if not data:
                return
            got_sha.update(data)
            received += len(data)

    rss_before = rss()
    sender = asyncio.ensure_future(send())  # noqa: TID251 - test-owned, awaited below

    # Wait until the sender is stuck, a state rather than a pause in progress: the sink ztunnel (next to the reader
    # that stopped) has given the stream's whole window out and its app socket is past its high-water mark (so it
    # releases no more until its reader reads), and the source ztunnel has stopped reading the sender. Polled; the
    # deadline only turns a hang into a failure.
    def stalled() -> bool:
        sinks, sources = (conns_b(), conns_a()) if direction == "upload" else (conns_a(), conns_b())
        if len(sinks) != 1 or len(sources) != 1 or len(sinks[0].streams) != 1 or len(sources[0].streams) != 1:
            return False
        sink, source = stream_of(sinks), stream_of(sources)
        window = sink.conn.core.streams.get(sink.stream_id)
        return (
            window is not None
            and window.recv_window == 0
            and sink.plain is not None
            and sink.plain.write_paused
            and source.plain is not None
            and source.plain.reading_paused
        )

    deadline = loop.time() + 30
    peak_a = peak_b = 0
    while not stalled():
        assert loop.time() < deadline, f"sender never stalled ({sent} bytes accepted)"
        peak_a, peak_b = max(peak_a, held(conns_a())), max(peak_b, held(conns_b()))
        await asyncio.sleep(0.02)
    peak_a, peak_b = max(peak_a, held(conns_a())), max(peak_b, held(conns_b()))
    assert not sender.done()
    stalled_at = sent
    held_a, held_b = held(conns_a()), held(conns_b())
    rss_growth = rss() - rss_before

    report = (
        f"{direction}: sender stalled at {stalled_at / MiB:.1f} MiB; ztunnel A holds {held_a / MiB:.2f} MiB (peak "
        f"{peak_a / MiB:.2f}), B {held_b / MiB:.2f} MiB (peak {peak_b / MiB:.2f}); RSS +{rss_growth / MiB:.1f} MiB"
    )
    print(report)
    assert stalled_at < TOTAL - 16 * MiB, report  # most of the 64 MiB is still waiting in the sender
    assert held_a + held_b <= BOUND, report
    assert peak_a + peak_b <= BOUND, report
    # The ztunnel next to the stalled reader used up the stream window into that socket's buffer, and no more; the
    # one next to the sender stopped reading it.
    sink, source = (held_b, conns_a()) if direction == "upload" else (held_a, conns_b())
    assert sink <= STREAM_WINDOW + PLAIN_HIGH_WATER + MiB, report
    plain = stream_of(source).plain
    assert plain is not None and plain.reading_paused, report
    # This process holds the sender, both ztunnels and the app: it did not grow by anything like what was sent.
    assert rss_growth < 24 * MiB, report

    await asyncio.wait_for(asyncio.gather(sender, receive()), 60)
    assert received == TOTAL
    assert got_sha.hexdigest() == sent_sha.hexdigest()
    writer.close()
    app.close()


CONNECTION_WINDOW = 16 * MiB
STREAMS = 8


async def test_streams_to_apps_that_do_not_read_hold_one_connection_window(
    nodes: tuple[TwoNodeMesh, Any, Any],
) -> None:
    """Eight tunnels on one pooled HBONE connection to apps that do not read. Node B stops releasing the
    connection's window as well as each stream's (as upstream's h2 crate: capacity comes back when the bytes are
    taken to the app), so what it buffers for the connection is one 16 MiB connection window plus a write high-water
    mark per app socket, not eight 4 MiB stream windows (36 MiB before, when the connection window was released on
    receipt; with 200 streams, 800 MiB). Once the apps read, every byte arrives, the tunnels' and those of a stream
    opened while the window was held."""
    m, a, b = nodes
    loop = asyncio.get_running_loop()
    app = AppSocket(m.server_app)
    # Small receive buffers on the app's side: the kernel takes less, so ztunnel's buffers fill sooner.
    app.listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    # More than one tunnel's path takes before its sender stalls (kernel buffers on both sides, ~20 MiB at most
    # here: once in a full run one of eight finished 24 MiB).
    per_stream = 40 * MiB
    block = os.urandom(MiB)
    sent = [0] * (STREAMS + 1)
    received = [0] * (STREAMS + 1)

    async def tunnel() -> tuple[asyncio.StreamWriter, socket.socket]:
        _reader, writer = await m.socks5()
        conn, _ = await asyncio.wait_for(loop.sock_accept(app.listener), 10)
        return writer, conn

    async def send(i: int, writer: asyncio.StreamWriter) -> None:
        while sent[i] < per_stream:
            writer.write(block)
            await writer.drain()
            sent[i] += len(block)
        writer.write_eof()

    async def receive(i: int, sock: socket.socket) -> None:
        while data := await loop.sock_recv(sock, MiB):
            received[i] += len(data)

    def conn_b() -> HboneTransport:
        (conn,) = b.proxy.inbound.connections  # one pooled connection carries every tunnel
        return conn  # type: ignore[no-any-return]

    tunnels = [await tunnel() for _ in range(STREAMS)]
    senders = [asyncio.ensure_future(send(i, w)) for i, (w, _) in enumerate(tunnels)]  # noqa: TID251
    try:
        # Stalled, a state and not a pause in progress: node B has told node A it may send nothing more on the
        # connection (its receive window is 0) and the whole window is held by streams whose app sockets are past
        # their high-water mark (none is on its way to a release), so nothing moves until an app reads. Polled; the
        # deadline only turns a hang into a failure.
        def stalled() -> bool:
            core = conn_b().core
            return core.receive_window == 0 and core.receive_held == CONNECTION_WINDOW

        def stall_state() -> str:
            conn = conn_b()
            return f"window {conn.core.receive_window}, held {conn.core.receive_held}; " + ", ".join(
                f"stream {h.stream_id} paused={h.plain is not None and h.plain.write_paused}"
                for h in conn.streams.values()
            )

        deadline = loop.time() + 60
        peak = peak_core = 0
        while not stalled():
            assert loop.time() < deadline, f"senders never stalled ({sum(sent)} bytes accepted): {stall_state()}"
            peak = max(peak, held(list(b.proxy.inbound.connections)))
            peak_core = max(peak_core, conn_b().core.receive_held)
            await asyncio.sleep(0.02)
        peak = max(peak, held(list(b.proxy.inbound.connections)))
        peak_core = max(peak_core, conn_b().core.receive_held)
        assert sum(sent) < STREAMS * per_stream, sent  # held back, not finished
        conn = conn_b()
        assert len(conn.streams) == STREAMS
        now = held([conn])
        report = (
            f"{STREAMS} stalled tunnels: senders stuck at {sum(sent) / MiB:.0f} MiB; node B holds {now / MiB:.2f} MiB "
            f"(peak {peak / MiB:.2f}), unreleased connection window {conn.core.receive_held / MiB:.2f} MiB (peak "
            f"{peak_core / MiB:.2f}), window left {conn.core.receive_window / MiB:.2f} MiB"
        )
        print(report)
        bound = CONNECTION_WINDOW + STREAMS * (PLAIN_HIGH_WATER + 128 * 1024) + MiB
        assert peak_core <= CONNECTION_WINDOW, report
        assert peak <= bound, report
        assert now <= bound, report

        # A stream opened now, while the stalled ones hold the connection's window, and its app reading at once.
        writer, sock = await tunnel()
        tunnels.append((writer, sock))
        senders.append(asyncio.ensure_future(send(STREAMS, writer)))  # noqa: TID251
        readers = [asyncio.ensure_future(receive(STREAMS, sock))]  # noqa: TID251
        # Wait (on conditions, not time) until the late stream is up at both ends and its bytes wait at node A for
        # connection window: A has read some from its client and may frame none of them.
        (conn_a,) = a.proxy.pi.pool.connections()
        late_id = max(conn_a.streams)

        def late_blocked() -> bool:
            h = conn_a.streams.get(late_id)
            plain = h.plain if h is not None else None
            return (
                len(conn_b().streams) == STREAMS + 1
                and plain is not None
                and (plain.end > plain.start or plain.reading_paused)
                and conn_a.core.send_window(late_id) == 0
            )

        deadline = loop.time() + 30
        while not late_blocked():
            assert loop.time() < deadline, "the late stream never came up with bytes waiting at node A"
            await asyncio.sleep(0.02)
        assert stalled()  # still: nothing of the stalled tunnels moved meanwhile
        late_b = conn_b().streams[late_id]
        early = received[STREAMS] + late_b.bytes_to_plain
        assert early == 0, f"the late stream got {early} bytes while the stalled streams held the window"
        # Then the stalled apps read: their window comes back and everything arrives.
        readers += [asyncio.ensure_future(receive(i, s)) for i, (_, s) in enumerate(tunnels[:STREAMS])]  # noqa: TID251
        await asyncio.wait_for(asyncio.gather(*senders, *readers), 120)
        print(f"the late stream got {early / MiB:.2f} MiB while the window was held")
        assert received == [per_stream] * (STREAMS + 1), received
    finally:
        for task in senders:
            task.cancel()
        for w, sock in tunnels:
            w.close()
            sock.close()
        app.close()
