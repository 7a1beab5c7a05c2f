"""Streams sharing one HBONE connection share its bandwidth.

Without rotation, the stream served first whenever the transport drained or the connection window opened took
almost everything (8 concurrent streams: 99.5% of the bytes to one, min/max 0.01).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ztunnel.proxy.hbone.connection import HboneTransport
from ztunnel.proxy.hbone.core import HboneConnection, WindowOpened
from ztunnel.testing import TwoNodeMesh, ZtunnelProcess


class Recorder:
    def __init__(self, name: str, calls: list[str]) -> None:
        self.name = name
        self.calls = calls

    def on_window(self) -> None:
        self.calls.append(self.name)

    def on_write_paused(self, paused: bool) -> None:
        if not paused:
            self.calls.append(self.name)


def test_window_and_resume_start_with_a_different_stream_each_time() -> None:
    conn = HboneTransport(HboneConnection(True), None, on_handshake=lambda t: None)
    calls: list[str] = []
    for name in "abcd":
        conn.streams[ord(name)] = Recorder(name, calls)  # type: ignore[assignment]
    firsts = []
    for i in range(8):
        calls.clear()
        if i % 2:
            conn._dispatch([WindowOpened(0)])
        else:
            conn.resume_writing()
        assert sorted(calls) == list("abcd")  # everyone, once
        firsts.append(calls[0])
    assert set(firsts) == set("abcd")


_SINKS: list[asyncio.StreamWriter] = []


async def _sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    _SINKS.append(writer)
    with contextlib.suppress(ConnectionError):
        while await reader.read(1 << 20):
            pass
    writer.close()
    with contextlib.suppress(ConnectionError):
        await writer.wait_closed()


@pytest.fixture
def mesh(tmp_path: Path) -> Iterator[TwoNodeMesh]:
    """Two ztunnel processes: the starvation came from the proxies' own scheduling, which in-process nodes sharing
    the test's event loop (and its pace) did not show."""
    m = TwoNodeMesh(tmp_path)
    # One worker each: the subject is streams sharing one HBONE connection. With the default worker count (2 on a
    # 2-core machine) the kernel spreads the six client connections over two workers, each with its own pool and
    # HBONE connection; a 1/5 split (12 of 64 ways) gives the lone stream a connection, and a core, of its own:
    # ~53 % of the bytes against ~9 % each for the others (min/max ~0.17, seen in CI), which is no starvation.
    node_b = ZtunnelProcess(m.env_b(ZTUNNEL_WORKER_THREADS="1"), tmp_path / "b.log").start()
    try:
        node_a = ZtunnelProcess(m.env_a(ZTUNNEL_WORKER_THREADS="1"), tmp_path / "a.log").start()
        try:
            yield m
        finally:
            node_a.stop()
    finally:
        node_b.stop()


async def test_concurrent_streams_on_one_connection_share_it(mesh: TwoNodeMesh) -> None:
    server = await asyncio.start_server(_sink, *mesh.server_app)
    counts = [0] * 6
    stop = asyncio.Event()

    async def stream(i: int) -> None:
        _reader, writer = await mesh.socks5()
        chunk = b"x" * (256 << 10)
        try:
            while not stop.is_set():
                writer.write(chunk)
                await writer.drain()
                counts[i] += len(chunk)
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    tasks: list[Any] = [asyncio.ensure_future(stream(i)) for i in range(len(counts))]  # noqa: TID251
    try:
        # All tunnels up and streaming (on a loaded machine a fixed pause was not always enough), then a window
        # of a fixed amount of traffic rather than of time: the shares, not the speed, are the subject.
        async def until(done: Callable[[], bool], limit: float) -> None:
            deadline = asyncio.get_running_loop().time() + limit
            while not done() and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)

        await until(lambda: min(counts) > 0, 30)
        await asyncio.sleep(0.3)
        start = list(counts)
        # 1 GiB: at 0.5-1 GB/s a 256 MiB window lasted 0.3-0.5 s, short enough for one stall of a loaded 2-core
        # machine (two streams at 0.08 of the others, once in CI) to read as unfairness; over 1-2 s it averages out,
        # while the starvation this guards against (0.01) holds for any length.
        await until(lambda: sum(counts) - sum(start) >= 1 << 30, 60)
        moved = [c - s for c, s in zip(counts, start, strict=True)]
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        server.close()
        for w in _SINKS:
            w.close()
            with contextlib.suppress(ConnectionError):
                await w.wait_closed()
        await server.wait_closed()
    # Equal shares would be 1.0; starvation was ~0.01. A loaded machine wobbles, so only a broad bound.
    assert min(moved) > 0.25 * max(moved), moved
