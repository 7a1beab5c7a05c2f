"""TCP passthrough (a destination outside the mesh) under backpressure: every byte through, both ways.

A receiver that stops reading makes ztunnel's write to it buffer, so the relay hands the read buffer to the transport
(``pin``) and reads on into a fresh one; a bookkeeping slip there once stalled the relay for good after ~40 MiB.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from ztunnel.testing import TwoNodeMesh, running_app, socks5_connect


@pytest.fixture
async def mesh(tmp_path: Path) -> AsyncIterator[TwoNodeMesh]:
    m = TwoNodeMesh(tmp_path)
    async with running_app(m.env_a()):
        yield m


async def test_bulk_through_passthrough_with_a_stalling_receiver(mesh: TwoNodeMesh) -> None:
    total = 48 << 20
    digest = hashlib.sha256()
    received = 0
    done = asyncio.Event()

    async def slow_sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal received
        n = 0
        while data := await reader.read(1 << 16):
            digest.update(data)
            received += len(data)
            n += 1
            if n % 64 == 0:
                await asyncio.sleep(0.01)  # stall now and then: ztunnel's writes to us buffer
        writer.write(received.to_bytes(8, "big"))
        await writer.drain()
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
        done.set()

    server = await asyncio.start_server(slow_sink, mesh.plain, 9000)
    try:
        reader, writer = await socks5_connect((mesh.node_a, 15080), mesh.plain, 9000)
        sent = hashlib.sha256()
        left = total
        while left:
            chunk = os.urandom(min(left, 1 << 20))
            sent.update(chunk)
            writer.write(chunk)
            await asyncio.wait_for(writer.drain(), 30)
            left -= len(chunk)
        writer.write_eof()
        count = await asyncio.wait_for(reader.readexactly(8), 30)
        writer.close()
        await asyncio.wait_for(done.wait(), 10)
    finally:
        server.close()
        await server.wait_closed()
    assert int.from_bytes(count, "big") == total
    assert digest.hexdigest() == sent.hexdigest()
