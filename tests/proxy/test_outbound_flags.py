"""The source side's ``response_flags`` when the HBONE server fails our CONNECT after the connection was made, and
clients that leave early.

Upstream counts an HTTP/2 error on its CONNECT (the stream reset, or the connection gone before the answer) as
``H2_HANDSHAKE_FAILURE`` (``proxy/metrics.rs`` maps ``Error::H2``; seen on its binary against a server that resets the
stream and one that closes the connection). Node A is a real ztunnel; "node B" is our HTTP/2 core over TLS on B's
15008 with the server's certificate from the mesh CA, which answers each CONNECT as the test says. A client that
leaves while its tunnel is made is no failure; one that resets before a listener ran for it is dropped quietly.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from datetime import timedelta
from pathlib import Path

import pytest

from ztunnel import tls
from ztunnel.identity.ca import LocalCA
from ztunnel.identity.spiffe import Identity
from ztunnel.proxy.hbone.connection import HboneTransport
from ztunnel.proxy.hbone.core import ConnectRequested, ErrorCode, HboneConnection
from ztunnel.proxy.hbone.stream import HboneStream
from ztunnel.testing import EchoServer, TwoNodeMesh, running_app, scrape


async def failed_at_source(node_ip: str) -> list[str]:
    return [
        labels["response_flags"]
        for name, labels, value in await scrape(node_ip)
        if name == "istio_tcp_connections_failed_total" and value and labels["reporter"] == "source"
    ]


@pytest.mark.parametrize("answer", ["reset", "close"])
async def test_a_connect_the_server_resets_or_drops_is_an_h2_failure(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, answer: str
) -> None:
    m = TwoNodeMesh(tmp_path)
    caplog.set_level(logging.INFO, logger="access")
    requests: list[str] = []

    def on_connect(t: HboneTransport, stream: HboneStream, ev: ConnectRequested) -> None:
        requests.append(ev.authority)
        if answer == "reset":
            stream.reset(ErrorCode.REFUSED_STREAM)
        else:
            t.abort("fake node B drops the connection")

    async with running_app(m.env_a()):
        ca = LocalCA.load_or_create(m.ca_dir, "cluster.local")  # node A has created the mesh CA by now
        cert = ca.issue(Identity("cluster.local", "default", "server"), timedelta(hours=1))
        ctx = tls.server_context(cert)
        loop = asyncio.get_running_loop()
        server = await loop.create_server(
            lambda: HboneTransport(
                HboneConnection(False), ctx, on_handshake=lambda t: None, on_connect_request=on_connect
            ),
            m.node_b,
            15008,
        )
        async with server:
            with pytest.raises(ConnectionError):
                await m.socks5()
            flags: list[str] = []
            for _ in range(100):  # the record lands a moment after the client saw the refusal
                flags = await failed_at_source(m.node_a)
                if flags:
                    break
                await asyncio.sleep(0.02)
    errors = [str(getattr(r, "fields", {}).get("error", "")) for r in caplog.records]
    assert len(requests) == 1  # the CONNECT reached the server: the failure is HTTP/2's, after the handshake
    assert flags == ["H2_HANDSHAKE_FAILURE"], errors
    assert any("HBONE stream failed" in e for e in errors), errors


async def test_a_socks5_client_gone_before_its_tunnel_is_up_is_not_a_failure(tmp_path: Path) -> None:
    """A SOCKS5 client that resets while its tunnel is being made (the fake node B holds the CONNECT's answer until
    the reset was seen): as upstream, a connection of no bytes counted "-", not a failure, and the stream ends."""
    m = TwoNodeMesh(tmp_path)
    held: list[tuple[HboneTransport, HboneStream]] = []

    def on_connect(t: HboneTransport, stream: HboneStream, ev: ConnectRequested) -> None:
        held.append((t, stream))

    async with running_app(m.env_a()):
        ca = LocalCA.load_or_create(m.ca_dir, "cluster.local")
        ctx = tls.server_context(ca.issue(Identity("cluster.local", "default", "server"), timedelta(hours=1)))
        server = await asyncio.get_running_loop().create_server(
            lambda: HboneTransport(
                HboneConnection(False), ctx, on_handshake=lambda t: None, on_connect_request=on_connect
            ),
            m.node_b,
            15008,
        )
        async with server:
            host, port = m.vip
            request = b"\x05\x01\x00" + b"\x05\x01\x00\x01" + socket.inet_aton(host) + port.to_bytes(2, "big")
            client = socket.create_connection((m.node_a, 15080))
            client.sendall(request)
            for _ in range(500):
                if held:
                    break
                await asyncio.sleep(0.01)
            assert held, "the CONNECT never reached node B"
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            client.close()  # RST, while node A waits for the answer
            await asyncio.sleep(0.1)  # node A (this loop) reads the reset
            conn, stream = held[0]
            conn.respond(stream, 200)
            closed: list[str] = []
            for _ in range(200):
                closed = [
                    labels["response_flags"]
                    for name, labels, value in await scrape(m.node_a)
                    if name == "istio_tcp_connections_closed_total" and value and labels["reporter"] == "source"
                ]
                if closed:
                    break
                await asyncio.sleep(0.02)
            assert closed == ["-"]
            assert await failed_at_source(m.node_a) == []
            for _ in range(200):  # cancelled, which a server reads as the end of the stream
                if stream.done:
                    break
                await asyncio.sleep(0.01)
            assert stream.done
            conn.abort("test done")


async def test_a_client_reset_before_it_is_served_is_dropped_quietly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A client that connects and resets before the listener ran for it: its transport has no peer address left.
    That raised TypeError as the connection was made (a traceback in the loop, the transport never closed); now the
    connection is dropped and the next one is served."""
    m = TwoNodeMesh(tmp_path)
    echo = await EchoServer().start(*m.server_app)
    try:
        async with running_app(m.env_a()), running_app(m.env_b()):
            # SOCKS5, outbound, inbound plaintext and HBONE listeners. Blocking calls: the loop (and so each
            # listener) runs only after the reset.
            for addr in [(m.node_a, 15080), (m.node_a, 15001), (m.node_b, 15006), (m.node_b, 15008)] * 3:
                s = socket.create_connection(addr)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.close()
            await asyncio.sleep(0.1)
            reader, writer = await m.socks5()
            writer.write(b"after\n")
            assert await asyncio.wait_for(reader.readline(), 5) == b"after\n"
            writer.close()
    finally:
        await echo.stop()
    assert "Unhandled exception" not in caplog.text and "Traceback" not in caplog.text, caplog.text
