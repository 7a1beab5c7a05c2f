"""Outbound (port 15001): captured connections from the proxied workload, carried over HBONE or passed through.

Upstream ``proxy/outbound.rs``. For each accepted connection:

1. the original destination: ``SO_ORIGINAL_DST`` (iptables REDIRECT), else the socket's own address (TPROXY);
2. a loopback destination on one of ztunnel's own ports is refused (``attempted recursive call to ourselves``);
3. the source is always the proxied workload (never looked up by source IP), waiting up to 5 s for xDS; with
   ``XDS_ON_DEMAND``, a destination the state does not know is asked for (``<network>/<ip>``) and its answer
   awaited, up to 5 s, before deciding;
4. :func:`build_request` decides: service waypoint, load-balanced endpoint, workload waypoint, HBONE to
   ``endpointIP:15008`` with ``:authority endpointIP:targetPort``, plain TCP to a non-mesh workload, or passthrough
   to the original destination when nothing in the mesh matches;
5. the bytes are relayed (see ``relay``), and the connection is tracked for metrics and the access log.

:func:`build_request` is pure (state in, decision out) and is tested without sockets.
"""

from __future__ import annotations

import asyncio
import enum
import ipaddress
import logging
import random
import socket
from collections.abc import Callable
from dataclasses import dataclass

from ztunnel import baggage
from ztunnel.identity.spiffe import Identity
from ztunnel.net import format_addr
from ztunnel.proxy.common import (
    BAGGAGE_HEADER,
    FORWARDED_HEADER,
    TRACEPARENT_HEADER,
    HttpStatusError,
    ProxyError,
    ResponseFlag,
    forwarded_header,
    is_timeout,
    new_traceparent,
)
from ztunnel.proxy.connect import connect_plain
from ztunnel.proxy.connection_manager import ConnectionRecord, Direction, log_failed
from ztunnel.proxy.inputs import ProxyInputs
from ztunnel.proxy.listener import Listener
from ztunnel.proxy.metrics import DerivedWorkload
from ztunnel.proxy.pool import WorkloadKey
from ztunnel.proxy.relay import PlainConnection, PlainRelay
from ztunnel.sockets import (
    local_dst,
    original_dst,
    peer_addr,
    set_accepted_options,
)
from ztunnel.state import ProxyState
from ztunnel.state.service import LoadBalancerMode
from ztunnel.state.upstream import (
    ServiceDescription,
    Upstream,
    UpstreamError,
    fetch_upstream,
    gateway_workloads,
    service_waypoint,
    workload_waypoint,
)
from ztunnel.state.workload import InboundProtocol, IPAddress, NetworkAddress, Workload

log = logging.getLogger("ztunnel.proxy.outbound")


class OutboundProtocol(enum.Enum):
    TCP = "TCP"
    HBONE = "HBONE"


@dataclass(frozen=True, slots=True)
class Request:
    """Where and how to send one outbound connection."""

    protocol: OutboundProtocol
    source: Workload
    actual_destination: tuple[IPAddress, int]  # the L4 next hop (endpointIP:15008 for HBONE)
    hbone_target: tuple[IPAddress, int] | None  # the CONNECT :authority
    actual_destination_workload: Workload | None
    intended_destination_service: ServiceDescription | None
    upstream_sans: tuple[Identity, ...]
    resolve_hostname: str | None = None  # the destination is known only by hostname: resolve it first


def build_request(
    state: ProxyState,
    source: Workload,
    downstream: IPAddress,
    target: tuple[IPAddress, int],
    network: str,
    rng: random.Random,
    hbone_port: int = 15008,
) -> Request:
    """Decide how to reach ``target`` (upstream ``build_request``). Raises :class:`ProxyError` when it cannot."""
    ip, port = target
    try:
        service = state.services.get_best_by_vip(NetworkAddress(network, ip), source.namespace)
        if service is not None:
            waypoint = service_waypoint(state, service, source, ip, rng)
            if waypoint is not None:
                _same_network(waypoint, source)
                return _to_gateway(waypoint, source, target, ServiceDescription.of(service), hbone_port)
        us = fetch_upstream(state, source.network, source, ip, port, rng)
        if us is None:
            if service is not None and (
                service.load_balancer is None or service.load_balancer.mode is not LoadBalancerMode.PASSTHROUGH
            ):
                raise ProxyError(f"no healthy upstream for {format_addr(ip, port)}")
            # Not in the mesh (or a passthrough service): plain TCP to where the client was going.
            return Request(OutboundProtocol.TCP, source, target, None, None, None, ())
        _same_network(us, source)
        if service is None and not _from_waypoint(state, us.workload, source, downstream):
            wp = workload_waypoint(state, us.workload, source, ip, rng)
            if wp is not None:
                return _to_gateway(wp, source, target, us.destination_service, hbone_port)
    except UpstreamError as e:
        raise ProxyError(str(e)) from None
    if us.selected_ip is None and not us.needs_dns:
        raise ProxyError(f"no valid destination for workload {us.workload.name}")
    selected = us.selected_ip if us.selected_ip is not None else ip
    resolve = us.workload.hostname if us.needs_dns else None
    if us.workload.protocol is InboundProtocol.HBONE:
        return Request(
            OutboundProtocol.HBONE,
            source,
            (selected, hbone_port),
            (selected, us.port),
            us.workload,
            us.destination_service,
            us.workload_and_services_san(),
            resolve,
        )
    return Request(
        OutboundProtocol.TCP,
        source,
        (selected, us.port),
        None,
        us.workload,
        us.destination_service,
        us.workload_and_services_san(),
        resolve,
    )


def _same_network(us: Upstream, source: Workload) -> None:
    if us.workload.network != source.network:
        # Cross-network traffic goes through the remote network's east-west gateway as double HBONE.
        raise ProxyError(
            f"destination {us.workload.name} is on network {us.workload.network!r}, not {source.network!r}: "
            "double HBONE through a network gateway is not supported"
        )


def _to_gateway(
    gw: Upstream,
    source: Workload,
    target: tuple[IPAddress, int],
    service: ServiceDescription | None,
    hbone_port: int,
) -> Request:
    """HBONE to a waypoint, keeping the original destination as the authority (upstream)."""
    if gw.selected_ip is None:
        raise ProxyError(f"no valid destination for waypoint {gw.workload.name}")
    return Request(
        OutboundProtocol.HBONE,
        source,
        (gw.selected_ip, gw.port if gw.port else hbone_port),
        target,
        gw.workload,
        service,
        gw.workload_and_services_san(),
    )


def _from_waypoint(state: ProxyState, dst: Workload, source: Workload, downstream: IPAddress) -> bool:
    """Traffic from the destination's own waypoint (sandwich) must not be sent back to it (upstream
    ``check_from_waypoint``): the source has the identity and one of the IPs of *any* of the waypoint's workloads."""
    if dst.waypoint is None:
        return False
    return any(
        w.identity == source.identity and downstream in w.workload_ips for w in gateway_workloads(state, dst.waypoint)
    )


def hbone_headers(req: Request, src: tuple[IPAddress, int]) -> list[tuple[str, str]]:
    service = req.intended_destination_service
    return [
        (BAGGAGE_HEADER, baggage.workload_baggage(req.source)),
        (FORWARDED_HEADER, forwarded_header(src, service.hostname if service else None)),
        (TRACEPARENT_HEADER, new_traceparent()),
    ]


class Outbound(Listener):
    """The 15001 listener of one proxy."""

    def __init__(self, pi: ProxyInputs) -> None:
        super().__init__(pi, pi.config.outbound_addr)
        self.hbone_port = 15008

    def new_protocol(self) -> PlainConnection:
        return PlainConnection(self._accepted)

    def _accepted(self, plain: PlainConnection) -> None:
        assert plain.transport is not None
        sock: socket.socket = plain.transport.get_extra_info("socket")
        set_accepted_options(sock, self.pi.sockets.cfg, keepalive=True)
        src = peer_addr(sock)
        dst = original_dst(sock) or local_dst(sock)
        self.pi.tasks.spawn(self.proxy_to(plain, src, dst), f"outbound {format_addr(*src)}")

    async def proxy_to(
        self,
        plain: PlainConnection,
        src: tuple[IPAddress, int],
        dst: tuple[IPAddress, int],
        ready: Callable[[ProxyError | None], None] | None = None,
    ) -> None:
        """Carry ``plain`` to ``dst``. ``ready`` (SOCKS5) hears once the tunnel is up, or why it failed."""
        pi = self.pi
        record: ConnectionRecord | None = None
        try:
            if dst[0].is_loopback and dst[1] in pi.config.illegal_ports:
                raise ProxyError("attempted recursive call to ourselves")
            if pi.drain.draining:
                raise ProxyError("proxy is draining")
            source = await pi.local.get()
            # XDS_ON_DEMAND: an address the state does not know is asked for first (upstream fetch_address).
            await pi.fetch_address(NetworkAddress(pi.config.network, dst[0]), source.namespace)
            req = build_request(pi.state, source, src[0], dst, pi.config.network, pi.rng, self.hbone_port)
            if req.resolve_hostname is not None:
                req = await _resolve(req)
            hbone = req.protocol is OutboundProtocol.HBONE
            dst_wl = req.actual_destination_workload
            record = ConnectionRecord(
                direction=Direction.OUTBOUND,
                src=src,
                dst=req.actual_destination,
                hbone_target=format_addr(*req.hbone_target) if req.hbone_target else None,
                src_identity=source.identity if hbone else None,
                dst_identity=dst_wl.identity if dst_wl is not None and hbone else None,
                src_workload=source,
                dst_workload=dst_wl,
                dst_service=req.intended_destination_service,
                # Over HBONE we present the source's certificate, so the source reporter claims that identity as
                # source_principal (upstream ``conn_metrics_from_request``); plain TCP claims none.
                derived_source=DerivedWorkload(identity=source.identity) if hbone else None,
                mtls=hbone,
                original_dst=dst,
            )
            if hbone:
                await self._hbone(plain, src, req, record, ready)
            else:
                await self._tcp(plain, req, record, ready)
        except ProxyError as e:
            self._fail(plain, src, dst, record, e, ready)
        except (OSError, ConnectionError) as e:
            self._fail(plain, src, dst, record, ProxyError(str(e), timed_out=is_timeout(e)), ready)

    def _fail(
        self,
        plain: PlainConnection,
        src: tuple[IPAddress, int],
        dst: tuple[IPAddress, int],
        record: ConnectionRecord | None,
        error: ProxyError,
        ready: Callable[[ProxyError | None], None] | None,
    ) -> None:
        if ready is not None:
            ready(error)
        plain.close()
        if record is None:
            log_failed(Direction.OUTBOUND, src, dst, str(error))
        else:
            self.pi.connections.register(record)
            self.pi.connections.release(record, error.flag, str(error))

    async def _hbone(
        self,
        plain: PlainConnection,
        src: tuple[IPAddress, int],
        req: Request,
        record: ConnectionRecord,
        ready: Callable[[ProxyError | None], None] | None,
    ) -> None:
        pi = self.pi
        assert req.hbone_target is not None
        key = WorkloadKey(req.source.identity, req.upstream_sans, req.actual_destination, src[0])
        stream = await pi.pool.open_stream(key, format_addr(*req.hbone_target), hbone_headers(req, src))
        assert stream.response is not None
        try:
            status, _headers = await stream.response
        except ConnectionError as e:
            lost = stream.lost
            raise ProxyError(f"HBONE stream failed: {e}", timed_out=lost is not None and lost.timed_out) from None
        if status != 200:
            stream.reset()
            raise HttpStatusError(status)
        if plain.closed:
            stream.reset()
            raise ProxyError("client closed the connection before the tunnel was established")
        record.bytes_sent = stream.count_to_plain
        record.bytes_recv = stream.count_from_plain
        record.closer = stream.abort
        pi.connections.register(record)
        if ready is not None:
            ready(None)
        stream.attach(plain, on_done=lambda s: pi.connections.release(record, ResponseFlag.NONE, s.error))

    async def _tcp(
        self,
        plain: PlainConnection,
        req: Request,
        record: ConnectionRecord,
        ready: Callable[[ProxyError | None], None] | None,
    ) -> None:
        pi = self.pi
        upstream = await connect_plain(pi.sockets, req.actual_destination)
        record.bytes_sent = lambda: upstream.bytes_read
        record.bytes_recv = lambda: upstream.bytes_written
        relay = PlainRelay(
            plain, upstream, on_done=lambda r: pi.connections.release(record, ResponseFlag.NONE, r.error)
        )
        record.closer = lambda reason: relay.reset()
        pi.connections.register(record)
        if ready is not None:
            ready(None)
        relay.start()


async def _resolve(req: Request) -> Request:
    """Resolve a hostname-only destination with the system resolver, preferring the request's IP family."""
    assert req.resolve_hostname is not None
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(req.resolve_hostname, None, type=socket.SOCK_STREAM)
    except OSError as e:
        raise ProxyError(f"dns lookup of {req.resolve_hostname} failed: {e}") from None
    ips = [ipaddress.ip_address(i[4][0]) for i in infos]
    if not ips:
        raise ProxyError(f"dns lookup of {req.resolve_hostname} returned no addresses")
    want = req.actual_destination[0].version
    ip = next((i for i in ips if i.version == want), ips[0])
    dst = (ip, req.actual_destination[1])
    target = (ip, req.hbone_target[1]) if req.hbone_target else None
    return Request(
        req.protocol,
        req.source,
        dst,
        target,
        req.actual_destination_workload,
        req.intended_destination_service,
        req.upstream_sans,
    )


__all__ = ["Outbound", "OutboundProtocol", "Request", "build_request", "hbone_headers"]
