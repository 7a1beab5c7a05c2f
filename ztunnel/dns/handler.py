"""The DNS proxy's protocol core (upstream ``dns/handler.rs``): request bytes in, a command out; no I/O.

:meth:`Handler.handle` turns one request (the bytes of a UDP datagram, or of one length-prefixed TCP message) into
one of:

- :class:`Reply`: send these bytes back (a local answer, or an error);
- :class:`Forward`: ask the upstream nameservers, then build the reply with :meth:`Handler.forwarded`;
- ``None``: send nothing (not a DNS request at all, or a *response*: answering those could loop two servers).

The rules, in order:

=====================================  =================================================================
request                                 reply
=====================================  =================================================================
not parseable, header readable          FORMERR, or NOTIMP if not a QUERY (id, opcode echoed, no question)
shorter than a header, or QR set        nothing
opcode other than QUERY                 NOTIMP
not exactly one question                FORMERR
proxy's own workload unknown            SERVFAIL
not class IN, or type not A/AAAA        forwarded
A/AAAA for a mesh service               authoritative answer (:class:`~ztunnel.dns.resolver.Store`)
anything else                           forwarded
=====================================  =================================================================

Every reply sets QR and RA, echoes ID, opcode, RD, CD and the question; a request with EDNS gets EDNS back with
the payload size ``max(request's, 512)`` and its DO bit. Over UDP a reply is cut to the client's size (512 bytes
without EDNS) with TC set, keeping as many whole records as fit, so the client retries over TCP; over TCP the
limit is 65,535. Parsing and rendering are dnspython's; nothing here reads wire bytes by hand except the 4-byte
header of a message dnspython rejected, to answer FORMERR.
"""

from __future__ import annotations

import enum
import logging
import struct
from dataclasses import dataclass

import dns.flags
import dns.message
import dns.opcode
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset

from ztunnel.dns.metrics import DnsLabels, Metrics
from ztunnel.dns.resolver import Store
from ztunnel.state.workload import Workload
from ztunnel.telemetry import log as log_fields

log = logging.getLogger("ztunnel.dns.handler")
access = logging.getLogger("dns")  # upstream's access-log target for DNS

MIN_UDP_PAYLOAD = 512  # RFC 1035 limit without EDNS; also the least EDNS payload we honour
MAX_MESSAGE = 65535
_HEADER = 12


class Transport(enum.Enum):
    UDP = "udp"
    TCP = "tcp"


@dataclass(frozen=True, slots=True)
class Reply:
    """Send ``wire`` to the client (the TCP adapter adds the length prefix)."""

    wire: bytes


@dataclass(frozen=True, slots=True)
class Forward:
    """Ask upstream for ``request``'s question, then reply with :meth:`Handler.forwarded`."""

    request: dns.message.Message
    transport: Transport
    client: Workload
    labels: DnsLabels


Command = Reply | Forward


def response_for(request: dns.message.Message, rcode: int, *, authoritative: bool = False) -> dns.message.Message:
    """An empty response to ``request``: flags, question and EDNS as the module docstring says."""
    resp = dns.message.Message(id=request.id)
    resp.flags = dns.flags.QR | dns.flags.RA | (request.flags & (dns.flags.RD | dns.flags.CD))
    if authoritative:
        resp.flags |= dns.flags.AA
    resp.set_opcode(request.opcode())
    resp.question = [dns.rrset.RRset(q.name, q.rdclass, q.rdtype) for q in request.question]
    if request.edns >= 0:
        resp.use_edns(0, request.ednsflags & dns.flags.DO, max(request.payload, MIN_UDP_PAYLOAD))
    if rcode > 0xF and request.edns < 0:
        rcode = dns.rcode.SERVFAIL  # an extended code cannot be told to a client without EDNS
    resp.set_rcode(dns.rcode.Rcode.make(rcode))
    return resp


def max_size(request: dns.message.Message | None, transport: Transport) -> int:
    if transport is Transport.TCP:
        return MAX_MESSAGE
    if request is None or request.edns < 0:
        return MIN_UDP_PAYLOAD
    return min(max(request.payload, MIN_UDP_PAYLOAD), MAX_MESSAGE)


def encode(response: dns.message.Message, request: dns.message.Message, transport: Transport) -> bytes:
    """Render ``response``, truncated (TC) to what the client can take."""
    try:
        return response.to_wire(max_size=max_size(request, transport), prefer_truncation=True)
    except Exception:  # a record dnspython cannot render must not cost the client its answer: SERVFAIL
        log.debug("cannot render DNS response", exc_info=True)
        return response_for(request, dns.rcode.SERVFAIL).to_wire(
            max_size=max_size(request, transport), prefer_truncation=True
        )


def formerr_for(wire: bytes) -> bytes | None:
    """FORMERR (NOTIMP for other opcodes) for a message dnspython could not parse, if its header is readable
    and it is not a response."""
    if len(wire) < _HEADER:
        return None
    msg_id, flags = struct.unpack_from("!HH", wire)
    if flags & dns.flags.QR:
        return None
    resp = dns.message.Message(id=msg_id)
    resp.flags = dns.flags.QR | dns.flags.RA | (flags & dns.flags.RD)
    opcode = dns.opcode.from_flags(flags)
    resp.set_opcode(opcode)
    # An opcode we do not implement is NOTIMP whether or not dnspython can parse its sections (UPDATE's differ).
    resp.set_rcode(dns.rcode.FORMERR if opcode == dns.opcode.QUERY else dns.rcode.NOTIMP)
    return resp.to_wire()


def parse(wire: bytes) -> dns.message.Message | Reply | None:
    """A request to handle, or what to do instead: FORMERR/NOTIMP for a broken one, nothing for a response."""
    try:
        request = dns.message.from_wire(wire)
    except Exception:  # dnspython raises a dozen exception types on hostile input; all mean FORMERR
        formerr = formerr_for(wire)
        return None if formerr is None else Reply(formerr)
    if request.flags & dns.flags.QR:
        return None
    return request


class Handler:
    """Requests to commands, for one proxied workload's resolver (:class:`~ztunnel.dns.resolver.Store`)."""

    def __init__(self, store: Store, metrics: Metrics) -> None:
        self.store = store
        self.metrics = metrics

    def handle(self, wire: bytes, transport: Transport, client: Workload | None) -> Command | None:
        """One request's bytes to a command (see the module docstring). Never raises."""
        parsed = parse(wire)
        if not isinstance(parsed, dns.message.Message):
            return parsed
        return self.handle_request(parsed, transport, client)

    def handle_request(self, request: dns.message.Message, transport: Transport, client: Workload | None) -> Command:
        """A request :func:`parse` accepted, to a command. Never raises."""
        try:
            out = self.handle_message(request, transport, client)
        except Exception:  # a bug must cost one query, not the listener (fuzzed, never seen)
            log.exception("DNS request handling failed")
            return Reply(encode(response_for(request, dns.rcode.SERVFAIL), request, transport))
        if isinstance(out, Forward):
            return out
        return Reply(encode(out, request, transport))

    def handle_message(
        self, request: dns.message.Message, transport: Transport, client: Workload | None
    ) -> dns.message.Message | Forward:
        """A parsed request to the response, or to a :class:`Forward` command."""
        if request.opcode() != dns.opcode.QUERY:
            return response_for(request, dns.rcode.NOTIMP)
        if len(request.question) != 1:
            return response_for(request, dns.rcode.FORMERR)
        q = request.question[0]
        if client is None:
            # The proxied workload is not (yet) in xDS state: we cannot know its namespace or network.
            self.metrics.request(DnsLabels.of(q.rdtype, transport.value, None))
            self._access(request, None, "unknown source", 0)
            return response_for(request, dns.rcode.SERVFAIL)
        labels = DnsLabels.of(q.rdtype, transport.value, client)
        if q.rdclass != dns.rdataclass.IN or q.rdtype not in (dns.rdatatype.A, dns.rdatatype.AAAA):
            return self._forward(request, transport, client, labels)
        answer = self.store.lookup(client, q.name, q.rdtype)
        if answer is None:
            return self._forward(request, transport, client, labels)
        self.metrics.request(labels)
        self._access(request, client, answer.result, len(answer.records))
        resp = response_for(request, dns.rcode.NOERROR, authoritative=True)
        resp.answer = list(answer.records)
        return resp

    def _forward(
        self, request: dns.message.Message, transport: Transport, client: Workload, labels: DnsLabels
    ) -> Forward:
        self.metrics.request(labels)
        self.metrics.forwarded(labels)
        return Forward(request, transport, client, labels)

    def forwarded(self, fwd: Forward, upstream: dns.message.Message | None) -> dns.message.Message:
        """The client's response from the upstream's answer (None: no upstream answered, SERVFAIL).

        Not authoritative; the answer, authority (the SOA negative answers are cached by) and additional records are
        passed on, each record on its own so a UDP reply can be truncated between records.
        """
        if upstream is None:
            self._access(fwd.request, fwd.client, "forwarding failed", 0)
            return response_for(fwd.request, dns.rcode.SERVFAIL)
        resp = response_for(fwd.request, upstream.rcode())
        resp.answer = list(upstream.answer)
        resp.authority = list(upstream.authority)
        resp.additional = list(upstream.additional)
        self._access(fwd.request, fwd.client, "forwarded", len(resp.answer))
        return resp

    def _access(self, request: dns.message.Message, client: Workload | None, result: str, endpoints: int) -> None:
        if not access.isEnabledFor(logging.DEBUG):
            return
        q = request.question[0] if request.question else None
        log_fields(
            access,
            logging.DEBUG,
            "dns request",
            **{
                "src.workload": client.name if client is not None else "unknown",
                "src.namespace": client.namespace if client is not None else "unknown",
                "query": dns.rdatatype.to_text(q.rdtype) if q is not None else "",
                "domain": q.name.to_text() if q is not None else "",
                "result": result,
                "endpoints": endpoints,
            },
        )
