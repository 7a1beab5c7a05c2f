"""On-demand DNS for hostname-only workloads: the resolver (a real DNS server on loopback, over UDP and, for a
truncated answer, TCP), upstream's random pick, and a connection through ztunnel to a ServiceEntry-style workload
known only by hostname, counted in ``istio_on_demand_dns_total``."""

from __future__ import annotations

import asyncio
import ipaddress
import random
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import dns.name
import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from ztunnel.dns.cache import AnswerCache, CachingForwarder
from ztunnel.dns.forwarder import Nameserver, SystemForwarder
from ztunnel.dns.lookup import HostLookup, HostLookupError, pick_address
from ztunnel.sockets import SocketConfig, SocketFactory
from ztunnel.testing import EchoServer, TwoNodeMesh, running_app
from ztunnel.testing.dns import UpstreamDns

UPSTREAM_IP = "127.0.54.2"


def forwarder(u: UpstreamDns, search: tuple[str, ...] = ()) -> SystemForwarder:
    return SystemForwarder(
        [Nameserver(ipaddress.ip_address(u.host), u.port)],
        SocketFactory(SocketConfig()),
        search=[dns.name.from_text(s) for s in search],
        timeout=1.0,
        lifetime=2.0,
    )


@pytest.fixture
async def upstream() -> AsyncIterator[UpstreamDns]:
    big = [f"10.1.{i // 250}.{i % 250 + 1}" for i in range(120)]  # 120 A records: more than 1232 bytes
    u = await UpstreamDns(
        {
            "backend.example.org": ["192.0.2.10", "192.0.2.11", "192.0.2.12", "2001:db8::10"],
            "v6only.example.org": ["2001:db8::20"],
            "api.corp.example": ["192.0.2.30"],
            "big.example.org": big,
        }
    ).start(UPSTREAM_IP)
    yield u
    await u.stop()


async def test_lookup_asks_a_and_aaaa_and_caches(upstream: UpstreamDns) -> None:
    lookup = HostLookup(CachingForwarder(forwarder(upstream), AnswerCache()))
    ips = await lookup.lookup_ip("backend.example.org")
    assert sorted(map(str, ips)) == ["192.0.2.10", "192.0.2.11", "192.0.2.12", "2001:db8::10"]
    assert sorted(q.question[0].rdtype for _, q in upstream.queries) == [1, 28]  # A and AAAA, once each
    assert await lookup.lookup_ip("backend.example.org") == ips  # from the cache
    assert len(upstream.queries) == 2


async def test_ipv6_disabled_asks_only_a(upstream: UpstreamDns) -> None:
    lookup = HostLookup(forwarder(upstream), ipv6_enabled=False)
    assert [str(i) for i in await lookup.lookup_ip("backend.example.org")][:1] == ["192.0.2.10"]
    assert {q.question[0].rdtype for _, q in upstream.queries} == {1}
    with pytest.raises(HostLookupError, match=r"v6only\.example\.org returned no addresses"):
        await lookup.lookup_ip("v6only.example.org")


async def test_truncated_answer_is_asked_again_over_tcp(upstream: UpstreamDns) -> None:
    lookup = HostLookup(forwarder(upstream), ipv6_enabled=False)
    assert len(await lookup.lookup_ip("big.example.org")) == 120
    assert [t for t, _ in upstream.queries] == ["udp", "tcp"]


async def test_unknown_name_and_search_domains(upstream: UpstreamDns) -> None:
    lookup = HostLookup(forwarder(upstream), search=[dns.name.from_text("corp.example.")])
    with pytest.raises(HostLookupError, match=r"nothing\.example\.org\. returned no addresses"):
        await lookup.lookup_ip("nothing.example.org.")
    assert [str(i) for i in await lookup.lookup_ip("api")] == ["192.0.2.30"]  # via the search list
    with pytest.raises(HostLookupError, match="not a valid name"):
        await lookup.lookup_ip("a" * 70 + ".example")


async def test_upstream_down_is_an_error() -> None:
    u = await UpstreamDns({}).start(UPSTREAM_IP)
    await u.stop()
    with pytest.raises(HostLookupError, match=r"no answer from upstream nameservers"):
        await HostLookup(forwarder(u)).lookup_ip("backend.example.org")


def test_pick_is_random_within_the_client_family() -> None:
    ips = [ipaddress.ip_address(t) for t in ("192.0.2.10", "192.0.2.11", "192.0.2.12", "2001:db8::10")]
    rng = random.Random(7)
    v4 = {str(pick_address(ips, False, rng)) for _ in range(200)}
    assert v4 == {"192.0.2.10", "192.0.2.11", "192.0.2.12"}  # every v4 address, never the v6 one
    assert {str(pick_address(ips, True, rng)) for _ in range(20)} == {"2001:db8::10"}
    only_v6 = [ipaddress.ip_address("2001:db8::20")]
    assert str(pick_address(only_v6, False, rng)) == "2001:db8::20"  # the other family when there is no match


def scrape(host: str) -> str:
    with urllib.request.urlopen(f"http://{host}:15020/metrics", timeout=5) as resp:
        return str(resp.read().decode())


HOSTNAME_WORKLOAD = """
- uid: Kubernetes/networking.istio.io/ServiceEntry/default/external/backend.example.org
  name: external
  namespace: default
  serviceAccount: default
  hostname: backend.example.org
  workloadIps: []
  protocol: TCP
  clusterId: Kubernetes
  services:
    "default/external.example.org":
      7000: {port}
services:
- name: external
  namespace: default
  hostname: external.example.org
  vips: ["/{vip}"]
  ports:
    7000: {port}
"""


async def test_connection_to_a_hostname_only_workload(tmp_path: Path) -> None:
    """Through ztunnel to a workload known only by hostname: the hostname is resolved on demand (one of its
    addresses, where an echo server listens), the bytes arrive, and the lookup is counted with upstream's labels."""
    echo_ip = f"127.0.54.{random.randrange(10, 250)}"
    echo = await EchoServer().start(echo_ip, 0)
    vip = f"127.0.55.{random.randrange(10, 250)}"

    def edit(text: str) -> str:
        return text.replace("\nservices:\n", HOSTNAME_WORKLOAD.format(port=echo.address[1], vip=vip), 1)

    m = TwoNodeMesh(tmp_path, edit)
    u = await UpstreamDns({"backend.example.org": [echo_ip]}).start(UPSTREAM_IP)
    try:
        async with running_app(m.env_a()) as app:
            app.proxy.pi.lookup_host = HostLookup(CachingForwarder(forwarder(u))).lookup_ip  # type: ignore[attr-defined]
            for _ in range(2):
                reader, writer = await m.socks5(vip, 7000)
                writer.write(b"ping")
                assert await asyncio.wait_for(reader.readexactly(4), 10) == b"ping"
                writer.close()
            text = await asyncio.to_thread(scrape, m.node_a)
    finally:
        await u.stop()
        await echo.stop()
    (fam,) = [f for f in text_string_to_metric_families(text) if f.name == "istio_on_demand_dns"]
    assert "unstable" in fam.documentation
    (sample,) = fam.samples
    assert sample.value == 2  # every connection that needed it, cached or not
    assert list(sample.labels) == [
        "source_workload",
        "source_canonical_service",
        "source_canonical_revision",
        "source_workload_namespace",
        "source_principal",
        "source_app",
        "source_version",
        "source_cluster",
        "hostname",
    ]
    assert sample.labels["hostname"] == "backend.example.org"
    assert sample.labels["source_workload"] == "client"
    assert sample.labels["source_principal"] == "spiffe://cluster.local/ns/default/sa/client"
    assert sample.labels["source_app"] == "client" and sample.labels["source_version"] == "v1"
    assert [int(q.question[0].rdtype) for _, q in u.queries].count(1) == 1  # the second connection used the cache
