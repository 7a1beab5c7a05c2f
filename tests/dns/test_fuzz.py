"""Malformed and odd DNS messages: the handler never raises, and the live server keeps answering.

Bounded Hypothesis runs, reproducible (``derandomize``): 100,000 malformed packets through the pure handler
(1,000 examples of 100 packets, a few seconds), 100,000 more through the proxy's request entry point
(:meth:`DnsProxy.on_request`, forwards and the wait for an unknown client included) on a real event loop, each
batch followed by good queries (one answered locally, one forwarded) that must be answered correctly,
well-formed but unusual queries checked against the protocol rules, and a few thousand malformed packets at the
live server over UDP and TCP, each batch followed by a good query that must still be answered.

A packet is one Hypothesis byte string read as a recipe (one draw per packet keeps 100,000 of them fast): raw
bytes, a valid seed query with bytes overwritten, a seed cut short with junk appended, or a seed under a random
header (flags, opcode, section counts).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import threading
from collections.abc import Iterator

import dns.edns
import dns.flags
import dns.message
import dns.name
import dns.opcode
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.tsigkeyring
import pytest
import uvloop
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.dns.helpers import CLIENT, FakeForwarder, new_state
from tests.dns.test_handler import make_handler
from ztunnel.config import SocketAddress
from ztunnel.dns.handler import MIN_UDP_PAYLOAD, Forward, Reply, Transport, encode
from ztunnel.dns.server import DnsProxy
from ztunnel.sockets import SocketConfig, SocketFactory
from ztunnel.state.workload import Workload

FUZZ_IP = "127.0.53.9"
BATCH = 100
PURE_EXAMPLES = 1000  # x BATCH = 100,000 packets
PROXY_EXAMPLES = 1000  # x BATCH = 100,000 packets through DnsProxy.on_request
LIVE_EXAMPLES = 30  # x BATCH x 2 transports = 6,000 packets


def _seeds() -> list[bytes]:
    names = (
        "productpage.",
        "productpage.ns1.ns1.svc.cluster.local.",
        "foo.svc.mesh.company.net.ns1.svc.cluster.local.",
        "headless.ns1.svc.cluster.local.",
        "large.ns1.svc.cluster.local.",
        "www.bing.com.",
        "*.wildcard.",
        ".".join(["x" * 63] * 3) + ".",
    )
    out = [dns.message.make_query(name, t).to_wire() for name in names for t in (dns.rdatatype.A, dns.rdatatype.AAAA)]
    out.append(dns.message.make_query("productpage.", "A", use_edns=0, payload=4096, want_dnssec=True).to_wire())
    cookie = dns.edns.GenericOption(dns.edns.COOKIE, b"\x01" * 8)
    out.append(dns.message.make_query("example.ns2.", "A", use_edns=0, options=[cookie]).to_wire())
    out.append(dns.message.make_query("example.ns2.", "SRV").to_wire())
    out.append(dns.message.make_query("example.ns2.", "AXFR").to_wire())
    signed = dns.message.make_query("productpage.", "A")
    signed.use_tsig(dns.tsigkeyring.from_text({"key.": "MTIzNDU2Nzg5MDEyMzQ1Ng=="}))
    out.append(signed.to_wire())
    two = dns.message.make_query("productpage.", "A")
    two.question.append(two.question[0])
    out.append(two.to_wire())
    resp = dns.message.make_response(dns.message.make_query("productpage.", "A"))
    out.append(resp.to_wire())  # compression pointers live in responses
    return out


SEEDS = _seeds()


def packet(recipe: bytes) -> bytes:
    if len(recipe) < 2:
        return recipe
    kind, seed, data = recipe[0] % 4, bytearray(SEEDS[recipe[1] % len(SEEDS)]), recipe[2:]
    if kind == 0:
        return data
    if kind == 1:  # overwrite bytes in place
        for i in range(0, len(data) - 1, 2):
            seed[data[i] % len(seed)] = data[i + 1]
        return bytes(seed)
    if kind == 2:  # cut short, append junk
        cut = data[0] % (len(seed) + 1) if data else len(seed) // 2
        return bytes(seed[:cut]) + data[1:]
    header = (data[:10] + bytes(10))[:10]  # random flags, opcode and section counts over a real body
    return bytes(seed[:2]) + header + bytes(seed[12:]) + data[10:]


packets = st.binary(max_size=80).map(packet)
batches = st.lists(packets, min_size=BATCH, max_size=BATCH)
fuzz_settings = settings(
    database=None,
    deadline=None,
    derandomize=True,
    phases=[Phase.generate, Phase.shrink],
    suppress_health_check=list(HealthCheck),
)


def check_reply(wire: bytes, request: bytes, transport: Transport) -> None:
    """A reply is a parseable response to the request's ID that fits the transport."""
    assert len(wire) <= (MIN_UDP_PAYLOAD if transport is Transport.UDP and len(request) < 12 else 65535)
    resp = dns.message.from_wire(wire)
    assert resp.flags & dns.flags.QR
    assert resp.id == struct.unpack_from("!H", request)[0]


# -- the pure handler -----------------------------------------------------------------------------------------


def test_pure_handler_survives_100k_malformed_packets(caplog: pytest.LogCaptureFixture) -> None:
    handler, _, _ = make_handler(seed=1)
    count = 0
    kinds = {"reply": 0, "forward": 0, "dropped": 0}

    @settings(fuzz_settings, max_examples=PURE_EXAMPLES)
    @given(batches)
    def run(batch: list[bytes]) -> None:
        nonlocal count
        for i, pkt in enumerate(batch):
            count += 1
            transport = Transport.TCP if i % 3 == 0 else Transport.UDP
            out = handler.handle(pkt, transport, None if i % 17 == 0 else CLIENT)
            if out is None:
                kinds["dropped"] += 1
            elif isinstance(out, Reply):
                kinds["reply"] += 1
                check_reply(out.wire, pkt, transport)
            else:
                assert isinstance(out, Forward)
                kinds["forward"] += 1
                # No upstream answer, and an upstream answer with records: both render.
                check_reply(encode(handler.forwarded(out, None), out.request, transport), pkt, transport)
                upstream = dns.message.make_response(out.request)
                check_reply(encode(handler.forwarded(out, upstream), out.request, transport), pkt, transport)

    with caplog.at_level(logging.ERROR, logger="ztunnel"):
        run()
    assert count >= 100_000
    # The recipes reach every path, not just the parser's rejections.
    assert all(v > 1000 for v in kinds.values()), kinds
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], "handler raised internally"


# -- the proxy's request path, in process ---------------------------------------------------------------------


def answers(wire: bytes) -> list[str]:
    return [rd.to_text() for r in dns.message.from_wire(wire).answer for rd in r if r.rdtype == dns.rdatatype.A]


def test_proxy_on_request_survives_100k_malformed_packets(caplog: pytest.LogCaptureFixture) -> None:
    """What the UDP and TCP listeners do with each message, without sockets: ``on_request`` with a recording
    send. Every 17th packet arrives while the client is not yet known (the wait-for-workload path); forwards go to
    the fake upstream. After each batch, once its tasks are done, a mesh name and a forwarded name are answered
    correctly, and nothing was left in flight."""
    loop = uvloop.new_event_loop()
    errors: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx))
    known = True

    async def appears() -> Workload:
        return CLIENT  # xDS "delivers" the workload at once: the wait path without the 5 s

    fwd = FakeForwarder()
    proxy = DnsProxy(
        SocketAddress(FUZZ_IP, 0),
        new_state(),
        lambda: CLIENT if known else None,
        fwd,
        SocketFactory(SocketConfig()),
        wait_local_workload=appears,
    )
    count = 0
    kinds = {"sync": 0, "later": 0, "silent": 0}

    async def batch_through_proxy(batch: list[bytes]) -> None:
        nonlocal known, count
        sent: list[list[bytes]] = [[] for _ in batch]
        tasks: list[asyncio.Task[None] | None] = []
        for i, pkt in enumerate(batch):
            known = i % 17 != 0
            transport = Transport.TCP if i % 3 == 0 else Transport.UDP
            task = proxy.on_request(pkt, transport, sent[i].append)
            kinds["sync" if sent[i] else "later" if task is not None else "silent"] += 1
            tasks.append(task)
        known = True
        await asyncio.gather(*(t for t in tasks if t is not None))
        count += len(batch)
        for pkt, replies, task in zip(batch, sent, tasks, strict=True):
            # One answer per request, never two; a request that went on to a task is answered by it.
            assert len(replies) == 1 if task is not None else len(replies) <= 1, (pkt, replies)
            if replies:
                wire = replies[0]  # a response to this request's ID (the full parse is the pure test's job)
                assert len(wire) >= 12 and wire[:2] == pkt[:2] and wire[2] & 0x80, (pkt, wire)
        assert proxy._in_flight == 0
        fwd.forwarded.clear()
        for name, want in (("productpage.ns1.", ["9.9.9.9"]), ("www.bing.com.", ["1.1.1.1"])):
            got: list[bytes] = []
            task = proxy.on_request(dns.message.make_query(name, "A").to_wire(), Transport.UDP, got.append)
            if task is not None:
                await task
            assert len(got) == 1 and answers(got[0]) == want, name

    @settings(fuzz_settings, max_examples=PROXY_EXAMPLES)
    @given(batches)
    def run(batch: list[bytes]) -> None:
        loop.run_until_complete(batch_through_proxy(batch))

    try:
        with caplog.at_level(logging.ERROR, logger="ztunnel"):
            run()
    finally:
        loop.run_until_complete(proxy.close())
        loop.close()
    assert count >= 100_000
    assert all(v > 1000 for v in kinds.values()), kinds  # local answers, forwards/waits, and drops all reached
    assert not errors, errors[:3]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


labels = st.one_of(
    st.sampled_from(["productpage", "ns1", "ns2", "svc", "cluster", "local", "*", "wildcard", "b", "www", "google"]),
    st.text(alphabet="abcXYZ019-_*.\\ \x00\xff", min_size=1, max_size=63).filter(lambda s: len(s.encode()) <= 63),
)


@st.composite
def queries(draw: st.DrawFn) -> dns.message.Message:
    parts = draw(st.lists(labels, min_size=0, max_size=7))
    try:
        name = dns.name.Name([p.encode() for p in parts] + [b""])
    except dns.name.NameTooLong:
        name = dns.name.root
    rdtype = dns.rdatatype.RdataType.make(draw(st.sampled_from([1, 28, 2, 5, 6, 12, 15, 16, 33, 255, 65280])))
    rdclass = dns.rdataclass.RdataClass.make(draw(st.sampled_from([1, 1, 1, 3, 255])))
    q = dns.message.make_query(name, rdtype, rdclass=rdclass)
    q.flags = draw(st.integers(0, 0xFFFF)) & ~dns.flags.QR & 0x87FF  # any flags, opcode set below
    q.set_opcode(
        draw(st.sampled_from([dns.opcode.QUERY] * 4 + [dns.opcode.NOTIFY, dns.opcode.UPDATE, dns.opcode.STATUS]))
    )
    if draw(st.booleans()):
        q.use_edns(0, draw(st.sampled_from([0, dns.flags.DO])), draw(st.integers(0, 65535)))
    return q


@settings(fuzz_settings, max_examples=1500)
@given(queries(), st.sampled_from(list(Transport)), st.booleans())
def test_well_formed_queries_follow_the_protocol_rules(
    q: dns.message.Message, transport: Transport, known_client: bool
) -> None:
    handler, _, _ = _HANDLER
    wire = q.to_wire()
    out = handler.handle(wire, transport, CLIENT if known_client else None)
    assert out is not None
    if isinstance(out, Forward):
        assert known_client and q.opcode() == dns.opcode.QUERY
        wire_out = encode(handler.forwarded(out, None), out.request, transport)
    else:
        wire_out = out.wire
    limit = 65535 if transport is Transport.TCP else (max(512, q.payload) if q.edns >= 0 else 512)
    assert len(wire_out) <= limit
    resp = dns.message.from_wire(wire_out)
    assert resp.id == q.id and resp.flags & dns.flags.QR and resp.flags & dns.flags.RA
    assert resp.opcode() == q.opcode()
    assert (resp.flags & dns.flags.RD) == (q.flags & dns.flags.RD)
    if q.opcode() != dns.opcode.QUERY:
        assert resp.rcode() == dns.rcode.NOTIMP
        return  # an UPDATE's sections may not even parse; its question is not echoed then
    assert [(r.name, r.rdtype, r.rdclass) for r in resp.question] == [(r.name, r.rdtype, r.rdclass) for r in q.question]
    assert (resp.edns >= 0) == (q.edns >= 0)
    if resp.edns >= 0:
        assert resp.payload == max(512, q.payload)
    if not known_client:
        assert resp.rcode() == dns.rcode.SERVFAIL
    if resp.flags & dns.flags.AA:
        # Only A/AAAA of class IN are answered here, with TTL 30.
        assert q.question[0].rdtype in (1, 28) and q.question[0].rdclass == 1
        assert all(r.ttl == 30 for r in resp.answer)
        assert {r.rdtype for r in resp.answer} <= {q.question[0].rdtype, dns.rdatatype.CNAME}


_HANDLER = make_handler(seed=2)


# -- the live server ---------------------------------------------------------------------------------------------


class ServerThread:
    """The proxy on its own uvloop thread, so a synchronous Hypothesis test can throw packets at it."""

    def __init__(self) -> None:
        self.loop = uvloop.new_event_loop()
        self.errors: list[dict[str, object]] = []
        self.thread = threading.Thread(target=self.loop.run_forever, name="dns-fuzz", daemon=True)
        self.proxy = DnsProxy(
            SocketAddress(FUZZ_IP, 0), new_state(), lambda: CLIENT, FakeForwarder(), SocketFactory(SocketConfig())
        )

    def __enter__(self) -> ServerThread:
        self.loop.set_exception_handler(lambda _loop, ctx: self.errors.append(ctx))
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.proxy.start(), self.loop).result(5)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self.proxy.close(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


@pytest.fixture(scope="module")
def live() -> Iterator[ServerThread]:
    with ServerThread() as server:
        yield server


def good_query_over_udp(sock: socket.socket, addr: tuple[str, int]) -> dns.message.Message:
    q = dns.message.make_query("productpage.ns1.", "A")
    sock.sendto(q.to_wire(), addr)
    while True:  # replies to the garbage (FORMERR...) may come first
        resp = dns.message.from_wire(sock.recv(65535))
        if resp.id == q.id and resp.question and resp.question[0].name == q.question[0].name:
            return resp


def recv_message(sock: socket.socket) -> bytes:
    def exactly(n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("closed")
            buf += chunk
        return buf

    (length,) = struct.unpack("!H", exactly(2))
    return exactly(length)


def test_live_server_keeps_answering_after_malformed_packets(
    live: ServerThread, caplog: pytest.LogCaptureFixture
) -> None:
    addr = live.proxy.udp_address
    sent = 0

    @settings(fuzz_settings, max_examples=LIVE_EXAMPLES)
    @given(batches)
    def run(batch: list[bytes]) -> None:
        nonlocal sent
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            udp.settimeout(3)
            for pkt in batch:
                udp.sendto(pkt, addr)
            sent += len(batch)
            resp = good_query_over_udp(udp, addr)
            assert [rd.to_text() for r in resp.answer for rd in r] == ["9.9.9.9"]
        with socket.create_connection(live.proxy.tcp_address, timeout=3) as tcp:
            tcp.sendall(b"".join(struct.pack("!H", len(p)) + p for p in batch))
            sent += len(batch)
            q = dns.message.make_query("productpage.ns1.", "A")
            wire = q.to_wire()
            tcp.sendall(struct.pack("!H", len(wire)) + wire)
            while True:
                resp = dns.message.from_wire(recv_message(tcp))
                if resp.id == q.id and resp.question and resp.question[0].name == q.question[0].name:
                    break
            assert [rd.to_text() for r in resp.answer for rd in r] == ["9.9.9.9"]

    with caplog.at_level(logging.ERROR, logger="ztunnel"):
        run()
    assert sent >= 2 * LIVE_EXAMPLES * BATCH
    assert live.thread.is_alive() and not live.errors
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    # And a fresh client still gets answers.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        udp.settimeout(3)
        assert good_query_over_udp(udp, addr).rcode() == dns.rcode.NOERROR


def test_live_server_survives_raw_tcp_garbage(live: ServerThread) -> None:
    for junk in (b"\xff" * 70000, b"\x00\x00" * 100, b"\x00\x05abc", b"\x10"):
        with socket.create_connection(live.proxy.tcp_address, timeout=3) as tcp:
            tcp.sendall(junk)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        udp.settimeout(3)
        assert good_query_over_udp(udp, live.proxy.udp_address).rcode() == dns.rcode.NOERROR
    assert not live.errors
