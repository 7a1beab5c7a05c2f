"""The answer cache of forwarded DNS answers: its rules on built messages (pure, with a fake clock), then the DNS
proxy as ztunnel builds it (``DnsProxy.from_config``: a resolv.conf naming a real DNS server on port 53 of a
loopback address) answering repeated questions over UDP and TCP without asking upstream again."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from pathlib import Path

import dns.asyncquery
import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rdatatype
import dns.rrset
import pytest

from tests.dns.helpers import CLIENT, new_state
from ztunnel.config import from_env
from ztunnel.dns.cache import MAX_NEGATIVE_TTL, MAX_TTL, AnswerCache, cache_ttl
from ztunnel.dns.server import DnsProxy
from ztunnel.sockets import SocketConfig, SocketFactory
from ztunnel.testing.dns import UpstreamDns

A, AAAA, TXT = dns.rdatatype.A, dns.rdatatype.AAAA, dns.rdatatype.TXT


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def query(name: str = "www.example.com.", rdtype: dns.rdatatype.RdataType = A) -> dns.message.Message:
    return dns.message.make_query(name, rdtype)


def answer(
    q: dns.message.Message,
    *ttls: int,
    rcode: int = dns.rcode.NOERROR,
    soa: tuple[int, int] | None = None,  # (SOA record TTL, SOA MINIMUM)
) -> dns.message.Message:
    resp = dns.message.make_response(q)
    resp.set_rcode(dns.rcode.Rcode(rcode))
    name = q.question[0].name
    for i, ttl in enumerate(ttls):
        resp.answer.append(dns.rrset.from_text(name, ttl, "IN", "A", f"10.0.{i // 250}.{i % 250 + 1}"))
    if soa is not None:
        ttl, minimum = soa
        resp.authority.append(
            dns.rrset.from_text(
                "example.com.", ttl, "IN", "SOA", f"ns.example.com. admin.example.com. 1 2 3 4 {minimum}"
            )
        )
    return resp


@pytest.mark.parametrize(
    ("ttls", "rcode", "soa", "expect"),
    [
        ((300,), dns.rcode.NOERROR, None, 300),
        ((300, 30), dns.rcode.NOERROR, None, 30),  # the shortest record
        ((10 * 86400,), dns.rcode.NOERROR, None, MAX_TTL),  # capped
        ((0,), dns.rcode.NOERROR, None, 0),  # TTL 0: never cached
        ((), dns.rcode.NXDOMAIN, (600, 60), 60),  # RFC 2308: min(SOA TTL, MINIMUM)
        ((), dns.rcode.NXDOMAIN, (45, 900), 45),
        ((), dns.rcode.NOERROR, (600, 120), 120),  # NODATA, same rule
        ((), dns.rcode.NXDOMAIN, (86400, 86400), MAX_NEGATIVE_TTL),
        ((), dns.rcode.NXDOMAIN, None, 0),  # no SOA: not cached
        ((), dns.rcode.NOERROR, None, 0),
        ((), dns.rcode.SERVFAIL, (600, 60), 0),  # errors never
        ((), dns.rcode.REFUSED, None, 0),
    ],
)
def test_cache_ttl_rules(ttls: tuple[int, ...], rcode: int, soa: tuple[int, int] | None, expect: int) -> None:
    assert cache_ttl(answer(query(), *ttls, rcode=rcode, soa=soa)) == expect


def test_truncated_answers_are_not_cached() -> None:
    q = query()
    a = answer(q, 300)
    a.flags |= dns.flags.TC
    assert cache_ttl(a) == 0
    assert not AnswerCache().put(q, a)


def test_hit_lowers_ttls_and_entries_expire() -> None:
    clock = Clock()
    cache = AnswerCache(clock=clock)
    q = query()
    assert cache.get(q) is None
    assert cache.put(q, answer(q, 300, 100, soa=(500, 500)))
    clock.now += 40.7
    again = query("WWW.Example.COM.")  # names compare without case
    hit = cache.get(again)
    assert hit is not None and hit.id == again.id
    assert sorted(r.ttl for r in hit.answer) == [60, 260]  # 40 whole seconds spent in the cache
    assert [r.ttl for r in hit.authority] == [460]
    clock.now += 60  # past the shortest TTL (100): the whole answer is gone
    assert cache.get(q) is None
    assert len(cache) == 0 and cache.size_bytes == 0


def test_key_is_question_type_and_dnssec_bits() -> None:
    cache = AnswerCache(clock=Clock())
    q = query()
    cache.put(q, answer(q, 300))
    assert cache.get(query(rdtype=AAAA)) is None
    do = dns.message.make_query("www.example.com.", A, want_dnssec=True)
    assert cache.get(do) is None
    cd = query()
    cd.flags |= dns.flags.CD
    assert cache.get(cd) is None
    assert cache.get(query()) is not None


def test_answer_to_another_question_is_not_kept() -> None:
    q = query()
    assert not AnswerCache().put(q, answer(query("other.example.com."), 300))


def test_bounded_by_entries_least_recently_used_first() -> None:
    cache = AnswerCache(max_entries=3, clock=Clock())
    names = [f"n{i}.example.com." for i in range(4)]
    for name in names[:3]:
        cache.put(query(name), answer(query(name), 300))
    assert cache.get(query(names[0])) is not None  # n0 used: n1 is now the oldest
    cache.put(query(names[3]), answer(query(names[3]), 300))
    assert len(cache) == 3
    assert cache.get(query(names[1])) is None
    assert all(cache.get(query(n)) is not None for n in (names[0], names[2], names[3]))


def test_bounded_by_bytes() -> None:
    one = query("big.example.com.")
    size = len(answer(one, *([300] * 20)).to_wire())
    cache = AnswerCache(max_bytes=size * 5 + size // 2, clock=Clock())
    for i in range(50):
        q = query(f"big{i}.example.com.")
        cache.put(q, answer(q, *([300] * 20)))
        assert cache.size_bytes <= cache.max_bytes
    assert len(cache) == 5
    assert not cache.put(one, answer(one, *([300] * 2000)))  # larger than the whole cache: not kept


# -- the proxy as ztunnel builds it, a real upstream on port 53 --------------------------------------------------


@pytest.fixture
async def upstream53() -> AsyncIterator[UpstreamDns]:
    ip = f"127.53.{random.randrange(10, 250)}.{random.randrange(2, 250)}"
    try:
        u = await UpstreamDns({"test.example.com": ["1.1.1.1", "2001:db8::1"]}).start(ip, 53)
    except PermissionError:
        pytest.skip("binding port 53 needs root (or CAP_NET_BIND_SERVICE)")
    yield u
    await u.stop()


async def test_proxy_answers_repeated_questions_from_its_cache(upstream53: UpstreamDns, tmp_path: Path) -> None:
    conf = tmp_path / "resolv.conf"
    conf.write_text(f"nameserver {upstream53.host}\noptions timeout:1\n")
    cfg = from_env(
        {
            "ISTIO_META_DNS_PROXY_ADDR": f"{upstream53.host}:0",
            "PROXY_MODE": "dedicated",
            "PROXY_WORKLOAD_INFO": "ns1/client/client",
        }
    )
    proxy = DnsProxy.from_config(cfg, new_state(), lambda: CLIENT, SocketFactory(SocketConfig()), resolv_conf=conf)
    await proxy.start()
    host, port = proxy.udp_address
    try:
        first: dict[str, dns.message.Message] = {}
        for ask in (dns.asyncquery.udp, dns.asyncquery.tcp):
            for name, rdtype in (("test.example.com.", A), ("test.example.com.", AAAA), ("nope.example.com.", A)):
                resp = await ask(dns.message.make_query(name, rdtype), host, port=port, timeout=3)
                key = f"{name}/{rdtype}"
                if key in first:  # the cached answer is the same answer
                    assert resp.rcode() == first[key].rcode()
                    assert [r.to_text() for r in resp.answer] == [r.to_text() for r in first[key].answer]
                first.setdefault(key, resp)
            # TXT for the name: NOERROR without records and without an SOA: never cached.
            await ask(dns.message.make_query("test.example.com.", TXT), host, port=port, timeout=3)
        assert first["test.example.com./1"].answer[0][0].to_text() == "1.1.1.1"
        assert first["nope.example.com./1"].rcode() == dns.rcode.NXDOMAIN
        asked = [(q.question[0].name.to_text(), q.question[0].rdtype) for _, q in upstream53.queries]
        # Once each over UDP; the TCP round came from the cache, except the uncacheable TXT.
        assert sorted(asked) == sorted(
            [
                ("test.example.com.", A),
                ("test.example.com.", AAAA),
                ("nope.example.com.", A),
                ("test.example.com.", TXT),
                ("test.example.com.", TXT),
            ]
        )
    finally:
        await proxy.close()
