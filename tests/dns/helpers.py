"""The mesh the DNS tests resolve against (the shape of upstream's ``dns/server.rs`` test state), and fakes."""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

import dns.message
import dns.name
import dns.rcode
import dns.rdatatype
import dns.rrset

from ztunnel.dns.forwarder import ForwardError
from ztunnel.dns.metrics import Metrics
from ztunnel.state import ProxyState, StateUpdate
from ztunnel.state.service import IpFamily, Service, Visibility
from ztunnel.state.workload import NamespacedHostname, NetworkAddress, Workload

NS1, NS2, NS3 = "ns1", "ns2", "ns3"
PREFERRED = "preferred-ns"
NW1, NW2 = "nw1", "nw2"
CLIENT_IP = "10.0.1.1"


def sample_value(metrics: Metrics, sample: str, labels: dict[str, str]) -> float | None:
    """The value of the sample named ``sample`` (``istio_dns_requests_total``...) with exactly ``labels`` in what
    ``metrics`` writes at a scrape; None when there is none."""
    for metric in metrics.collect():
        for s in metric.samples:
            if s.name == sample and s.labels == labels:
                return s.value
    return None


def ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    return ipaddress.ip_address(text)


def na(network: str, addr: str) -> NetworkAddress:
    return NetworkAddress(network, ip(addr))


def kube_fqdn(name: str, ns: str) -> str:
    return f"{name}.{ns}.svc.cluster.local"


def service(
    name: str,
    ns: str,
    vips: Sequence[NetworkAddress] = (),
    *,
    hostname: str | None = None,
    visibility: Visibility = Visibility.PUBLIC,
    canonical: bool = False,
    ip_families: IpFamily | None = None,
) -> Service:
    return Service(
        name=name,
        namespace=ns,
        hostname=hostname if hostname is not None else kube_fqdn(name, ns),
        vips=tuple(vips),
        ports={80: 80},
        visibility=visibility,
        canonical=canonical,
        ip_families=ip_families,
    )


def external(hostname: str, vips: Sequence[NetworkAddress] = (), ns: str = NS1, **kw: object) -> Service:
    return service(hostname, ns, vips, hostname=hostname, **kw)  # type: ignore[arg-type]


def workload(name: str, ns: str, ips: Sequence[str], services: Sequence[str] = (), network: str = NW1) -> Workload:
    return Workload(
        uid=f"Kubernetes//Pod/{ns}/{name}",
        name=name,
        namespace=ns,
        workload_ips=tuple(ip(i) for i in ips),
        trust_domain="cluster.local",
        service_account="default",
        network=network,
        canonical_name=f"{name}-app",
        canonical_revision="v1",
        services={NamespacedHostname.parse(s): {80: 80} for s in services},
    )


CLIENT = workload("client", NS1, [CLIENT_IP])
LARGE_VIPS = [na(NW1, f"240.0.{i // 256}.{i % 256}") for i in range(256)]


def services() -> list[Service]:
    return [
        external("www.google.com", [na(NW1, "1.1.1.1")]),
        service("productpage", NS1, [na(NW1, "9.9.9.9")]),
        service("example", NS2, [na(NW1, "10.10.10.10")]),
        # visibility NAMESPACE: the ns2 one is invisible to an ns1 client (forwarded), the ns1 one resolves.
        service("nslocal", NS2, [na(NW1, "10.10.10.240")], visibility=Visibility.NAMESPACE),
        service("nslocalsame", NS1, [na(NW1, "10.10.10.241")], visibility=Visibility.NAMESPACE),
        # The same hostname in several namespaces: the client's wins, then canonical, then the preferred one.
        external("everywhere.io", [na(NW1, "10.10.10.110")], ns=NS2),
        external("everywhere.io", [na(NW1, "10.10.10.111")], ns=PREFERRED),
        external("everywhere.io", [na(NW1, "10.10.10.112")], ns=NS1),
        external("preferred.io", [na(NW1, "10.10.10.210")], ns=NS2),
        external("preferred.io", [na(NW1, "10.10.10.211")], ns=PREFERRED),
        external("canonical.svc", [na(NW1, "10.10.10.140")], ns=NS2),
        external("canonical.svc", [na(NW1, "10.10.10.141")], ns=NS3, canonical=True),
        external("canonical.with.local", [na(NW1, "10.10.10.150")], ns=NS1),
        external("canonical.with.local", [na(NW1, "10.10.10.151")], ns=NS2, canonical=True),
        service(
            "details",
            NS2,
            [na(NW1, "11.11.11.11"), na(NW1, "12.12.12.12"), na(NW1, "13.13.13.13"), na(NW1, "14.14.14.14")],
            hostname="details.ns2.svc.cluster.remote",
        ),
        external("ipv4.localhost", [na(NW1, "2.2.2.2")]),
        external("ipv6.localhost", [na(NW1, "2001:db8::ff00:42:8329")]),
        external("dual.localhost", [na(NW1, "2.2.2.2"), na(NW1, "2001:db8::ff00:42:8329")]),
        external("*.wildcard", [na(NW1, "10.10.10.10")]),
        external("*.b.wildcard", [na(NW1, "11.11.11.11")]),
        external("*.svc.mesh.company.net", [na(NW1, "10.1.2.3")]),
        service("nw2-only", NS1, [na(NW2, "20.20.20.20")]),
        service("both-networks", NS1, [na(NW1, "21.21.21.21"), na(NW2, "22.22.22.22")]),
        service("headless", NS1),
        external("headless.example.com"),
        external("headless-no-endpoints.example.com"),
        service("headless-ipv6", NS1, ip_families=IpFamily.IPV6),
        service("headless-ipv4", NS1, ip_families=IpFamily.IPV4),
        service("many", NS1, [na(NW1, f"10.20.0.{i}") for i in range(1, 21)]),
        service("large", NS1, LARGE_VIPS),
    ]


def workloads() -> list[Workload]:
    headless = f"{NS1}/{kube_fqdn('headless', NS1)}"
    return [
        CLIENT,
        workload("headless0", NS1, ["30.30.30.30", "2001:db8::30"], [headless]),
        workload("headless1", NS1, ["31.31.31.31", "2001:db8::31"], [headless]),
        workload("headless-external", NS1, ["32.32.32.32", "2001:db8::32"], [f"{NS1}/headless.example.com"]),
        workload("headless2", NS1, ["33.33.33.33", "2001:db8::33"], [f"{NS1}/{kube_fqdn('headless-ipv6', NS1)}"]),
        workload("headless3", NS1, ["34.34.34.34", "2001:db8::34"], [f"{NS1}/{kube_fqdn('headless-ipv4', NS1)}"]),
    ]


def new_state() -> ProxyState:
    state = ProxyState()
    state.apply(StateUpdate(workloads=workloads(), services=services()))
    return state


K8S_SEARCH = [dns.name.from_text(d) for d in ("ns1.svc.cluster.local", "svc.cluster.local", "cluster.local")]


class FakeForwarder:
    """Upstream's test forwarder: ``www.bing.com`` is 1.1.1.1 (with ::1 as an additional), anything else NXDOMAIN.

    ``fail=True`` makes every forward fail as if no nameserver answered.
    """

    def __init__(self, search: Sequence[dns.name.Name] = K8S_SEARCH, *, fail: bool = False) -> None:
        self.search = list(search)
        self.fail = fail
        self.forwarded: list[dns.message.Message] = []
        self.records = {dns.name.from_text("www.bing.com."): ["1.1.1.1"]}
        self.additionals = {dns.name.from_text("www.bing.com."): ["::1"]}

    def search_domains(self, client: Workload) -> Sequence[dns.name.Name]:
        return self.search

    async def forward(self, request: dns.message.Message) -> dns.message.Message:
        self.forwarded.append(request)
        if self.fail:
            raise ForwardError("upstream down (fake)")
        q = request.question[0]
        resp = dns.message.make_response(request)
        ips = self.records.get(q.name)
        if ips is None:
            resp.set_rcode(dns.rcode.NXDOMAIN)
            return resp
        for addr in ips:
            rdtype = dns.rdatatype.A if ip(addr).version == 4 else dns.rdatatype.AAAA
            if rdtype == q.rdtype:
                resp.answer.append(dns.rrset.from_text(q.name, 30, "IN", rdtype, addr))
        for addr in self.additionals.get(q.name, []):
            rdtype = dns.rdatatype.A if ip(addr).version == 4 else dns.rdatatype.AAAA
            resp.additional.append(dns.rrset.from_text(q.name, 30, "IN", rdtype, addr))
        return resp
