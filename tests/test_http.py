"""The admin/stats/readiness HTTP servers answer what they cannot parse as upstream's hyper does."""

from __future__ import annotations

import asyncio

from ztunnel.config import SocketAddress
from ztunnel.readiness import Readiness, ReadinessServer


async def test_garbage_gets_http11_400() -> None:
    """Upstream's ``malicious_calls_inpod`` sends ``hello world\\r\\n\\r\\n`` to 15020/15021 and expects
    ``HTTP/1.1 400`` back (hyper); aiohttp's own answer would start ``HTTP/1.0 400``."""
    server = ReadinessServer(Readiness())
    await server.start(SocketAddress("127.0.0.1", 0))
    try:
        assert server.address is not None
        reader, writer = await asyncio.open_connection(*server.address)
        writer.write(b"hello world\r\n\r\n")
        head = await asyncio.wait_for(reader.readline(), 5)
        assert head.startswith(b"HTTP/1.1 400 "), head
        assert await asyncio.wait_for(reader.read(), 5)  # the rest, then the server closes
        writer.close()
    finally:
        await server.stop()
