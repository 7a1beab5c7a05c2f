"""On-demand DNS: the address of a workload known only by hostname (upstream ``state.rs``
``resolve_on_demand_dns``).

A ServiceEntry with ``resolution: DNS`` gives workloads that have a ``hostname`` and no IP. When outbound picks one,
the hostname is looked up here at connection time, and one of its addresses is picked **at random**, preferring
the family of the address the client connected to (a v4 client gets a v4 address if there is one), as upstream
(``choose(&mut rand::rng())`` over the matching family, else over the rest).

The resolver is upstream's state resolver: ztunnel's own ``/etc/resolv.conf`` nameservers (in-pod too: it runs in
ztunnel's network namespace, not the pod's), A and AAAA asked in parallel (only A when IPv6 is disabled: upstream's
``Ipv4AndIpv6``/``Ipv4Only``), and an answer cache of 4,096 entries (upstream's ``cache_size``; :mod:`~ztunnel.dns.
cache`), so a busy hostname costs one query per TTL. One :class:`HostLookup` serves every proxy of a process.

The name is asked as written; if that finds nothing and it is not a fully-qualified name (no trailing dot), each
resolv.conf search domain is tried after it (hickory applies the search list before the bare name when the name has
fewer dots than ``ndots``; ServiceEntry hosts are fully-qualified external names, for which the order does not
change the answer).

Each lookup is counted in ``istio_on_demand_dns_total`` by the caller (:mod:`ztunnel.proxy.outbound`).
"""

from __future__ import annotations

import asyncio
import ipaddress
import random
from collections.abc import Sequence
from pathlib import Path

import dns.exception
import dns.message
import dns.name
import dns.rcode
import dns.rdatatype

from ztunnel.dns.cache import AnswerCache, CachingForwarder
from ztunnel.dns.forwarder import RESOLV_CONF, Forwarder, ForwardError, ResolvConf, SystemForwarder
from ztunnel.errors import ZtunnelError
from ztunnel.sockets import SocketFactory
from ztunnel.state.workload import IPAddress, canonical_ip


class HostLookupError(ZtunnelError):
    """A hostname resolved to nothing usable. The message names the hostname and why."""


class HostLookup:
    """Resolves hostnames through ``forwarder`` (normally a :class:`CachingForwarder` over ztunnel's nameservers)."""

    def __init__(
        self, forwarder: Forwarder, *, search: Sequence[dns.name.Name] = (), ipv6_enabled: bool = True
    ) -> None:
        self.forwarder = forwarder
        self.search = tuple(search)
        self.ipv6_enabled = ipv6_enabled

    @classmethod
    def from_resolv_conf(
        cls, sockets: SocketFactory, *, ipv6_enabled: bool = True, resolv_conf: str | Path = RESOLV_CONF
    ) -> HostLookup:
        """Upstream's state resolver: ``resolv_conf``'s nameservers, timeout and search list, with a cache."""
        conf = ResolvConf.load(resolv_conf)
        inner = SystemForwarder(conf.nameservers, sockets, search=conf.search, timeout=conf.timeout)
        return cls(CachingForwarder(inner, AnswerCache()), search=inner.search, ipv6_enabled=ipv6_enabled)

    async def lookup_ip(self, hostname: str) -> list[IPAddress]:
        """Every A (and AAAA) address of ``hostname``. Raises :class:`HostLookupError` when there is none."""
        try:
            name = dns.name.from_text(hostname)
        except (dns.exception.DNSException, UnicodeError, ValueError) as e:
            raise HostLookupError(f"dns lookup of {hostname!r} failed: not a valid name ({e})") from None
        candidates = [name]
        if not hostname.endswith("."):
            for domain in self.search:
                try:
                    candidates.append(dns.name.Name((*name.labels[:-1], *domain.labels)))
                except dns.exception.DNSException:
                    continue  # too long with this domain
        errors: list[str] = []
        for candidate in candidates:
            ips, error = await self._ask(candidate)
            if ips:
                return ips
            if error:
                errors.append(error)
        why = "; ".join(errors) if errors else "no A or AAAA records"
        raise HostLookupError(f"dns lookup of {hostname} returned no addresses ({why})")

    async def _ask(self, name: dns.name.Name) -> tuple[list[IPAddress], str]:
        types = [dns.rdatatype.A, dns.rdatatype.AAAA] if self.ipv6_enabled else [dns.rdatatype.A]
        results = await asyncio.gather(
            *(self.forwarder.forward(dns.message.make_query(name, t)) for t in types), return_exceptions=True
        )
        ips: list[IPAddress] = []
        errors: list[str] = []
        for result in results:
            if isinstance(result, ForwardError | OSError):
                errors.append(str(result))
                continue
            if isinstance(result, BaseException):
                raise result
            if result.rcode() not in (dns.rcode.NOERROR, dns.rcode.NXDOMAIN):
                errors.append(f"{name}: {dns.rcode.to_text(result.rcode())}")
            for rrset in result.answer:  # the addresses at the end of any CNAME chain
                if rrset.rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA):
                    ips.extend(canonical_ip(ipaddress.ip_address(rd.address)) for rd in rrset)
        return ips, "; ".join(errors)


def pick_address(ips: Sequence[IPAddress], want_ipv6: bool, rng: random.Random) -> IPAddress:
    """Upstream's pick: a random address of the family the client used, else a random one of the other."""
    matching = [ip for ip in ips if (ip.version == 6) == want_ipv6]
    return rng.choice(matching or list(ips))
