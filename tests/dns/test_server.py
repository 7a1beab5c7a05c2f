"""The DNS proxy on real sockets: dnspython and dig as clients, a real DNS server on loopback as the upstream.

Addresses: the proxy listens on 127.0.53.1, upstream servers on 127.0.53.2 and 127.0.53.3 (ports picked by the
kernel), so these tests never clash with other suites.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import re
import shutil
import socket
import struct
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

import dns.asyncquery
import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rdatatype
import pytest

from tests.dns.helpers import CLIENT, PREFERRED, FakeForwarder, new_state, sample_value
from tests.dns.test_handler import CASES, Case, records
from ztunnel.config import SocketAddress
from ztunnel.dns.forwarder import Nameserver, SystemForwarder
from ztunnel.dns.metrics import Metrics
from ztunnel.dns.server import TCP_REQUEST_TIMEOUT, DnsProxy, ResolveError
from ztunnel.proxy.socks5 import Resolver as Socks5Resolver
from ztunnel.sockets import SocketConfig, SocketFactory
from ztunnel.state import ProxyState, StateUpdate
from ztunnel.state.workload import Workload
from ztunnel.testing.dns import UpstreamDns

PROXY_IP = "127.0.53.1"
PROXY_ADDR = SocketAddress(PROXY_IP, 0)
UPSTREAM_IP = "127.0.53.2"
UPSTREAM2_IP = "127.0.53.3"
A, AAAA = dns.rdatatype.A, dns.rdatatype.AAAA
DIG = shutil.which("dig")
needs_dig = pytest.mark.skipif(DIG is None, reason="dig not installed (apt-get install dnsutils; CI installs it)")


class RecordingFactory(SocketFactory):
    """Every socket the proxy creates, as (kind, socket)."""

    def __init__(self, cfg: SocketConfig) -> None:
        super().__init__(cfg)
        self.created: list[tuple[str, socket.socket]] = []

    def tcp(self, family: socket.AddressFamily, *, bind_source: bool = True) -> socket.socket:
        s = super().tcp(family, bind_source=bind_source)
        self.created.append(("tcp", s))
        return s

    def udp(self, family: socket.AddressFamily) -> socket.socket:
        s = super().udp(family)
        self.created.append(("udp", s))
        return s

    def listeners(self, addr: SocketAddress, **kw: Any) -> list[tuple[socket.socket, bool]]:
        out = super().listeners(addr, **kw)
        self.created.extend(("tcp-listener", s) for s, _ in out)
        return out

    def udp_listeners(self, addr: SocketAddress, **kw: Any) -> list[socket.socket]:
        out = super().udp_listeners(addr, **kw)
        self.created.extend(("udp-listener", s) for s in out)
        return out


def make_proxy(
    forwarder: Any = None,
    *,
    state: ProxyState | None = None,
    client: Callable[[], Workload | None] = lambda: CLIENT,
    addr: SocketAddress = PROXY_ADDR,
    sockets: SocketFactory | None = None,
    metrics: Metrics | None = None,
    **kw: Any,
) -> DnsProxy:
    return DnsProxy(
        addr,
        state if state is not None else new_state(),
        client,
        forwarder if forwarder is not None else FakeForwarder(),
        sockets if sockets is not None else SocketFactory(SocketConfig()),
        preferred_service_namespace=PREFERRED,
        metrics=metrics,
        **kw,
    )


@pytest.fixture
async def proxy() -> AsyncIterator[DnsProxy]:
    p = make_proxy()
    await p.start()
    yield p
    await p.close()


@pytest.fixture
async def upstream() -> AsyncIterator[UpstreamDns]:
    u = await UpstreamDns({"test.example.com": ["1.1.1.1", "2001:db8::1"]}).start(UPSTREAM_IP)
    yield u
    await u.stop()


async def udp(p: DnsProxy, name: str, rdtype: dns.rdatatype.RdataType = A, **kw: Any) -> dns.message.Message:
    host, port = p.udp_address
    return await dns.asyncquery.udp(dns.message.make_query(name, rdtype, **kw), host, port=port, timeout=3)


async def tcp(p: DnsProxy, name: str, rdtype: dns.rdatatype.RdataType = A, **kw: Any) -> dns.message.Message:
    host, port = p.tcp_address
    return await dns.asyncquery.tcp(dns.message.make_query(name, rdtype, **kw), host, port=port, timeout=3)


def system_forwarder(*servers: UpstreamDns, timeout: float = 1.0, lifetime: float = 2.0) -> SystemForwarder:
    return SystemForwarder(
        [Nameserver(ipaddress.ip_address(s.host), s.port) for s in servers],
        SocketFactory(SocketConfig()),
        timeout=timeout,
        lifetime=lifetime,
    )


# -- name forms over both transports ---------------------------------------------------------------------------


async def test_every_name_form_over_udp_and_tcp(proxy: DnsProxy) -> None:
    async def check(case: Case, transport: str) -> None:
        ask = udp if transport == "udp" else tcp
        resp = await ask(proxy, case.host, case.qtype)
        where = f"[{transport}] {case.name}"
        assert resp.rcode() == case.code, where
        assert bool(resp.flags & dns.flags.AA) == case.authoritative, where
        assert resp.flags & dns.flags.RA, where
        if case.code == dns.rcode.NOERROR:
            assert sorted(records(resp)) == sorted(case.answers), where
            assert records(resp, "additional") == case.additionals, where

    await asyncio.gather(*(check(c, t) for c in CASES for t in ("udp", "tcp")))


async def test_same_port_for_udp_and_tcp(proxy: DnsProxy) -> None:
    assert proxy.udp_address == proxy.tcp_address
    assert proxy.udp_address[0] == PROXY_IP


async def test_localhost_binds_v4_and_v6() -> None:
    p = make_proxy(addr=SocketAddress("localhost", 0))
    await p.start()
    try:
        hosts = {h for h, _ in p.udp_addresses} | {h for h, _ in p.tcp_addresses}
        ports = {port for _, port in p.udp_addresses + p.tcp_addresses}
        assert "127.0.0.1" in hosts and len(ports) == 1
        for host, port in p.udp_addresses:
            q = dns.message.make_query("productpage.ns1.", A)
            resp = await dns.asyncquery.udp(q, host, port=port, timeout=3)
            assert [rd.to_text() for r in resp.answer for rd in r] == ["9.9.9.9"]
    finally:
        await p.close()


# -- dig ---------------------------------------------------------------------------------------------------------


async def dig(p: DnsProxy, *args: str) -> tuple[str, set[str], list[tuple[str, int, str, str]]]:
    """(status, header flags, answer records as (name, ttl, type, data))."""
    host, port = p.udp_address
    assert DIG is not None
    proc = await asyncio.create_subprocess_exec(
        DIG, f"@{host}", "-p", str(port), "+time=3", "+tries=1", *args, stdout=asyncio.subprocess.PIPE
    )
    out, _ = await proc.communicate()
    text = out.decode()
    assert proc.returncode == 0, text
    status = re.search(r"status: (\w+)", text)
    flags = re.search(r";; flags: ([a-z ]+);", text)
    assert status is not None and flags is not None, text
    answers: list[tuple[str, int, str, str]] = []
    section = re.search(r";; ANSWER SECTION:\n(.*?)\n\n", text, re.S)
    if section:
        for line in section.group(1).splitlines():
            name, ttl, _cls, rtype, data = line.split(None, 4)
            answers.append((name, int(ttl), rtype, data))
    return status.group(1), set(flags.group(1).split()), answers


@needs_dig
async def test_dig_short_name_and_search_domain_cname(proxy: DnsProxy) -> None:
    status, flags, answers = await dig(proxy, "productpage", "A")
    assert status == "NOERROR" and {"qr", "aa", "rd", "ra"} <= flags
    assert answers == [("productpage.", 30, "A", "9.9.9.9")]

    # What glibc sends for `productpage.ns1` with the ns1 search list first: answered with a CNAME.
    status, flags, answers = await dig(proxy, "+tcp", "productpage.ns1.ns1.svc.cluster.local", "A")
    assert status == "NOERROR" and "aa" in flags
    assert answers == [
        ("productpage.ns1.ns1.svc.cluster.local.", 30, "CNAME", "productpage.ns1."),
        ("productpage.ns1.", 30, "A", "9.9.9.9"),
    ]


@needs_dig
async def test_dig_empty_noerror_nxdomain_and_headless(proxy: DnsProxy) -> None:
    status, flags, answers = await dig(proxy, "ipv4.localhost", "AAAA")
    assert (status, answers) == ("NOERROR", []) and "aa" in flags
    status, flags, answers = await dig(proxy, "example", "A")  # another namespace's short name: forwarded
    assert status == "NXDOMAIN" and "aa" not in flags
    status, _, answers = await dig(proxy, "+tcp", "headless.ns1.svc.cluster.local", "AAAA")
    assert status == "NOERROR"
    assert sorted(a[3] for a in answers) == ["2001:db8::30", "2001:db8::31"]


@needs_dig
async def test_dig_unknown_client_servfail() -> None:
    p = make_proxy(client=lambda: None)
    await p.start()
    try:
        status, _, answers = await dig(p, "productpage.ns1.svc.cluster.local", "A")
        assert (status, answers) == ("SERVFAIL", [])
    finally:
        await p.close()


@needs_dig
async def test_dig_truncation_then_tcp_retry(proxy: DnsProxy) -> None:
    # dig without +ignore retries over TCP on TC, like a stub resolver: it ends with every record.
    status, _, answers = await dig(proxy, "+noedns", "large.ns1.svc.cluster.local", "A")
    assert status == "NOERROR" and len(answers) == 256
    status, flags, answers = await dig(proxy, "+noedns", "+ignore", "large.ns1.svc.cluster.local", "A")
    assert "tc" in flags and 0 < len(answers) < 256


# -- forwarding to a real upstream --------------------------------------------------------------------------------


async def test_forwarding_to_local_upstream(upstream: UpstreamDns) -> None:
    p = make_proxy(system_forwarder(upstream))
    await p.start()
    try:
        for ask in (udp, tcp):
            resp = await ask(p, "test.example.com.")
            assert resp.rcode() == dns.rcode.NOERROR and not resp.flags & dns.flags.AA
            assert [rd.to_text() for r in resp.answer for rd in r] == ["1.1.1.1"]
            resp = await ask(p, "test.example.com.", AAAA)
            assert [rd.to_text() for r in resp.answer for rd in r] == ["2001:db8::1"]
            resp = await ask(p, "fake-blahblahblah.com.")
            assert resp.rcode() == dns.rcode.NXDOMAIN
            assert [r.rdtype for r in resp.authority] == [dns.rdatatype.SOA]  # kept for negative caching
            resp = await ask(p, "test.example.com.", dns.rdatatype.TXT)  # other types are forwarded too
            assert resp.rcode() == dns.rcode.NOERROR and not resp.answer
        # The upstream got the names as asked (no search domains added), with EDNS.
        assert {q.question[0].name.to_text() for _, q in upstream.queries} == {
            "test.example.com.",
            "fake-blahblahblah.com.",
        }
        assert all(q.edns == 0 and q.flags & dns.flags.RD for _, q in upstream.queries)
        # Mesh names never reach the upstream.
        await udp(p, "productpage.ns1.")
        assert len(upstream.queries) == 8
    finally:
        await p.close()


async def test_an_upstream_answer_without_records_counts_as_a_failure(upstream: UpstreamDns) -> None:
    """istio_dns_upstream_failures_total as upstream's: its resolver fails on NXDOMAIN and on NOERROR without
    records (hickory's NoRecordsFound) as on SERVFAIL, and each failure is counted; an answer with records is not."""
    metrics = Metrics()
    p = make_proxy(system_forwarder(upstream), metrics=metrics)
    await p.start()
    try:
        labels = {
            "request_query_type": "a",
            "request_protocol": "udp",
            "source_canonical_service": "client-app",
            "source_canonical_revision": "v1",
        }
        assert (await udp(p, "test.example.com.")).answer
        assert sample_value(metrics, "istio_dns_upstream_failures_total", labels) is None
        assert (await udp(p, "fake-blahblahblah.com.")).rcode() == dns.rcode.NXDOMAIN
        assert sample_value(metrics, "istio_dns_upstream_failures_total", labels) == 1
        txt = await udp(p, "test.example.com.", dns.rdatatype.TXT)
        assert txt.rcode() == dns.rcode.NOERROR and not txt.answer
        txt_labels = {**labels, "request_query_type": "txt"}
        assert sample_value(metrics, "istio_dns_upstream_failures_total", txt_labels) == 1
    finally:
        await p.close()


@needs_dig
async def test_dig_through_proxy_to_upstream(upstream: UpstreamDns) -> None:
    p = make_proxy(system_forwarder(upstream))
    await p.start()
    try:
        status, flags, answers = await dig(p, "test.example.com", "A")
        assert status == "NOERROR" and "aa" not in flags and "ra" in flags
        assert [a[2:] for a in answers] == [("A", "1.1.1.1")]
    finally:
        await p.close()


async def test_upstream_down_is_servfail(upstream: UpstreamDns) -> None:
    metrics = Metrics()
    p = make_proxy(system_forwarder(upstream), metrics=metrics)
    await p.start()
    await upstream.stop()  # nothing listens any more: ICMP port unreachable, an immediate error
    try:
        for ask in (udp, tcp):
            start = time.monotonic()
            resp = await ask(p, "test.example.com.")
            assert resp.rcode() == dns.rcode.SERVFAIL and not resp.answer
            assert time.monotonic() - start < 1.5
        labels = {
            "request_query_type": "a",
            "request_protocol": "udp",
            "source_canonical_service": "client-app",
            "source_canonical_revision": "v1",
        }
        assert sample_value(metrics, "istio_dns_upstream_failures_total", labels) == 1
        assert sample_value(metrics, "istio_dns_upstream_requests_total", labels) == 1
        assert sample_value(metrics, "istio_dns_requests_total", labels) == 1
        assert sample_value(metrics, "istio_dns_upstream_request_duration_seconds_count", labels) == 1
    finally:
        await p.close()


async def test_silent_upstream_times_out_to_servfail() -> None:
    silent = await UpstreamDns(mode="drop").start(UPSTREAM_IP)
    p = make_proxy(system_forwarder(silent, timeout=0.2, lifetime=0.5))
    await p.start()
    try:
        start = time.monotonic()
        resp = await udp(p, "test.example.com.")
        elapsed = time.monotonic() - start
        assert resp.rcode() == dns.rcode.SERVFAIL
        assert 0.35 < elapsed < 1.5  # two tries of 0.2 s, within the 0.5 s lifetime
        assert len(silent.queries) == 2
    finally:
        await p.close()
        await silent.stop()


async def test_failing_upstream_moves_on_to_the_next(upstream: UpstreamDns) -> None:
    broken = await UpstreamDns(mode="servfail").start(UPSTREAM2_IP)
    p = make_proxy(system_forwarder(broken, upstream))
    await p.start()
    try:
        resp = await udp(p, "test.example.com.")
        assert resp.rcode() == dns.rcode.NOERROR
        assert [rd.to_text() for r in resp.answer for rd in r] == ["1.1.1.1"]
        assert len(broken.queries) == 1
    finally:
        await p.close()
        await broken.stop()
    # Every upstream refusing: the last answer's code is passed on.
    refused = await UpstreamDns(mode="refused").start(UPSTREAM2_IP)
    p = make_proxy(system_forwarder(refused))
    await p.start()
    try:
        assert (await udp(p, "test.example.com.")).rcode() == dns.rcode.REFUSED
    finally:
        await p.close()
        await refused.stop()


async def test_large_upstream_answer_tcp_retry_and_truncation() -> None:
    big = await UpstreamDns({"large.com": [f"240.0.0.{i}" for i in range(256)]}).start(UPSTREAM_IP)
    p = make_proxy(system_forwarder(big))
    await p.start()
    try:
        resp = await tcp(p, "large.com.")
        assert not resp.flags & dns.flags.TC
        assert len([rd for r in resp.answer for rd in r]) == 256
        # The upstream truncated its UDP answer (1232 bytes), so the proxy asked again over TCP.
        assert [t for t, _ in big.queries] == ["udp", "tcp"]

        resp = await udp(p, "large.com.", use_edns=0, payload=1232)
        assert resp.flags & dns.flags.TC
        n = len([rd for r in resp.answer for rd in r])
        # Whole records, as many as 1232 bytes hold (12 header + 15 question + 11 OPT, 16 per A record).
        assert n == (1232 - 12 - 15 - 11) // 16
        resp = await udp(p, "large.com.")
        assert resp.flags & dns.flags.TC and len([rd for r in resp.answer for rd in r]) == (512 - 12 - 15) // 16
    finally:
        await p.close()
        await big.stop()


# -- TCP ---------------------------------------------------------------------------------------------------------


async def read_message(reader: asyncio.StreamReader) -> dns.message.Message:
    (length,) = struct.unpack("!H", await reader.readexactly(2))
    return dns.message.from_wire(await reader.readexactly(length))


async def test_tcp_pipelined_queries(proxy: DnsProxy) -> None:
    reader, writer = await asyncio.open_connection(*proxy.tcp_address)
    names = ["productpage.", "www.bing.com.", "example.ns2.", "nope.example.", "dual.localhost."]
    queries = {}
    payload = b""
    for name in names:
        q = dns.message.make_query(name, A)
        queries[q.id] = name
        wire = q.to_wire()
        payload += struct.pack("!H", len(wire)) + wire
    writer.write(payload[:7])  # split mid-message
    await writer.drain()
    writer.write(payload[7:])
    got = {}
    for _ in names:
        resp = await asyncio.wait_for(read_message(reader), 3)
        got[resp.id] = resp.rcode()
    assert set(got) == set(queries)
    assert got[next(i for i, nm in queries.items() if nm == "nope.example.")] == dns.rcode.NXDOMAIN
    writer.close()


async def test_tcp_idle_connections_close_after_5s(proxy: DnsProxy) -> None:
    assert TCP_REQUEST_TIMEOUT == 5.0

    async def closed_after(send: bytes) -> float:
        reader, writer = await asyncio.open_connection(*proxy.tcp_address)
        start = time.monotonic()
        if send:
            writer.write(send)
        try:
            while await asyncio.wait_for(reader.read(65536), 8):
                pass
        finally:
            writer.close()
        return time.monotonic() - start

    q = dns.message.make_query("productpage.", A).to_wire()
    idle, partial = await asyncio.gather(closed_after(b""), closed_after(struct.pack("!H", len(q)) + q[:5]))
    assert 4.8 < idle < 6.5
    assert 4.8 < partial < 6.5


async def test_tcp_timeout_waits_for_a_pending_answer() -> None:
    class Slow(FakeForwarder):
        async def forward(self, request: dns.message.Message) -> dns.message.Message:
            await asyncio.sleep(0.6)
            return await super().forward(request)

    p = make_proxy(Slow(), tcp_timeout=0.2)
    await p.start()
    try:
        resp = await tcp(p, "www.bing.com.")
        assert [rd.to_text() for r in resp.answer for rd in r] == ["1.1.1.1"]
    finally:
        await p.close()


# -- clients, sockets, SOCKS5 ---------------------------------------------------------------------------------------


async def test_client_appearing_later_is_answered() -> None:
    state = ProxyState()
    local: list[Workload] = []
    p = make_proxy(state=state, client=lambda: local[0] if local else None)
    await p.start()
    try:
        assert (await udp(p, "productpage.ns1.")).rcode() == dns.rcode.SERVFAIL
        fresh = new_state()
        state.apply(StateUpdate(workloads=list(fresh.workloads), services=list(fresh.services)))
        local.append(CLIENT)
        resp = await udp(p, "productpage.ns1.")
        assert [rd.to_text() for r in resp.answer for rd in r] == ["9.9.9.9"]
        # A client in another namespace sees that namespace's short names.
        local[0] = replace(CLIENT, namespace="ns2")
        resp = await udp(p, "example.")
        assert [rd.to_text() for r in resp.answer for rd in r] == ["10.10.10.10"]
    finally:
        await p.close()


async def test_every_socket_comes_from_the_factory(upstream: UpstreamDns) -> None:
    mark = 1337 if os.geteuid() == 0 else None  # SO_MARK needs CAP_NET_ADMIN
    sockets = RecordingFactory(SocketConfig(mark=mark))
    fwd = SystemForwarder([Nameserver(ipaddress.ip_address(upstream.host), upstream.port)], sockets, timeout=1)
    p = make_proxy(fwd, sockets=sockets)
    await p.start()
    try:
        assert (await udp(p, "test.example.com.")).rcode() == dns.rcode.NOERROR
        kinds = [k for k, _ in sockets.created]
        assert kinds == ["tcp-listener", "udp-listener", "udp"]
        if mark is not None:
            for _, s in sockets.created[:2]:  # the upstream socket is closed by now
                assert s.getsockopt(socket.SOL_SOCKET, 36) == mark
    finally:
        await p.close()


async def test_resolve_for_socks5(proxy: DnsProxy) -> None:
    resolve: Socks5Resolver = proxy.resolve  # the signature SOCKS5 takes
    assert await resolve("productpage.ns1") == [ipaddress.ip_address("9.9.9.9")]
    assert await resolve("dual.localhost") == [
        ipaddress.ip_address("2.2.2.2"),
        ipaddress.ip_address("2001:db8::ff00:42:8329"),
    ]
    assert await resolve("www.bing.com") == [ipaddress.ip_address("1.1.1.1")]  # forwarded
    assert await resolve("nope.example") == []
    with pytest.raises(ResolveError):
        await resolve("a..b")


async def test_resolve_errors_are_oserrors() -> None:
    p = make_proxy(client=lambda: None)
    with pytest.raises(OSError, match="SERVFAIL"):
        await p.resolve("productpage.ns1")
    p = make_proxy(FakeForwarder(fail=True))
    with pytest.raises(OSError, match="SERVFAIL"):
        await p.resolve("www.bing.com")


async def test_queries_wait_for_the_proxied_workload_to_appear() -> None:
    known: list[Workload] = []
    appeared = asyncio.Event()

    async def wait() -> Workload | None:
        await appeared.wait()
        return known[0]

    p = make_proxy(client=lambda: known[0] if known else None, wait_local_workload=wait, local_workload_wait=2.0)
    await p.start()
    try:
        loop = asyncio.get_running_loop()

        def appear() -> None:
            known.append(CLIENT)
            appeared.set()

        loop.call_later(0.3, appear)
        start = time.monotonic()
        udp_resp, tcp_resp, resolved = await asyncio.gather(
            udp(p, "productpage.ns1."), tcp(p, "www.bing.com."), p.resolve("productpage.ns1")
        )
        assert time.monotonic() - start >= 0.25
        assert [rd.to_text() for r in udp_resp.answer for rd in r] == ["9.9.9.9"]
        assert [rd.to_text() for r in tcp_resp.answer for rd in r] == ["1.1.1.1"]  # forwarded after the wait
        assert resolved == [ipaddress.ip_address("9.9.9.9")]
    finally:
        await p.close()


async def test_waiting_for_the_proxied_workload_gives_up_with_servfail() -> None:
    async def never() -> Workload | None:
        await asyncio.Event().wait()
        return None

    p = make_proxy(client=lambda: None, wait_local_workload=never, local_workload_wait=0.3)
    await p.start()
    try:
        start = time.monotonic()
        resp = await udp(p, "productpage.ns1.")
        assert resp.rcode() == dns.rcode.SERVFAIL
        assert 0.25 < time.monotonic() - start < 2
        # Garbage is still answered at once (FORMERR), without waiting.
        host, port = p.udp_address
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.setblocking(False)
            s.sendto(b"\x12\x34" + bytes(10) + b"\xff\xff", (host, port))
            wire = await asyncio.wait_for(asyncio.get_running_loop().sock_recv(s, 512), 0.2)
            assert dns.message.from_wire(wire).rcode() == dns.rcode.FORMERR
    finally:
        await p.close()
