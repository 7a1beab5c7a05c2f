"""The inbound's drain GOAWAY on a real connection (our 15008 in process, a raw HBONE client over TLS on loopback).

Upstream's HBONE server drains with hyper's ``graceful_shutdown``: the h2 crate sends GOAWAY with the last stream id
2^31-1 and a PING, and the final GOAWAY (the last stream the client opened) only once the PING is answered. So a
CONNECT the client sent before it read the first GOAWAY is served, not refused.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from pathlib import Path
from typing import Any

from ztunnel.identity.ca import LocalCA
from ztunnel.identity.spiffe import Identity
from ztunnel.proxy.hbone.connection import HboneTransport
from ztunnel.testing import EchoServer, TwoNodeMesh, hbone_dial, hbone_tunnel, running_app

CLIENT = Identity("cluster.local", "default", "client")


async def test_a_connect_racing_the_drain_goaway_is_served_and_the_connection_closes_after(tmp_path: Path) -> None:
    m = TwoNodeMesh(tmp_path)
    ca = LocalCA.load_or_create(m.ca_dir, "cluster.local")
    echo = await EchoServer().start(*m.server_app)
    target = f"{m.server_app[0]}:{m.server_app[1]}"
    try:
        async with running_app(m.env_b()) as app:
            cert = ca.issue(CLIENT, timedelta(hours=1))
            conn: Any = await hbone_dial((m.node_b, 15008), cert)
            assert isinstance(conn, HboneTransport)
            status, reader, writer = await hbone_tunnel(conn, target)
            assert status == 200

            app.proxy.inbound.drain()  # type: ignore[attr-defined]  # the GOAWAY is on the wire; the client has not read it
            racing = conn.open_stream(target)  # so this CONNECT crosses it
            assert racing.response is not None
            racing_status, _ = await asyncio.wait_for(racing.response, 10)
            assert racing_status == 200  # served: the door closes only once the client answered the PING

            # The final GOAWAY names the racing stream: nothing above it is served, the open ones finish.
            await asyncio.wait_for(_until(lambda: conn.goaway_received), 10)
            assert conn.core.goaway_received is not None
            assert conn.core.goaway_received.last_stream_id == racing.stream_id
            writer.write(b"still served\n")
            assert await asyncio.wait_for(reader.readline(), 5) == b"still served\n"
            assert not conn.closed

            writer.write_eof()
            assert await asyncio.wait_for(reader.read(), 5) == b""
            writer.close()
            racing.end()  # the echo ends it too; then our client closes the connection (it had the GOAWAY)
            await asyncio.wait_for(_until(lambda: conn.closed), 10)
            assert echo.connections == 2
    finally:
        await echo.stop()


async def _until(cond: Any) -> None:
    while not cond():
        await asyncio.sleep(0.01)
