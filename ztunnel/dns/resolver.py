"""Which mesh service a name means, and its addresses: the pure part of the DNS proxy (upstream ``Store`` in
``dns/server.rs``). No I/O, no clock; reads :class:`~ztunnel.state.ProxyState` only.

Theory of operation, for a client workload asking ``name`` (A or AAAA):

1. **Aliases.** The name itself; its Kubernetes expansions (:meth:`Store.kube_fqdns`: ``svc`` ->
   ``svc.<client ns>.svc.<cd>``, ``svc.ns`` -> ``svc.ns.svc.<cd>`` and the pod-subdomain form, ``svc.ns.svc`` ->
   ``svc.ns.svc.<cd>``...); and for each of the client's search domains the name with that domain stripped, plus
   the stripped name's expansions. A stub resolver appends its search domains before asking (``productpage`` goes
   out as ``productpage.ns1.svc.cluster.local``, but also ``www.google.com`` as ``www.google.com.ns1.svc...``), so
   stripping finds ``www.google.com`` on the first query instead of letting the client walk its search list.
2. **Wildcards.** Each alias is tried as itself, then with its first label replaced by ``*`` at every level
   (``a.b.c`` -> ``*.b.c`` -> ``*.c``).
3. **Services.** The first candidate hostname with a usable service wins: services must have a VIP, or be
   headless Kubernetes services (hostname under ``.svc.<cd>``); ``visibility: NAMESPACE`` hides a service from
   other namespaces; among several, the client's namespace wins, then a ``canonical`` one, then
   ``PREFERED_SERVICE_NAMESPACE``, then the first.
4. **Addresses.** Headless: the first IP of the requested family of each endpoint's workload. Otherwise the VIPs
   of that family on the client's network. Shuffled (clients take the first: DNS load balancing). A service whose
   ``ipFamilies`` exclude the family, or AAAA with IPv6 disabled, answers no records.
5. **Records.** TTL 30 s. If a stripped alias matched a non-wildcard host, a CNAME from the asked name to the
   stripped name comes first and the addresses are given under the stripped name.

Nothing found means the name is not the mesh's: the caller forwards it upstream.
"""

from __future__ import annotations

import ipaddress
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import dns.exception
import dns.name
import dns.rdata
import dns.rdataclass
import dns.rdatatype
import dns.rdtypes.ANY.CNAME
import dns.rdtypes.IN.A
import dns.rdtypes.IN.AAAA
import dns.rrset

from ztunnel.dns.name_util import has_domain, is_wildcard, labels, trim_domain
from ztunnel.state import ProxyState
from ztunnel.state.service import IpFamily, Service, find_best_match
from ztunnel.state.workload import IPAddress, Workload

TTL = 30  # seconds, upstream DEFAULT_TTL_SECONDS
SVC = dns.name.Name((b"svc",))
A = dns.rdatatype.A
AAAA = dns.rdatatype.AAAA
IN = dns.rdataclass.IN

SearchDomains = Callable[[Workload], Sequence[dns.name.Name]]
# dnspython's rdata constructors are untyped; typed aliases keep mypy strict at the call sites.
_make_a: Callable[[int, int, str], dns.rdata.Rdata] = dns.rdtypes.IN.A.A
_make_aaaa: Callable[[int, int, str], dns.rdata.Rdata] = dns.rdtypes.IN.AAAA.AAAA
_make_cname: Callable[[int, int, dns.name.Name], dns.rdata.Rdata] = dns.rdtypes.ANY.CNAME.CNAME


@dataclass(frozen=True, slots=True)
class Alias:
    """A name to look up for the request. ``stripped`` is set when it came from removing a search domain."""

    name: dns.name.Name
    stripped: dns.name.Name | None = None


@dataclass(frozen=True, slots=True)
class ServerMatch:
    """The service found, the hostname (maybe a wildcard) it was found under, and the alias that led there."""

    name: dns.name.Name
    alias: Alias
    service: Service


@dataclass(frozen=True, slots=True)
class LocalAnswer:
    """An authoritative answer: the records (one per RRset, so UDP truncation can keep a prefix), maybe none."""

    records: tuple[dns.rrset.RRset, ...]
    result: str  # for the access log: "success", "no records", ...


def concat(name: dns.name.Name, domain: dns.name.Name) -> dns.name.Name:
    """``name`` + ``domain`` as an absolute name. Raises :class:`dns.name.NameTooLong` past 255 octets."""
    return dns.name.Name((*labels(name), *labels(domain), b""))


def get_wildcards(name: dns.name.Name) -> list[dns.name.Name]:
    """``a.b.c.`` -> ``[a.b.c., *.b.c., *.c.]``: the name, then wildcards of decreasing specificity."""
    out = [name]
    rest = labels(name)
    while len(rest) > 1:
        out.append(dns.name.Name((b"*", *rest[1:], b"")))
        rest = rest[1:]
    return out


def wildcard_hosts(host: str) -> list[str]:
    """:func:`get_wildcards` on hostname text: ``a.b.c`` -> ``[a.b.c, *.b.c, *.c]``. Slices of one string, where
    Name objects cost ~100 µs per name of 120 labels to build and print (a pod's long query names would otherwise
    take ~12 ms of the worker's loop each: 4 aliases times 118 wildcards). ``host`` has no escaped dot."""
    out = [host]
    dot = host.find(".")
    while dot != -1:
        out.append("*." + host[dot + 1 :])
        dot = host.find(".", dot + 1)
    return out


def host_text(name: dns.name.Name) -> str:
    """How a hostname is written in xDS: no trailing dot."""
    return name.to_text(omit_final_dot=True)


class Store:
    """Answers A/AAAA for mesh services from the proxy state, as the given client sees them."""

    def __init__(
        self,
        state: ProxyState,
        cluster_domain: str,
        search_domains: SearchDomains,
        *,
        preferred_service_namespace: str | None = None,
        ipv6_enabled: bool = True,
        rng: random.Random | None = None,
    ) -> None:
        self.state = state
        self.domain = dns.name.from_text(cluster_domain)
        self.svc_domain = concat(SVC, self.domain)
        # Headless services are answered only under this suffix (upstream: ".svc.cluster.local").
        self.headless_suffix = "." + host_text(self.svc_domain)
        self.search_domains = search_domains
        self.preferred_service_namespace = preferred_service_namespace
        self.ipv6_enabled = ipv6_enabled
        self.rng = rng if rng is not None else random.Random()

    # -- names ---------------------------------------------------------------------------------------------------

    def kube_fqdns(self, name: dns.name.Name, namespaced_domain: dns.name.Name) -> list[dns.name.Name]:
        """The Kubernetes FQDNs ``name`` may be short for, given how many labels it has.

        Standard service: ``<svc>.<ns>.svc.<cd>``; pod with a subdomain (StatefulSet):
        ``<pod>.<subdomain>.<ns>.svc.<cd>``. Anything else is not a Kubernetes short name.
        """
        n = len(labels(name))
        candidates: list[tuple[dns.name.Name, dns.name.Name]] = []
        if n == 1:
            candidates.append((name, namespaced_domain))  # <svc> in the client's namespace
        elif n == 2:
            candidates.append((name, self.svc_domain))  # <svc>.<ns>
            candidates.append((name, namespaced_domain))  # <pod>.<subdomain>
        elif n == 3:
            if has_domain(name, SVC):
                candidates.append((name, self.domain))  # <svc>.<ns>.svc
            candidates.append((name, self.svc_domain))  # <pod>.<subdomain>.<ns>
        elif n == 4 and has_domain(name, SVC):
            candidates.append((name, self.domain))  # <pod>.<subdomain>.<ns>.svc
        out: list[dns.name.Name] = []
        for base, domain in candidates:
            try:
                out.append(concat(base, domain))
            except dns.exception.DNSException:
                continue  # past 255 octets: cannot be a real name
        return out

    def aliases(self, client: Workload, name: dns.name.Name) -> list[Alias]:
        out: list[Alias] = []
        seen: set[dns.name.Name] = set()

        def add(alias: Alias) -> None:
            if alias.name not in seen:
                seen.add(alias.name)
                out.append(alias)

        add(Alias(name))
        try:
            namespaced_domain = concat(dns.name.Name((client.namespace.encode(),)), self.svc_domain)
        except (dns.exception.DNSException, UnicodeError):
            namespaced_domain = self.svc_domain
        for fqdn in self.kube_fqdns(name, namespaced_domain):
            add(Alias(fqdn))
        for search in self.search_domains(client):
            trimmed = trim_domain(name, search)
            if trimmed is None:
                continue
            stripped = trimmed.concatenate(dns.name.root)
            add(Alias(stripped, stripped))
            for fqdn in self.kube_fqdns(stripped, namespaced_domain):
                add(Alias(fqdn, stripped))
        return out

    # -- services ------------------------------------------------------------------------------------------------

    def _candidates(self, host: str) -> list[Service]:
        services = self.state.services.get_by_host(host)
        if not services:
            lower = host.lower()  # DNS is case-insensitive; xDS hostnames are lowercase
            if lower != host:
                services = self.state.services.get_by_host(lower)
        return services

    def find_server(self, client: Workload, name: dns.name.Name) -> ServerMatch | None:
        for alias in self.aliases(client, name):
            host = host_text(alias.name)
            if "\\" in host:  # an escaped byte (a dot inside a label, ...): split by the labels themselves
                hosts = [host_text(candidate) for candidate in get_wildcards(alias.name)]
            else:
                hosts = wildcard_hosts(host)
            for candidate in hosts:
                services = [
                    s
                    for s in self._candidates(candidate)
                    # No VIP and not a Kubernetes headless service (a ServiceEntry without addresses): forward.
                    if (s.vips or s.hostname.endswith(self.headless_suffix)) and s.visible_to(client.namespace)
                ]
                best = find_best_match(services, client.namespace, self.preferred_service_namespace)
                if best is not None:
                    return ServerMatch(dns.name.from_text(candidate), alias, best)
        return None

    def family_allowed(self, service: Service, rdtype: int) -> bool:
        """Headless pods may be dual-stack behind a single-stack service: answer only the service's families."""
        if rdtype == AAAA and not self.ipv6_enabled:
            return False
        if service.ip_families is IpFamily.IPV4:
            return rdtype != AAAA
        if service.ip_families is IpFamily.IPV6:
            return rdtype != A
        return True

    def addresses(self, client: Workload, service: Service, rdtype: int) -> list[IPAddress]:
        version = 4 if rdtype == A else 6
        if version == 6 and not self.ipv6_enabled:
            return []
        out: list[IPAddress] = []
        if not service.vips:
            # Headless: each endpoint's first address of the family.
            workloads = self.state.workloads
            for uid in service.endpoints:
                w = workloads.find_uid(uid)
                if w is None:
                    continue
                ip = next((i for i in w.workload_ips if i.version == version), None)
                if ip is not None:
                    out.append(ip)
        else:
            out = [v.address for v in service.vips if v.address.version == version and v.network == client.network]
        self.rng.shuffle(out)
        return out

    # -- the answer ----------------------------------------------------------------------------------------------

    def lookup(self, client: Workload, qname: dns.name.Name, rdtype: int) -> LocalAnswer | None:
        """The authoritative answer for an A/AAAA question, or None when the name is not a mesh service."""
        match = self.find_server(client, qname)
        if match is None:
            return None
        if not self.family_allowed(match.service, rdtype):
            # Not NXDOMAIN: the host exists, it just has no address of this family.
            return LocalAnswer((), "service does not support this record type")
        addrs = self.addresses(client, match.service, rdtype)
        if not addrs:
            return LocalAnswer((), "no records")
        records: list[dns.rrset.RRset] = []
        owner = qname
        stripped = match.alias.stripped
        if stripped is not None and not is_wildcard(match.name):
            records.append(dns.rrset.from_rdata(qname, TTL, _make_cname(IN, dns.rdatatype.CNAME, stripped)))
            owner = stripped
        for ip in addrs:
            make = _make_a if isinstance(ip, ipaddress.IPv4Address) else _make_aaaa
            rdata = make(IN, A if ip.version == 4 else AAAA, str(ip))
            records.append(dns.rrset.from_rdata(owner, TTL, rdata))
        return LocalAnswer(tuple(records), "success")
