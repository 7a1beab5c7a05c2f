"""Two real ztunnel processes configured by the local control plane: xDS and certificates over gRPC with TLS.

Node A (127.0.31.1) proxies workload "client"; node B (127.0.32.1) proxies "server", whose app is an echo server
on 127.0.32.1:8080 behind the VIP 127.10.3.10:80. Both run with ``FAKE_CA=false``: their certificates come from the
control plane's CreateCertificate, each authenticated by its own token. The addresses are this module's own, so
it can run beside the other end-to-end tests.

The control plane serves a file and watches it; every change below is a write to that file. Node A's pool allows one
stream per HBONE connection and drops idle connections after 200 ms, so a new client connection made while another
is open is a new TLS handshake (the certificate-outage test relies on it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from xds.istio.workload import workload_pb2 as wl_pb
from ztunnel.identity.spiffe import Identity
from ztunnel.standins.istiod.server import DeltaSession, XdsServer
from ztunnel.testing import EchoServer, ZtunnelProcess, node_env, socks5_connect
from ztunnel.testing.control_plane import control_plane, wait_until, ztunnel_env
from ztunnel.xds.types import ADDRESS_TYPE, AUTHORIZATION_TYPE

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


def _env(cp: XdsServer, node: str, ip: str, workload: str, token: str, tmp: Path, **extra: str) -> dict[str, str]:
    env = node_env(node, ip, workload, tmp / "unused-ca")
    del env["LOCAL_XDS_PATH"]
    # SECRET_TTL=62s: with the CA's 60 s backdating the half-life is 1 s away, so certificates rotate every second.
    env.update(ztunnel_env(cp, token=token, SECRET_TTL="62s", RUST_LOG="info", **extra))
    return env


@contextlib.asynccontextmanager
async def start_mesh(tmp_path: Path, text: str, **extra: str) -> AsyncIterator[Mesh]:
    """The control plane serving ``text`` from a file, and both nodes started from it (``extra``: more env)."""
    config = tmp_path / "mesh.yaml"
    config.write_text(text)
    echo = await EchoServer().start(*APP)
    pool_a = {"POOL_MAX_STREAMS_PER_CONNECTION": "1", "POOL_UNUSED_RELEASE_TIMEOUT": "200ms"}
    async with control_plane(tmp_path, config_paths=(config,), tokens={"tok-a": CLIENT, "tok-b": SERVER}) as cp:
        env_a = _env(cp, "node-a", NODE_A, "default/client/client", "tok-a", tmp_path, **pool_a, **extra)
        a = ZtunnelProcess(env_a, tmp_path / "a.log")
        b = ZtunnelProcess(
            _env(cp, "node-b", NODE_B, "default/server/server", "tok-b", tmp_path, **extra), tmp_path / "b.log"
        )
        try:
            # start() blocks until ready; the control plane must keep serving meanwhile, so run it in threads.
            await asyncio.gather(asyncio.to_thread(a.start), asyncio.to_thread(b.start))
            yield Mesh(cp, config, a, b, echo)
        finally:
            for p in (a, b):
                if p.proc is not None:
                    await asyncio.to_thread(p.stop)
    await echo.stop()


@pytest.fixture
async def two_nodes(tmp_path: Path) -> AsyncIterator[Mesh]:
    async with start_mesh(tmp_path, mesh(server=False)) as m:  # the server workload is added by the test
        yield m


def http_get(ip: str, port: int, path: str) -> str:
    with urllib.request.urlopen(f"http://{ip}:{port}{path}", timeout=5) as resp:
        return str(resp.read().decode())


async def config_dump(ip: str) -> dict[str, Any]:
    """The admin config dump of the ztunnel on ``ip`` (admin port 15000)."""
    return dict(json.loads(await asyncio.to_thread(http_get, ip, 15000, "/config_dump")))


async def cert_serial(ip: str, identity: Identity) -> str:
    """The serial number of ``identity``'s leaf certificate as the ztunnel's config dump shows it."""
    for entry in (await config_dump(ip))["certificates"]:
        if entry["identity"] == str(identity):
            assert entry["state"] == "Available", entry["state"]
            return str(entry["certChain"][0]["serialNumber"])
    raise AssertionError(f"no certificate for {identity} in the config dump of {ip}")


async def inbound_peers(ip: str) -> set[str]:
    """The TLS peers (client ip:port) of the inbound connections open at the ztunnel on ``ip`` (admin /connections)."""
    conns = json.loads(await asyncio.to_thread(http_get, ip, 15000, "/connections"))
    return {c["src"] for c in conns if c["direction"] == "inbound"}


async def scrape(ip: str) -> dict[str, list[Any]]:
    """The ztunnel's /metrics on the stats port 15020: sample name -> samples."""
    out: dict[str, list[Any]] = {}
    for fam in text_string_to_metric_families(await asyncio.to_thread(http_get, ip, 15020, "/metrics")):
        for sample in fam.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


def metric(samples: dict[str, list[Any]], name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return float(sum(s.value for s in samples.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items())))


def session_of(cp: XdsServer, node: str) -> DeltaSession:
    """The newest xDS session of the ztunnel on ``node`` (by its NODE_NAME metadata)."""
    return [s for s in cp.sessions if s.node_name == node][-1]


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


async def applied_within(seconds: float, since: float, names: set[str]) -> float:
    """Poll node A's config dump until its workloads are ``names``; return the time since ``since`` (fails after
    ``seconds``). For a change that makes traffic impossible by removing node B's own workload: a traffic probe then
    may need a new HBONE connection, which node B holds up to 5 s waiting for its workload to come back (as upstream's
    local workload wait), so a probe measures that wait, not when the change arrived."""
    while True:
        if {w["name"] for w in (await config_dump(NODE_A))["workloads"]} == names:
            return time.monotonic() - since
        if time.monotonic() - since > seconds:
            raise AssertionError(f"node A's workloads did not become {sorted(names)} within {seconds}s")
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

    # Removed, it is gone within 1 s (read in node A's config dump: see applied_within), and the traffic stops.
    assert await applied_within(1.0, m.write(mesh(server=False)), {"client"}) < 1.0
    assert not await echo_once()
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
    held_peers = await inbound_peers(NODE_B)

    # Certificates rotate every second; the established connection is not touched by it.
    requests = len(m.cp.ca_requests)
    await wait_until(lambda: len(m.cp.ca_requests) >= requests + 2, 3)

    # Control plane (and CA) down for 3 s, three certificate half-lives: every refresh in that time fails.
    sessions = len(m.cp.sessions)
    await m.cp.stop()
    down = time.monotonic()
    requests = len(m.cp.ca_requests)
    cached = await cert_serial(NODE_A, CLIENT)
    await asyncio.sleep(1.5)
    # The held connection carries on, and new connections work on the cached certificates and the last state: with
    # one stream per pooled connection, this one is a new TLS handshake at both ends.
    writer.write(b"during")
    assert await asyncio.wait_for(reader.readexactly(6), 3) == b"during"
    r2, w2 = await socks5_connect(SOCKS_A, *VIP)
    w2.write(b"new")
    assert await asyncio.wait_for(r2.readexactly(3), 3) == b"new"
    assert await inbound_peers(NODE_B) - held_peers, "the new connection should be a new HBONE connection"
    w2.close()
    assert ready(NODE_A) and ready(NODE_B)  # as upstream: the initial sync happened, readiness stays
    await asyncio.sleep(max(0.0, 3.0 - (time.monotonic() - down)))
    # Refreshes were attempted and failed; the certificate in use is still the one from before the outage.
    log_a = m.a.log_path.read_text() if m.a.log_path else ""
    assert f"certificate renewal for {CLIENT} failed" in log_a
    assert "retaining the existing valid certificate" in log_a
    assert await cert_serial(NODE_A, CLIENT) == cached
    assert len(m.cp.ca_requests) == requests

    # Back up on the same port: both reconnect (with backoff) and resync, echoing the versions they hold.
    await m.cp.start()
    # One new stream per node; a session is registered when the stream opens, before its first request lands.
    await wait_until(
        lambda: len(m.cp.sessions) >= sessions + 2 and all(s.subscriptions for s in m.cp.sessions[sessions:]), 5
    )
    new = m.cp.sessions[sessions:]
    assert all(s.initial_versions for s in new)
    assert any(len(s.initial_versions.get(ADDRESS_TYPE, {})) == 3 for s in new)
    # The certificate is renewed once the CA answers (the retry backoff is at most ~2.4 s by now), and the admin
    # config dump shows the new one.
    await wait_until(lambda: len(m.cp.ca_requests) > requests, 5)
    deadline = time.monotonic() + 5
    while (renewed := await cert_serial(NODE_A, CLIENT)) == cached:
        assert time.monotonic() < deadline, "the config dump still shows the certificate from before the outage"
        await asyncio.sleep(0.05)
    assert renewed != cached
    writer.write(b"after!")
    assert await asyncio.wait_for(reader.readexactly(6), 3) == b"after!"
    writer.close()
    # And the resynced config is live: a change still arrives within 1 s (failed once in CI when measured by traffic:
    # see applied_within), and it stops the traffic.
    assert await applied_within(1.0, m.write(mesh(server=False)), {"client"}) < 1.0
    assert not await echo_once()

    # istio_xds_connection_terminations_total counts the stream the outage broke, and the failed reconnects.
    metrics = await scrape(NODE_A)
    assert metric(metrics, "istio_xds_connection_terminations_total") >= 2
    assert metric(metrics, "istio_xds_connection_terminations_total", reason="ConnectionError") >= 1
    assert {s.labels["reason"] for s in metrics["istio_xds_connection_terminations_total"]} <= {
        "ConnectionError",
        "Error",
        "Reconnect",
        "Complete",
    }


async def test_nack_in_a_running_ztunnel_and_xds_metrics(two_nodes: Mesh) -> None:
    m = two_nodes
    await within(1.0, m.write(mesh()), want=True)
    before = await scrape(NODE_A)
    # Upstream's names and labels: a counter per type URL for the responses and for their resources' bytes.
    assert metric(before, "istio_xds_message_total", url=ADDRESS_TYPE) >= 2  # the initial sync and the push
    assert metric(before, "istio_xds_message_total", url=AUTHORIZATION_TYPE) >= 1
    assert metric(before, "istio_xds_message_bytes_total", url=ADDRESS_TYPE) > 0

    # The control plane pushes a workload whose address is 3 bytes long: the ztunnel NACKs it, naming it.
    session = session_of(m.cp, "node-a")
    bad = "Kubernetes//v1/Pod/default/bad-ip"
    invalid = wl_pb.Address(workload=wl_pb.Workload(uid=bad, name="bad-ip", namespace="default", addresses=[b"\1\2\3"]))
    m.cp.set_raw_resource(ADDRESS_TYPE, bad, invalid)
    await wait_until(lambda: session.nacks, 2)
    (nack,) = session.nacks
    assert nack.type_url == ADDRESS_TYPE and nack.message.startswith(f"{bad}: "), nack.message
    await wait_until(lambda: f"type=NACK error={bad}: " in (m.a.log_path.read_text() if m.a.log_path else ""), 2)

    # It keeps serving on its last good state.
    assert m.a.proc is not None and m.a.proc.poll() is None and ready(NODE_A)
    assert await echo_once()
    assert bad not in {w["uid"] for w in (await config_dump(NODE_A))["workloads"]}

    # The next valid push is accepted (ACKed) and applied: the server workload goes away.
    acks = len(session.acks)
    assert await applied_within(1.0, m.write(mesh(server=False)), {"client"}) < 1.0  # see applied_within
    assert not await echo_once()
    await wait_until(lambda: len(session.acks) > acks, 1)
    assert session.acks[-1][0] == ADDRESS_TYPE and int(session.acks[-1][1]) > int(nack.nonce)
    assert len(session.nacks) == 1

    after = await scrape(NODE_A)
    # The NACKed response and the valid one were both received and counted.
    assert (
        metric(after, "istio_xds_message_total", url=ADDRESS_TYPE)
        >= metric(before, "istio_xds_message_total", url=ADDRESS_TYPE) + 2
    )
    assert metric(after, "istio_xds_message_bytes_total", url=ADDRESS_TYPE) > metric(
        before, "istio_xds_message_bytes_total", url=ADDRESS_TYPE
    )


async def test_on_demand_vip_becomes_routable_on_first_use(tmp_path: Path) -> None:
    outside = await EchoServer().start("127.0.33.1", 7070)  # not in the mesh: passthrough
    on_demand = {"XDS_ON_DEMAND": "true", "ISTIO_META_DNS_CAPTURE": "false"}  # upstream refuses DNS + on-demand
    async with start_mesh(tmp_path, mesh(), **on_demand) as m:
        session = session_of(m.cp, "node-a")
        sub = session.subscriptions[ADDRESS_TYPE]
        assert not sub.wildcard  # subscribed to nothing ("*" subscribed and unsubscribed)
        # Nothing was pushed but node A's own workload (istiod sends a node's workloads unasked).
        dump = await config_dump(NODE_A)
        assert [w["name"] for w in dump["workloads"]] == ["client"] and dump["services"] == []

        # First use of the VIP: node A asks for "/127.10.3.10", gets the service and its endpoint, and the very
        # first connection goes through HBONE.
        start = time.monotonic()
        assert await echo_once()
        first = time.monotonic() - start
        assert "/127.10.3.10" in sub.names
        dump = await config_dump(NODE_A)
        assert {w["name"] for w in dump["workloads"]} == {"client", "server"}
        assert [s["hostname"] for s in dump["services"]] == ["echo.default.svc.cluster.local"]

        async def opened() -> float:
            return metric(
                await scrape(NODE_A),
                "istio_tcp_connections_opened_total",
                reporter="source",
                destination_service="echo.default.svc.cluster.local",
                connection_security_policy="mutual_tls",
            )

        deadline = time.monotonic() + 5
        while await opened() < 1:
            assert time.monotonic() < deadline, "no mTLS connection to the service in node A's metrics"
            await asyncio.sleep(0.1)

        # An address nobody has: the control plane answers it as removed and the connection passes through.
        start = time.monotonic()
        reader, writer = await socks5_connect(SOCKS_A, "127.0.33.1", 7070)
        writer.write(b"plain")
        assert await asyncio.wait_for(reader.readexactly(5), 3) == b"plain"
        unknown = time.monotonic() - start
        writer.close()
        assert "/127.0.33.1" in sub.names and outside.connections == 1
        print(f"on-demand: first VIP connection {first * 1000:.0f} ms, unknown address {unknown * 1000:.0f} ms")
        assert unknown < 1.0
    await outside.stop()


MAPPED = "::ffff:127.0.0.0/104"  # IPv4-mapped IPv6: 127.0.0.0/8 written the IPv6 way
MAPPED_DENY = f"""
policies:
- name: deny-not-mapped
  namespace: default
  scope: Namespace
  action: Deny
  rules: [[[{{notSourceIps: ["{MAPPED}"]}}]]]
"""
MAPPED_ALLOW = f"""
policies:
- name: allow-mapped
  namespace: default
  scope: Namespace
  action: Allow
  rules: [[[{{sourceIps: ["{MAPPED}"], namespaces: [{{Exact: default}}]}}]]]
"""


async def test_ipv4_mapped_cidrs_reach_the_inbound_check_as_upstream(two_nodes: Mesh) -> None:
    """Over real gRPC into a running ztunnel: a mapped CIDR is an IPv6 network and so contains no IPv4 peer
    (upstream's IpNet). Dropping it on conversion made both rules below fail open."""
    m = two_nodes
    await within(1.0, m.write(mesh()), want=True)
    assert m.b.log_path is not None
    # DENY notIpBlocks [mapped]: every IPv4 source is "not in" it, so node A's connection is denied.
    await within(2.0, m.write(mesh() + MAPPED_DENY), want=False)
    await wait_until(lambda: "explicitly denied by: default/deny-not-mapped" in m.b.log_path.read_text(), 2)  # type: ignore[union-attr]
    await within(2.0, m.write(mesh()), want=True)
    # ALLOW {ipBlocks: [mapped], namespaces: [default]}: matches no IPv4 source, so nobody is allowed.
    await within(2.0, m.write(mesh() + MAPPED_ALLOW), want=False)
    await wait_until(lambda: "allow policies exist, but none allowed" in m.b.log_path.read_text(), 2)  # type: ignore[union-attr]
    # The control: the same ALLOW written with the IPv4 CIDR allows node A's client.
    await within(2.0, m.write(mesh() + MAPPED_ALLOW.replace(MAPPED, "127.0.0.0/8")), want=True)
    assert m.cp.nacks == []
