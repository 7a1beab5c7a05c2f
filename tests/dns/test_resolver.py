"""Name expansion, wildcards and search domains (upstream ``test_to_kube_fqdns``, ``test_get_wildcards``,
``search_domains``, ``name_util`` tests)."""

from __future__ import annotations

import ipaddress
from dataclasses import replace
from pathlib import Path

import dns.name
import pytest

from tests.dns.helpers import CLIENT, FakeForwarder, new_state
from ztunnel.config import ProxyMode
from ztunnel.dns.forwarder import Nameserver, ResolvConf, SystemForwarder, forwarder_for_mode
from ztunnel.dns.name_util import has_domain, trim_domain
from ztunnel.dns.resolver import Alias, Store, get_wildcards, host_text, wildcard_hosts
from ztunnel.sockets import SocketConfig, SocketFactory


def n(text: str) -> dns.name.Name:
    return dns.name.from_text(text)


def store() -> Store:
    return Store(new_state(), "cluster.local", FakeForwarder().search_domains)


@pytest.mark.parametrize(
    ("host", "client_ns", "expected"),
    [
        ("name", "ns1", ["name.ns1.svc.cluster.local."]),
        ("name.", "ns1", ["name.ns1.svc.cluster.local."]),
        ("name.ns2", "ns1", ["name.ns2.svc.cluster.local.", "name.ns2.ns1.svc.cluster.local."]),
        ("name.ns2.svc.", "ns1", ["name.ns2.svc.cluster.local.", "name.ns2.svc.svc.cluster.local."]),
        ("name.ns2.not-svc.", "ns1", ["name.ns2.not-svc.svc.cluster.local."]),
        ("pod.sub-domain.ns.svc", "ns1", ["pod.sub-domain.ns.svc.cluster.local."]),
        ("pod.sub-domain.ns.not-svc", "ns1", []),
        ("name.ns2.svc.cluster.", "ns1", []),
        ("name.ns2.svc.cluster.local", "ns1", []),
        ("www.google.com.", "ns1", ["www.google.com.svc.cluster.local."]),
    ],
)
def test_kube_fqdns(host: str, client_ns: str, expected: list[str]) -> None:
    s = store()
    got = s.kube_fqdns(n(host), n(f"{client_ns}.svc.cluster.local."))
    assert [x.to_text() for x in got] == expected


def test_get_wildcards() -> None:
    assert get_wildcards(n("svc1.")) == [n("svc1.")]
    assert [w.to_text() for w in get_wildcards(n("svc1.ns1.svc.cluster.local."))] == [
        "svc1.ns1.svc.cluster.local.",
        "*.ns1.svc.cluster.local.",
        "*.svc.cluster.local.",
        "*.cluster.local.",
        "*.local.",
    ]


def test_wildcard_hosts_match_get_wildcards() -> None:
    for name in ("svc1.", "svc1.ns1.svc.cluster.local.", "a.b.", "x.y.z.example.com."):
        assert wildcard_hosts(host_text(n(name))) == [host_text(w) for w in get_wildcards(n(name))]


def test_a_long_query_name_builds_no_name_per_wildcard(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 119-label name under the client's namespace has 4 aliases of ~118 wildcards each: they are looked up as
    slices of each alias's text, one text per alias, not a dns.name.Name built and printed per wildcard (that was
    ~470 of each and ~12 ms of the loop per query, so one pod's long names stalled every pod's DNS and tunnels)."""
    s = store()
    qname = n(".".join(["a"] * 115 + ["ns1", "svc", "cluster", "local"]) + ".")
    texts = 0
    to_text = dns.name.Name.to_text

    def counting(self: dns.name.Name, omit_final_dot: bool = False) -> str:
        nonlocal texts
        texts += 1
        return to_text(self, omit_final_dot)

    monkeypatch.setattr(dns.name.Name, "to_text", counting)
    assert s.find_server(CLIENT, qname) is None
    assert 0 < texts <= len(s.aliases(CLIENT, qname)) * 2, texts
    # The same names still match where they should, wildcards included.
    match = s.find_server(CLIENT, n("productpage.ns1.svc.cluster.local."))
    assert match is not None and match.service.hostname == "productpage.ns1.svc.cluster.local"


def test_aliases_strip_search_domains_and_expand() -> None:
    aliases = store().aliases(CLIENT, n("productpage.ns1.ns1.svc.cluster.local."))
    assert aliases[0] == Alias(n("productpage.ns1.ns1.svc.cluster.local."))
    # Stripping ns1.svc.cluster.local leaves productpage.ns1, whose expansion is the service's FQDN.
    assert Alias(n("productpage.ns1."), n("productpage.ns1.")) in aliases
    assert Alias(n("productpage.ns1.svc.cluster.local."), n("productpage.ns1.")) in aliases
    # No duplicates.
    assert len({a.name for a in aliases}) == len(aliases)


def test_client_namespace_drives_short_names() -> None:
    ns2_client = replace(CLIENT, namespace="ns2")
    s = store()
    match = s.find_server(ns2_client, n("example."))
    assert match is not None and match.service.namespace == "ns2"
    assert s.find_server(CLIENT, n("example.")) is None


def test_has_domain_and_trim_domain() -> None:
    domain = n("svc.cluster.local")
    assert has_domain(n("name.ns.svc.cluster.local"), domain)
    assert has_domain(n("NAME.NS.SVC.Cluster.Local."), domain)
    assert not has_domain(n("name.ns.a.different.domain"), domain)
    assert not has_domain(n("cluster.com"), domain)
    assert not has_domain(n("svc.cluster.local"), domain)  # equal is not "in"
    assert not has_domain(n("a.b.c"), n("*.c"))  # wildcards never match
    assert trim_domain(n("name.ns.svc.cluster.local."), domain) == dns.name.Name((b"name", b"ns"))
    assert trim_domain(n("name.ns.a.different.domain"), domain) is None
    assert trim_domain(n("svc.cluster.local"), domain) is None


# -- search domains and resolv.conf -----------------------------------------------------------------------------


def factory() -> SocketFactory:
    return SocketFactory(SocketConfig())


def test_search_domains_per_pod_in_shared_mode() -> None:
    f = SystemForwarder(
        [Nameserver(ipaddress.ip_address("10.0.0.10"))],
        factory(),
        search=[n("istio-system.svc.cluster.local"), n("svc.cluster.local"), n("cluster.local")],
        per_pod_cluster_domain="cluster.local",
    )
    wl = replace(CLIENT, namespace="default-ns")
    assert [d.to_text() for d in f.search_domains(wl)] == [
        "default-ns.svc.cluster.local.",
        "svc.cluster.local.",
        "cluster.local.",
    ]


def test_resolv_conf_and_mode(tmp_path: Path) -> None:
    conf = tmp_path / "resolv.conf"
    conf.write_text(
        "# comment\nnameserver 10.96.0.10\nnameserver fd00::10\n"
        "search team.svc.cluster.local svc.cluster.local cluster.local\noptions ndots:5 timeout:3\n"
    )
    rc = ResolvConf.load(conf)
    assert [str(s) for s in rc.nameservers] == ["10.96.0.10:53", "[fd00::10]:53"]
    assert [d.to_text() for d in rc.search] == ["team.svc.cluster.local.", "svc.cluster.local.", "cluster.local."]
    assert rc.timeout == 3

    dedicated = forwarder_for_mode(ProxyMode.DEDICATED, "cluster.local", factory(), conf)
    assert [d.to_text() for d in dedicated.search_domains(CLIENT)] == [d.to_text() for d in rc.search]
    shared = forwarder_for_mode(ProxyMode.SHARED, "corp.example", factory(), conf)
    assert [d.to_text() for d in shared.search_domains(CLIENT)] == [
        "ns1.svc.corp.example.",
        "svc.corp.example.",
        "corp.example.",
    ]
    assert shared.nameservers == rc.nameservers and shared.timeout == 3


def test_missing_or_broken_resolv_conf_means_no_nameservers(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    rc = ResolvConf.load(tmp_path / "absent")
    assert rc.nameservers == () and rc.search == ()
    bad = tmp_path / "bad.conf"
    bad.write_text("nameserver not-an-ip\n")
    assert ResolvConf.load(bad).nameservers == ()
    assert "forwarded queries will get SERVFAIL" in caplog.text
