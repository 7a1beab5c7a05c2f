"""Inbound HBONE (port 15008): mutual TLS, HTTP/2 CONNECT, policy, then a relay to the local workload.

Upstream ``proxy/inbound.rs``. The TLS server presents the proxied workload's certificate and requires a client
certificate from the same trust domain. Each CONNECT stream is checked in upstream's order, and answered with
upstream's status codes (the client maps anything but 200 to a failed connection):

* 400: the method is not CONNECT; the ``:authority`` is not ``ip:port`` (or ``host:port``); the target IP is not
  the IP the client dialled (``ip mismatch``), unless the local workload has an app tunnel or is the target's
  waypoint;
* 503: the local workload is unknown; no target port (hostname authority without a port mapping); the target port
  is one of ztunnel's own (``attempted recursive call to ourselves``); the workload refused the connection;
* 401: the peer's certificate identity is not the identity of the workload its source IP belongs to (a pod
  presenting another pod's certificate; stricter than upstream, see ``_check_source_identity``); authorization
  policy denied it;
* 200 (with ``baggage`` describing the destination, when ``ENABLE_RESPONSE_BAGGAGE``), then the bytes flow.

The upstream connection's source IP is the client's when the listener could be made transparent (IP_TRANSPARENT),
so the workload sees who really called.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Callable
from dataclasses import dataclass

from ztunnel import baggage, tls
from ztunnel.identity.spiffe import Identity
from ztunnel.proxy.common import (
    BAGGAGE_HEADER,
    FORWARDED_HEADER,
    ProxyError,
    ProxyInputs,
    ResponseFlag,
    format_addr,
)
from ztunnel.proxy.connection_manager import ConnectionRecord, Direction, log_failed
from ztunnel.proxy.hbone.connection import HboneTransport
from ztunnel.proxy.hbone.core import ConnectRequested, ErrorCode, HboneConnection, Settings
from ztunnel.proxy.metrics import DerivedWorkload
from ztunnel.proxy.outbound import connect_plain
from ztunnel.proxy.relay import HboneStream
from ztunnel.rbac import Connection
from ztunnel.sockets import local_dst, peer_addr, set_accepted_options
from ztunnel.state.upstream import ServiceDescription
from ztunnel.state.workload import IPAddress, NamespacedHostname, NetworkAddress, NetworkMode, Workload

log = logging.getLogger("ztunnel.proxy.inbound")

# Authorization hook: (connection, destination workload) -> None if allowed, else the denial reason.
# The proxy passes ``connection_manager.Authorizer`` (policy evaluation); there is deliberately no default.
AuthorizeFn = Callable[[Connection, Workload], str | None]


@dataclass(frozen=True, slots=True)
class InboundRequest:
    """A validated CONNECT: where to connect, and what policy and telemetry need to know."""

    upstream: tuple[IPAddress, int]
    local: Workload
    service: ServiceDescription | None


class InboundRejected(Exception):
    def __init__(self, status: int, message: str, flag: ResponseFlag = ResponseFlag.CONNECT) -> None:
        super().__init__(message)
        self.status = status
        self.flag = flag


def parse_authority(authority: str) -> tuple[IPAddress, int] | tuple[str, int]:
    """``ip:port`` / ``[v6]:port`` as an address, or ``host:port`` as a hostname; ValueError naming the authority
    otherwise.

    As strict as upstream (Rust's ``SocketAddr``, then ``http::uri::Authority``): ASCII only, a decimal port of at
    most 5 digits, an IPv6 address only in brackets and without a zone (``::1:80`` is ambiguous, ``fe80::1%eth0``
    is no pod's address), nothing but an IPv6 address in brackets.
    """
    bad = _quote(authority)
    host, sep, port_s = authority.rpartition(":")
    if not sep or not host:
        raise ValueError(f"invalid authority {bad}: expected host:port")
    # isdigit() alone accepts "²" and "٨٠"; the length bound keeps int() from parsing thousands of digits.
    if not (port_s.isascii() and port_s.isdigit() and len(port_s) <= 5) or int(port_s) > 65535:
        raise ValueError(f"invalid authority {bad}: port {_quote(port_s)} is not a number from 0 to 65535")
    port = int(port_s)
    if not host.isascii() or "%" in host:
        raise ValueError(f"invalid authority {bad}: host {_quote(host)} is not an IP address or a hostname")
    if host.startswith("[") and host.endswith("]"):
        try:
            ip6 = ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise ValueError(f"invalid authority {bad}: {_quote(host)} is not an IPv6 address") from None
        return ip6.ipv4_mapped or ip6, port  # [::ffff:a.b.c.d] is the IPv4 address, as every lookup has it
    try:
        return ipaddress.IPv4Address(host), port
    except ValueError:
        if not host.replace("-", "").replace(".", "").isalnum():
            raise ValueError(
                f"invalid authority {bad}: host {_quote(host)} is not an IP address or a hostname"
            ) from None
        return host, port


def _quote(text: str) -> str:
    """``repr`` cut to 100 characters: an authority can be as long as the header block (64 KiB)."""
    return repr(text) if len(text) <= 100 else f"{text[:100]!r}..."


def build_inbound_request(
    pi: ProxyInputs, method: str, authority: str, conn_dst: IPAddress, headers: dict[str, str]
) -> InboundRequest:
    """Upstream's ``build_inbound_request``: validate a CONNECT and find the upstream. Raises InboundRejected."""
    if method != "CONNECT":
        raise InboundRejected(400, f"unsupported method {method!r}: HBONE requires CONNECT")
    try:
        target = parse_authority(authority)
    except ValueError as e:
        raise InboundRejected(400, str(e)) from None
    local = pi.local.find()
    if local is None:
        raise InboundRejected(503, f"unknown local workload {pi.local.info}")
    host, port = target
    service: ServiceDescription | None = None
    if isinstance(host, str):
        # A service hostname (double HBONE / waypoints): map the service port to the workload's target port.
        svc = pi.state.find_service_by_hostname(host, local.namespace)
        if svc is None:
            raise InboundRejected(503, f"unknown service hostname {host}")
        ep = svc.endpoints.get(local.uid)
        mapped = ep.port.get(port) if ep is not None else None
        if not mapped:
            mapped = svc.ports.get(port) or None
        if not mapped:
            raise InboundRejected(503, f"no port mapping for {svc.hostname}:{port} on workload {local.name}")
        port = mapped
        service = ServiceDescription.of(svc)
    elif host != conn_dst and not _may_redirect(pi, local, host):
        raise InboundRejected(400, f"ip mismatch: {host} != {conn_dst}")
    if local.application_tunnel is not None and local.application_tunnel.port:
        port = local.application_tunnel.port
    if port in pi.config.illegal_ports:
        raise InboundRejected(503, "attempted recursive call to ourselves")
    if service is None:
        service = _guess_service(pi, local, headers, port)
    # The target IP is always the one the client dialled (the pod's own address).
    return InboundRequest(upstream=(conn_dst, port), local=local, service=service)


def _may_redirect(pi: ProxyInputs, local: Workload, target_ip: IPAddress) -> bool:
    """The sandwich case: an app tunnel, or this workload is the waypoint of the HBONE target."""
    if local.application_tunnel is not None:
        return True
    svc = pi.state.services.get_best_by_vip(_naddr(pi, target_ip), None)
    gw = svc.waypoint if svc is not None else None
    if gw is None:
        wl = pi.state.workloads.find_address(_naddr(pi, target_ip))
        gw = wl.waypoint if wl is not None else None
    if gw is None:
        return False
    dest = gw.destination
    if isinstance(dest, NamespacedHostname):
        wp = pi.state.services.get(dest)
        return wp is not None and local.uid in wp.endpoints
    return dest.address in local.workload_ips


def _naddr(pi: ProxyInputs, ip: IPAddress) -> NetworkAddress:
    return NetworkAddress(pi.config.network, ip)


def _guess_service(pi: ProxyInputs, local: Workload, headers: dict[str, str], port: int) -> ServiceDescription | None:
    """``destination_service`` for telemetry: the ``forwarded`` host, else a service of ours with that target port
    (upstream ``proxy.rs::guess_inbound_service``)."""
    fwd = headers.get(FORWARDED_HEADER, "")
    for part in fwd.split(";"):
        k, _, v = part.strip().partition("=")
        if k.lower() == "host" and v:
            host = v.strip('"')
            svc = pi.state.find_service_by_hostname(host, local.namespace)
            return ServiceDescription.of(svc) if svc is not None else ServiceDescription(host, "", "")
    for key in local.services:
        svc = pi.state.services.get(key)
        if svc is not None and port in svc.ports.values():
            return ServiceDescription.of(svc)
    return None


class Inbound:
    """The 15008 listener of one proxy."""

    def __init__(self, pi: ProxyInputs, authorize: AuthorizeFn) -> None:
        self.pi = pi
        self.authorize = authorize
        self.servers: list[asyncio.Server] = []
        self.transparent = False
        self.connections: set[HboneTransport] = set()
        self.settings = Settings(
            stream_window=pi.config.http2_stream_window_size,
            connection_window=pi.config.http2_connection_window_size,
            max_frame_size=pi.config.http2_frame_size,
            max_concurrent_streams=200,
            max_header_list_size=64 * 1024,
        )

    async def start(self) -> None:
        cfg = self.pi.config
        loop = asyncio.get_running_loop()
        socks = self.pi.sockets.listeners(
            cfg.inbound_addr, reuse_port=cfg.inpod_port_reuse, transparent=cfg.enable_orig_src, ipv6=cfg.ipv6_enabled
        )
        for sock, transparent in socks:
            self.transparent = self.transparent or transparent
            self.servers.append(await loop.create_server(self._new_connection, sock=sock))

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.servers[0].sockets[0].getsockname()[:2]
        return str(host), int(port)

    def stop(self) -> None:
        for s in self.servers:
            s.close()

    def drain(self) -> None:
        """GOAWAY every connection: open streams finish, new ones go elsewhere."""
        for conn in list(self.connections):
            conn.goaway()

    def _new_connection(self) -> HboneTransport:
        conn = HboneTransport(
            HboneConnection(False, self.settings),
            None,
            on_handshake=self._verified,
            on_connect_request=self._on_request,
            on_closed=self._closed,
        )
        self.connections.add(conn)
        self.pi.tasks.spawn(self._start_tls(conn), "inbound tls")
        return conn

    async def _start_tls(self, conn: HboneTransport) -> None:
        """Serve the proxied workload's certificate (fetched on demand, waiting for xDS as upstream)."""
        try:
            local = await self.pi.local.get()
            cert = await self.pi.certs.fetch_certificate(local.identity)
        except Exception as e:
            self._early_fail(conn, f"no certificate for the local workload: {e}")
            conn.abort(str(e))
            return
        if conn.transport is None:
            await asyncio.sleep(0)
        sock = conn.transport.get_extra_info("socket") if conn.transport is not None else None
        if sock is not None:
            set_accepted_options(sock, self.pi.sockets.cfg, keepalive=False)
        conn.start_tls(self.pi.contexts.server(local.identity, cert))

    def _verified(self, conn: HboneTransport) -> None:
        assert conn.ssl_object is not None
        local = self.pi.local.find()
        trust_domain = local.trust_domain if local is not None else self.pi.config.trust_domain
        try:
            identity = tls.verify_client_identity(conn.ssl_object, trust_domain)
        except tls.TlsError as e:
            identity_error = isinstance(e, (tls.TrustDomainMismatch, tls.MultipleIdentities))
            self._early_fail(
                conn, f"TLS handshake: {e}", ResponseFlag.IDENTITY_ERROR if identity_error else ResponseFlag.TLS_FAILURE
            )
            conn.abort(str(e))
            return
        conn.peer_identity = identity

    def _early_fail(self, conn: HboneTransport, error: str, flag: ResponseFlag | None = None) -> None:
        """A connection that failed before any stream: the WARN line, and with ``flag`` a failed-connection sample
        (reporter destination, the local workload as destination) so rejected peers show up in metrics too."""
        if conn.peer is None:
            return
        src, dst = peer_addr_of(conn), local_addr_of(conn)
        if flag is None:
            log_failed(Direction.INBOUND, src, dst, error)
            return
        record = ConnectionRecord(direction=Direction.INBOUND, src=src, dst=dst, mtls=True)
        record.src_workload = self.pi.state.workloads.find_address(_naddr(self.pi, src[0]))
        local = self.pi.local.find()
        if local is not None:
            record.dst_workload = local
            record.dst_identity = local.identity
        self.pi.connections.register(record)
        self.pi.connections.release(record, flag, error)

    def _closed(self, conn: HboneTransport) -> None:
        self.connections.discard(conn)
        if not conn.handshake_done and conn.close_reason.startswith("TLS") and conn.peer is not None:
            self._early_fail(conn, conn.close_reason, ResponseFlag.TLS_FAILURE)

    def _on_request(self, conn: HboneTransport, ev: ConnectRequested) -> None:
        stream = HboneStream(conn, ev.stream_id)
        conn.handlers[ev.stream_id] = stream
        stream.setup = self.pi.tasks.spawn(self._serve(conn, stream, ev), "inbound stream")

    async def _serve(self, conn: HboneTransport, stream: HboneStream, ev: ConnectRequested) -> None:
        pi = self.pi
        src = peer_addr_of(conn)
        conn_dst = local_addr_of(conn)
        identity = conn.peer_identity
        record = ConnectionRecord(
            direction=Direction.INBOUND,
            src=src,
            dst=conn_dst,
            hbone_target=ev.authority,
            src_identity=identity,
            mtls=True,
        )
        record.src_workload = pi.state.workloads.find_address(_naddr(pi, src[0]))
        # As upstream: the peer's mTLS identity always, plus what its baggage says when enhanced baggage is on;
        # an xDS-known source workload (by IP) overrides the workload fields, never the principal.
        bag = (
            baggage.parse(ev.headers.get(BAGGAGE_HEADER, ""))
            if pi.config.enable_response_baggage
            else baggage.Baggage()
        )
        record.derived_source = DerivedWorkload.from_baggage(bag, identity)
        try:
            req = build_inbound_request(pi, ev.method, ev.authority, conn_dst[0], ev.headers)
            record.dst_workload = req.local
            record.dst_identity = req.local.identity
            record.dst_service = req.service
            record.dst = conn_dst
            rbac_conn = Connection(src[0], src[1], req.upstream[0], req.upstream[1], identity, pi.config.network)
            record.rbac = rbac_conn
            _check_source_identity(record.src_workload, identity, src[0])
            denied = self.authorize(rbac_conn, req.local)
            if denied is not None:
                raise InboundRejected(401, denied, ResponseFlag.DENY)
            spoof = src[0] if self.transparent and src[0] != req.upstream[0] else None
            try:
                upstream = await connect_plain(pi, req.upstream, bind_src=spoof, transparent=self.transparent)
            except ProxyError as e:
                raise InboundRejected(503, str(e)) from None
        except InboundRejected as e:
            conn.core.send_response(ev.stream_id, e.status, end_stream=True)
            conn.detach(ev.stream_id)
            conn.flush()
            pi.connections.register(record)
            reason = _deny_message(e.args[0]) if e.flag is ResponseFlag.DENY else e.args[0]
            pi.connections.release(record, e.flag, reason)
            return
        if stream.done or conn.closed:
            upstream.close()
            return
        headers: list[tuple[str, str]] = []
        if pi.config.enable_response_baggage:
            headers.append((BAGGAGE_HEADER, baggage.workload_baggage(req.local)))
        conn.core.send_response(ev.stream_id, 200, headers)
        conn.flush()
        record.bytes_sent = lambda: stream.bytes_from_plain
        record.bytes_recv = lambda: stream.bytes_to_plain
        record.closer = lambda reason: stream.reset(ErrorCode.CANCEL)
        pi.connections.register(record)
        stream._on_done = lambda s: pi.connections.release(record, ResponseFlag.NONE, s.error)
        stream.attach(upstream)


def _check_source_identity(source: Workload | None, identity: Identity | None, ip: IPAddress) -> None:
    """A peer whose source IP is a known workload must present that workload's identity.

    Stricter than upstream, which trusts the certificate alone: a pod presenting another pod's certificate (a
    compromised node replaying a certificate it holds) is refused. Only ordinary pod-network workloads are checked:
    a host-network workload shares its node's IP with everything else on the node. The source IP is the pod's own
    in in-pod mode (the outbound socket lives in the pod's network namespace, and upstream never rewrites it).
    """
    if source is None or identity is None or source.network_mode is not NetworkMode.STANDARD:
        return
    if source.identity != identity:
        raise InboundRejected(
            401,
            f"identity mismatch: peer certificate is {identity} but source {ip} is workload "
            f"{source.namespace}/{source.name} ({source.identity})",
            ResponseFlag.IDENTITY_ERROR,
        )


def _deny_message(reason: str) -> str:
    return f"connection closed due to policy rejection: {reason}"


def peer_addr_of(conn: HboneTransport) -> tuple[IPAddress, int]:
    sock = conn.transport.get_extra_info("socket") if conn.transport is not None else None
    if sock is not None:
        return peer_addr(sock)
    assert conn.peer is not None
    return ipaddress.ip_address(conn.peer[0]), conn.peer[1]


def local_addr_of(conn: HboneTransport) -> tuple[IPAddress, int]:
    sock = conn.transport.get_extra_info("socket") if conn.transport is not None else None
    if sock is not None:
        return local_dst(sock)
    assert conn.local is not None
    return ipaddress.ip_address(conn.local[0]), conn.local[1]


__all__ = ["Inbound", "InboundRejected", "build_inbound_request", "format_addr", "parse_authority"]
