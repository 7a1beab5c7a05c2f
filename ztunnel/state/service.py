"""Services: hostnames and VIPs in front of workloads, with their endpoints; and the store that indexes them.

Mirrors upstream ``state/service.rs``. Endpoints come from the workloads (each workload lists the services it
backs), so a workload may arrive before its service: its endpoints wait in ``staged`` until the service appears.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from ztunnel.state.workload import (
    GatewayAddress,
    HealthStatus,
    IPAddress,
    NamespacedHostname,
    NetworkAddress,
    NetworkCidr,
)


class LoadBalancerMode(enum.Enum):
    STANDARD = "Standard"
    STRICT = "Strict"
    FAILOVER = "Failover"
    PASSTHROUGH = "Passthrough"


class LoadBalancerHealthPolicy(enum.Enum):
    ONLY_HEALTHY = "OnlyHealthy"
    ALLOW_ALL = "AllowAll"


class LoadBalancerScope(enum.Enum):
    REGION = "Region"
    ZONE = "Zone"
    SUBZONE = "Subzone"
    NODE = "Node"
    CLUSTER = "Cluster"
    NETWORK = "Network"


class IpFamily(enum.Enum):
    DUAL = "Dual"
    IPV4 = "IPv4"
    IPV6 = "IPv6"

    def accepts(self, ip: IPAddress) -> bool:
        return self is IpFamily.DUAL or (ip.version == 4) == (self is IpFamily.IPV4)


class Visibility(enum.Enum):
    PUBLIC = "Public"
    NAMESPACE = "Namespace"


@dataclass(frozen=True, slots=True)
class LoadBalancer:
    routing_preferences: tuple[LoadBalancerScope, ...] = ()
    mode: LoadBalancerMode = LoadBalancerMode.STANDARD
    health_policy: LoadBalancerHealthPolicy = LoadBalancerHealthPolicy.ONLY_HEALTHY


@dataclass(frozen=True, slots=True)
class WeightedWaypoint:
    destination: GatewayAddress
    weight: int


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One workload behind a service, with its own port overrides (service port -> target port)."""

    workload_uid: str
    port: Mapping[int, int]
    status: HealthStatus = HealthStatus.HEALTHY


def _empty_ports() -> Mapping[int, int]:
    return MappingProxyType({})


@dataclass(frozen=True, slots=True)
class Service:
    """A service as xDS describes it.

    ``endpoints`` (by workload UID) is owned by the :class:`ServiceStore`, which updates it in place: copying it per
    endpoint would make loading a 10,000-endpoint service quadratic. Everything else is immutable.
    """

    name: str
    namespace: str
    hostname: str
    vips: tuple[NetworkAddress, ...] = ()
    cidr_vips: tuple[NetworkCidr, ...] = ()
    ports: Mapping[int, int] = field(default_factory=_empty_ports)
    endpoints: dict[str, Endpoint] = field(default_factory=dict)
    subject_alt_names: tuple[str, ...] = ()
    waypoint: GatewayAddress | None = None
    weighted_waypoints: tuple[WeightedWaypoint, ...] = ()
    load_balancer: LoadBalancer | None = None
    ip_families: IpFamily | None = None
    canonical: bool = False
    visibility: Visibility = Visibility.PUBLIC

    @property
    def key(self) -> NamespacedHostname:
        return NamespacedHostname(self.namespace, self.hostname)

    def visible_to(self, client_namespace: str) -> bool:
        return self.visibility is not Visibility.NAMESPACE or self.namespace == client_namespace

    def should_include_endpoint(self, status: HealthStatus) -> bool:
        return status is HealthStatus.HEALTHY or (
            self.load_balancer is not None and self.load_balancer.health_policy is LoadBalancerHealthPolicy.ALLOW_ALL
        )


def find_best_match(
    services: Iterable[Service], client_ns: str | None, preferred_namespace: str | None = None
) -> Service | None:
    """Upstream's ranking among services sharing a VIP or hostname.

    A service in the client's namespace wins at once; otherwise the last ``canonical`` one; otherwise one in the
    preferred namespace (``PREFERED_SERVICE_NAMESPACE``); otherwise the first seen.
    """
    best: Service | None = None
    best_kind = 0  # 0 none, 1 first, 2 preferred namespace, 3 canonical
    for s in services:
        if client_ns is not None and s.namespace == client_ns:
            return s
        if s.canonical:
            best, best_kind = s, 3
        elif preferred_namespace is not None and s.namespace == preferred_namespace and best_kind != 3:
            best, best_kind = s, 2
        elif best_kind == 0:
            best, best_kind = s, 1
    return best


class ServiceStore:
    """Services by key, by VIP (several services may share one), by CIDR VIP and by hostname."""

    def __init__(self) -> None:
        self.by_key: dict[NamespacedHostname, Service] = {}
        self._by_vip: dict[NetworkAddress, list[Service]] = {}
        self._by_cidr_vip: list[tuple[NetworkCidr, Service]] = []
        self._by_host: dict[str, list[Service]] = {}
        # Endpoints of services not (yet) known: service key -> {workload uid -> endpoint}.
        self.staged: dict[NamespacedHostname, dict[str, Endpoint]] = {}

    def __len__(self) -> int:
        return len(self.by_key)

    def __iter__(self) -> Iterator[Service]:
        return iter(self.by_key.values())

    def get(self, key: NamespacedHostname) -> Service | None:
        return self.by_key.get(key)

    def get_by_vip(self, vip: NetworkAddress) -> list[Service]:
        return list(self._by_vip.get(vip, ()))

    def get_best_by_vip(
        self, vip: NetworkAddress, client_ns: str | None, preferred_ns: str | None = None
    ) -> Service | None:
        """The service at ``vip`` visible to ``client_ns``; falls back to CIDR VIPs (namespace, prefix, canonical)."""
        services = self._by_vip.get(vip)
        if services:
            visible = (s for s in services if client_ns is None or s.visible_to(client_ns))
            found = find_best_match(visible, client_ns, preferred_ns)
            if found is not None:
                return found
        if not self._by_cidr_vip:
            return None
        best: tuple[tuple[bool, int, bool], Service] | None = None
        for nc, svc in self._by_cidr_vip:
            if nc.network != vip.network or vip.address not in nc.cidr:
                continue
            if client_ns is not None and not svc.visible_to(client_ns):
                continue
            rank = (client_ns is not None and svc.namespace == client_ns, nc.cidr.prefixlen, svc.canonical)
            if best is None or rank > best[0]:
                best = (rank, svc)
        return None if best is None else best[1]

    def get_by_host(self, hostname: str) -> list[Service]:
        return list(self._by_host.get(hostname, ()))

    def get_best_by_host(self, hostname: str, client_ns: str | None, preferred_ns: str | None = None) -> Service | None:
        services = self._by_host.get(hostname)
        if not services:
            return None
        visible = (s for s in services if client_ns is None or s.visible_to(client_ns))
        return find_best_match(visible, client_ns, preferred_ns)

    def insert(self, svc: Service) -> Service | None:
        """Insert or replace a service (keeping the endpoints it already has and any staged for it)."""
        old = self._unindex(svc.key)
        endpoints = dict(svc.endpoints)  # only a local config lists endpoints on the service itself
        if old is not None:
            endpoints.update(old.endpoints)
        endpoints.update(self.staged.pop(svc.key, {}))
        self._index(replace(svc, endpoints=endpoints))
        return old

    def remove(self, key: NamespacedHostname) -> Service | None:
        """Remove a service; its endpoints are staged again so a re-added service gets them back."""
        old = self._unindex(key)
        if old is not None and old.endpoints:
            self.staged[key] = dict(old.endpoints)
        return old

    def insert_endpoint(self, key: NamespacedHostname, ep: Endpoint) -> None:
        svc = self.by_key.get(key)
        if svc is None:
            self.staged.setdefault(key, {})[ep.workload_uid] = ep
            return
        svc.endpoints[ep.workload_uid] = ep

    def remove_endpoint(self, key: NamespacedHostname, workload_uid: str) -> None:
        staged = self.staged.get(key)
        if staged is not None:
            staged.pop(workload_uid, None)
            if not staged:
                del self.staged[key]
        svc = self.by_key.get(key)
        if svc is not None:
            svc.endpoints.pop(workload_uid, None)

    def _index(self, svc: Service) -> None:
        self.by_key[svc.key] = svc
        for vip in svc.vips:
            self._by_vip.setdefault(vip, []).append(svc)
        for cidr in svc.cidr_vips:
            self._by_cidr_vip.append((cidr, svc))
        self._by_host.setdefault(svc.hostname, []).append(svc)

    def _unindex(self, key: NamespacedHostname) -> Service | None:
        svc = self.by_key.pop(key, None)
        if svc is None:
            return None
        for vip in svc.vips:
            lst = self._by_vip.get(vip)
            if lst is not None:
                lst[:] = [s for s in lst if s.key != key]
                if not lst:
                    del self._by_vip[vip]
        if svc.cidr_vips:
            self._by_cidr_vip = [(c, s) for c, s in self._by_cidr_vip if s.key != key]
        hosts = self._by_host.get(svc.hostname)
        if hosts is not None:
            hosts[:] = [s for s in hosts if s.key != key]
            if not hosts:
                del self._by_host[svc.hostname]
        return svc
