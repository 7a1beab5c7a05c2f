"""Outbound (port 15001): captured connections from the proxied workload, carried over HBONE or passed through.

Upstream ``proxy/outbound.rs``. For each accepted connection:

1. the original destination: ``SO_ORIGINAL_DST`` (iptables REDIRECT), else the socket's own address (TPROXY);
2. a destination on one of ztunnel's own ports at a loopback or local address (the node's own, in dedicated mode)
   is refused (``attempted recursive call to ourselves``): passing it through would loop until the fd limit;
3. the source is always the proxied workload (never looked up by source IP), waiting up to 5 s for xDS; with
   ``XDS_ON_DEMAND``, a destination the state does not know is asked for (``<network>/<ip>``) and its answer
   awaited, up to 5 s, before deciding;
4. :func:`build_request` decides: service waypoint, load-balanced endpoint, workload waypoint, HBONE to
   ``endpointIP:15008`` with ``:authority endpointIP:targetPort``, double HBONE through the network gateway of an
   endpoint (or waypoint) on another network (``double_hbone``, docs/multinetwork.md), plain TCP to a non-mesh
   workload, or passthrough to the original destination when nothing in the mesh matches; with ``XDS_ON_DEMAND``
   the waypoints and gateways it will look up are asked for first (:func:`fetch_references`);
5. the bytes are relayed (see ``relay``), and the connection is tracked for metrics and the access log.

:func:`build_request` is pure (state in, decision out) and is tested without sockets.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import ipaddress
import logging
import random
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ztunnel import baggage
from ztunnel.dns.lookup import pick_address
from ztunnel.errors import ZtunnelError
from ztunnel.identity.manager import CertificateUnavailable
from ztunnel.identity.spiffe import Identity
from ztunnel.net import format_addr
from ztunnel.proxy.common import (
    BAGGAGE_HEADER,
    FORWARDED_HEADER,
    TRACEPARENT_HEADER,
    X_FORWARDED_NETWORK,
    HttpStatusError,
    ProxyError,
    ResponseFlag,
    forwarded_header,
    is_timeout,
    new_traceparent,
)
from ztunnel.proxy.connect import connect_plain
from ztunnel.proxy.connection_manager import ConnectionRecord, Direction, log_failed
from ztunnel.proxy.double_hbone import open_inner
from ztunnel.proxy.hbone.stream import HboneStream
from ztunnel.proxy.inputs import ProxyInputs
from ztunnel.proxy.listener import Listener
from ztunnel.proxy.metrics import DerivedWorkload, OpenSocket
from ztunnel.proxy.pool import WorkloadKey
from ztunnel.proxy.relay import PlainConnection, PlainRelay
from ztunnel.sockets import (
    accepted_addresses,
    family_of,
)
from ztunnel.state import ProxyState
from ztunnel.state.service import LoadBalancerMode, Service
from ztunnel.state.upstream import (
    ServiceDescription,
    Trace,
    Upstream,
    UpstreamError,
    fetch_gateway,
    fetch_upstream,
    gateway_workloads,
    service_waypoint,
    workload_waypoint,
)
from ztunnel.state.workload import (
    GatewayAddress,
    InboundProtocol,
    IPAddress,
    NamespacedHostname,
    NetworkAddress,
    Workload,
)
from ztunnel.telemetry import Display, enter_span
from ztunnel.telemetry import log as log_fields

log = logging.getLogger("ztunnel.proxy.outbound")


class OutboundProtocol(enum.Enum):
    TCP = "TCP"
    HBONE = "HBONE"
    DOUBLE_HBONE = "DOUBLE_HBONE"  # through the destination network's gateway (double_hbone.py)


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
    # Double HBONE: the identities the final destination (inner TLS) must present, the workload the load balancer
    # picked behind the gateway, and the ``<service hostname>:<port>`` authority of both CONNECTs.
    final_sans: tuple[Identity, ...] = ()
    final_workload: Workload | None = None
    hbone_host: str | None = None

    @property
    def authority(self) -> str | None:
        """The CONNECT ``:authority``: ``ip:port``, or ``<service hostname>:<port>`` through a network gateway."""
        if self.hbone_host is not None:
            return self.hbone_host
        return format_addr(*self.hbone_target) if self.hbone_target is not None else None


def build_request(
    state: ProxyState,
    source: Workload,
    downstream: IPAddress,
    target: tuple[IPAddress, int],
    network: str,
    rng: random.Random,
    hbone_port: int = 15008,
    trace: Trace | None = None,
) -> Request:
    """Decide how to reach ``target`` (upstream ``build_request``). Raises :class:`ProxyError` when it cannot.

    ``trace`` (``ztunnel explain``) is told each step and why; the proxy passes none."""
    ip, port = target
    try:
        service = state.services.get_best_by_vip(NetworkAddress(network, ip), source.namespace)
        if trace is not None and service is not None:
            trace("service", f"{format_addr(ip, port)} is a VIP of service {service.namespace}/{service.hostname}")
        if service is not None:
            waypoint = service_waypoint(state, service, source, ip, rng, trace)
            if waypoint is not None:
                if waypoint.workload.network != source.network:
                    return _through_network_gateway(state, source, waypoint, service, target, rng)
                return _to_gateway(waypoint, source, target, ServiceDescription.of(service), hbone_port)
        # The VIP lookup above answers for the source's network too when it is ours (always, but for tests and
        # explain): looked up once per connection.
        known = (service,) if network == source.network else None
        us = fetch_upstream(state, source.network, source, ip, port, rng, trace, known)
        if us is None:
            if service is not None and (
                service.load_balancer is None or service.load_balancer.mode is not LoadBalancerMode.PASSTHROUGH
            ):
                raise ProxyError(f"no healthy upstream for {format_addr(ip, port)}")
            # Not in the mesh (or a passthrough service): plain TCP to where the client was going.
            if trace is not None:
                trace("protocol", "passthrough: plain TCP to the original destination (nothing in the mesh matches)")
            return Request(OutboundProtocol.TCP, source, target, None, None, None, ())
        if us.workload.network != source.network:
            # Only a service reaches another network (fetch_upstream finds workloads on ours alone).
            if service is None:
                raise ProxyError(
                    f"workload {us.workload.name} on network {us.workload.network!r} is not service-addressed"
                )
            return _through_network_gateway(state, source, us, service, target, rng)
        if service is None and not _from_waypoint(state, us.workload, source, downstream):
            wp = workload_waypoint(state, us.workload, source, ip, rng, trace)
            if wp is not None:
                return _to_gateway(wp, source, target, us.destination_service, hbone_port)
        elif trace is not None and service is None:
            trace("waypoint", "skipped: the source is the destination's own waypoint (traffic goes direct)")
    except UpstreamError as e:
        raise ProxyError(str(e)) from None
    if us.selected_ip is None and not us.needs_dns:
        raise ProxyError(f"no valid destination for workload {us.workload.name}")
    selected = us.selected_ip if us.selected_ip is not None else ip
    resolve = us.workload.hostname if us.needs_dns else None
    if trace is not None:
        kind = (
            "HBONE: the destination is in the mesh"
            if us.workload.protocol is InboundProtocol.HBONE
            else ("plain TCP: the destination workload is not in the mesh (protocol TCP)")
        )
        trace("protocol", kind)
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


def _through_network_gateway(
    state: ProxyState,
    source: Workload,
    us: Upstream,
    service: Service,
    target: tuple[IPAddress, int],
    rng: random.Random,
) -> Request:
    """Upstream's ``build_request_through_gateway``: ``us`` (a workload, or a waypoint) is on another network, so
    the request goes as double HBONE to its network gateway. The outer tunnel is verified against the gateway's
    identities, the inner one against the service's SANs (upstream's ``final_sans``); both CONNECTs name the
    service by hostname, since our VIP means nothing on the other network."""
    gw = us.workload.network_gateway
    if gw is None:
        raise ProxyError(
            f"no valid destination: workload {us.workload.name} is on network {us.workload.network!r} "
            f"(not {source.network!r}) and has no network gateway"
        )
    gateway = fetch_gateway(state, gw, source, target[0], rng, what="network gateway")
    if gateway.selected_ip is None:
        raise ProxyError(f"no valid destination for network gateway {gateway.workload.name}")
    final = tuple(i for i in (Identity.try_parse(san) for san in us.service_sans) if i is not None)
    return Request(
        OutboundProtocol.DOUBLE_HBONE,
        source,
        (gateway.selected_ip, gateway.port),
        None,
        gateway.workload,
        ServiceDescription.of(service),
        gateway.workload_and_services_san(),
        # A service without SANs: the picked workload's own identity (upstream would expect none and fail).
        final_sans=final or (us.workload.identity,),
        final_workload=us.workload,
        hbone_host=f"{service.hostname}:{target[1]}",
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


async def fetch_references(pi: ProxyInputs, source: Workload, ip: IPAddress) -> None:
    """``XDS_ON_DEMAND``: what :func:`build_request` may look up besides the destination, asked for when the state
    lacks it (upstream's on-demand lookups): the destination's waypoints (service or workload waypoint, by address
    or hostname), the network gateways of endpoints on other networks, and the workloads of a workload waypoint's
    service by UID (``check_from_waypoint``). Each miss is one request; all are asked at once."""
    state = pi.state
    addr = NetworkAddress(pi.config.network, ip)
    gateways: list[GatewayAddress] = []
    service = state.services.get_best_by_vip(addr, source.namespace)
    if service is not None:
        if service.waypoint is not None:
            gateways.append(service.waypoint)
        gateways.extend(w.destination for w in service.weighted_waypoints)
        gateways.extend(_remote_gateways(state, source, (state.workloads.find_uid(u) for u in service.endpoints)))
    else:
        wl = state.workloads.find_address(addr)
        if wl is not None and wl.waypoint is not None:
            gateways.append(wl.waypoint)
    dests = list(dict.fromkeys(gw.destination for gw in gateways))  # each once, in order
    await asyncio.gather(*(pi.fetch_destination(d, source.namespace) for d in dests))
    # A waypoint service's own endpoints (by UID) and, across networks, their gateways.
    uids: list[str] = []
    for dest in dests:
        found = state.find_address(dest) if isinstance(dest, NetworkAddress) else state.find_hostname(dest)
        if isinstance(found, Service):
            uids.extend(u for u in found.endpoints if state.workloads.find_uid(u) is None)
    await asyncio.gather(*(pi.fetch_workload_by_uid(u) for u in dict.fromkeys(uids)))
    more = [gw.destination for d in dests for gw in _remote_gateways(state, source, _workloads_at(state, d))]
    await asyncio.gather(*(pi.fetch_destination(d) for d in dict.fromkeys(more) if d not in dests))


def _remote_gateways(state: ProxyState, source: Workload, workloads: Iterable[Workload | None]) -> list[GatewayAddress]:
    return [
        w.network_gateway
        for w in workloads
        if w is not None and w.network != source.network and w.network_gateway is not None
    ]


def _workloads_at(state: ProxyState, dest: NetworkAddress | NamespacedHostname) -> list[Workload | None]:
    found = state.find_address(dest) if isinstance(dest, NetworkAddress) else state.find_hostname(dest)
    if isinstance(found, Service):
        return [state.workloads.find_uid(u) for u in found.endpoints]
    return [found]


def hbone_headers(req: Request, src: tuple[IPAddress, int], traceparent: str | None = None) -> list[tuple[str, str]]:
    service = req.intended_destination_service
    return [
        (BAGGAGE_HEADER, baggage.workload_baggage(req.source)),
        (FORWARDED_HEADER, forwarded_header(src, service.hostname if service else None)),
        (TRACEPARENT_HEADER, traceparent or new_traceparent()),
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
        plain.on_lost = OpenSocket(self.pi.connections.traffic, "source").closed
        addresses = accepted_addresses(plain.transport, self.pi.sockets.cfg)
        if addresses is None:  # reset before it was served
            return
        src, dst = addresses
        self.pi.tasks.spawn(self.proxy_to(plain, src, dst), "outbound")  # a constant: no formatting per connection

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
        # Upstream's outbound span (this task's log lines): the trace id of the traceparent sent over HBONE.
        traceparent = new_traceparent()
        enter_span("outbound", {"id": Display(traceparent[3:35])})  # ours, so well-formed: no span_id parse
        if log.isEnabledFor(logging.DEBUG):
            log_fields(log, logging.DEBUG, "connection started", component="outbound")
        try:
            if dst[1] in pi.config.illegal_ports and (dst[0].is_loopback or _is_local(pi, dst[0])):
                raise ProxyError(
                    f"attempted recursive call to ourselves: {format_addr(*dst)} is this proxy's own "
                    f"address and port {dst[1]} one of its listeners (the connection would loop)"
                )
            if pi.drain.draining:
                raise ProxyError("proxy is draining")
            source = pi.local.find() or await pi.local.get()  # known (but for the first seconds): no coroutine
            if pi.on_demand is not None:
                # XDS_ON_DEMAND: an address the state does not know is asked for first (upstream fetch_address).
                await pi.fetch_address(NetworkAddress(pi.config.network, dst[0]), source.namespace)
                await fetch_references(pi, source, dst[0])
            req = build_request(pi.state, source, src[0], dst, pi.config.network, pi.rng, self.hbone_port)
            if req.resolve_hostname is not None:
                req = await _resolve(pi, req)
            hbone = req.protocol is not OutboundProtocol.TCP
            # Through a gateway, the destination is the workload behind it (its identity is checked on the inner
            # TLS), not the gateway the TCP connection goes to.
            dst_wl = req.final_workload or req.actual_destination_workload
            authority = req.authority  # formatted once: the record's and the CONNECT's
            record = ConnectionRecord(
                direction=Direction.OUTBOUND,
                src=src,
                dst=req.actual_destination,
                hbone_target=authority,
                src_identity=source.identity if hbone else None,
                dst_identity=dst_wl.identity if dst_wl is not None and hbone else None,
                src_workload=source,
                dst_workload=dst_wl,
                dst_service=req.intended_destination_service,
                # Over HBONE we present the source's certificate, so the source reporter claims that identity as
                # source_principal (upstream ``conn_metrics_from_request``); plain TCP claims none.
                derived_source=DerivedWorkload.of_identity(source.identity) if hbone else None,
                mtls=hbone,
                original_dst=dst,
            )
            if req.protocol is OutboundProtocol.DOUBLE_HBONE:
                await self._double_hbone(plain, src, req, record, ready, traceparent)
            elif hbone:
                assert authority is not None
                # Inline rather than a method of its own: one coroutine fewer per connection (its object, frame
                # and two resumptions).
                stream = await self._open_outer(src, req, authority, traceparent)
                record.tunnel = stream.conn  # a CRL revoking the peer closes the pooled connection, and this too
                self._carry(plain, stream, record, ready)
            else:
                await self._tcp(plain, req, record, ready)
        except ProxyError as e:
            self._fail(plain, src, dst, record, e, ready)
        except (OSError, ConnectionError) as e:
            self._fail(plain, src, dst, record, ProxyError(str(e), timed_out=is_timeout(e)), ready)
        except ZtunnelError as e:  # any other refusal ends this connection alone, logged and counted (CONNECT)
            self._fail(plain, src, dst, record, ProxyError(str(e)), ready)

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

    def _carry(
        self,
        plain: PlainConnection,
        stream: HboneStream,
        record: ConnectionRecord,
        ready: Callable[[ProxyError | None], None] | None,
    ) -> None:
        """The tunnel is up: count and register it, tell SOCKS5, and relay ``plain`` over ``stream``."""
        pi = self.pi
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

    async def _open_outer(
        self, src: tuple[IPAddress, int], req: Request, authority: str, traceparent: str
    ) -> HboneStream:
        """A CONNECT for ``authority`` on a pooled connection to ``req.actual_destination``, answered 200 (else
        ProxyError)."""
        key = WorkloadKey(req.source.identity, req.upstream_sans, req.actual_destination, src[0])
        headers = hbone_headers(req, src, traceparent)
        pool = self.pi.pool
        # A pooled connection with room (the common case) in one plain call; the coroutine only to dial or wait.
        stream = pool.try_open_stream(key, authority, headers) or await pool.open_stream(key, authority, headers)
        # _established's wait, inline (one coroutine fewer per connection): the answer, 200 or the reason why not.
        assert stream.response is not None
        try:
            status, _headers = await stream.response
        except ConnectionError as e:
            raise _stream_failed(stream, e) from None
        if status != 200:
            stream.reset()
            raise HttpStatusError(status)
        return stream

    async def _double_hbone(
        self,
        plain: PlainConnection,
        src: tuple[IPAddress, int],
        req: Request,
        record: ConnectionRecord,
        ready: Callable[[ProxyError | None], None] | None,
        traceparent: str,
    ) -> None:
        """Upstream's ``proxy_to_double_hbone``: the outer stream to the gateway (pooled), then inside it a new
        TLS handshake with the source's certificate verified against ``final_sans`` and a new, unpooled HTTP/2
        connection whose one CONNECT carries ``x-forwarded-network``."""
        pi = self.pi
        authority = req.authority
        assert authority is not None
        outer = await self._open_outer(src, req, authority, traceparent)
        record.tunnel = outer.conn  # the gateway's certificate revoked by a CRL closes the outer connection
        try:
            try:
                cert = await pi.certs.fetch_certificate(req.source.identity)
            except CertificateUnavailable as e:
                raise ProxyError.no_certificate(req.source.identity, e.reason) from None
            inner, _pipe = await open_inner(
                outer,
                pi.contexts.client(req.source.identity, cert),
                pi.pool.settings,
                req.final_sans,
                f"{authority} through {format_addr(*req.actual_destination)}",
                peer=(str(req.actual_destination[0]), req.actual_destination[1]),
            )
        except BaseException:
            outer.reset()
            raise
        headers = [*hbone_headers(req, src, traceparent), (X_FORWARDED_NETWORK, pi.config.network)]
        stream = inner.open_stream(authority, headers)
        inner.drain_when_idle()  # one stream: the inner connection closes with it (and so the outer stream)
        try:
            await _established(stream)
        except BaseException:
            inner.abort("inner CONNECT failed")
            raise
        record.dst_identity = inner.peer_identity  # verified end to end, through the gateway
        self._carry(plain, stream, record, ready)

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


async def _established(stream: HboneStream) -> None:
    """Wait for the CONNECT's answer: 200, else the stream is reset and ProxyError (HttpStatusError) says why."""
    assert stream.response is not None
    try:
        status, _headers = await stream.response
    except ConnectionError as e:
        raise _stream_failed(stream, e) from None
    if status != 200:
        stream.reset()
        raise HttpStatusError(status)


def _stream_failed(stream: HboneStream, e: ConnectionError) -> ProxyError:
    lost = stream.lost
    return ProxyError.stream_failed(e, timed_out=lost is not None and lost.timed_out)


def _is_local(pi: ProxyInputs, ip: IPAddress) -> bool:
    """Whether ``ip`` is an address of the proxy's own network namespace (the node's, in dedicated mode): then a
    connection to it on a listener port comes straight back to ztunnel, and passing it through would loop until
    the fd limit. Checked by binding a throwaway socket there (EADDRNOTAVAIL for a foreign address): two syscalls,
    paid only by connections to one of ztunnel's own ports."""
    try:
        sock = pi.sockets.udp(family_of(ip))
    except OSError:
        return False
    try:
        sock.bind((str(ip), 0))
    except OSError:
        return False
    finally:
        sock.close()
    return True


async def _resolve(pi: ProxyInputs, req: Request) -> Request:
    """Resolve a hostname-only destination (upstream ``resolve_on_demand_dns``): counted in
    ``istio_on_demand_dns_total``, looked up through ztunnel's resolver (``pi.lookup_host``: its nameservers, with
    a cache), and one address picked at random, preferring the family the client connected to."""
    hostname = req.resolve_hostname
    assert hostname is not None
    traffic = pi.connections.traffic
    if traffic is not None:
        traffic.on_demand_dns(req.source, hostname)
    try:
        ips = await (pi.lookup_host or _system_lookup)(hostname)
    except (OSError, ZtunnelError) as e:
        raise ProxyError(f"dns lookup of {hostname} failed: {e}") from None
    if not ips:
        raise ProxyError(f"dns lookup of {hostname} returned no addresses")
    ip = pick_address(ips, req.actual_destination[0].version == 6, pi.rng)
    dst = (ip, req.actual_destination[1])
    target = (ip, req.hbone_target[1]) if req.hbone_target else None
    return dataclasses.replace(req, actual_destination=dst, hbone_target=target, resolve_hostname=None)


async def _system_lookup(hostname: str) -> list[IPAddress]:
    # Only for proxies built without a resolver (tests building ProxyInputs by hand); ztunnel's always have one.
    infos = await asyncio.get_running_loop().getaddrinfo(hostname, None, type=socket.SOCK_STREAM)
    return [ipaddress.ip_address(i[4][0]) for i in infos]


__all__ = ["Outbound", "OutboundProtocol", "Request", "build_request", "hbone_headers"]
