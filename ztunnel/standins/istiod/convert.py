"""The state model -> xDS protobufs: what the local control plane serves (the inverse of ``ztunnel.xds.types``).

Resource names are istiod's: a workload's ``uid``, a service's ``<namespace>/<hostname>``, a policy's
``<namespace>/<name>``. A workload with no ``uid`` in the file gets istiod's shape of one,
``<clusterId>//v1/Pod/<namespace>/<name>``, so it still has a stable, unique name.

Two things in the local schema have no xDS form and are refused with an error naming the resource: endpoints
listed on a service (over xDS, endpoints come from the workloads' ``services`` maps) and a ``workloadType`` other
than ``deployment``, ``cronjob``, ``pod`` or ``job``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from google.protobuf import any_pb2, empty_pb2
from google.protobuf.message import Message

from xds.istio.security import authorization_pb2 as sec_pb
from xds.istio.workload import workload_pb2 as wl_pb
from ztunnel.errors import ZtunnelError
from ztunnel.rbac import Action, Authorization, IPNetwork, Match, Scope, ServiceAccountMatch, StringMatch
from ztunnel.rbac import StringMatchKind as K
from ztunnel.state import StateUpdate
from ztunnel.state.service import (
    IpFamily,
    LoadBalancer,
    LoadBalancerHealthPolicy,
    LoadBalancerMode,
    LoadBalancerScope,
    Service,
    Visibility,
)
from ztunnel.state.workload import (
    AppTunnelProtocol,
    GatewayAddress,
    HealthStatus,
    InboundProtocol,
    NamespacedHostname,
    NetworkAddress,
    NetworkMode,
    Workload,
)
from ztunnel.xds.types import ADDRESS_TYPE, AUTHORIZATION_TYPE

__all__ = [
    "ADDRESS_TYPE",
    "AUTHORIZATION_TYPE",
    "ConvertError",
    "authorization_to_xds",
    "pack",
    "resources_from_update",
    "service_to_xds",
    "workload_name",
    "workload_to_xds",
]


class ConvertError(ZtunnelError, ValueError):
    """A model object that cannot be expressed as an xDS resource; the message names it."""


def pack(type_url: str, message: Message) -> any_pb2.Any:
    """``message`` in an ``Any`` with the given type URL (deterministic bytes, so versions are stable)."""
    return any_pb2.Any(type_url=type_url, value=message.SerializeToString(deterministic=True))


def _gateway(gw: GatewayAddress) -> wl_pb.GatewayAddress:
    out = wl_pb.GatewayAddress(hbone_mtls_port=gw.hbone_mtls_port)
    if isinstance(gw.destination, NetworkAddress):
        out.address.CopyFrom(
            wl_pb.NetworkAddress(network=gw.destination.network, address=gw.destination.address.packed)
        )
    else:
        out.hostname.CopyFrom(
            wl_pb.NamespacedHostname(namespace=gw.destination.namespace, hostname=gw.destination.hostname)
        )
    return out


def _ports(ports: Mapping[int, int]) -> list[wl_pb.Port]:
    return [wl_pb.Port(service_port=sp, target_port=tp) for sp, tp in sorted(ports.items())]


_WORKLOAD_TYPES = {
    "": wl_pb.DEPLOYMENT,
    "deployment": wl_pb.DEPLOYMENT,
    "cronjob": wl_pb.CRONJOB,
    "pod": wl_pb.POD,
    "job": wl_pb.JOB,
}


def workload_name(w: Workload) -> str:
    """The xDS resource name of ``w``: its uid, or istiod's shape of one when the file left it empty."""
    return w.uid or f"{w.cluster_id or 'Kubernetes'}//v1/Pod/{w.namespace}/{w.name}"


def workload_to_xds(w: Workload) -> wl_pb.Workload:
    """One workload as ``istio.workload.Workload``."""
    wtype = _WORKLOAD_TYPES.get(w.workload_type.lower())
    if wtype is None:
        raise ConvertError(
            f"workload {workload_name(w)}: workloadType {w.workload_type!r} has no xDS form; "
            "use deployment, cronjob, pod or job"
        )
    out = wl_pb.Workload(
        uid=workload_name(w),
        name=w.name,
        namespace=w.namespace,
        addresses=[ip.packed for ip in w.workload_ips],
        hostname=w.hostname,
        network=w.network,
        tunnel_protocol=wl_pb.HBONE if w.protocol is InboundProtocol.HBONE else wl_pb.NONE,
        trust_domain=w.trust_domain,
        service_account=w.service_account,
        node=w.node,
        canonical_name=w.canonical_name,
        canonical_revision=w.canonical_revision,
        workload_type=wtype,
        workload_name=w.workload_name,
        native_tunnel=w.native_tunnel,
        authorization_policies=list(w.authorization_policies),
        status=wl_pb.HEALTHY if w.status is HealthStatus.HEALTHY else wl_pb.UNHEALTHY,
        cluster_id=w.cluster_id,
        network_mode=wl_pb.HOST_NETWORK if w.network_mode is NetworkMode.HOST_NETWORK else wl_pb.STANDARD,
    )
    out.capacity.value = w.capacity
    if w.waypoint is not None:
        out.waypoint.CopyFrom(_gateway(w.waypoint))
    if w.network_gateway is not None:
        out.network_gateway.CopyFrom(_gateway(w.network_gateway))
    if w.application_tunnel is not None:
        proto = (
            wl_pb.ApplicationTunnel.PROXY
            if w.application_tunnel.protocol is AppTunnelProtocol.PROXY
            else wl_pb.ApplicationTunnel.NONE
        )
        out.application_tunnel.CopyFrom(wl_pb.ApplicationTunnel(protocol=proto, port=w.application_tunnel.port or 0))
    if w.locality.region or w.locality.zone or w.locality.subzone:
        out.locality.CopyFrom(
            wl_pb.Locality(region=w.locality.region, zone=w.locality.zone, subzone=w.locality.subzone)
        )
    for key, ports in w.services.items():
        out.services[str(key)].CopyFrom(wl_pb.PortList(ports=_ports(ports)))
    return out


_SCOPES = {
    LoadBalancerScope.REGION: wl_pb.LoadBalancing.REGION,
    LoadBalancerScope.ZONE: wl_pb.LoadBalancing.ZONE,
    LoadBalancerScope.SUBZONE: wl_pb.LoadBalancing.SUBZONE,
    LoadBalancerScope.NODE: wl_pb.LoadBalancing.NODE,
    LoadBalancerScope.CLUSTER: wl_pb.LoadBalancing.CLUSTER,
    LoadBalancerScope.NETWORK: wl_pb.LoadBalancing.NETWORK,
}
_MODES = {
    LoadBalancerMode.STANDARD: wl_pb.LoadBalancing.UNSPECIFIED_MODE,
    LoadBalancerMode.STRICT: wl_pb.LoadBalancing.STRICT,
    LoadBalancerMode.FAILOVER: wl_pb.LoadBalancing.FAILOVER,
    LoadBalancerMode.PASSTHROUGH: wl_pb.LoadBalancing.PASSTHROUGH,
}
_FAMILIES = {
    None: wl_pb.AUTOMATIC,
    IpFamily.IPV4: wl_pb.IPV4_ONLY,
    IpFamily.IPV6: wl_pb.IPV6_ONLY,
    IpFamily.DUAL: wl_pb.DUAL,
}


def _load_balancing(lb: LoadBalancer) -> wl_pb.LoadBalancing:
    return wl_pb.LoadBalancing(
        routing_preference=[_SCOPES[s] for s in lb.routing_preferences],
        mode=_MODES[lb.mode],
        health_policy=(
            wl_pb.LoadBalancing.ALLOW_ALL
            if lb.health_policy is LoadBalancerHealthPolicy.ALLOW_ALL
            else wl_pb.LoadBalancing.ONLY_HEALTHY
        ),
    )


def service_to_xds(s: Service) -> wl_pb.Service:
    """One service as ``istio.workload.Service``."""
    if s.endpoints:
        raise ConvertError(
            f"service {s.key}: endpoints listed on a service cannot be served over xDS; "
            "list the service in each workload's services map instead"
        )
    out = wl_pb.Service(
        name=s.name,
        namespace=s.namespace,
        hostname=s.hostname,
        addresses=[wl_pb.NetworkAddress(network=v.network, address=v.address.packed) for v in s.vips],
        ports=_ports(s.ports),
        subject_alt_names=list(s.subject_alt_names),
        ip_families=_FAMILIES[s.ip_families],
        canonical=s.canonical,
        visibility=wl_pb.Service.NAMESPACE if s.visibility is Visibility.NAMESPACE else wl_pb.Service.PUBLIC,
    )
    for c in s.cidr_vips:
        out.addresses.append(
            wl_pb.NetworkAddress(network=c.network, address=c.cidr.network_address.packed, length=c.cidr.prefixlen)
        )
    if s.waypoint is not None:
        out.waypoint.CopyFrom(_gateway(s.waypoint))
    for ww in s.weighted_waypoints:
        out.weighted_waypoints.append(wl_pb.WeightedWaypoint(destination=_gateway(ww.destination), weight=ww.weight))
    if s.load_balancer is not None:
        out.load_balancing.CopyFrom(_load_balancing(s.load_balancer))
    return out


def _strings(items: Iterable[StringMatch]) -> list[sec_pb.StringMatch]:
    out = []
    for m in items:
        if m.kind is K.EXACT:
            out.append(sec_pb.StringMatch(exact=m.value))
        elif m.kind is K.PREFIX:
            out.append(sec_pb.StringMatch(prefix=m.value))
        elif m.kind is K.SUFFIX:
            out.append(sec_pb.StringMatch(suffix=m.value))
        else:
            out.append(sec_pb.StringMatch(presence=empty_pb2.Empty()))
    return out


def _cidrs(items: Iterable[IPNetwork]) -> list[sec_pb.Address]:
    return [sec_pb.Address(address=n.network_address.packed, length=n.prefixlen) for n in items]


def _accounts(items: Iterable[ServiceAccountMatch]) -> list[sec_pb.ServiceAccountMatch]:
    return [sec_pb.ServiceAccountMatch(namespace=a.namespace, serviceAccount=a.service_account) for a in items]


def _match(m: Match) -> sec_pb.Match:
    return sec_pb.Match(
        namespaces=_strings(m.namespaces),
        not_namespaces=_strings(m.not_namespaces),
        principals=_strings(m.principals),
        not_principals=_strings(m.not_principals),
        source_ips=_cidrs(m.source_ips),
        not_source_ips=_cidrs(m.not_source_ips),
        destination_ips=_cidrs(m.destination_ips),
        not_destination_ips=_cidrs(m.not_destination_ips),
        destination_ports=list(m.destination_ports),
        not_destination_ports=list(m.not_destination_ports),
        service_accounts=_accounts(m.service_accounts),
        not_service_accounts=_accounts(m.not_service_accounts),
    )


_RBAC_SCOPES = {
    Scope.GLOBAL: sec_pb.GLOBAL,
    Scope.NAMESPACE: sec_pb.NAMESPACE,
    Scope.WORKLOAD_SELECTOR: sec_pb.WORKLOAD_SELECTOR,
}


def authorization_to_xds(p: Authorization) -> sec_pb.Authorization:
    """One policy as ``istio.security.Authorization``."""
    return sec_pb.Authorization(
        name=p.name,
        namespace=p.namespace,
        scope=_RBAC_SCOPES[p.scope],
        action=sec_pb.DENY if p.action is Action.DENY else sec_pb.ALLOW,
        rules=[
            sec_pb.Rule(clauses=[sec_pb.Clause(matches=[_match(m) for m in clause]) for clause in rule])
            for rule in p.rules
        ],
        dry_run=p.dry_run,
    )


def resources_from_update(update: StateUpdate) -> dict[str, dict[str, Message]]:
    """Every resource of a parsed local config, by type URL and resource name.

    Address resources are ``istio.workload.Address`` wrappers (the payload istiod sends); raises
    :class:`ConvertError` for anything without an xDS form or for two resources with one name.
    """
    addresses: dict[str, Message] = {}
    for w in update.workloads:
        name = workload_name(w)
        if name in addresses:
            raise ConvertError(f"two workloads have the resource name {name!r}")
        addresses[name] = wl_pb.Address(workload=workload_to_xds(w))
    for s in update.services:
        name = str(NamespacedHostname(s.namespace, s.hostname))
        if name in addresses:
            raise ConvertError(f"service {name!r} has the same resource name as a workload")
        addresses[name] = wl_pb.Address(service=service_to_xds(s))
    policies: dict[str, Message] = {}
    for p in update.policies:
        policies[p.key] = authorization_to_xds(p)
    return {ADDRESS_TYPE: addresses, AUTHORIZATION_TYPE: policies}
