"""Pure conversion from the xDS protobufs to the state model (upstream ``state/workload.rs``, ``state/service.rs``,
``rbac.rs`` ``TryFrom`` impls, and the type URLs of ``xds/types.rs``).

One function per resource kind; each returns a model value or raises :class:`ConversionError` whose message names
the field that is wrong (``addresses[1]: IP address must be 4 or 16 bytes, got 5``), so a NACK's ``error_detail``
(``"<resource name>: <reason>"``) tells the control-plane operator exactly what to fix.

The rules are upstream's:

* an empty ``trust_domain`` means ``cluster.local``, an empty ``service_account`` means ``default`` and an empty
  ``cluster_id`` means ``Kubernetes``; an unset ``capacity`` means 1;
* IPs are raw bytes of length 4 or 16 (anything else rejects the resource); IPv4-mapped IPv6 workload and
  service addresses are stored as IPv4, as every lookup canonicalises them, but authorization CIDRs are kept as
  sent (a mapped CIDR stays IPv6 and so matches no IPv4 peer, as upstream's ``IpNet``);
* ``LEGACY_ISTIO_MTLS`` is rejected (ztunnel cannot originate it), as is any enum value the schema does not
  define, except ``workload_type`` (unknown reads as ``deployment``, prost's default) and ``visibility``
  (unknown reads as ``PUBLIC``: fail open rather than drop the service);
* a service address with a ``length`` shorter than the full prefix is a CIDR VIP;
* in authorization policies a ``StringMatch`` with no match set is dropped from its match (upstream's
  ``filter_map``), not rejected.

Deviations, deliberately stricter: ports above 65535 (upstream truncates them to 16 bits) reject the resource,
because a truncated port would silently route or authorize the wrong port; so does an authorization CIDR that does
not parse (bytes not 4 or 16 long, prefix longer than the address), which upstream drops from its match, silently
widening or narrowing the rule.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any

from xds.istio.security import authorization_pb2 as sec_pb
from xds.istio.workload import workload_pb2 as wl_pb
from ztunnel.errors import ZtunnelError
from ztunnel.identity.spiffe import DEFAULT_TRUST_DOMAIN
from ztunnel.rbac import (
    Action,
    Authorization,
    IPNetwork,
    Match,
    Scope,
    ServiceAccountMatch,
    StringMatch,
    StringMatchKind,
)
from ztunnel.state.service import (
    IpFamily,
    LoadBalancer,
    LoadBalancerHealthPolicy,
    LoadBalancerMode,
    LoadBalancerScope,
    Service,
    Visibility,
    WeightedWaypoint,
)
from ztunnel.state.workload import (
    ApplicationTunnel,
    AppTunnelProtocol,
    GatewayAddress,
    HealthStatus,
    InboundProtocol,
    IPAddress,
    Locality,
    NamespacedHostname,
    NetworkAddress,
    NetworkCidr,
    NetworkMode,
    Workload,
    canonical_ip,
)

__all__ = [
    "ADDRESS_TYPE",
    "AUTHORIZATION_TYPE",
    "DEFAULT_CLUSTER_ID",
    "DEFAULT_SERVICE_ACCOUNT",
    "ConversionError",
    "address_from_xds",
    "authorization_from_xds",
    "ip_from_bytes",
    "service_from_xds",
    "workload_from_xds",
]

ADDRESS_TYPE = "type.googleapis.com/istio.workload.Address"
AUTHORIZATION_TYPE = "type.googleapis.com/istio.security.Authorization"

DEFAULT_SERVICE_ACCOUNT = "default"
DEFAULT_CLUSTER_ID = "Kubernetes"
MAX_PORT = 65535


class ConversionError(ZtunnelError, ValueError):
    """A resource that cannot be converted. ``str()`` is ``<field path>: <problem>``."""

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        self.problem = problem
        super().__init__(f"{field}: {problem}" if field else problem)

    def within(self, prefix: str) -> ConversionError:
        """The same error with ``prefix`` prepended to the field path (``waypoint`` + ``address`` ...)."""
        return ConversionError(f"{prefix}.{self.field}" if self.field else prefix, self.problem)


# -- primitives --------------------------------------------------------------------------------------------------


def ip_from_bytes(raw: bytes, field: str) -> IPAddress:
    """Raw IP bytes (4 or 16 long, upstream ``byte_to_ip``) as an address, IPv4-mapped IPv6 canonicalised."""
    return canonical_ip(_raw_ip(raw, field))


def _raw_ip(raw: bytes, field: str) -> IPAddress:
    """Raw IP bytes (4 or 16 long) as an address, exactly as sent (a mapped IPv6 address stays IPv6)."""
    if len(raw) == 4:
        return ipaddress.IPv4Address(raw)
    if len(raw) == 16:
        return ipaddress.IPv6Address(raw)
    raise ConversionError(field, f"IP address must be 4 or 16 bytes, got {len(raw)}")


def _enum_name(wrapper: Any, value: int, field: str) -> str:
    # proto3 enums are open: an unknown number survives decoding as a plain int, so it is checked here (upstream
    # prost's TryFrom<i32> fails the same way).
    try:
        return str(wrapper.Name(value))
    except ValueError:
        raise ConversionError(field, f"unknown enum value {value}") from None


def _port(value: int, field: str) -> int:
    if value > MAX_PORT:
        raise ConversionError(field, f"port {value} is out of range (0-{MAX_PORT})")
    return value


def _port_map(ports: Iterable[wl_pb.Port], field: str) -> Mapping[int, int]:
    out: dict[int, int] = {}
    for i, p in enumerate(ports):
        out[_port(p.service_port, f"{field}[{i}].service_port")] = _port(p.target_port, f"{field}[{i}].target_port")
    return MappingProxyType(out)


def _namespaced_hostname(text: str, field: str) -> NamespacedHostname:
    namespace, sep, hostname = text.partition("/")
    if not sep:
        raise ConversionError(field, f"failed to parse namespaced hostname {text!r} (expected namespace/hostname)")
    return NamespacedHostname(namespace, hostname)


def _gateway(gw: wl_pb.GatewayAddress, field: str) -> GatewayAddress:
    port = _port(gw.hbone_mtls_port, f"{field}.hbone_mtls_port")
    kind = gw.WhichOneof("destination")
    if kind == "address":
        addr = gw.address
        ip = ip_from_bytes(addr.address, f"{field}.address.address")
        return GatewayAddress(NetworkAddress(addr.network, ip), port)
    if kind == "hostname":
        return GatewayAddress(NamespacedHostname(gw.hostname.namespace, gw.hostname.hostname), port)
    raise ConversionError(field, "nonempty gateway address is missing address")


# -- workloads ---------------------------------------------------------------------------------------------------


_TUNNEL = {
    "NONE": InboundProtocol.TCP,
    "HBONE": InboundProtocol.HBONE,
}
_NETWORK_MODE = {"STANDARD": NetworkMode.STANDARD, "HOST_NETWORK": NetworkMode.HOST_NETWORK}
_STATUS = {"HEALTHY": HealthStatus.HEALTHY, "UNHEALTHY": HealthStatus.UNHEALTHY}
_APP_TUNNEL = {"NONE": AppTunnelProtocol.NONE, "PROXY": AppTunnelProtocol.PROXY}


def workload_from_xds(w: wl_pb.Workload) -> Workload:
    """Convert one ``istio.workload.Workload``; raise :class:`ConversionError` naming the bad field."""
    tunnel = _enum_name(wl_pb.TunnelProtocol, w.tunnel_protocol, "tunnel_protocol")
    if tunnel == "LEGACY_ISTIO_MTLS":
        raise ConversionError("tunnel_protocol", "unsupported tunnel protocol: legacy istio mtls")
    network_mode = _NETWORK_MODE[_enum_name(wl_pb.NetworkMode, w.network_mode, "network_mode")]
    status = _STATUS[_enum_name(wl_pb.WorkloadStatus, w.status, "status")]
    ips = tuple(ip_from_bytes(raw, f"addresses[{i}]") for i, raw in enumerate(w.addresses))
    # prost's getter maps an unknown workload_type to the default (DEPLOYMENT); the label is the lowercase name.
    try:
        workload_type = wl_pb.WorkloadType.Name(w.workload_type).lower()
    except ValueError:
        workload_type = "deployment"
    tunnel_app = None
    if w.HasField("application_tunnel"):
        at = w.application_tunnel
        proto = _APP_TUNNEL[_enum_name(wl_pb.ApplicationTunnel.Protocol, at.protocol, "application_tunnel.protocol")]
        tunnel_app = ApplicationTunnel(proto, _port(at.port, "application_tunnel.port") or None)
    services: dict[NamespacedHostname, Mapping[int, int]] = {}
    for key in sorted(w.services):
        field = f"services[{key!r}]"
        services[_namespaced_hostname(key, field)] = _port_map(w.services[key].ports, f"{field}.ports")
    locality = Locality()
    if w.HasField("locality"):
        locality = Locality(w.locality.region, w.locality.zone, w.locality.subzone)
    return Workload(
        uid=w.uid,
        name=w.name,
        namespace=w.namespace,
        workload_ips=ips,
        trust_domain=w.trust_domain or DEFAULT_TRUST_DOMAIN,
        service_account=w.service_account or DEFAULT_SERVICE_ACCOUNT,
        network=w.network,
        protocol=_TUNNEL[tunnel],
        network_mode=network_mode,
        waypoint=_gateway(w.waypoint, "waypoint") if w.HasField("waypoint") else None,
        network_gateway=_gateway(w.network_gateway, "network_gateway") if w.HasField("network_gateway") else None,
        workload_name=w.workload_name,
        workload_type=workload_type,
        canonical_name=w.canonical_name,
        canonical_revision=w.canonical_revision,
        hostname=w.hostname,
        node=w.node,
        native_tunnel=w.native_tunnel,
        application_tunnel=tunnel_app,
        authorization_policies=tuple(w.authorization_policies),
        status=status,
        cluster_id=w.cluster_id or DEFAULT_CLUSTER_ID,
        locality=locality,
        services=MappingProxyType(services),
        capacity=w.capacity.value if w.HasField("capacity") else 1,
    )


# -- services ----------------------------------------------------------------------------------------------------

_SCOPE = {
    "REGION": LoadBalancerScope.REGION,
    "ZONE": LoadBalancerScope.ZONE,
    "SUBZONE": LoadBalancerScope.SUBZONE,
    "NODE": LoadBalancerScope.NODE,
    "CLUSTER": LoadBalancerScope.CLUSTER,
    "NETWORK": LoadBalancerScope.NETWORK,
}
_LB_MODE = {
    "UNSPECIFIED_MODE": LoadBalancerMode.STANDARD,
    "STRICT": LoadBalancerMode.STRICT,
    "FAILOVER": LoadBalancerMode.FAILOVER,
    "PASSTHROUGH": LoadBalancerMode.PASSTHROUGH,
}
_HEALTH = {"ONLY_HEALTHY": LoadBalancerHealthPolicy.ONLY_HEALTHY, "ALLOW_ALL": LoadBalancerHealthPolicy.ALLOW_ALL}
_IP_FAMILIES = {"AUTOMATIC": None, "IPV4_ONLY": IpFamily.IPV4, "IPV6_ONLY": IpFamily.IPV6, "DUAL": IpFamily.DUAL}


def _load_balancer(lb: wl_pb.LoadBalancing) -> LoadBalancer:
    prefs = []
    for i, raw in enumerate(lb.routing_preference):
        field = f"load_balancing.routing_preference[{i}]"
        name = _enum_name(wl_pb.LoadBalancing.Scope, raw, field)
        if name not in _SCOPE:
            raise ConversionError(field, f"invalid target {name}")
        prefs.append(_SCOPE[name])
    return LoadBalancer(
        routing_preferences=tuple(prefs),
        mode=_LB_MODE[_enum_name(wl_pb.LoadBalancing.Mode, lb.mode, "load_balancing.mode")],
        health_policy=_HEALTH[
            _enum_name(wl_pb.LoadBalancing.HealthPolicy, lb.health_policy, "load_balancing.health_policy")
        ],
    )


def service_from_xds(s: wl_pb.Service) -> Service:
    """Convert one ``istio.workload.Service``; raise :class:`ConversionError` naming the bad field."""
    vips: list[NetworkAddress] = []
    cidrs: list[NetworkCidr] = []
    for i, addr in enumerate(s.addresses):
        field = f"addresses[{i}]"
        ip = ip_from_bytes(addr.address, f"{field}.address")
        full = 32 if ip.version == 4 else 128
        if addr.HasField("length") and addr.length != full:
            if addr.length > full:
                raise ConversionError(f"{field}.length", f"invalid cidr: prefix length {addr.length} > {full}")
            cidrs.append(NetworkCidr(addr.network, ipaddress.ip_network((ip, addr.length), strict=False)))
        else:
            vips.append(NetworkAddress(addr.network, ip))
    weighted = []
    for i, ww in enumerate(s.weighted_waypoints):
        field = f"weighted_waypoints[{i}].destination"
        if not ww.HasField("destination"):
            raise ConversionError(field, "nonempty gateway address is missing address")
        weighted.append(WeightedWaypoint(_gateway(ww.destination, field), ww.weight))
    try:
        visibility_name = wl_pb.Service.Visibility.Name(s.visibility)
    except ValueError:
        visibility_name = "PUBLIC"  # unknown: fail open rather than drop the service, as upstream
    return Service(
        name=s.name,
        namespace=s.namespace,
        hostname=s.hostname,
        vips=tuple(vips),
        cidr_vips=tuple(cidrs),
        ports=_port_map(s.ports, "ports"),
        subject_alt_names=tuple(s.subject_alt_names),
        waypoint=_gateway(s.waypoint, "waypoint") if s.HasField("waypoint") else None,
        weighted_waypoints=tuple(weighted),
        load_balancer=_load_balancer(s.load_balancing) if s.HasField("load_balancing") else None,
        ip_families=_IP_FAMILIES[_enum_name(wl_pb.IPFamilies, s.ip_families, "ip_families")],
        canonical=s.canonical,
        visibility=Visibility.NAMESPACE if visibility_name == "NAMESPACE" else Visibility.PUBLIC,
    )


def address_from_xds(a: wl_pb.Address) -> Workload | Service:
    """An ``Address`` resource: its workload or its service (an empty ``Address`` is rejected)."""
    kind = a.WhichOneof("type")
    if kind == "workload":
        try:
            return workload_from_xds(a.workload)
        except ConversionError as e:
            raise e.within("workload") from None
    if kind == "service":
        try:
            return service_from_xds(a.service)
        except ConversionError as e:
            raise e.within("service") from None
    raise ConversionError("type", "unknown address type: neither workload nor service is set")


# -- authorization -----------------------------------------------------------------------------------------------

_RBAC_SCOPE = {"GLOBAL": Scope.GLOBAL, "NAMESPACE": Scope.NAMESPACE, "WORKLOAD_SELECTOR": Scope.WORKLOAD_SELECTOR}
_RBAC_ACTION = {"ALLOW": Action.ALLOW, "DENY": Action.DENY}


def _string_matches(items: Iterable[sec_pb.StringMatch]) -> tuple[StringMatch, ...]:
    out = []
    for m in items:
        kind = m.WhichOneof("match_type")
        if kind == "exact":
            out.append(StringMatch(StringMatchKind.EXACT, m.exact))
        elif kind == "prefix":
            out.append(StringMatch(StringMatchKind.PREFIX, m.prefix))
        elif kind == "suffix":
            out.append(StringMatch(StringMatchKind.SUFFIX, m.suffix))
        elif kind == "presence":
            out.append(StringMatch(StringMatchKind.PRESENCE))
        # No match type set: dropped, as upstream.
    return tuple(out)


def _cidr(a: sec_pb.Address, field: str) -> IPNetwork:
    """One policy CIDR, exactly as sent: the raw bytes are *not* canonicalised, so ``::ffff:10.0.0.0/104`` stays an
    IPv6 network, as upstream's ``IpNet::new(byte_to_ip(..), length)``. Connection addresses are canonical (IPv4),
    and a network matches only addresses of its own family, so a mapped CIDR matches no IPv4 peer (upstream's
    ``IpNet::contains``). Host bits are kept out of the match, as ``IpNet::contains`` masks them."""
    ip = _raw_ip(a.address, field)
    full = 32 if ip.version == 4 else 128
    if a.length > full:
        raise ConversionError(field, f"invalid CIDR {ip}/{a.length}: prefix length {a.length} > {full}")
    return ipaddress.ip_network((ip, a.length), strict=False)


def _cidrs(items: Iterable[sec_pb.Address], field: str) -> tuple[IPNetwork, ...]:
    # Deliberately stricter than upstream, which drops an entry that does not parse (and truncates the length to 8
    # bits first, so /264 reads as /8): dropping one entry of ``notIpBlocks``, or the only one of ``ipBlocks``,
    # widens or narrows a rule silently. istiod never sends such an entry (it skips unparsable ipBlocks itself), so
    # one can only come from a broken control plane, and a NACK naming it is the safe answer.
    return tuple(_cidr(a, f"{field}[{i}]") for i, a in enumerate(items))


def _ports(items: Iterable[int], field: str) -> tuple[int, ...]:
    return tuple(_port(p, f"{field}[{i}]") for i, p in enumerate(items))


def _accounts(items: Iterable[sec_pb.ServiceAccountMatch]) -> tuple[ServiceAccountMatch, ...]:
    return tuple(ServiceAccountMatch(a.namespace, a.serviceAccount) for a in items)


def _match(m: sec_pb.Match, field: str) -> Match:
    return Match(
        namespaces=_string_matches(m.namespaces),
        not_namespaces=_string_matches(m.not_namespaces),
        service_accounts=_accounts(m.service_accounts),
        not_service_accounts=_accounts(m.not_service_accounts),
        principals=_string_matches(m.principals),
        not_principals=_string_matches(m.not_principals),
        source_ips=_cidrs(m.source_ips, f"{field}.source_ips"),
        not_source_ips=_cidrs(m.not_source_ips, f"{field}.not_source_ips"),
        destination_ips=_cidrs(m.destination_ips, f"{field}.destination_ips"),
        not_destination_ips=_cidrs(m.not_destination_ips, f"{field}.not_destination_ips"),
        destination_ports=_ports(m.destination_ports, f"{field}.destination_ports"),
        not_destination_ports=_ports(m.not_destination_ports, f"{field}.not_destination_ports"),
    )


def authorization_from_xds(a: sec_pb.Authorization) -> Authorization:
    """Convert one ``istio.security.Authorization``; raise :class:`ConversionError` naming the bad field."""
    rules = tuple(
        tuple(
            tuple(_match(m, f"rules[{i}].clauses[{j}].matches[{k}]") for k, m in enumerate(clause.matches))
            for j, clause in enumerate(rule.clauses)
        )
        for i, rule in enumerate(a.rules)
    )
    return Authorization(
        name=a.name,
        namespace=a.namespace,
        scope=_RBAC_SCOPE[_enum_name(sec_pb.Scope, a.scope, "scope")],
        action=_RBAC_ACTION[_enum_name(sec_pb.Action, a.action, "action")],
        rules=rules,
        dry_run=a.dry_run,
    )
