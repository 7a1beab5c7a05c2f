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

from ztunnel.app import App
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
            # The client read the first GOAWAY (before the answer): its pool takes no new stream on this connection.
            assert conn.open_stream_within(100, target) is None

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


async def test_the_drain_waits_for_the_peer_to_answer_the_goaway_ping(tmp_path: Path) -> None:
    """An idle HBONE connection holds the drain until its peer answered the first GOAWAY's PING: a CONNECT sent by a
    peer that had not read the GOAWAY yet is served, the final GOAWAY names it, and only then does the drain end.
    (The drain ended at once when no stream was open, leaving the connection with only the first GOAWAY.)"""
    m = TwoNodeMesh(tmp_path)
    ca = LocalCA.load_or_create(m.ca_dir, "cluster.local")
    echo = await EchoServer().start(*m.server_app)
    target = f"{m.server_app[0]}:{m.server_app[1]}"
    try:
        async with running_app(m.env_b(CONNECTION_TERMINATION_DEADLINE="30s")) as app:
            assert isinstance(app, App) and app.proxy is not None
            conn: Any = await hbone_dial((m.node_b, 15008), ca.issue(CLIENT, timedelta(hours=1)))
            assert isinstance(conn, HboneTransport) and conn.transport is not None
            inbound = app.proxy.inbound
            conn.transport.pause_reading()  # the peer has not read the GOAWAY yet
            app.shutdown()
            waiter = asyncio.ensure_future(app.wait())  # noqa: TID251 - test-owned, awaited below
            await asyncio.wait_for(_until(lambda: any(c.core.goaway_announced for c in inbound.connections)), 10)
            done, _ = await asyncio.wait({waiter}, timeout=0.5)
            assert not done  # the drain waits for the connection (30 s at most), not only for open streams

            racing = conn.open_stream(target)
            conn.transport.resume_reading()
            assert racing.response is not None
            status, _ = await asyncio.wait_for(racing.response, 10)
            assert status == 200
            await asyncio.wait_for(_until(lambda: conn.goaway_received), 10)
            assert conn.core.goaway_received is not None
            assert conn.core.goaway_received.last_stream_id == racing.stream_id
            racing.end()  # the echo ends it too; then the connection closes and the drain is over
            await asyncio.wait_for(waiter, 20)
            assert conn.closed
    finally:
        await echo.stop()
