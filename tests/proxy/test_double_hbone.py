"""Double HBONE through an east-west gateway, in process (the namespaced, multi-process acceptance tests are in
tests/proxy/test_multinetwork.py).

Two networks on loopback: the client (node A) on ``net-a``, the server (node B) on ``net-b`` behind the gateway
``ztunnel.testing.gateway.TestGateway`` (G). The client asks for the echo service's VIP; A picks the server on
net-b, opens the outer HBONE to G (verified as the gateway's identity) with ``:authority
echo.default.svc.cluster.local:80``, and inside it the inner mTLS + CONNECT to B (verified as the service's SAN),
with ``x-forwarded-network: net-a``. G routes the hostname to B's 15008 and relays the inner bytes.
"""

from __future__ import annotations

import asyncio
import logging
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from ztunnel.identity.ca import LocalCA
from ztunnel.identity.spiffe import Identity
from ztunnel.proxy import double_hbone
from ztunnel.proxy.hbone import connection as hbone_connection
from ztunnel.testing import EchoServer, TwoNodeMesh, access_fields, eventually, running_app
from ztunnel.testing.gateway import TestGateway

ECHO_HOST = "echo.default.svc.cluster.local"
GATEWAY_ID = Identity("cluster.local", "istio-system", "istio-eastwestgateway")
CLIENT_ID = "spiffe://cluster.local/ns/default/sa/client"
SERVER_ID = "spiffe://cluster.local/ns/default/sa/server"


def two_networks(m: TwoNodeMesh, gateway_ip: str, *, local_endpoint: str | None = None, lb: str = "") -> None:
    """Client on net-a, server on net-b behind the gateway at ``gateway_ip`` (referenced by address). With
    ``local_endpoint``, a second echo endpoint on net-a at that address (same node as nothing: protocol HBONE on
    node-a's ztunnel is not needed for the split test, which runs its own app there). ``lb``: a loadBalancing
    block for the service."""
    text = m.config.read_text()
    text = text.replace("  node: node-a\n", "  node: node-a\n  network: net-a\n", 1)
    text = text.replace(
        "  node: node-b\n",
        f'  node: node-b\n  network: net-b\n  networkGateway: {{destination: "net-b/{gateway_ip}", hboneMtlsPort: 15008}}\n',
        1,
    )
    text = text.replace(f'vips: ["/{m.vip[0]}"]', f'vips: ["net-a/{m.vip[0]}"]{lb}')
    gateway = f"""workloads:
- uid: Kubernetes//v1/Pod/istio-system/eastwestgateway
  name: eastwestgateway
  namespace: istio-system
  serviceAccount: istio-eastwestgateway
  workloadIps: ["{gateway_ip}"]
  network: net-b
  node: node-g
"""
    if local_endpoint is not None:
        gateway += f"""- uid: Kubernetes//v1/Pod/default/server-a
  name: server-a
  namespace: default
  serviceAccount: server
  workloadIps: ["{local_endpoint}"]
  protocol: HBONE
  node: node-a2
  network: net-a
  canonicalName: echo
  workloadName: server-a
  services:
    "default/{ECHO_HOST}":
      80: 8080
"""
    text = text.replace("workloads:\n", gateway, 1)
    m.config.write_text(text)


async def test_double_hbone_through_a_gateway(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="access")
    m = TwoNodeMesh(tmp_path)
    gateway_ip = m.plain.rsplit(".", 1)[0] + ".2"
    two_networks(m, gateway_ip)
    ca = LocalCA.load_or_create(m.ca_dir, "cluster.local")
    gw = await TestGateway(ca.issue(GATEWAY_ID, timedelta(hours=1)), {ECHO_HOST: (m.node_b, 15008)}).start(
        gateway_ip, 15008
    )
    echo = await EchoServer().start(*m.server_app)
    payload = os.urandom(1 << 20)
    try:
        async with running_app(m.env_a(NETWORK="net-a")), running_app(m.env_b(NETWORK="net-b")):
            reader, writer = await m.socks5()
            writer.write(payload)
            writer.write_eof()
            got = await asyncio.wait_for(reader.readexactly(len(payload)), 20)
            assert await asyncio.wait_for(reader.read(), 10) == b""
            writer.close()
            out = await eventually(lambda: access_fields(caplog.records, "outbound"))
            inb = await eventually(lambda: access_fields(caplog.records, "inbound"))
            await eventually(lambda: gw.streams and gw.streams[0].done)
    finally:
        await echo.stop()
        await gw.stop()
    assert got == payload
    # The gateway: one outer stream from the client's identity, named by service hostname, and no plaintext.
    (s,) = gw.streams
    assert s.status == 200 and s.authority == f"{ECHO_HOST}:80" and s.peer_identity == CLIENT_ID, s
    assert "x-forwarded-network" not in s.headers and "baggage" in s.headers and "forwarded" in s.headers, s
    assert s.bytes_in > len(payload) and s.bytes_out > len(payload)  # TLS records: more than the payload
    # A's access log: through the gateway, to the server's identity as the inner TLS proved it.
    (a,) = out
    assert a["dst.addr"] == f"{gateway_ip}:15008" and a["dst.hbone_addr"] == f"{ECHO_HOST}:80", a
    assert a["dst.identity"] == SERVER_ID and a["dst.workload"] == "server" and "error" not in a, a
    # B's: the client's identity from its certificate, the gateway's address as the TCP peer, not its workload.
    (b,) = inb
    assert b["src.identity"] == CLIENT_ID and b["src.addr"].startswith(f"{gateway_ip}:"), b
    assert b.get("src.workload") != "eastwestgateway" and "error" not in b, b
    assert b["dst.hbone_addr"] == f"{ECHO_HOST}:80" and b["dst.service"] == ECHO_HOST, b


async def test_gateway_without_a_route_fails_the_connection(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="access")
    m = TwoNodeMesh(tmp_path)
    gateway_ip = m.plain.rsplit(".", 1)[0] + ".2"
    two_networks(m, gateway_ip)
    ca = LocalCA.load_or_create(m.ca_dir, "cluster.local")
    gw = await TestGateway(ca.issue(GATEWAY_ID, timedelta(hours=1)), {}).start(gateway_ip, 15008)
    try:
        async with running_app(m.env_a(NETWORK="net-a")):
            # SOCKS5 answers once the tunnel is up: here, never (reply 5, refused).
            with pytest.raises(ConnectionError, match="SOCKS5 reply 5"):
                await m.socks5()
            out = await eventually(lambda: access_fields(caplog.records, "outbound"))
    finally:
        await gw.stop()
    assert "503" in out[0]["error"] and out[0]["dst.addr"] == f"{gateway_ip}:15008", out
    assert gw.streams[0].error == f"no route for {ECHO_HOST}"


async def test_outer_stream_reset_when_the_gateway_never_ends_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # After the inner connection closed, the outer stream is half-closed by us and waits for the gateway's end; a
    # gateway that never sends it would hold the stream (a slot on the pooled connection) forever.
    monkeypatch.setattr(double_hbone, "CLOSE_TIMEOUT", 0.2)
    m = TwoNodeMesh(tmp_path)
    gateway_ip = m.plain.rsplit(".", 1)[0] + ".2"
    two_networks(m, gateway_ip)
    ca = LocalCA.load_or_create(m.ca_dir, "cluster.local")
    cert = ca.issue(GATEWAY_ID, timedelta(hours=1))
    gw = await TestGateway(cert, {ECHO_HOST: (m.node_b, 15008)}, hold_open=True).start(gateway_ip, 15008)
    echo = await EchoServer().start(*m.server_app)
    try:
        async with running_app(m.env_a(NETWORK="net-a")) as app, running_app(m.env_b(NETWORK="net-b")):
            reader, writer = await m.socks5()
            writer.write(b"ping")
            writer.write_eof()
            assert await asyncio.wait_for(reader.read(), 10) == b"ping"
            writer.close()
            pool: Any = app.proxy.outbound.pi.pool  # type: ignore[attr-defined]
            (conn,) = pool.connections()
            streams = await eventually(lambda: conn.stream_count, timeout=5, until=lambda n: n == 0)
    finally:
        await echo.stop()
        await gw.stop()
    assert streams == 0
    assert gw.streams[0].done and gw.streams[0].error is not None  # the gateway saw the reset


@pytest.mark.parametrize("fed_inside_dispatch", [False, True], ids=["deferred", "fed-inside-dispatch"])
async def test_bulk_both_ways_never_waits_for_a_ping(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fed_inside_dispatch: bool
) -> None:
    # The pipe writes the inner connection's bytes to the outer stream outside the outer connection's dispatch; fed
    # from inside it ("fed-inside-dispatch": the pipe's deferral switched off), the outer connection's end-of-dispatch
    # flush must send them itself. Before it did, they waited for its next control frame, which on a quiet
    # connection is the PING (every 10 s). With the PING put off for an hour, such a stall is a hang (the deadline
    # below is for that only).
    monkeypatch.setattr(hbone_connection, "PING_INTERVAL", 3600.0)
    if fed_inside_dispatch:
        no_deferral = property(lambda _: False, lambda _, v: None)
        monkeypatch.setattr(double_hbone.StreamPipe, "_in_outer", no_deferral, raising=False)
    m = TwoNodeMesh(tmp_path)
    gateway_ip = m.plain.rsplit(".", 1)[0] + ".2"
    two_networks(m, gateway_ip)
    ca = LocalCA.load_or_create(m.ca_dir, "cluster.local")
    gw = await TestGateway(ca.issue(GATEWAY_ID, timedelta(hours=1)), {ECHO_HOST: (m.node_b, 15008)}).start(
        gateway_ip, 15008
    )
    echo = await EchoServer().start(*m.server_app)
    size, chunk = 16 << 20, os.urandom(1 << 16)
    try:
        async with running_app(m.env_a(NETWORK="net-a")), running_app(m.env_b(NETWORK="net-b")):
            reader, writer = await m.socks5()

            async def send() -> None:
                for _ in range(size // len(chunk)):
                    writer.write(chunk)
                    await writer.drain()
                writer.write_eof()

            async def receive() -> int:
                got = 0
                while data := await reader.read(1 << 18):
                    got += len(data)
                return got

            _, got = await asyncio.wait_for(asyncio.gather(send(), receive()), 60)
            writer.close()
    finally:
        await echo.stop()
        await gw.stop()
    assert got == size
