"""The sans-IO DNS handler: request bytes in, reply bytes (or a forward) out, against the test mesh.

The name-form table is upstream's ``dns/server.rs`` ``lookup`` test, case by case.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import dns.flags
import dns.message
import dns.name
import dns.opcode
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import pytest

from tests.dns.helpers import CLIENT, LARGE_VIPS, PREFERRED, FakeForwarder, new_state, sample_value
from ztunnel.dns.handler import Forward, Handler, Reply, Transport, encode
from ztunnel.dns.metrics import Metrics
from ztunnel.dns.resolver import Store
from ztunnel.state.workload import Workload

A, AAAA = dns.rdatatype.A, dns.rdatatype.AAAA


def make_handler(
    forwarder: FakeForwarder | None = None, *, ipv6: bool = True, seed: int | None = None
) -> tuple[Handler, FakeForwarder, Metrics]:
    fwd = forwarder or FakeForwarder()
    metrics = Metrics()
    store = Store(
        new_state(),
        "cluster.local",
        fwd.search_domains,
        preferred_service_namespace=PREFERRED,
        ipv6_enabled=ipv6,
        rng=random.Random(seed),
    )
    return Handler(store, metrics), fwd, metrics


async def ask(
    handler: Handler,
    fwd: FakeForwarder,
    query: dns.message.Message,
    transport: Transport = Transport.UDP,
    client: Workload | None = CLIENT,
) -> dns.message.Message:
    """Run one query through the handler; a forward goes to the fake forwarder (as the server would)."""
    out = handler.handle(query.to_wire(), transport, client)
    assert out is not None
    if isinstance(out, Forward):
        try:
            upstream = await fwd.forward(out.request)
        except Exception:
            upstream = None
        wire = encode(handler.forwarded(out, upstream), out.request, transport)
    else:
        assert isinstance(out, Reply)
        wire = out.wire
    if transport is Transport.UDP:
        assert len(wire) <= max(512, query.payload if query.edns >= 0 else 512)
    resp = dns.message.from_wire(wire)
    assert resp.id == query.id
    assert resp.flags & dns.flags.QR
    return resp


def records(resp: dns.message.Message, section: str = "answer") -> list[tuple[str, str, str]]:
    return [
        (rrset.name.to_text(), dns.rdatatype.to_text(rrset.rdtype), rd.to_text())
        for rrset in getattr(resp, section)
        for rd in rrset
    ]


def a(name: str, addr: str) -> tuple[str, str, str]:
    return (name, "A", addr)


def aaaa(name: str, addr: str) -> tuple[str, str, str]:
    return (name, "AAAA", addr)


def cname(name: str, target: str) -> tuple[str, str, str]:
    return (name, "CNAME", target)


@dataclass
class Case:
    name: str
    host: str
    qtype: dns.rdatatype.RdataType = A
    code: int = dns.rcode.NOERROR
    authoritative: bool = True
    answers: list[tuple[str, str, str]] = field(default_factory=list)
    additionals: list[tuple[str, str, str]] = field(default_factory=list)


def forwarded_nx(name: str, host: str, qtype: dns.rdatatype.RdataType = A) -> Case:
    """Not the mesh's: forwarded, and the fake upstream says NXDOMAIN."""
    return Case(name, host, qtype, code=dns.rcode.NXDOMAIN, authoritative=False)


CASES = [
    forwarded_nx("unsupported record type is forwarded", "productpage.ns1.", dns.rdatatype.NS),
    Case("non k8s host in local cache", "www.google.com", answers=[a("www.google.com.", "1.1.1.1")]),
    Case(
        "non k8s host with search namespace yields cname+A",
        "www.google.com.ns1.svc.cluster.local.",
        answers=[
            cname("www.google.com.ns1.svc.cluster.local.", "www.google.com."),
            a("www.google.com.", "1.1.1.1"),
        ],
    ),
    Case(
        "non k8s host not in local cache is forwarded",
        "www.bing.com",
        authoritative=False,
        answers=[a("www.bing.com.", "1.1.1.1")],
        additionals=[aaaa("www.bing.com.", "::1")],
    ),
    Case(
        "k8s fqdn", "productpage.ns1.svc.cluster.local.", answers=[a("productpage.ns1.svc.cluster.local.", "9.9.9.9")]
    ),
    Case("k8s name.namespace", "productpage.ns1.", answers=[a("productpage.ns1.", "9.9.9.9")]),
    Case("k8s short name", "productpage.", answers=[a("productpage.", "9.9.9.9")]),
    Case(
        "k8s name.namespace with search namespace yields cname+A",
        "productpage.ns1.ns1.svc.cluster.local.",
        answers=[cname("productpage.ns1.ns1.svc.cluster.local.", "productpage.ns1."), a("productpage.ns1.", "9.9.9.9")],
    ),
    Case("AAAA for an IPv4 service via search namespace is empty", "productpage.ns1.ns1.svc.cluster.local.", AAAA),
    Case("other namespace name.namespace", "example.ns2.", answers=[a("example.ns2.", "10.10.10.10")]),
    Case(
        "other namespace fqdn",
        "example.ns2.svc.cluster.local.",
        answers=[a("example.ns2.svc.cluster.local.", "10.10.10.10")],
    ),
    forwarded_nx("NAMESPACE visibility: other namespace's service is forwarded", "nslocal.ns2.svc.cluster.local."),
    Case(
        "NAMESPACE visibility: own namespace's service resolves",
        "nslocalsame.ns1.svc.cluster.local.",
        answers=[a("nslocalsame.ns1.svc.cluster.local.", "10.10.10.241")],
    ),
    Case("other namespace name.namespace.svc", "example.ns2.svc.", answers=[a("example.ns2.svc.", "10.10.10.10")]),
    forwarded_nx("other namespace short name is forwarded", "example."),
    Case(
        "remote cluster domain fqdn",
        "details.ns2.svc.cluster.remote.",
        answers=[a("details.ns2.svc.cluster.remote.", f"{i}.{i}.{i}.{i}") for i in (11, 12, 13, 14)],
    ),
    forwarded_nx("remote cluster domain name.namespace is forwarded", "details.ns2."),
    Case("A query returns A records only", "dual.localhost.", answers=[a("dual.localhost.", "2.2.2.2")]),
    Case(
        "AAAA query returns AAAA only",
        "dual.localhost.",
        AAAA,
        answers=[aaaa("dual.localhost.", "2001:db8::ff00:42:8329")],
    ),
    Case("A for an IPv6-only host is empty NOERROR", "ipv6.localhost."),
    Case("AAAA for an IPv4-only host is empty NOERROR", "ipv4.localhost.", AAAA),
    Case("wildcard", "foo.wildcard.", answers=[a("foo.wildcard.", "10.10.10.10")]),
    Case("more specific wildcard", "a.b.wildcard.", answers=[a("a.b.wildcard.", "11.11.11.11")]),
    Case("wildcard with domain", "foo.svc.mesh.company.net.", answers=[a("foo.svc.mesh.company.net.", "10.1.2.3")]),
    Case(
        "wildcard with namespace and domain",
        "foo.foons.svc.mesh.company.net.",
        answers=[a("foo.foons.svc.mesh.company.net.", "10.1.2.3")],
    ),
    Case(
        "wildcard via search domain: no CNAME, the asked name",
        "foo.svc.mesh.company.net.ns1.svc.cluster.local.",
        answers=[a("foo.svc.mesh.company.net.ns1.svc.cluster.local.", "10.1.2.3")],
    ),
    Case("no VIP on the client's network: empty", "nw2-only.ns1.svc.cluster.local."),
    Case(
        "only the client network's VIP",
        "both-networks.ns1.svc.cluster.local.",
        answers=[a("both-networks.ns1.svc.cluster.local.", "21.21.21.21")],
    ),
    Case(
        "headless: endpoint IPs (A)",
        "headless.ns1.svc.cluster.local.",
        answers=[
            a("headless.ns1.svc.cluster.local.", "30.30.30.30"),
            a("headless.ns1.svc.cluster.local.", "31.31.31.31"),
        ],
    ),
    Case(
        "headless: endpoint IPs (AAAA)",
        "headless.ns1.svc.cluster.local.",
        AAAA,
        answers=[
            aaaa("headless.ns1.svc.cluster.local.", "2001:db8::30"),
            aaaa("headless.ns1.svc.cluster.local.", "2001:db8::31"),
        ],
    ),
    Case(
        "headless IPv6-only service: AAAA",
        "headless-ipv6.ns1.svc.cluster.local.",
        AAAA,
        answers=[aaaa("headless-ipv6.ns1.svc.cluster.local.", "2001:db8::33")],
    ),
    Case("headless IPv6-only service: A is empty", "headless-ipv6.ns1.svc.cluster.local."),
    Case(
        "headless IPv4-only service: A",
        "headless-ipv4.ns1.svc.cluster.local.",
        answers=[a("headless-ipv4.ns1.svc.cluster.local.", "34.34.34.34")],
    ),
    Case("headless IPv4-only service: AAAA is empty", "headless-ipv4.ns1.svc.cluster.local.", AAAA),
    forwarded_nx("pod fqdn is not answered (upstream TODO)", "headless.pod0.ns1.svc.cluster.local."),
    forwarded_nx("pod name.domain.ns is not answered", "headless.pod0.ns1."),
    forwarded_nx("headless external without endpoints is forwarded", "headless-no-endpoints.example.com"),
    forwarded_nx("headless external is forwarded", "headless.example.com"),
    Case(
        "preferred namespace wins when the local one has none",
        "preferred.io.",
        answers=[a("preferred.io.", "10.10.10.211")],
    ),
    Case("client namespace wins", "everywhere.io.", answers=[a("everywhere.io.", "10.10.10.112")]),
    Case("canonical wins without a local one", "canonical.svc", answers=[a("canonical.svc.", "10.10.10.141")]),
    Case(
        "local namespace beats canonical", "canonical.with.local", answers=[a("canonical.with.local.", "10.10.10.150")]
    ),
]


@pytest.mark.parametrize("transport", list(Transport), ids=lambda t: t.value)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
async def test_lookup(case: Case, transport: Transport) -> None:
    handler, fwd, _ = make_handler()
    query = dns.message.make_query(case.host, case.qtype)
    resp = await ask(handler, fwd, query, transport)
    assert resp.rcode() == case.code
    assert bool(resp.flags & dns.flags.AA) == case.authoritative
    assert resp.flags & dns.flags.RA and resp.flags & dns.flags.RD
    assert [(q.name, q.rdtype) for q in resp.question] == [(query.question[0].name, case.qtype)]
    if case.code == dns.rcode.NOERROR:
        got = records(resp)
        if case.authoritative:
            # Addresses are shuffled; a CNAME (if any) comes first.
            assert got[: len(got) - len(case.answers)] == []
            cnames = [r for r in case.answers if r[1] == "CNAME"]
            assert got[: len(cnames)] == cnames
            assert sorted(got) == sorted(case.answers)
            assert all(rrset.ttl == 30 for rrset in resp.answer)
        else:
            assert got == case.answers
        assert records(resp, "additional") == case.additionals
    forwarded = not case.authoritative
    assert (len(fwd.forwarded) == 1) is forwarded


async def test_unknown_client_gets_servfail() -> None:
    handler, fwd, metrics = make_handler()
    resp = await ask(handler, fwd, dns.message.make_query("productpage.ns1.svc.cluster.local.", A), client=None)
    assert resp.rcode() == dns.rcode.SERVFAIL
    assert not resp.answer and not fwd.forwarded
    labels = {
        "request_query_type": "a",
        "request_protocol": "udp",
        "source_canonical_service": "unknown",
        "source_canonical_revision": "unknown",
    }
    assert sample_value(metrics, "istio_dns_requests_total", labels) == 1


async def test_unknown_client_servfail_also_for_forwardable_names() -> None:
    handler, fwd, _ = make_handler()
    resp = await ask(handler, fwd, dns.message.make_query("www.bing.com.", A), client=None)
    assert resp.rcode() == dns.rcode.SERVFAIL and not fwd.forwarded


async def test_forward_failure_is_servfail() -> None:
    handler, fwd, _ = make_handler(FakeForwarder(fail=True))
    resp = await ask(handler, fwd, dns.message.make_query("www.bing.com.", A))
    assert resp.rcode() == dns.rcode.SERVFAIL
    assert not resp.flags & dns.flags.AA


async def test_answer_echoes_the_asked_case() -> None:
    handler, fwd, _ = make_handler()
    resp = await ask(handler, fwd, dns.message.make_query("ProductPage.NS1.", A))
    assert resp.rcode() == dns.rcode.NOERROR and resp.flags & dns.flags.AA
    assert [(r.name.to_text(), rd.to_text()) for r in resp.answer for rd in r] == [("ProductPage.NS1.", "9.9.9.9")]


async def test_addresses_are_shuffled() -> None:
    handler, fwd, _ = make_handler(seed=7)
    orders = set()
    for _ in range(10):
        resp = await ask(handler, fwd, dns.message.make_query("many.ns1.svc.cluster.local.", A))
        got = tuple(rd.to_text() for r in resp.answer for rd in r)
        assert sorted(got) == sorted(f"10.20.0.{i}" for i in range(1, 21))
        orders.add(got)
    assert len(orders) > 1


async def test_ipv6_disabled_answers_no_aaaa() -> None:
    handler, fwd, _ = make_handler(ipv6=False)
    resp = await ask(handler, fwd, dns.message.make_query("dual.localhost.", AAAA))
    assert resp.rcode() == dns.rcode.NOERROR and resp.flags & dns.flags.AA and not resp.answer
    resp = await ask(handler, fwd, dns.message.make_query("headless.ns1.svc.cluster.local.", AAAA))
    assert resp.rcode() == dns.rcode.NOERROR and not resp.answer


async def test_non_in_class_is_forwarded() -> None:
    handler, fwd, _ = make_handler()
    resp = await ask(handler, fwd, dns.message.make_query("productpage.ns1.", A, rdclass=dns.rdataclass.CH))
    assert fwd.forwarded and resp.rcode() == dns.rcode.NXDOMAIN


# -- protocol rules -------------------------------------------------------------------------------------------------


def test_opcode_other_than_query_is_notimp() -> None:
    handler, _, _ = make_handler()
    query = dns.message.make_query("productpage.", A)
    query.set_opcode(dns.opcode.NOTIFY)
    out = handler.handle(query.to_wire(), Transport.UDP, CLIENT)
    assert isinstance(out, Reply)
    resp = dns.message.from_wire(out.wire)
    assert resp.rcode() == dns.rcode.NOTIMP and resp.opcode() == dns.opcode.NOTIFY and resp.id == query.id


@pytest.mark.parametrize("count", [0, 2])
def test_not_exactly_one_question_is_formerr(count: int) -> None:
    handler, _, _ = make_handler()
    query = dns.message.make_query("productpage.", A)
    query.question = query.question * count
    out = handler.handle(query.to_wire(), Transport.UDP, CLIENT)
    assert isinstance(out, Reply)
    assert dns.message.from_wire(out.wire).rcode() == dns.rcode.FORMERR


def test_unparseable_with_header_is_formerr_and_echoes_id() -> None:
    handler, _, _ = make_handler()
    wire = bytearray(dns.message.make_query("productpage.", A, id=0x1234).to_wire())
    wire[5] = 9  # QDCOUNT 9, only one question present
    out = handler.handle(bytes(wire), Transport.UDP, CLIENT)
    assert isinstance(out, Reply)
    resp = dns.message.from_wire(out.wire)
    assert resp.id == 0x1234 and resp.rcode() == dns.rcode.FORMERR and resp.flags & dns.flags.QR


@pytest.mark.parametrize("wire", [b"", b"\x12", b"\x00" * 11], ids=["empty", "1 byte", "11 bytes"])
def test_shorter_than_a_header_is_dropped(wire: bytes) -> None:
    handler, _, _ = make_handler()
    assert handler.handle(wire, Transport.UDP, CLIENT) is None


def test_responses_are_never_answered() -> None:
    # Answering a response (even with FORMERR) could make two servers bounce messages forever.
    handler, _, _ = make_handler()
    query = dns.message.make_query("productpage.", A)
    resp = dns.message.make_response(query)
    assert handler.handle(resp.to_wire(), Transport.UDP, CLIENT) is None
    assert handler.handle(resp.to_wire()[:13], Transport.UDP, CLIENT) is None


async def test_edns_is_echoed_with_at_least_512() -> None:
    handler, fwd, _ = make_handler()
    for payload, expected in ((4096, 4096), (100, 512), (1232, 1232)):
        query = dns.message.make_query("productpage.", A, use_edns=0, payload=payload, want_dnssec=True)
        resp = await ask(handler, fwd, query)
        assert resp.edns == 0 and resp.payload == expected
        assert resp.ednsflags & dns.flags.DO
    resp = await ask(handler, fwd, dns.message.make_query("productpage.", A, use_edns=False))
    assert resp.edns == -1


async def test_large_answer_is_truncated_over_udp_only() -> None:
    handler, fwd, _ = make_handler()
    name = "large.ns1.svc.cluster.local."
    everything = sorted(str(v.address) for v in LARGE_VIPS)

    resp = await ask(handler, fwd, dns.message.make_query(name, A, use_edns=False), Transport.UDP)
    assert resp.flags & dns.flags.TC
    plain = [rd.to_text() for r in resp.answer for rd in r]
    assert 0 < len(plain) < 256

    resp = await ask(handler, fwd, dns.message.make_query(name, A, use_edns=0, payload=1232), Transport.UDP)
    assert resp.flags & dns.flags.TC
    # 1232 bytes hold more 16-byte A records than 512 do: whole records are kept, as many as fit.
    assert len(plain) < len([rd for r in resp.answer for rd in r]) < 256

    resp = await ask(handler, fwd, dns.message.make_query(name, A, use_edns=False), Transport.TCP)
    assert not resp.flags & dns.flags.TC
    assert sorted(rd.to_text() for r in resp.answer for rd in r) == everything


async def test_metrics() -> None:
    handler, fwd, metrics = make_handler()
    await ask(handler, fwd, dns.message.make_query("productpage.", A))
    await ask(handler, fwd, dns.message.make_query("www.bing.com.", AAAA), Transport.TCP)
    local = {
        "request_query_type": "a",
        "request_protocol": "udp",
        "source_canonical_service": "client-app",
        "source_canonical_revision": "v1",
    }
    fwd_labels = dict(local, request_query_type="aaaa", request_protocol="tcp")
    assert sample_value(metrics, "istio_dns_requests_total", local) == 1
    assert sample_value(metrics, "istio_dns_upstream_requests_total", local) is None
    assert sample_value(metrics, "istio_dns_requests_total", fwd_labels) == 1
    assert sample_value(metrics, "istio_dns_upstream_requests_total", fwd_labels) == 1
    # Only upstream's four families, each "unstable", with upstream's labels and no hostname.
    families = {m.name: m for m in metrics.collect()}
    assert set(families) == {
        "istio_dns_requests",
        "istio_dns_upstream_requests",
        "istio_dns_upstream_failures",
        "istio_dns_upstream_request_duration_seconds",
    }
    for m in families.values():
        assert "unstable" in m.documentation
        for s in m.samples:
            assert not {"hostname", "destination_service"} & set(s.labels)
    assert families["istio_dns_upstream_request_duration_seconds"].unit == "seconds"


def test_query_type_label_is_bounded() -> None:
    from ztunnel.dns.metrics import query_type_label

    assert query_type_label(dns.rdatatype.A) == "a"
    assert query_type_label(dns.rdatatype.SRV) == "srv"
    assert {query_type_label(t) for t in range(65280, 65536)} == {"unknown"}
