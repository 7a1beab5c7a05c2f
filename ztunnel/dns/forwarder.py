"""Forwarding to the nameservers of ``/etc/resolv.conf`` (upstream ``dns/forwarder.rs`` and ``SystemForwarder``).

Names the proxy does not own are asked of the nameservers in ztunnel's ``/etc/resolv.conf``, with the search list
removed: the client's stub resolver has already applied its search domains, so the name is sent as it came. Every
socket comes from the :class:`~ztunnel.sockets.SocketFactory`, so in-pod proxies ask from inside the pod's network
namespace with the mark (1337) that the pod's DNS capture rule lets through and the CT-zone rule matches.

Timing, chosen so a failure reaches the client before its own timeout (glibc: 5 s): each try waits
``timeout`` (resolv.conf ``options timeout:``, else 2 s), nameservers are tried in order, twice round, and the whole
forward gives up after :data:`DEFAULT_LIFETIME` (5 s). A UDP answer with TC set is asked again over TCP. An answer
of SERVFAIL, REFUSED, NOTIMP or FORMERR moves on to the next nameserver; if every try fails that way, the last
such answer is passed on, and if none answered at all :class:`ForwardError` is raised (the proxy answers SERVFAIL).

Sockets and timers are the only I/O here; the wire format is dnspython's.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast

import dns.exception
import dns.flags
import dns.message
import dns.name
import dns.rcode

from ztunnel.config import ProxyMode
from ztunnel.errors import ZtunnelError
from ztunnel.net import format_addr
from ztunnel.sockets import SocketFactory, connect, family_of
from ztunnel.state.workload import IPAddress, Workload, canonical_ip

log = logging.getLogger("ztunnel.dns.forwarder")

RESOLV_CONF = "/etc/resolv.conf"
DEFAULT_TRY_TIMEOUT = 2.0  # dnspython's (and many stubs') per-try default when resolv.conf sets none
DEFAULT_ATTEMPTS = 2  # rounds over the nameserver list (glibc and hickory default)
DEFAULT_LIFETIME = 5.0  # whole forward; a glibc client gives up at 5 s, so it still sees our SERVFAIL
# EDNS payload we advertise upstream: the DNS Flag Day 2020 value, safe from IP fragmentation.
UPSTREAM_EDNS_PAYLOAD = 1232
_RETRYABLE = frozenset({dns.rcode.SERVFAIL, dns.rcode.REFUSED, dns.rcode.NOTIMP, dns.rcode.FORMERR})


class ForwardError(ZtunnelError):
    """No upstream nameserver answered. The message names what was tried."""


class Forwarder(Protocol):
    """What the DNS proxy needs from an upstream: the client's search domains, and forwarding a query."""

    def search_domains(self, client: Workload) -> Sequence[dns.name.Name]: ...

    async def forward(self, request: dns.message.Message) -> dns.message.Message:
        """The upstream's answer to ``request``'s question; raises :class:`ForwardError` when none answered."""
        ...


@dataclass(frozen=True, slots=True)
class Nameserver:
    ip: IPAddress
    port: int = 53

    def __str__(self) -> str:
        return format_addr(self.ip, self.port)


@dataclass(frozen=True, slots=True)
class ResolvConf:
    """The parts of resolv.conf the proxy uses: nameservers, search list, ``options timeout:``.

    Parsed here, as dnspython's ``Resolver.read_resolv_conf`` reads the same file (``tests/dns/test_resolv_conf.py``
    holds the two to the same answers), not with it: ``dns.resolver`` imports dnspython's whole client
    (``dns.query``, ``dns.asyncquery``, ``dns.xfr``...), 0.9 MiB of objects in every data-plane worker for the few
    lines of this file (docs/process-model.md, "A worker's idle memory"). Where dnspython refuses the whole file (no
    nameservers: every forwarded query SERVFAIL), a bad line is skipped with a warning instead: a ``nameserver`` that
    is not an IP address, a ``search`` or ``domain`` line with a name that is not one; and ``options timeout:`` of 0
    or less is the default (dnspython would time every try out at once).
    """

    nameservers: tuple[Nameserver, ...]
    search: tuple[dns.name.Name, ...]
    timeout: float

    @classmethod
    def load(cls, path: str | Path = RESOLV_CONF) -> ResolvConf:
        """Read ``path``. A missing file or one without nameservers gives no nameservers (and a warning)."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, ValueError) as e:  # no file, not UTF-8
            log.warning("DNS proxy: no upstream nameservers from %s (%s); forwarded queries will get SERVFAIL", path, e)
            return cls((), (), DEFAULT_TRY_TIMEOUT)
        return cls.parse(text, str(path))

    @classmethod
    def parse(cls, text: str, path: str = RESOLV_CONF) -> ResolvConf:
        """The resolv.conf ``text`` (read from ``path``, named in warnings)."""
        servers: list[Nameserver] = []
        search: list[dns.name.Name] = []
        timeout = 0
        for line in text.splitlines():
            if not line or line[0] in "#;":
                continue
            tokens = line.split()
            if len(tokens) < 2:  # malformed: skipped, as every resolver does
                continue
            key = tokens[0]
            if key == "nameserver":
                address = tokens[1].split("%", 1)[0]  # drop an IPv6 zone id
                try:
                    servers.append(Nameserver(canonical_ip(ipaddress.ip_address(address))))
                except ValueError:
                    log.warning("DNS proxy: ignoring nameserver %r in %s: not an IP address", tokens[1], path)
            elif key in ("domain", "search"):
                # domain and search exclude each other and the last line wins; a domain alone is the search list,
                # as glibc and upstream's resolver read it (resolv-conf's get_last_search_or_domain)
                try:
                    names = [dns.name.from_text(name) for name in (tokens[1:] if key == "search" else tokens[1:2])]
                except (dns.exception.DNSException, ValueError) as e:
                    log.warning("DNS proxy: ignoring %r in %s: %s", line.strip(), path, e)
                    continue
                search = names
            elif key == "options":
                for opt in tokens[1:]:
                    if "timeout" in opt:
                        with contextlib.suppress(ValueError, IndexError):  # a bad value keeps the last good one
                            timeout = int(opt.split(":")[1])
        if not servers:
            log.warning(
                "DNS proxy: no upstream nameservers from %s (no nameservers); forwarded queries will get SERVFAIL", path
            )
            return cls((), (), DEFAULT_TRY_TIMEOUT)
        # glibc waits at least a second per try whatever the option says; 0 or less here would be a timeout that
        # fires at once, failing every forwarded query: the default instead.
        return cls(tuple(servers), tuple(search), float(timeout) if timeout > 0 else DEFAULT_TRY_TIMEOUT)

    def to_json(self) -> dict[str, Any]:
        """``dnsResolverCfg`` / ``dnsResolverOpts`` of ``/config_dump``: the nameservers forwarded to, in the shape
        of upstream's resolver config (hickory's field names), and the options this forwarder uses."""
        servers = [
            {"ip": str(ns.ip), "connections": [{"port": ns.port, "protocol": {"type": t}} for t in ("udp", "tcp")]}
            for ns in self.nameservers
        ]
        return {
            "dnsResolverCfg": {"domain": None, "search": [str(n) for n in self.search], "name_servers": servers},
            "dnsResolverOpts": {"attempts": DEFAULT_ATTEMPTS, "timeout": self.timeout},
        }


class SystemForwarder:
    """Forwards to fixed nameservers; search domains per pod (shared mode) or from resolv.conf (dedicated)."""

    def __init__(
        self,
        nameservers: Sequence[Nameserver],
        sockets: SocketFactory,
        *,
        search: Sequence[dns.name.Name] = (),
        per_pod_cluster_domain: str | None = None,
        timeout: float = DEFAULT_TRY_TIMEOUT,
        attempts: int = DEFAULT_ATTEMPTS,
        lifetime: float = DEFAULT_LIFETIME,
    ) -> None:
        self.nameservers = tuple(nameservers)
        self.sockets = sockets
        self.search = tuple(n if n.is_absolute() else n.concatenate(dns.name.root) for n in search)
        self.per_pod_cluster_domain = per_pod_cluster_domain
        self.timeout = timeout
        self.attempts = max(1, attempts)
        self.lifetime = lifetime
        if per_pod_cluster_domain is not None:
            domain = dns.name.from_text(per_pod_cluster_domain)
            self._svc_domain = dns.name.Name((b"svc", *domain.labels))
            self._domain = domain

    def search_domains(self, client: Workload) -> Sequence[dns.name.Name]:
        """Shared mode: the Kubernetes search list of the client's namespace (``<ns>.svc.<cd>``, ``svc.<cd>``,
        ``<cd>``), as upstream hardcodes until it learns pods' real settings; dedicated: resolv.conf's list."""
        if self.per_pod_cluster_domain is None:
            return self.search
        try:
            ns = dns.name.Name((client.namespace.encode(), *self._svc_domain.labels))
        except (dns.exception.DNSException, UnicodeError, ValueError):
            return (self._svc_domain, self._domain)
        return (ns, self._svc_domain, self._domain)

    async def forward(self, request: dns.message.Message) -> dns.message.Message:
        if not self.nameservers:
            raise ForwardError("no upstream nameservers configured (check /etc/resolv.conf)")
        q = request.question[0]
        query = dns.message.make_query(
            q.name,
            q.rdtype,
            q.rdclass,
            use_edns=0,
            want_dnssec=bool(request.ednsflags & dns.flags.DO),
            payload=UPSTREAM_EDNS_PAYLOAD,
        )
        query.flags |= request.flags & dns.flags.CD
        wire = query.to_wire()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.lifetime
        errors: list[str] = []
        failed_answer: dns.message.Message | None = None
        for _ in range(self.attempts):
            for ns in self.nameservers:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                try:
                    answer = await self._ask(query, wire, ns, min(self.timeout, remaining))
                except (OSError, TimeoutError, dns.exception.DNSException, ForwardError) as e:
                    errors.append(f"{ns}: {_describe(e)}")
                    continue
                if answer.rcode() in _RETRYABLE:
                    errors.append(f"{ns}: {dns.rcode.to_text(answer.rcode())}")
                    failed_answer = answer
                    continue
                return answer
        if failed_answer is not None:
            return failed_answer
        raise ForwardError("no answer from upstream nameservers: " + "; ".join(errors or ["out of time"]))

    async def _ask(
        self, query: dns.message.Message, wire: bytes, ns: Nameserver, timeout: float
    ) -> dns.message.Message:
        async with asyncio.timeout(timeout):
            try:
                return await self._udp(query, wire, ns)
            except dns.message.Truncated:
                return await self._tcp(query, wire, ns)

    async def _udp(self, query: dns.message.Message, wire: bytes, ns: Nameserver) -> dns.message.Message:
        loop = asyncio.get_running_loop()
        sock = self.sockets.udp(family_of(ns.ip))
        try:
            # A connected socket only accepts datagrams from the nameserver and reports ICMP unreachable at once.
            await connect(sock, (str(ns.ip), ns.port))
            await loop.sock_sendall(sock, wire)
            while True:
                data = await loop.sock_recv(sock, 65535)
                try:
                    answer = dns.message.from_wire(
                        data, ignore_trailing=True, one_rr_per_rrset=True, raise_on_truncation=True
                    )
                except dns.message.Truncated as e:
                    partial: dns.message.Message = cast(Any, e).message()  # untyped in dnspython
                    if partial.id == query.id:
                        raise
                    continue
                except Exception:  # dnspython raises many types on garbage; a stray datagram is not an answer
                    continue
                if query.is_response(answer):
                    return answer
        finally:
            sock.close()

    async def _tcp(self, query: dns.message.Message, wire: bytes, ns: Nameserver) -> dns.message.Message:
        sock = self.sockets.tcp(family_of(ns.ip), bind_source=False)
        loop = asyncio.get_running_loop()
        try:
            await connect(sock, (str(ns.ip), ns.port))
            await loop.sock_sendall(sock, struct.pack("!H", len(wire)) + wire)
            (length,) = struct.unpack("!H", await _recv_exactly(loop, sock, 2))
            answer = dns.message.from_wire(
                await _recv_exactly(loop, sock, length), ignore_trailing=True, one_rr_per_rrset=True
            )
        finally:
            sock.close()
        if not query.is_response(answer):
            raise ForwardError("TCP answer does not match the query")
        return answer


async def _recv_exactly(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = await loop.sock_recv(sock, n - len(buf))
        if not chunk:
            raise ForwardError("nameserver closed the TCP connection mid-answer")
        buf += chunk
    return bytes(buf)


def _describe(e: BaseException) -> str:
    if isinstance(e, TimeoutError):
        return "timed out"
    return str(e) or type(e).__name__


def forwarder_for_mode(
    mode: ProxyMode, cluster_domain: str, sockets: SocketFactory, resolv_conf: str | Path = RESOLV_CONF
) -> SystemForwarder:
    """Upstream's ``forwarder_for_mode``: ztunnel's resolv.conf nameservers; per-pod search domains when shared."""
    conf = ResolvConf.load(resolv_conf)
    return SystemForwarder(
        conf.nameservers,
        sockets,
        search=conf.search,
        per_pod_cluster_domain=cluster_domain if mode is ProxyMode.SHARED else None,
        timeout=conf.timeout,
    )
