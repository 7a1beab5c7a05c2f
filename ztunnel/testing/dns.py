"""A small authoritative DNS server on loopback (UDP and TCP), to stand in for the cluster DNS behind the proxy.

It answers A and AAAA from a table, NXDOMAIN (with an SOA, for negative caching) for other names, and over UDP
truncates (TC) to the client's size like a real server. ``mode`` makes it fail on purpose: ``servfail``,
``refused``, or ``drop`` (never answer). Every query it gets is recorded, with the address it came from.
"""

from __future__ import annotations

import asyncio
import ipaddress
import struct
from collections.abc import Mapping, Sequence
from typing import cast

import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset

SOA = "ns.upstream.test. admin.upstream.test. 1 3600 600 86400 60"


class UpstreamDns:
    def __init__(self, records: Mapping[str, Sequence[str]] | None = None, *, mode: str = "answer") -> None:
        table = records or {}
        self.records = {dns.name.from_text(k): [ipaddress.ip_address(v) for v in vs] for k, vs in table.items()}
        self.mode = mode
        self.queries: list[tuple[str, dns.message.Message]] = []
        self.sources: list[str] = []  # the source IP of each of ``queries``
        self._udp: asyncio.DatagramTransport | None = None
        self._tcp: asyncio.Server | None = None
        self.host = ""
        self.port = 0

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> UpstreamDns:
        loop = asyncio.get_running_loop()
        self._tcp = await asyncio.start_server(self._tcp_client, host, port)
        self.host, self.port = self._tcp.sockets[0].getsockname()[:2]
        self._udp, _ = await loop.create_datagram_endpoint(lambda: _Udp(self), local_addr=(host, self.port))
        return self

    async def stop(self) -> None:
        if self._udp is not None:
            self._udp.close()
        if self._tcp is not None:
            self._tcp.close()
            await self._tcp.wait_closed()

    def answer(self, query: dns.message.Message) -> dns.message.Message | None:
        if self.mode == "drop":
            return None
        resp = dns.message.make_response(query, recursion_available=True)
        if self.mode == "servfail":
            resp.set_rcode(dns.rcode.SERVFAIL)
            return resp
        if self.mode == "refused":
            resp.set_rcode(dns.rcode.REFUSED)
            return resp
        q = query.question[0]
        ips = self.records.get(q.name)
        if ips is None:
            resp.set_rcode(dns.rcode.NXDOMAIN)
            resp.authority.append(dns.rrset.from_text(dns.name.from_text("upstream.test."), 60, "IN", "SOA", SOA))
            return resp
        resp.flags |= dns.flags.AA
        version = 4 if q.rdtype == dns.rdatatype.A else 6 if q.rdtype == dns.rdatatype.AAAA else 0
        for ip in ips:
            if ip.version == version:
                resp.answer.append(dns.rrset.from_text(q.name, 300, "IN", dns.rdatatype.to_text(q.rdtype), str(ip)))
        return resp

    def _handle(self, data: bytes, transport: str, source: str) -> dns.message.Message | None:
        try:
            query = dns.message.from_wire(data)
        except Exception:
            return None
        self.queries.append((transport, query))
        self.sources.append(source)
        return self.answer(query)

    async def _tcp_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        source = str(writer.get_extra_info("peername")[0])
        try:
            while True:
                (length,) = struct.unpack("!H", await reader.readexactly(2))
                resp = self._handle(await reader.readexactly(length), "tcp", source)
                if resp is not None:
                    wire = resp.to_wire(max_size=65535)
                    writer.write(struct.pack("!H", len(wire)) + wire)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


class _Udp(asyncio.DatagramProtocol):
    def __init__(self, server: UpstreamDns) -> None:
        self.server = server
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str | int, ...]) -> None:
        resp = self.server._handle(data, "udp", str(addr[0]))
        if resp is None or self.transport is None:
            return
        query_payload = resp.request_payload if resp.request_payload else 512
        # One record per RRset, so truncation keeps whole records as real servers do.
        for section in (resp.answer, resp.authority):
            section[:] = [dns.rrset.from_rdata(r.name, r.ttl, rd) for r in section for rd in r]
        self.transport.sendto(resp.to_wire(max_size=max(512, query_payload), prefer_truncation=True), addr)
