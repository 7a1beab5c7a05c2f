"""Two in-process ztunnels on loopback (examples/two-node.yaml): SOCKS5 -> HBONE -> echo, and the error paths.

Node A (127.0.1.1) proxies workload "client"; node B (127.0.2.1) proxies "server", whose app is an echo server on
127.0.2.1:8080 behind the VIP 127.10.0.10:80. Real sockets, real TLS, real HTTP/2.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from ztunnel.identity.ca import LocalCA
from ztunnel.identity.spiffe import Identity
from ztunnel.proxy.hbone.connection import HboneTransport
from ztunnel.state import StateUpdate
from ztunnel.testing import (
    NODE_A_IP,
    NODE_B_IP,
    SERVER_APP,
    SERVICE_VIP,
    TWO_NODE,
    EchoServer,
    hbone_dial,
    hbone_request,
    node_env,
    running_app,
    socks5_connect,
)

SOCKS_A = (NODE_A_IP, 15080)
CLIENT_ID = Identity("cluster.local", "default", "client")
SERVER_ID = Identity("cluster.local", "default", "server")


@pytest.fixture
async def nodes(tmp_path: Path) -> AsyncIterator[tuple[Any, Any, EchoServer]]:
    ca = tmp_path / "ca"
    echo = await EchoServer().start(*SERVER_APP)
    async with (
        running_app(node_env("node-a", NODE_A_IP, "default/client/client", ca)) as a,
        running_app(node_env("node-b", NODE_B_IP, "default/server/server", ca)) as b,
    ):
        yield a, b, echo
    await echo.stop()


async def transfer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, total: int) -> tuple[str, str, int]:
    """Send ``total`` random bytes then FIN; return (sha of sent, sha of received, bytes received)."""
    sent, got = hashlib.sha256(), hashlib.sha256()
    received = 0

    async def send() -> None:
        left = total
        while left:
            chunk = os.urandom(min(left, 1 << 20))
            sent.update(chunk)
            writer.write(chunk)
            await writer.drain()
            left -= len(chunk)
        writer.write_eof()

    async def recv() -> None:
        nonlocal received
        while True:
            data = await reader.read(1 << 20)
            if not data:
                return
            got.update(data)
            received += len(data)

    await asyncio.wait_for(asyncio.gather(send(), recv()), 60)
    return sent.hexdigest(), got.hexdigest(), received


async def test_64mib_each_way_intact(nodes: tuple[Any, Any, EchoServer]) -> None:
    a, _b, echo = nodes
    reader, writer = await socks5_connect(SOCKS_A, *SERVICE_VIP)
    sent, got, n = await transfer(reader, writer, 64 << 20)
    writer.close()
    assert n == 64 << 20
    assert sent == got
    assert echo.received == 64 << 20
    assert a.proxy.pi.pool.dials == 1  # it went through HBONE, on one pooled connection


async def test_500_concurrent_connections_share_pooled_connections(nodes: tuple[Any, Any, EchoServer]) -> None:
    a, _b, echo = nodes
    all_open = asyncio.Event()

    async def one(i: int) -> bytes:
        reader, writer = await socks5_connect(SOCKS_A, *SERVICE_VIP)
        msg = f"hello {i}".encode()
        writer.write(msg)
        echoed = await asyncio.wait_for(reader.readexactly(len(msg)), 30)
        await all_open.wait()  # hold every tunnel open at once
        writer.write_eof()
        rest = await asyncio.wait_for(reader.read(), 30)
        writer.close()
        return echoed + rest

    tasks = [asyncio.ensure_future(one(i)) for i in range(500)]  # noqa: TID251 - plain test concurrency
    while echo.connections < 500:
        await asyncio.sleep(0.02)
    pool = a.proxy.pi.pool
    assert sum(c.stream_count for c in pool.connections()) == 500
    all_open.set()
    results = await asyncio.gather(*tasks)
    assert results == [f"hello {i}".encode() for i in range(500)]
    # 500 open streams, at most 100 per connection: five connections (plus at most a few from racing dials).
    assert 5 <= pool.dials <= 8
    assert all(c.stream_count <= 100 for c in pool.connections())


async def test_half_close_client_first(nodes: tuple[Any, Any, EchoServer]) -> None:
    reader, writer = await socks5_connect(SOCKS_A, *SERVICE_VIP)
    writer.write(b"x" * 100_000)
    writer.write_eof()  # FIN -> END_STREAM -> FIN at the echo server, which then closes its side
    data = await asyncio.wait_for(reader.read(), 10)  # reads until EOF
    assert data == b"x" * 100_000
    writer.close()


async def test_half_close_server_first(tmp_path: Path) -> None:
    """The server sends and closes its write side first; the client can still send, and the server gets it."""
    got: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"greeting")
        writer.write_eof()  # half-close from the server
        got.set_result(await reader.read())  # still readable until the client's FIN
        writer.close()

    server = await asyncio.start_server(handler, *SERVER_APP, reuse_address=True)
    ca = tmp_path / "ca"
    async with (
        running_app(node_env("node-a", NODE_A_IP, "default/client/client", ca)),
        running_app(node_env("node-b", NODE_B_IP, "default/server/server", ca)),
    ):
        reader, writer = await socks5_connect(SOCKS_A, *SERVICE_VIP)
        assert await asyncio.wait_for(reader.read(), 10) == b"greeting"  # then EOF
        writer.write(b"after your FIN")
        writer.write_eof()
        assert await asyncio.wait_for(got, 10) == b"after your FIN"
        writer.close()
    server.close()


async def test_server_reset_reaches_client_as_reset(tmp_path: Path) -> None:
    echo = await EchoServer(mode="reset").start(*SERVER_APP)
    ca = tmp_path / "ca"
    async with (
        running_app(node_env("node-a", NODE_A_IP, "default/client/client", ca)),
        running_app(node_env("node-b", NODE_B_IP, "default/server/server", ca)),
    ):
        reader, writer = await socks5_connect(SOCKS_A, *SERVICE_VIP)
        writer.write(b"trigger")
        await writer.drain()
        with pytest.raises(ConnectionResetError):
            await asyncio.wait_for(reader.read(), 10)
        writer.close()
    await echo.stop()


async def test_passthrough_to_non_mesh_destination(nodes: tuple[Any, Any, EchoServer]) -> None:
    """An address ztunnel does not know is passed through as plain TCP (no HBONE)."""
    a, _, _ = nodes
    plain = await EchoServer().start("127.0.9.1", 9000)
    reader, writer = await socks5_connect(SOCKS_A, "127.0.9.1", 9000)
    writer.write(b"plain")
    writer.write_eof()
    assert await asyncio.wait_for(reader.read(), 10) == b"plain"
    writer.close()
    assert a.proxy.pi.pool.dials == 0
    await plain.stop()


# -- inbound error paths with a raw HBONE client ------------------------------------------------------------------


@pytest.fixture
def ca(tmp_path: Path) -> LocalCA:
    return LocalCA.load_or_create(tmp_path / "ca", "cluster.local")


@pytest.fixture
async def node_b(ca: LocalCA, tmp_path: Path) -> AsyncIterator[Any]:
    echo = await EchoServer().start(*SERVER_APP)
    async with running_app(node_env("node-b", NODE_B_IP, "default/server/server", tmp_path / "ca")) as b:
        yield b
    await echo.stop()


async def client_conn(ca: LocalCA, identity: Identity = CLIENT_ID) -> HboneTransport:
    conn = await hbone_dial((NODE_B_IP, 15008), ca.issue(identity, timedelta(hours=1)))
    assert isinstance(conn, HboneTransport)
    return conn


@pytest.mark.parametrize(
    ("method", "authority", "status", "log"),
    [
        ("CONNECT", f"{NODE_B_IP}:8080", 200, "connection complete"),
        ("GET", f"{NODE_B_IP}:8080", 400, "unsupported method 'GET'"),
        ("CONNECT", "not-an-authority", 400, "invalid authority"),  # no port; a space is malformed: RST_STREAM
        ("CONNECT", "127.0.9.9:8080", 400, f"ip mismatch: 127.0.9.9 != {NODE_B_IP}"),
        ("CONNECT", f"{NODE_B_IP}:8099", 503, "failed to connect"),
        ("CONNECT", f"{NODE_B_IP}:15006", 503, "attempted recursive call to ourselves"),
        ("CONNECT", "nosuch.example:80", 503, "unknown service hostname nosuch.example"),
    ],
)
async def test_inbound_status_codes(
    node_b: Any, ca: LocalCA, method: str, authority: str, status: int, log: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="access")
    conn = await client_conn(ca)
    try:
        got, _stream = await hbone_request(conn, authority, method=method)
        assert got == status
    finally:
        conn.close("test done")  # the access log line is written when the connection closes
    for _ in range(100):
        if any(log in r.getMessage() + str(getattr(r, "fields", "")) for r in caplog.records):
            break
        await asyncio.sleep(0.02)
    assert any(log in r.getMessage() + str(getattr(r, "fields", "")) for r in caplog.records), caplog.text


async def wait_logged(caplog: pytest.LogCaptureFixture, logger: str, message: str) -> dict[str, Any]:
    """The structured fields of the first ``logger`` record with ``message`` (waiting up to 5 s for it)."""
    for _ in range(250):
        for r in caplog.records:
            if r.name == logger and r.getMessage() == message:
                fields: dict[str, Any] = getattr(r, "fields", {})
                return fields
        await asyncio.sleep(0.02)
    raise AssertionError(f"no {logger!r} record {message!r} in:\n{caplog.text}")


async def test_unknown_local_workload_is_503(node_b: Any, ca: LocalCA, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="access")
    conn = await client_conn(ca)
    node_b.state.apply(StateUpdate(removed_workloads=["Kubernetes//v1/Pod/default/server"]))
    status, _ = await hbone_request(conn, f"{NODE_B_IP}:8080")
    assert status == 503
    conn.close("test done")
    # The acceptance's "clear log line": the access log names the reason and the workload ztunnel proxies.
    fields = await wait_logged(caplog, "access", "connection complete")
    assert fields["error"] == "unknown local workload default/server (sa server)", fields
    assert fields["direction"] == "inbound"
    assert fields["src.identity"] == str(CLIENT_ID)


async def test_client_without_certificate_fails_handshake(node_b: Any, ca: LocalCA) -> None:
    import ssl

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.load_verify_locations(cadata=ca.root_pem())
    ctx.set_alpn_protocols(["h2"])
    reader, writer = await asyncio.open_connection(NODE_B_IP, 15008, ssl=ctx, server_hostname="")
    # TLS 1.3: the client finishes first; the server's rejection arrives as an alert (or a close) on read.
    with pytest.raises((ssl.SSLError, ConnectionError, asyncio.IncompleteReadError)):
        data = await asyncio.wait_for(reader.read(100), 5)
        if not data:
            raise ConnectionError("closed")
    writer.close()


async def test_client_from_other_trust_domain_rejected(node_b: Any, ca: LocalCA) -> None:
    with pytest.raises(ConnectionError):
        conn = await client_conn(ca, Identity("evil.example", "default", "client"))
        await hbone_request(conn, f"{NODE_B_IP}:8080")


async def test_server_identity_not_expected_is_refused(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Node B presents an identity node A does not expect for that destination: A refuses, the client is closed."""
    caplog.set_level(logging.INFO, logger="access")
    impostor = tmp_path / "impostor.yaml"
    impostor.write_text(TWO_NODE.read_text().replace("serviceAccount: server", "serviceAccount: impostor"))
    ca = tmp_path / "ca"
    echo = await EchoServer().start(*SERVER_APP)
    async with (
        running_app(node_env("node-a", NODE_A_IP, "default/client/client", ca)) as a_app,
        running_app(node_env("node-b", NODE_B_IP, "default/server/impostor", ca, config=impostor)),
    ):
        with pytest.raises(ConnectionError):
            await socks5_connect(SOCKS_A, *SERVICE_VIP)
        a: Any = a_app
        assert a.proxy.pi.pool.dials == 0
        fields = await wait_logged(caplog, "access", "connection complete")
    assert echo.connections == 0
    # Node A's outbound access log says which identity it got, which it expected, and what to check.
    assert fields["direction"] == "outbound", fields
    assert fields["error"] == (
        f"TLS to {NODE_B_IP}:15008: server certificate identities (spiffe://cluster.local/ns/default/sa/impostor) "
        "do not match the expected identities (spiffe://cluster.local/ns/default/sa/server); check the destination "
        "workload's service account and the service's subjectAltNames"
    ), fields
    await echo.stop()


async def test_self_call_refused(nodes: tuple[Any, Any, EchoServer]) -> None:
    with pytest.raises(ConnectionError):
        await socks5_connect(SOCKS_A, "127.0.0.1", 15001)
