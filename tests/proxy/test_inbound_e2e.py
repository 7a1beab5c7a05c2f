"""Inbound HBONE end to end where the target is not simply the dialled pod (upstream's namespaced tests
``service_waypoint*``, ``sandwich_waypoint_plain``, ``test_svc_hostname_port``, ``test_svc_hostname_named_port``).

Waypoints: three in-process ztunnels on loopback (examples/two-node.yaml plus a waypoint node W). The client's
ztunnel A sends HBONE to the waypoint workload's ztunnel W with the original destination as ``:authority``; W checks
that it is the target's waypoint (referenced by service hostname, service VIP or pod IP) and hands the stream to the
waypoint "app" on W's address: a TCP relay standing in for the waypoint proxy, which sends the bytes on through W's
own ztunnel (SOCKS5, its outbound) to the server, where ztunnel B delivers them to the echo app.

Hostname authorities: a raw HBONE client asks node B for ``echo.default.svc.cluster.local:80``; B maps the service
port to the workload's target port (the service's number, or the endpoint's own map for a named port).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from ztunnel.identity.ca import LocalCA
from ztunnel.identity.spiffe import Identity
from ztunnel.testing import (
    EchoServer,
    TwoNodeMesh,
    access_fields,
    eventually,
    hbone_dial,
    hbone_tunnel,
    node_env,
    running_app,
    socks5_connect,
)

CLIENT = Identity("cluster.local", "default", "client")
ECHO_HOST = "echo.default.svc.cluster.local"
WAYPOINT_HOST = "waypoint.default.svc.cluster.local"


class Relay:
    """The waypoint proxy's stand-in: each connection accepted on ``listen`` is relayed, from the waypoint's own
    address, through ``socks5`` (the waypoint node's ztunnel) to ``target``."""

    def __init__(self, socks5: tuple[str, int], target: tuple[str, int], source_ip: str) -> None:
        self.socks5, self.target, self.source_ip = socks5, target, source_ip
        self.server: asyncio.Server | None = None
        self.connections = 0
        self.errors: list[str] = []
        # Strong references: a handler whose client transport is paused (its buffer full) is otherwise reachable
        # only through a reference cycle, and the garbage collector destroyed it mid-relay.
        self._tasks: set[asyncio.Task[None] | None] = set()

    async def start(self, host: str, port: int) -> Relay:
        self.server = await asyncio.start_server(self._handle, host, port, reuse_address=True)
        return self

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        task = asyncio.current_task()
        self._tasks.add(task)
        try:
            await self._relay(reader, writer)
        finally:
            self._tasks.discard(task)

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            # The waypoint proxy's own outbound traffic comes from the waypoint pod's address.
            up_reader, up_writer = await socks5_connect(self.socks5, *self.target, local_addr=(self.source_ip, 0))
        except (ConnectionError, OSError) as e:
            self.errors.append(repr(e))
            writer.close()
            return

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError, OSError):
                while data := await src.read(1 << 16):
                    dst.write(data)
                    await dst.drain()
                if dst.can_write_eof():
                    dst.write_eof()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        writer.close()
        up_writer.close()

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.server.wait_closed(), 2)


def with_waypoint(m: TwoNodeMesh, reference: str) -> tuple[str, str]:
    """Add a waypoint (workload W, service with VIP) to the mesh's config and attach it as ``reference`` says:
    ``service-hostname`` / ``service-vip``: the echo service's waypoint; ``workload-vip``: the server workload's.
    Returns (W's address, the waypoint VIP)."""
    base = m.plain.rsplit(".", 1)[0]
    w_ip, wp_vip = f"{base}.2", m.vip[0].rsplit(".", 1)[0] + ".20"
    text = m.config.read_text()
    workload = f"""workloads:
- uid: Kubernetes//v1/Pod/default/waypoint
  name: waypoint
  namespace: default
  serviceAccount: waypoint
  workloadIps: ["{w_ip}"]
  protocol: HBONE
  node: node-w
  canonicalName: waypoint
  workloadName: waypoint
  workloadType: deployment
  services:
    "default/{WAYPOINT_HOST}":
      15008: 15008
"""
    service = f"""
services:
- name: waypoint
  namespace: default
  hostname: {WAYPOINT_HOST}
  vips: ["/{wp_vip}"]
  ports:
    15008: 15008
  subjectAltNames: ["spiffe://cluster.local/ns/default/sa/waypoint"]
"""
    if reference == "service-hostname":
        gw = f"{{destination: {{namespace: default, hostname: {WAYPOINT_HOST}}}, hboneMtlsPort: 15008}}"
    else:
        gw = f'{{destination: "/{wp_vip}", hboneMtlsPort: 15008}}'
    text = text.replace("workloads:\n", workload, 1).replace("\nservices:\n", service, 1)
    if reference.startswith("service"):
        anchor = 'subjectAltNames: ["spiffe://cluster.local/ns/default/sa/server"]\n'
        assert anchor in text
        text = text.replace(anchor, f"{anchor}  waypoint: {gw}\n", 1)
    else:
        anchor = "  workloadName: server\n"
        assert anchor in text
        text = text.replace(anchor, f"{anchor}  waypoint: {gw}\n", 1)
    # The waypoint hears from the client, the server from the waypoint (the example's policy allows the client).
    allow = "principals: [{Exact: cluster.local/ns/default/sa/client}]"
    assert allow in text
    text = text.replace(allow, allow[:-1] + ", {Exact: cluster.local/ns/default/sa/waypoint}]")
    m.config.write_text(text)
    return w_ip, wp_vip


def inbound_lines(caplog: pytest.LogCaptureFixture, node_ip: str) -> list[dict[str, Any]]:
    return [f for f in access_fields(caplog.records) if str(f.get("dst.addr", "")).startswith(f"{node_ip}:")]


@pytest.mark.parametrize("reference", ["service-hostname", "service-vip", "workload-vip"])
async def test_through_a_waypoint(tmp_path: Path, caplog: pytest.LogCaptureFixture, reference: str) -> None:
    m = TwoNodeMesh(tmp_path)
    w_ip, _ = with_waypoint(m, reference)
    caplog.set_level(logging.INFO, logger="access")
    # What the client dials, and so the :authority W receives and the port its waypoint app is reached on.
    dest = m.vip if reference.startswith("service") else m.server_app
    echo = await EchoServer().start(*m.server_app)
    relay = await Relay((w_ip, 15080), m.server_app, w_ip).start(w_ip, dest[1])
    env_w = node_env("node-w", w_ip, "default/waypoint/waypoint", m.ca_dir, m.config)
    try:
        async with running_app(m.env_a()), running_app(env_w), running_app(m.env_b()):
            reader, writer = await socks5_connect((m.node_a, 15080), *dest)
            payload = os.urandom(256 * 1024)
            writer.write(payload)
            writer.write_eof()
            got = await asyncio.wait_for(reader.read(), 10)
            writer.close()
            w_lines = await eventually(lambda: inbound_lines(caplog, w_ip))
            b_lines = await eventually(lambda: inbound_lines(caplog, m.node_b))
    finally:
        await relay.stop()
        await echo.stop()
    assert got == payload
    assert relay.connections == 1 and not relay.errors, relay.errors
    assert echo.connections == 1
    # W accepted the original destination as :authority, from the client.
    assert len(w_lines) == 1, w_lines
    assert w_lines[0]["dst.hbone_addr"] == f"{dest[0]}:{dest[1]}" and "error" not in w_lines[0], w_lines
    assert w_lines[0]["src.identity"] == str(CLIENT) and w_lines[0]["dst.workload"] == "waypoint"
    # B heard from the waypoint.
    assert [f["src.identity"] for f in b_lines] == ["spiffe://cluster.local/ns/default/sa/waypoint"], b_lines


# -- hostname :authority with service-port mapping ------------------------------------------------------------------


def numeric_port(text: str) -> str:
    """The service maps 80 -> 8080; the server's endpoint has no port map of its own."""
    old = f'"default/{ECHO_HOST}":\n      80: 8080\n'
    assert old in text
    return text.replace(old, f'"default/{ECHO_HOST}": {{}}\n')


def named_port(text: str) -> str:
    """The service's target port is a name (0 in xDS); only the server's endpoint knows it is 8080."""
    old = "  ports:\n    80: 8080\n  subjectAltNames"
    assert old in text
    return text.replace(old, "  ports:\n    80: 0\n  subjectAltNames")


@pytest.mark.parametrize("edit", [numeric_port, named_port], ids=["port", "named-port"])
async def test_svc_hostname(tmp_path: Path, caplog: pytest.LogCaptureFixture, edit: Callable[[str], str]) -> None:
    m = TwoNodeMesh(tmp_path, edit=edit)
    caplog.set_level(logging.INFO, logger="access")
    echo = await EchoServer().start(*m.server_app)
    try:
        async with running_app(m.env_b()):
            cert = LocalCA.load_or_create(m.ca_dir, "cluster.local").issue(CLIENT, timedelta(hours=1))
            conn: Any = await hbone_dial((m.node_b, 15008), cert, local_addr=(m.node_a, 0))
            try:
                status, reader, writer = await hbone_tunnel(conn, f"{ECHO_HOST}:80")
                assert status == 200
                writer.write(b"by hostname")
                writer.write_eof()
                assert await asyncio.wait_for(reader.read(), 10) == b"by hostname"
                writer.close()
                # A port the service does not have: no target port (503).
                status, _, writer = await hbone_tunnel(conn, f"{ECHO_HOST}:81")
                writer.close()
                assert status == 503
            finally:
                conn.close("test done")
            lines = await eventually(lambda: inbound_lines(caplog, m.node_b), until=lambda got: len(got) >= 2)
    finally:
        await echo.stop()
    ok = [f for f in lines if "error" not in f]
    assert len(ok) == 1 and ok[0]["dst.service"] == ECHO_HOST and ok[0]["dst.hbone_addr"] == f"{ECHO_HOST}:80", lines
    assert echo.connections == 1


# -- application tunnels ---------------------------------------------------------------------------------------------


def app_tunnel(protocol: str) -> Callable[[str], str]:
    def edit(text: str) -> str:
        anchor = "  workloadName: server\n"
        assert anchor in text
        return text.replace(anchor, f"{anchor}  applicationTunnel: {{protocol: {protocol}}}\n", 1)

    return edit


async def test_app_tunnel_none(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A ``NONE`` app tunnel is a plain stream to the app (``PROXY`` ones: tests/proxy/test_app_tunnel.py)."""
    m = TwoNodeMesh(tmp_path, edit=app_tunnel("NONE"))
    caplog.set_level(logging.INFO, logger="access")
    echo = await EchoServer().start(*m.server_app)
    try:
        async with running_app(m.env_b()):
            cert = LocalCA.load_or_create(m.ca_dir, "cluster.local").issue(CLIENT, timedelta(hours=1))
            conn: Any = await hbone_dial((m.node_b, 15008), cert, local_addr=(m.node_a, 0))
            try:
                status, reader, writer = await hbone_tunnel(conn, f"{m.server_app[0]}:{m.server_app[1]}")
                assert status == 200
                writer.write(b"through the tunnel")
                writer.write_eof()
                assert await asyncio.wait_for(reader.read(), 10) == b"through the tunnel"
                writer.close()
            finally:
                conn.close("test done")
            lines = await eventually(lambda: inbound_lines(caplog, m.node_b))
    finally:
        await echo.stop()
    assert echo.connections == 1
    assert "error" not in lines[0], lines
