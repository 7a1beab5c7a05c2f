"""Finding the upstream for a destination: service VIP load balancing, port mapping, waypoints and gateways.

Upstream ``state.rs`` (``find_upstream``, ``load_balance``, ``finalize_upstream``, ``fetch_waypoint``). Pure: reads a
:class:`~ztunnel.state.ProxyState`; randomness comes from an injected ``random.Random`` so tests are exact.
"""

from __future__ import annotations

import enum
import functools
import logging
import random
from dataclasses import dataclass
from typing import Any, Protocol

from ztunnel.errors import ZtunnelError
from ztunnel.identity.spiffe import Identity
from ztunnel.state import ProxyState
from ztunnel.state.service import Endpoint, IpFamily, LoadBalancerMode, LoadBalancerScope, Service
from ztunnel.state.workload import (
    GatewayAddress,
    IPAddress,
    NamespacedHostname,
    NetworkAddress,
    Workload,
)

log = logging.getLogger("ztunnel.state")


class Trace(Protocol):
    """Told each step of a routing decision and why (``ztunnel explain``). The proxy passes none: every call site
    is ``if trace is not None``, so routing a connection pays one comparison per step for the feature."""

    def __call__(self, step: str, message: str, /, **data: Any) -> None: ...


class ResolutionMode(enum.Enum):
    """``STANDARD``: a user-addressed service; ``WAYPOINT``: reaching a waypoint, where an app tunnel frees the port."""

    STANDARD = "standard"
    WAYPOINT = "waypoint"


class UpstreamError(ZtunnelError):
    """No way to reach the destination; the message says why (for the access log)."""


@dataclass(frozen=True, slots=True)
class ServiceDescription:
    hostname: str
    name: str
    namespace: str

    @classmethod
    def of(cls, svc: Service) -> ServiceDescription:
        """The description of ``svc``, made once per service name (one per routed connection before, each side)."""
        hit = _DESCRIPTIONS.get(svc.hostname)
        if hit is not None and hit.name == svc.name and hit.namespace == svc.namespace:
            return hit
        if len(_DESCRIPTIONS) >= 4096:
            _DESCRIPTIONS.clear()
        desc = _DESCRIPTIONS[svc.hostname] = cls(svc.hostname, svc.name, svc.namespace)
        return desc


# Descriptions of recent services by hostname: three strings each, so no Service object (with its endpoints) that an
# xDS update replaced is kept alive by the cache.
_DESCRIPTIONS: dict[str, ServiceDescription] = {}


@dataclass(frozen=True, slots=True)
class Upstream:
    """The chosen destination workload, the IP to use (None: through its network gateway) and the port."""

    workload: Workload
    selected_ip: IPAddress | None
    port: int
    service_sans: tuple[str, ...] = ()
    destination_service: ServiceDescription | None = None
    needs_dns: bool = False  # only a hostname is known: resolve ``workload.hostname`` before connecting

    def workload_and_services_san(self) -> tuple[Identity, ...]:
        """Identities the server may present: the service's SANs, then the workload's own identity.

        Duplicates are dropped (first occurrence kept): a service whose SAN is its workloads' identity is the common
        case, and the list is shown to operators in the identity-mismatch error.
        """
        out: list[Identity] = []
        for san in self.service_sans:
            ident = _san_identity(san)
            if ident is None:
                log.warning("ignoring invalid SAN %s", san)
            elif ident not in out:
                out.append(ident)
        if self.workload.identity not in out:
            out.append(self.workload.identity)
        return tuple(out)


@functools.lru_cache(maxsize=4096)
def _san_identity(san: str) -> Identity | None:
    # A service's SANs are the same few strings on every connection to it: each parsed once (identities are
    # immutable values, so a bounded cache of them is safe to share), not on every routed connection.
    return Identity.try_parse(san)


_ORIGINAL_DESTINATION = object()


def find_upstream(
    state: ProxyState,
    network: str,
    source: Workload,
    ip: IPAddress,
    port: int,
    mode: ResolutionMode,
    rng: random.Random,
    trace: Trace | None = None,
    vip_service: tuple[Service | None] | None = None,
) -> tuple[Workload, int, Service | None] | object | None:
    """(workload, target port, service) for ``ip:port``; the passthrough marker; or None if nothing matches.

    ``vip_service``: the caller's own ``get_best_by_vip`` answer for the same network, address and namespace (in a
    1-tuple: None is an answer), so a connection looks the VIP up once."""
    addr = NetworkAddress(network, ip)
    svc = vip_service[0] if vip_service is not None else state.services.get_best_by_vip(addr, source.namespace)
    if svc is not None:
        if svc.load_balancer is not None and svc.load_balancer.mode is LoadBalancerMode.PASSTHROUGH:
            if trace is not None:
                trace("passthrough", f"service {svc.namespace}/{svc.hostname} has load balancer mode Passthrough")
            return _ORIGINAL_DESTINATION
        return find_upstream_from_service(state, source, port, mode, svc, rng, trace)
    wl = state.workloads.find_address(addr)
    if trace is not None:
        found = f"workload {wl.namespace}/{wl.name} (uid {wl.uid})" if wl is not None else "no workload"
        trace("workload", f"no service VIP {addr}: {found} at that address", workload=wl.uid if wl else None)
    if wl is not None:
        return (wl, port, None)
    return None


def find_upstream_from_service(
    state: ProxyState,
    source: Workload,
    svc_port: int,
    mode: ResolutionMode,
    svc: Service,
    rng: random.Random,
    trace: Trace | None = None,
) -> tuple[Workload, int, Service] | None:
    picked = load_balance(state, source, svc, svc_port, mode, rng, trace)
    if picked is None:
        log.debug("service %s has no healthy endpoints", svc.hostname)
        return None
    ep, wl = picked
    svc_target = svc.ports.get(svc_port, 0)
    ep_target = ep.port.get(svc_port)
    # The reason is a constant here and formatted only for a trace: this runs for every routed connection.
    if ep_target is not None:
        target, why = ep_target, "the endpoint's own port map: {svc_port} -> {target}"  # the endpoint's map wins
    elif svc_target > 0:
        target, why = svc_target, "the service's ports: {svc_port} -> {target}"
    elif wl.application_tunnel is not None and wl.application_tunnel.port is not None:
        # An app tunnel does not need the port on the service.
        target, why = svc_port, "the workload's application tunnel (port {tunnel}) keeps port {svc_port}"
    else:
        log.debug("found service %s, but port %d was unknown", svc.hostname, svc_port)
        if trace is not None:
            trace("port", f"service {svc.hostname} has no mapping for port {svc_port}", target_port=None)
        return None
    if trace is not None:
        tunnel = wl.application_tunnel.port if wl.application_tunnel is not None else None
        trace(
            "port",
            why.format(svc_port=svc_port, target=target, tunnel=tunnel),
            service_port=svc_port,
            target_port=target,
        )
    return (wl, target, svc)


def load_balance(
    state: ProxyState,
    src: Workload,
    svc: Service,
    svc_port: int,
    mode: ResolutionMode,
    rng: random.Random,
    trace: Trace | None = None,
) -> tuple[Endpoint, Workload] | None:
    """Pick an endpoint: healthy ones, ranked by routing preference (STRICT/FAILOVER), weighted by capacity."""
    target_port = svc.ports.get(svc_port)
    if mode is ResolutionMode.STANDARD and target_port is None:
        log.debug("service %s does not have port %d", svc.hostname, svc_port)
        if trace is not None:
            trace("endpoints", f"service {svc.hostname} does not have port {svc_port}: no endpoint can be picked")
        return None
    candidates: list[tuple[Endpoint, Workload]] = []
    for ep in svc.endpoints.values():
        skip = ""
        wl = None
        if not svc.should_include_endpoint(ep.status):
            skip = "unhealthy, and the service's health policy takes only healthy endpoints"
        elif (wl := state.workloads.find_uid(ep.workload_uid)) is None:
            skip = "no workload with this uid"
        elif not (bool(wl.workload_ips) or bool(wl.hostname)) and (
            wl.network == src.network or wl.network_gateway is None
        ):
            # A workload without an address is reachable only through its network gateway, on another network.
            skip = "no address, and no network gateway on another network"
        elif mode is ResolutionMode.STANDARD:
            if not target_port and svc_port not in ep.port:
                skip = "the service names its target port, and this endpoint does not define it"
        elif target_port is None and wl.application_tunnel is None:
            skip = "the service lacks the port, and the workload has no application tunnel"
        if trace is not None:
            trace("candidate", skip or "eligible", workload=ep.workload_uid, eligible=not skip)
        if skip or wl is None:
            continue
        candidates.append((ep, wl))
    lb = svc.load_balancer
    if lb is not None and lb.mode is not LoadBalancerMode.STANDARD and candidates:
        prefs = lb.routing_preferences
        network_first = bool(prefs) and prefs[0] is LoadBalancerScope.NETWORK
        ranked: list[tuple[int, Endpoint, Workload]] = []
        for ep, wl in candidates:
            rank = 0
            adjust = 0
            for scope in prefs:
                if scope is LoadBalancerScope.NETWORK:
                    matches = src.network == wl.network
                    if network_first:
                        if not matches:
                            continue  # try the other scopes
                        adjust = len(prefs) - 1
                elif scope is LoadBalancerScope.REGION:
                    matches = src.locality.region == wl.locality.region
                elif scope is LoadBalancerScope.ZONE:
                    matches = src.locality.zone == wl.locality.zone
                elif scope is LoadBalancerScope.SUBZONE:
                    matches = src.locality.subzone == wl.locality.subzone
                elif scope is LoadBalancerScope.NODE:
                    matches = src.node == wl.node
                else:
                    matches = src.cluster_id == wl.cluster_id
                if not matches:
                    break
                rank += 1
            if lb.mode is LoadBalancerMode.STRICT and rank != len(prefs):
                if trace is not None:
                    trace(
                        "rank", f"Strict: matches {rank} of {len(prefs)} preferences, dropped", workload=ep.workload_uid
                    )
                continue
            if trace is not None:
                trace("rank", f"rank {rank + adjust} ({lb.mode.value})", workload=ep.workload_uid, rank=rank + adjust)
            ranked.append((rank + adjust, ep, wl))
        if not ranked:
            return None
        best = max(r for r, _, _ in ranked)
        candidates = [(ep, wl) for r, ep, wl in ranked if r == best]
    # One candidate (the usual service of one pod, or a pod's own address) without a comprehension's call.
    weights = (
        [max(candidates[0][1].capacity, 0)] if len(candidates) == 1 else [max(w.capacity, 0) for _, w in candidates]
    )
    if not sum(weights):
        # No candidates, or all of capacity 0: upstream's choose_weighted fails, so there is no upstream.
        if trace is not None:
            trace("pick", "no eligible endpoint with capacity above 0: no upstream", picked=None)
        return None
    picked = candidates[0] if len(candidates) == 1 else rng.choices(candidates, weights=weights)[0]
    if trace is not None:
        total = sum(weights)
        chances = {ep.workload_uid: w / total for (ep, _), w in zip(candidates, weights, strict=True)}
        how = "the only one" if len(candidates) == 1 else f"random among {len(candidates)}, weighted by capacity"
        trace("pick", how, picked=picked[0].workload_uid, chances=chances)
    return picked


def pick_workload_ip(dst: Workload, original_ip: IPAddress, family: IpFamily | None) -> tuple[IPAddress | None, bool]:
    """(IP to use, needs DNS). The requested IP if it is the workload's; else one of the service's family,
    preferring the request's; else DNS on the workload hostname; else None (through the network gateway)."""
    if original_ip in dst.workload_ips:
        return original_ip, False
    # The first allowed IP of the request's family, else the first allowed one: one pass, no lists (a VIP is never
    # a workload IP, so every service-addressed connection comes here).
    # The family compared by class (IPv4Address or IPv6Address, canonical): ``version`` is a Python property.
    same = original_ip.__class__
    first: IPAddress | None = None
    for ip in dst.workload_ips:
        if family is None or family.accepts(ip):
            if ip.__class__ is same:
                return ip, False
            if first is None:
                first = ip
    if first is not None:
        return first, False
    if dst.hostname:
        return None, True
    if dst.network_gateway is None:
        raise UpstreamError(f"workload {dst.name} has no suitable workload IPs for routing")
    return None, False


def finalize_upstream(
    found: tuple[Workload, int, Service | None] | object | None, original_ip: IPAddress, trace: Trace | None = None
) -> Upstream | None:
    if found is None or found is _ORIGINAL_DESTINATION:
        return None
    assert isinstance(found, tuple)
    wl, port, svc = found
    ip, needs_dns = pick_workload_ip(wl, original_ip, svc.ip_families if svc is not None else None)
    if trace is not None:
        how = (
            "the address dialled"
            if ip == original_ip
            else "resolve the workload's hostname"
            if needs_dns
            else "through its network gateway"
            if ip is None
            else "the workload's first address of the right family"
        )
        trace(
            "address", f"{wl.namespace}/{wl.name}: {ip if ip is not None else '-'} ({how})", ip=str(ip) if ip else None
        )
    return Upstream(
        workload=wl,
        selected_ip=ip,
        port=port,
        service_sans=svc.subject_alt_names if svc is not None else (),
        destination_service=ServiceDescription.of(svc) if svc is not None else None,
        needs_dns=needs_dns,
    )


def fetch_upstream(
    state: ProxyState,
    network: str,
    source: Workload,
    ip: IPAddress,
    port: int,
    rng: random.Random,
    trace: Trace | None = None,
    vip_service: tuple[Service | None] | None = None,
) -> Upstream | None:
    """The upstream for ``ip:port`` from ``source`` (``vip_service``: as :func:`find_upstream`)."""
    found = find_upstream(state, network, source, ip, port, ResolutionMode.STANDARD, rng, trace, vip_service)
    return finalize_upstream(found, ip, trace)


def fetch_gateway(
    state: ProxyState,
    gw: GatewayAddress,
    source: Workload,
    original_ip: IPAddress,
    rng: random.Random,
    what: str = "waypoint",
    trace: Trace | None = None,
) -> Upstream:
    """Resolve a waypoint or network gateway address (by IP or, preferably, by service hostname)."""
    mode = ResolutionMode.WAYPOINT if what == "waypoint" else ResolutionMode.STANDARD
    dest = gw.destination
    if isinstance(dest, NetworkAddress):
        found = find_upstream(state, dest.network, source, dest.address, gw.hbone_mtls_port, mode, rng, trace)
        target_ip = dest.address
    else:
        svc = state.services.get(NamespacedHostname(dest.namespace, dest.hostname))
        if svc is not None:
            found = find_upstream_from_service(state, source, gw.hbone_mtls_port, mode, svc, rng, trace)
        else:
            wl = _workload_by_hostname(state, dest)
            if wl is None:
                raise UpstreamError(f"{what} {dest.hostname} not found")
            found = (wl, gw.hbone_mtls_port, None)
        target_ip = original_ip  # adapt to the caller's IP family
    up = finalize_upstream(found, target_ip, trace)
    if up is None:
        raise UpstreamError(f"{what} {_gw_str(gw)} not found")
    return up


def gateway_workloads(state: ProxyState, gw: GatewayAddress) -> list[Workload]:
    """Every workload that makes up a waypoint/gateway (upstream ``check_gateway_address``): the workload at its
    address, else the endpoints of the service at that address or hostname, else the workload with that hostname."""
    dest = gw.destination
    svc: Service | None
    if isinstance(dest, NetworkAddress):
        wl = state.workloads.find_address(dest)
        if wl is not None:
            return [wl]
        svc = state.services.get_best_by_vip(dest, None)
    else:
        svc = state.services.get(dest)
        if svc is None:
            wl = _workload_by_hostname(state, dest)
            return [wl] if wl is not None else []
    if svc is None:
        return []
    found = (state.workloads.find_uid(ep.workload_uid) for ep in svc.endpoints.values())
    return [w for w in found if w is not None]


def _workload_by_hostname(state: ProxyState, host: NamespacedHostname) -> Workload | None:
    for w in state.workloads:
        if w.hostname == host.hostname and w.namespace == host.namespace:
            return w
    return None


def _gw_str(gw: GatewayAddress) -> str:
    return f"{gw.destination}:{gw.hbone_mtls_port}"


def service_waypoint(
    state: ProxyState,
    svc: Service,
    source: Workload,
    original_ip: IPAddress,
    rng: random.Random,
    trace: Trace | None = None,
) -> Upstream | None:
    """The service's waypoint: one of ``weighted_waypoints`` by weight, else ``waypoint``, else None."""
    gw: GatewayAddress | None = None
    why = ""
    if svc.weighted_waypoints:
        weights = [max(w.weight, 0) for w in svc.weighted_waypoints]
        if sum(weights) > 0:
            gw = rng.choices(svc.weighted_waypoints, weights=weights)[0].destination
            why = f"picked by weight among {len(weights)} weighted waypoints"
    if gw is None:
        gw = svc.waypoint
        why = "the service's waypoint"
    if trace is not None:
        trace(
            "waypoint",
            f"service {svc.hostname}: {why} {_gw_str(gw)}" if gw is not None else f"service {svc.hostname}: none",
            waypoint=_gw_str(gw) if gw is not None else None,
        )
    if gw is None:
        return None
    return fetch_gateway(state, gw, source, original_ip, rng, trace=trace)


def workload_waypoint(
    state: ProxyState,
    wl: Workload,
    source: Workload,
    original_ip: IPAddress,
    rng: random.Random,
    trace: Trace | None = None,
) -> Upstream | None:
    if trace is not None:
        gw = _gw_str(wl.waypoint) if wl.waypoint is not None else None
        trace("waypoint", f"workload {wl.namespace}/{wl.name}: {gw or 'none'}", waypoint=gw)
    if wl.waypoint is None:
        return None
    return fetch_gateway(state, wl.waypoint, source, original_ip, rng, trace=trace)
