"""Two real ztunnel processes configured by the local control plane: xDS and certificates over gRPC with TLS.

Node A (127.0.31.1) proxies workload "client"; node B (127.0.32.1) proxies "server", whose app is an echo server
on 127.0.32.1:8080 behind the VIP 127.10.3.10:80. Both run with ``FAKE_CA=false``: their certificates come from the
control plane's CreateCertificate, each authenticated by its own token. The addresses are this module's own, so
it can run beside the other end-to-end tests.

The control plane serves a file and watches it; every change below is a write to that file.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from xds.server import XdsServer
from ztunnel.identity.spiffe import Identity
from ztunnel.testing import EchoServer, ZtunnelProcess, node_env, socks5_connect
from ztunnel.testing.control_plane import control_plane, wait_until, ztunnel_env

NODE_A, NODE_B = "127.0.31.1", "127.0.32.1"
SOCKS_A = (NODE_A, 15080)
VIP = ("127.10.3.10", 80)
APP = (NODE_B, 8080)
CLIENT = Identity("cluster.local", "default", "client")
SERVER = Identity("cluster.local", "default", "server")

CLIENT_WORKLOAD = """
- uid: Kubernetes//v1/Pod/default/client
  name: client
  namespace: default
  serviceAccount: client
  workloadIps: ["127.0.31.1"]
  protocol: HBONE
  node: node-a
"""
SERVER_WORKLOAD = """
- uid: Kubernetes//v1/Pod/default/server
  name: server
  namespace: default
  serviceAccount: server
  workloadIps: ["127.0.32.1"]
  protocol: HBONE
  node: node-b
  services:
    "default/echo.default.svc.cluster.local": {80: 8080}
"""
SERVICE = """
services:
- name: echo
  namespace: default
  hostname: echo.default.svc.cluster.local
  vips: ["/127.10.3.10"]
  ports: {80: 8080}
  subjectAltNames: ["spiffe://cluster.local/ns/default/sa/server"]
"""
DENY_8080 = """
policies:
- name: deny-8080
  namespace: default
  scope: Namespace
  action: Deny
  rules: [[[{destinationPorts: [8080]}]]]
"""


# ZtunnelProcess.start() opens its log file and never closes it (ztunnel/testing/__init__.py); only that warning is
# silenced here, anything else unraisable still fails the test.
pytestmark = pytest.mark.filterwarnings(
    r"ignore:Exception ignored in. <_io.FileIO name='[^']*\.log':pytest.PytestUnraisableExceptionWarning"
)


def mesh(server: bool = True, deny: bool = False) -> str:
    return "workloads:" + CLIENT_WORKLOAD + (SERVER_WORKLOAD if server else "") + SERVICE + (DENY_8080 if deny else "")


@dataclass
class Mesh:
    cp: XdsServer
    config: Path
    a: ZtunnelProcess
    b: ZtunnelProcess
    echo: EchoServer

    def write(self, text: str) -> float:
        self.config.write_text(text)
        return time.monotonic()


def _env(cp: XdsServer, node: str, ip: str, workload: str, token: str, tmp: Path) -> dict[str, str]:
    env = node_env(node, ip, workload, tmp / "unused-ca")
    del env["LOCAL_XDS_PATH"]
    # SECRET_TTL=62s: with the CA's 60 s backdating the half-life is 1 s away, so certificates rotate every second.
    env.update(ztunnel_env(cp, token=token, SECRET_TTL="62s", RUST_LOG="info"))
    return env


@pytest.fixture
async def two_nodes(tmp_path: Path) -> AsyncIterator[Mesh]:
    config = tmp_path / "mesh.yaml"
    config.write_text(mesh(server=False))  # the server workload is added by the test
    echo = await EchoServer().start(*APP)
    async with control_plane(tmp_path, config_paths=(config,), tokens={"tok-a": CLIENT, "tok-b": SERVER}) as cp:
        a = ZtunnelProcess(_env(cp, "node-a", NODE_A, "default/client/client", "tok-a", tmp_path), tmp_path / "a.log")
        b = ZtunnelProcess(_env(cp, "node-b", NODE_B, "default/server/server", "tok-b", tmp_path), tmp_path / "b.log")
        try:
            # start() blocks until ready; the control plane must keep serving meanwhile, so run it in threads.
            await asyncio.gather(asyncio.to_thread(a.start), asyncio.to_thread(b.start))
            yield Mesh(cp, config, a, b, echo)
        finally:
            for p in (a, b):
                if p.proc is not None:
                    await asyncio.to_thread(p.stop)
    await echo.stop()


async def echo_once(msg: bytes = b"ping") -> bool:
    """One connection through A's SOCKS5 to the service VIP; True if the echo came back."""
    writer = None
    try:
        reader, writer = await asyncio.wait_for(socks5_connect(SOCKS_A, *VIP), 3)
        writer.write(msg)
        return await asyncio.wait_for(reader.readexactly(len(msg)), 3) == msg
    except (ConnectionError, OSError, asyncio.IncompleteReadError, TimeoutError):
        return False
    finally:
        if writer is not None:
            writer.close()


async def within(seconds: float, since: float, want: bool) -> float:
    """Retry :func:`echo_once` until it returns ``want``; return the time since ``since`` (fails after ``seconds``)."""
    while True:
        if await echo_once() == want:
            return time.monotonic() - since
        if time.monotonic() - since > seconds:
            raise AssertionError(f"traffic did not become {'possible' if want else 'impossible'} within {seconds}s")
        await asyncio.sleep(0.02)


def ready(ip: str) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((ip, 15021), timeout=1) as s:
        s.sendall(b"GET /healthz/ready HTTP/1.0\r\n\r\n")
        return b" 200 " in s.recv(100)
    return False


async def test_config_and_certificates_from_the_control_plane(two_nodes: Mesh) -> None:
    m = two_nodes
    assert not await echo_once()  # the service has no endpoint yet

    # A workload added to the file becomes routable within 1 s.
    took = await within(1.0, m.write(mesh()), want=True)
    assert took < 1.0
    # Both certificates came from the control plane, each ztunnel asking with its own token for its own identity.
    tokens = {r.metadata.get("authorization") for r in m.cp.ca_requests}
    assert {"Bearer tok-a", "Bearer tok-b"} <= tokens
    assert all(not r.request.HasField("metadata") for r in m.cp.ca_requests)  # dedicated mode: no impersonation

    # Removed, it is gone within 1 s.
    assert await within(1.0, m.write(mesh(server=False)), want=False) < 1.0
    await within(1.0, m.write(mesh()), want=True)

    assert m.cp.nacks == []


async def test_policy_change_reaches_the_inbound_check(two_nodes: Mesh) -> None:
    m = two_nodes
    await within(1.0, m.write(mesh()), want=True)
    assert await within(1.0, m.write(mesh(deny=True)), want=False) < 1.0
    assert await within(1.0, m.write(mesh()), want=True) < 1.0


async def test_control_plane_outage_and_certificate_rotation(two_nodes: Mesh) -> None:
    m = two_nodes
    await within(1.0, m.write(mesh()), want=True)
    reader, writer = await socks5_connect(SOCKS_A, *VIP)
    writer.write(b"before")
    assert await asyncio.wait_for(reader.readexactly(6), 3) == b"before"

    # Certificates rotate every second; the established connection is not touched by it.
    requests = len(m.cp.ca_requests)
    await wait_until(lambda: len(m.cp.ca_requests) >= requests + 2, 3)

    # Control plane down: existing and new connections keep working on the last state and cached certificates,
    # and readiness stays (as upstream: the initial sync happened).
    sessions = len(m.cp.sessions)
    await m.cp.stop()
    await asyncio.sleep(0.3)
    writer.write(b"during")
    assert await asyncio.wait_for(reader.readexactly(6), 3) == b"during"
    assert await echo_once()
    assert ready(NODE_A) and ready(NODE_B)

    # Back up on the same port: both reconnect (with backoff) and resync, echoing the versions they hold.
    await m.cp.start()
    # One new stream per node; a session is registered when the stream opens, before its first request lands.
    await wait_until(
        lambda: len(m.cp.sessions) >= sessions + 2 and all(s.subscriptions for s in m.cp.sessions[sessions:]), 5
    )
    new = m.cp.sessions[sessions:]
    assert all(s.initial_versions for s in new)
    assert any(len(s.initial_versions.get("type.googleapis.com/istio.workload.Address", {})) == 3 for s in new)
    writer.write(b"after!")
    assert await asyncio.wait_for(reader.readexactly(6), 3) == b"after!"
    writer.close()
    # And the resynced config is live: a change still arrives within 1 s.
    assert await within(1.0, m.write(mesh(server=False)), want=False) < 1.0
