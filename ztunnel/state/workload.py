"""Workloads: the pods (and VMs, ServiceEntry endpoints) of the mesh, and their store.

The model mirrors upstream ``state/workload.rs``: values are immutable, and the store keeps the indexes the
per-connection path needs (by UID, by ``network/ip``, node-local by identity) so each lookup is one dict access.
"""

from __future__ import annotations

import enum
import ipaddress
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from ztunnel.identity.spiffe import Identity

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
EMPTY_PORTS: Mapping[int, int] = MappingProxyType({})


def _no_services() -> Mapping[NamespacedHostname, Mapping[int, int]]:
    return MappingProxyType({})


class InboundProtocol(enum.Enum):
    """How a workload accepts traffic: plain ``TCP``, or ``HBONE`` (it is in the mesh, behind a ztunnel)."""

    TCP = "TCP"
    HBONE = "HBONE"


class NetworkMode(enum.Enum):
    STANDARD = "Standard"
    HOST_NETWORK = "HostNetwork"


class HealthStatus(enum.Enum):
    HEALTHY = "Healthy"
    UNHEALTHY = "Unhealthy"


class AppTunnelProtocol(enum.Enum):
    NONE = "NONE"
    PROXY = "PROXY"


def canonical_ip(ip: IPAddress) -> IPAddress:
    """``::ffff:a.b.c.d`` is the IPv4 address (upstream canonicalises every address it looks up)."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


@dataclass(frozen=True, slots=True)
class NetworkAddress:
    """An IP on a network; written ``network/ip`` (an empty network is ``/10.0.0.1``)."""

    network: str
    address: IPAddress

    @classmethod
    def parse(cls, text: str) -> NetworkAddress:
        network, sep, ip = text.partition("/")
        if not sep:
            raise ValueError(f"{text!r} is not network/IP (e.g. '/10.0.0.1' or 'net1/10.0.0.1')")
        try:
            return cls(network, canonical_ip(ipaddress.ip_address(ip)))
        except ValueError:
            raise ValueError(f"{text!r}: {ip!r} is not an IP address") from None

    def __str__(self) -> str:
        return f"{self.network}/{self.address}"


@dataclass(frozen=True, slots=True)
class NetworkCidr:
    network: str
    cidr: IPNetwork

    @classmethod
    def parse(cls, text: str) -> NetworkCidr:
        network, sep, cidr = text.partition("/")
        if not sep:
            raise ValueError(f"{text!r} is not network/CIDR (e.g. '/10.96.0.0/12')")
        try:
            return cls(network, ipaddress.ip_network(cidr, strict=True))
        except ValueError as e:
            raise ValueError(f"{text!r}: {e}") from None

    def __str__(self) -> str:
        return f"{self.network}/{self.cidr}"


@dataclass(frozen=True, slots=True)
class NamespacedHostname:
    """A service key, written ``namespace/hostname``."""

    namespace: str
    hostname: str

    @classmethod
    def parse(cls, text: str) -> NamespacedHostname:
        namespace, sep, hostname = text.partition("/")
        if not sep:
            raise ValueError(f"{text!r} is not namespace/hostname")
        return cls(namespace, hostname)

    def __str__(self) -> str:
        return f"{self.namespace}/{self.hostname}"


@dataclass(frozen=True, slots=True)
class GatewayAddress:
    """Where a waypoint or network gateway is: an address or a service hostname, and its HBONE port."""

    destination: NetworkAddress | NamespacedHostname
    hbone_mtls_port: int = 15008


@dataclass(frozen=True, slots=True)
class ApplicationTunnel:
    protocol: AppTunnelProtocol
    port: int | None = None


@dataclass(frozen=True, slots=True)
class Locality:
    region: str = ""
    zone: str = ""
    subzone: str = ""


@dataclass(frozen=True, slots=True)
class Workload:
    """One workload as xDS describes it. ``identity`` is derived once at construction (it is read per connection)."""

    uid: str
    name: str
    namespace: str
    workload_ips: tuple[IPAddress, ...] = ()
    trust_domain: str = ""
    service_account: str = ""
    network: str = ""
    protocol: InboundProtocol = InboundProtocol.TCP
    network_mode: NetworkMode = NetworkMode.STANDARD
    waypoint: GatewayAddress | None = None
    network_gateway: GatewayAddress | None = None
    workload_name: str = ""
    workload_type: str = ""
    canonical_name: str = ""
    canonical_revision: str = ""
    hostname: str = ""
    node: str = ""
    native_tunnel: bool = False
    application_tunnel: ApplicationTunnel | None = None
    authorization_policies: tuple[str, ...] = ()
    status: HealthStatus = HealthStatus.HEALTHY
    cluster_id: str = ""
    locality: Locality = Locality()
    # service key -> {service port: target port}; the source of each service's endpoint list.
    services: Mapping[NamespacedHostname, Mapping[int, int]] = field(default_factory=_no_services)
    capacity: int = 1
    identity: Identity = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "identity", Identity(self.trust_domain, self.namespace, self.service_account))

    def __str__(self) -> str:
        return f"Workload{{{self.name} with uid {self.uid} ({self.protocol.value})}}"


class WorkloadStore:
    """Workloads by UID, by ``network/ip`` and, for this node, by identity. Mutated only by :class:`ProxyState`."""

    def __init__(self, local_node: str | None = None) -> None:
        self.local_node = local_node
        self.by_uid: dict[str, Workload] = {}
        # Several workloads may claim one address (a pod and a ServiceEntry); the ranked winner is cached here.
        self._by_addr: dict[NetworkAddress, list[Workload]] = {}
        self._best_by_addr: dict[NetworkAddress, Workload] = {}
        self._node_local_by_identity: dict[Identity, set[str]] = {}

    def __len__(self) -> int:
        return len(self.by_uid)

    def __iter__(self) -> Iterator[Workload]:
        return iter(self.by_uid.values())

    def find_uid(self, uid: str) -> Workload | None:
        return self.by_uid.get(uid)

    def find_address(self, addr: NetworkAddress) -> Workload | None:
        """The workload at ``network/ip`` (host-network workloads are not indexed by IP, as upstream)."""
        return self._best_by_addr.get(addr)

    def is_node_local(self, w: Workload) -> bool:
        return self.local_node is None or w.node == self.local_node

    def node_local_identities(self) -> Iterable[Identity]:
        return self._node_local_by_identity.keys()

    def node_local_uids(self, identity: Identity) -> set[str]:
        return self._node_local_by_identity.get(identity, set())

    def find_local(self, namespace: str, name: str, service_account: str) -> Workload | None:
        """The node-local workload with this name/namespace/service account (how a proxy finds its own workload)."""
        for w in self.by_uid.values():
            if (
                w.name == name
                and w.namespace == namespace
                and w.service_account == service_account
                and self.is_node_local(w)
            ):
                return w
        return None

    def insert(self, w: Workload) -> Workload | None:
        """Insert or replace by UID; returns the previous workload with that UID."""
        old = self.remove(w.uid)
        self.by_uid[w.uid] = w
        if w.network_mode is NetworkMode.STANDARD:
            for ip in w.workload_ips:
                addr = NetworkAddress(w.network, ip)
                self._by_addr.setdefault(addr, []).append(w)
                self._rank(addr)
        if self.is_node_local(w):
            self._node_local_by_identity.setdefault(w.identity, set()).add(w.uid)
        return old

    def remove(self, uid: str) -> Workload | None:
        w = self.by_uid.pop(uid, None)
        if w is None:
            return None
        for ip in w.workload_ips:
            addr = NetworkAddress(w.network, ip)
            entries = self._by_addr.get(addr)
            if entries is None:
                continue
            entries[:] = [e for e in entries if e.uid != uid]
            if entries:
                self._rank(addr)
            else:
                del self._by_addr[addr]
                self._best_by_addr.pop(addr, None)
        uids = self._node_local_by_identity.get(w.identity)
        if uids is not None:
            uids.discard(uid)
            if not uids:
                del self._node_local_by_identity[w.identity]
        return w

    def _rank(self, addr: NetworkAddress) -> None:
        # On conflict prefer pods (not spoofable) and then HBONE workloads, as upstream's WorkloadByAddr::get.
        # max() keeps the first of equals, so ties go to the earliest inserted.
        self._best_by_addr[addr] = max(
            self._by_addr[addr],
            key=lambda e: (("//Pod/" in e.uid) * 2) + (e.protocol is InboundProtocol.HBONE),
        )
