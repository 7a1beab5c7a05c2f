"""HTTP/2 abuse at a live 15008 from a client holding a valid certificate, while a good tunnel keeps streaming.

Each attack runs on its own TLS connection (real sockets, real TLS, hyperframe-built frames) against node B. The
well-behaved traffic is node A's pooled HBONE connection to node B carrying one long SOCKS5 tunnel: it must lose no
byte (sha256 both ways) and B must keep serving new connections afterwards. The sans-IO tier
(tests/proxy/hbone/test_abuse.py) proves each limit; this tier proves the GOAWAY reaches the offender and nobody
else notices.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import hpack
import pytest
from hyperframe.frame import ContinuationFrame, Frame, GoAwayFrame, HeadersFrame, RstStreamFrame, SettingsFrame

from ztunnel import tls
from ztunnel.identity.ca import LocalCA
from ztunnel.identity.spiffe import Identity
from ztunnel.proxy.hbone.core import ErrorCode
from ztunnel.testing import (
    NODE_A_IP,
    NODE_B_IP,
    SERVER_APP,
    SERVICE_VIP,
    EchoServer,
    node_env,
    running_app,
    socks5_connect,
)

from .hbone.test_abuse import (
    PREFACE,
    connect_block,
    data_on_closed_stream,
    empty_data,
    pings,
    priorities,
    rst_on_closed_streams,
    settings,
    unknown_frames,
)

SOCKS_A = (NODE_A_IP, 15080)
HBONE_B = (NODE_B_IP, 15008)
CLIENT_ID = Identity("cluster.local", "default", "client")
AUTHORITY = f"{SERVER_APP[0]}:{SERVER_APP[1]}"


def too_many_streams() -> Iterator[bytes]:
    # SETTINGS_MAX_CONCURRENT_STREAMS is 200: each stream over it is refused alone (RST_STREAM REFUSED_STREAM),
    # and each refusal costs the control-frame budget (burst 200), so 400 refusals end the connection.
    enc = hpack.Encoder()
    for i in range(600):
        h = HeadersFrame(2 * i + 1, connect_block(enc, AUTHORITY))
        h.flags.add("END_HEADERS")
        yield h.serialize()


def continuation_flood() -> Iterator[bytes]:
    enc = hpack.Encoder()
    yield HeadersFrame(1, connect_block(enc, AUTHORITY)).serialize()
    for _ in range(100):
        yield ContinuationFrame(1, b"\x00" * 16384).serialize()


def window_overflow() -> Iterator[bytes]:
    # The connection window starts at 65,535; this takes it past 2^31-1 (RFC 9113 §6.9.1).
    yield b"\x00\x00\x04\x08\x00\x00\x00\x00\x00" + (2**31 - 1).to_bytes(4, "big")


def oversized_header_block() -> Iterator[bytes]:
    enc = hpack.Encoder()
    h = HeadersFrame(
        1, bytes(enc.encode([(":method", "CONNECT"), (":authority", AUTHORITY), ("x-pad", "p" * 100_000)]))
    )
    h.flags.add("END_HEADERS")
    yield h.serialize()


def ours_rapid_reset() -> Iterator[bytes]:
    # rapid_reset aims at 10.0.0.1:8080; aim at the real backend, so an unprotected server would dial it.
    enc = hpack.Encoder()
    for i in range(2000):
        sid = 2 * i + 1
        h = HeadersFrame(sid, connect_block(enc, AUTHORITY))
        h.flags.add("END_HEADERS")
        yield h.serialize() + RstStreamFrame(sid, error_code=ErrorCode.CANCEL).serialize()


ATTACKS: dict[str, tuple[Callable[[], Iterator[bytes]], int]] = {
    "rapid reset": (ours_rapid_reset, ErrorCode.ENHANCE_YOUR_CALM),
    "streams over MAX_CONCURRENT_STREAMS, again and again": (too_many_streams, ErrorCode.ENHANCE_YOUR_CALM),
    "CONTINUATION flood": (continuation_flood, ErrorCode.ENHANCE_YOUR_CALM),
    "header block over the limit": (oversized_header_block, ErrorCode.ENHANCE_YOUR_CALM),
    "window update overflow": (window_overflow, ErrorCode.FLOW_CONTROL_ERROR),
    "DATA on a closed stream": (lambda: data_on_closed_stream(2000), ErrorCode.ENHANCE_YOUR_CALM),
    "PING flood": (lambda: pings(5000), ErrorCode.ENHANCE_YOUR_CALM),
    "SETTINGS flood": (lambda: settings(5000), ErrorCode.ENHANCE_YOUR_CALM),
    "PRIORITY flood": (lambda: priorities(5000), ErrorCode.ENHANCE_YOUR_CALM),
    "empty DATA flood": (lambda: empty_data(5000), ErrorCode.ENHANCE_YOUR_CALM),
    "unknown frame flood": (lambda: unknown_frames(5000), ErrorCode.ENHANCE_YOUR_CALM),
    "RST_STREAM flood on a closed stream": (lambda: rst_on_closed_streams(5000), ErrorCode.ENHANCE_YOUR_CALM),
}


@pytest.fixture
async def nodes(tmp_path: Path) -> AsyncIterator[tuple[Any, Any, EchoServer, LocalCA]]:
    ca_dir = tmp_path / "ca"
    echo = await EchoServer().start(*SERVER_APP)
    async with (
        running_app(node_env("node-a", NODE_A_IP, "default/client/client", ca_dir)) as a,
        running_app(node_env("node-b", NODE_B_IP, "default/server/server", ca_dir)) as b,
    ):
        yield a, b, echo, LocalCA.load_or_create(ca_dir, "cluster.local")
    await echo.stop()


async def attack(ca: LocalCA, frames: Iterator[bytes]) -> tuple[int | None, bool]:
    """Send ``frames`` on a fresh mTLS connection; returns (GOAWAY error code or None, connection closed)."""
    ctx = tls.client_context(ca.issue(CLIENT_ID, timedelta(hours=1)))
    reader, writer = await asyncio.open_connection(*HBONE_B, ssl=ctx, server_hostname="")
    received = bytearray()

    async def read_all() -> None:
        while True:
            chunk = await reader.read(65536)
            if not chunk:
                return
            received.extend(chunk)

    reading = asyncio.ensure_future(read_all())  # noqa: TID251 - test-local reader, awaited below
    closed = False
    try:
        writer.write(PREFACE + SettingsFrame(0).serialize())
        batch = bytearray()
        for f in frames:
            batch += f
            if len(batch) >= 32 * 1024:
                writer.write(bytes(batch))
                batch.clear()
                await writer.drain()
        writer.write(bytes(batch))
        await writer.drain()
        await asyncio.wait_for(asyncio.shield(reading), 10)
        closed = True
    except (ConnectionError, OSError):
        closed = True
        await asyncio.wait_for(asyncio.shield(reading), 10)
    finally:
        writer.close()
        if not reading.done():
            reading.cancel()
    return goaway_in(bytes(received)), closed


def goaway_in(data: bytes) -> int | None:
    pos = 0
    while pos + 9 <= len(data):
        f, length = Frame.parse_frame_header(memoryview(data[pos : pos + 9]))
        if pos + 9 + length > len(data):
            break
        f.parse_body(memoryview(data[pos + 9 : pos + 9 + length]))
        if isinstance(f, GoAwayFrame):
            return int(f.error_code)
        pos += 9 + length
    return None


async def test_every_attack_gets_goaway_while_a_good_tunnel_streams(
    nodes: tuple[Any, Any, EchoServer, LocalCA], caplog: pytest.LogCaptureFixture
) -> None:
    _a, _b, echo, ca = nodes
    reader, writer = await socks5_connect(SOCKS_A, *SERVICE_VIP)
    sent, got = hashlib.sha256(), hashlib.sha256()
    stop = asyncio.Event()
    counts = [0, 0]

    async def send() -> None:
        while not stop.is_set():
            chunk = os.urandom(256 * 1024)
            sent.update(chunk)
            writer.write(chunk)
            await writer.drain()
            counts[0] += len(chunk)
        writer.write_eof()

    async def recv() -> None:
        while data := await reader.read(1 << 20):
            got.update(data)
            counts[1] += len(data)

    good = asyncio.gather(send(), recv())
    results: dict[str, tuple[int | None, bool]] = {}
    dialled: dict[str, int] = {}
    try:
        for name, (make, _code) in ATTACKS.items():
            before = echo.connections
            results[name] = await attack(ca, make())
            dialled[name] = echo.connections - before
    finally:
        stop.set()
        await asyncio.wait_for(good, 60)
        writer.close()

    wrong = {n: r for n, r in results.items() if r != (ATTACKS[n][1], True)}
    assert not wrong, f"attacks not answered with the expected GOAWAY and close: {wrong}"
    # The good tunnel never noticed: every byte back, intact, on its one pooled connection.
    assert counts[0] == counts[1] > 0
    assert sent.hexdigest() == got.hexdigest()
    # Streams reset before they were answered cost no backend connection: the connect is cancelled with the
    # stream (without that, each of the ~500 streams before the GOAWAY would dial the backend).
    assert dialled["rapid reset"] < 50, dialled
    # And node B still takes new connections.
    r2, w2 = await socks5_connect(SOCKS_A, *SERVICE_VIP)
    w2.write(b"still here")
    w2.write_eof()
    assert await asyncio.wait_for(r2.read(), 10) == b"still here"
    w2.close()
    # No traceback anywhere: every attack was an expected, logged protocol error.
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records if r.exc_info]
    assert sum("closing HTTP/2 connection" in r.getMessage() for r in caplog.records) == len(ATTACKS)
