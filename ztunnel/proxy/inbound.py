"""Inbound HBONE (port 15008): mutual TLS, HTTP/2 CONNECT, policy, then a relay to the local workload.

Upstream ``proxy/inbound.rs``. The TLS server presents the proxied workload's certificate and requires a client
certificate from the same trust domain. Each CONNECT stream is checked in upstream's order, and answered with
upstream's status codes (the client maps anything but 200 to a failed connection):

* 400: the method is not CONNECT; the ``:authority`` is not ``ip:port`` (or ``host:port``); the target IP is not
  the IP the client dialled (``ip mismatch``), unless the local workload has an app tunnel or is the target's
  waypoint;
* 503: the local workload is unknown; no target port (hostname authority without a port mapping); the target port
  is one of ztunnel's own (``attempted recursive call to ourselves``); the workload refused the connection;
* 401: authorization policy denied it, also when the denying policy arrived while the app was being connected to;
  with ``ZTUNNEL_VERIFY_SOURCE_IDENTITY=true``, the peer's certificate is not the identity of the workload its
  source IP belongs to (stricter than upstream, see ``_check_source_identity``);
* 200 (with ``baggage`` describing the destination, when ``ENABLE_RESPONSE_BAGGAGE``), then the bytes flow.

The source workload (labels, access log) is the workload at the peer's IP only when the certificate is that
workload's identity, and never through a gateway (``x-forwarded-network``); otherwise the source is the certificate
identity, plus the peer's ``baggage`` once the stream is established. A workload with a PROXY-protocol application
tunnel (a waypoint) gets a PROXY v2 header first (``proxy_protocol``), over loopback with ``LOCALHOST_APP_TUNNEL``.
The upstream connection's source IP is the
client's when the listener could be made transparent (IP_TRANSPARENT), so the workload sees who really called.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging
import socket
from collections.abc import Container, Mapping
from dataclasses import dataclass
from functools import partial
from typing import cast

from ztunnel import baggage, tls
from ztunnel.crl import REPORTER_INBOUND, Tracked
from ztunnel.identity.spiffe import Identity
from ztunnel.net import format_addr
from ztunnel.proxy.common import (
    BAGGAGE_HEADER,
    FORWARDED_HEADER,
    TRACEPARENT_HEADER,
    X_FORWARDED_NETWORK,
    ProxyError,
    ResponseFlag,
    guess_inbound_service,
    services_of,
)
from ztunnel.proxy.connect import INTERRUPTED, connect_interruptible
from ztunnel.proxy.connection_manager import AuthorizeFn, ConnectionRecord, Direction, log_failed
from ztunnel.proxy.hbone.connection import HboneTransport, http2_settings
from ztunnel.proxy.hbone.core import ConnectRequested, HboneConnection
from ztunnel.proxy.hbone.reason import CloseKind, CloseReason
from ztunnel.proxy.hbone.stream import HboneStream
from ztunnel.proxy.inputs import InboundBalance, ProxyInputs
from ztunnel.proxy.listener import Listener
from ztunnel.proxy.metrics import DerivedWorkload
from ztunnel.proxy.proxy_protocol import app_tunnel_header
from ztunnel.proxy.relay import PlainConnection
from ztunnel.rbac import Connection
from ztunnel.sockets import parsed_address, set_accepted_options
from ztunnel.state import ProxyState
from ztunnel.state.service import Service
from ztunnel.state.upstream import ServiceDescription
from ztunnel.state.workload import AppTunnelProtocol, IPAddress, NetworkAddress, NetworkMode, Workload
from ztunnel.tasks import running_loop
from ztunnel.telemetry import Display, display, enter_span, span_id
from ztunnel.telemetry import log as log_fields

log = logging.getLogger("ztunnel.proxy.inbound")


_LOOPBACK_V4 = ipaddress.IPv4Address("127.0.0.1")
_LOOPBACK_V6 = ipaddress.IPv6Address("::1")

# The access log's error for a stream that went away (peer reset, connection lost) before the app answered.
STREAM_GONE = "stream closed before the connection to the app was established"


@dataclass(frozen=True, slots=True)
class InboundRequest:
    """A validated CONNECT: where to connect, and what policy and telemetry need to know."""

    upstream: tuple[IPAddress, int]
    local: Workload
    service: ServiceDescription | None
    # The local workload has an application tunnel: its protocol, and the address that goes in its PROXY header
    # (the HBONE target; for a hostname target, the service's VIP with the requested port).
    tunnel: AppTunnelProtocol | None = None
    tunnel_target: tuple[IPAddress, int] | None = None


class InboundRejected(ProxyError):
    """A CONNECT refused with HTTP ``status``; the message and response flag go to the access log."""

    def __init__(self, status: int, message: str, flag: ResponseFlag = ResponseFlag.CONNECT) -> None:
        super().__init__(message, flag)
        self.status = status


def parse_authority(authority: str) -> tuple[IPAddress, int] | tuple[str, int]:
    """``ip:port`` / ``[v6]:port`` as an address, or ``host:port`` as a hostname; ValueError naming the authority
    otherwise.

    Answers from a bounded cache (the same few authorities come back on every CONNECT; parsing one with
    ``ipaddress`` was most of its cost, and the results are immutable): 4,096 authorities of at most 64 characters
    (a bracketed IPv6 address with a port is at most 47), so a peer's long or many authorities hold no more than
    ~1 MiB; a refused one is parsed each time.
    """
    if len(authority) <= _CACHED_AUTHORITY:
        return _parse_authority_cached(authority)
    return _parse_authority(authority)


_CACHED_AUTHORITY = 64


def _parse_authority(authority: str) -> tuple[IPAddress, int] | tuple[str, int]:
    """:func:`parse_authority`, uncached.

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


_parse_authority_cached = functools.lru_cache(maxsize=4096)(_parse_authority)


def _quote(text: str) -> str:
    """``repr`` cut to 100 characters: an authority can be as long as the header block (64 KiB)."""
    return repr(text) if len(text) <= 100 else f"{text[:100]!r}..."


def build_inbound_request(
    pi: ProxyInputs, method: str, authority: str, conn_dst: IPAddress, headers: Mapping[str, str]
) -> InboundRequest:
    """Upstream's ``build_inbound_request``: validate a CONNECT and find the upstream. Raises InboundRejected.

    In upstream's order: the method and ``:authority`` (400), the local workload (503), the destination
    (``validate_destination``, 400), then the upstream port (``find_inbound_upstream``, 503).
    """
    if method != "CONNECT":
        raise InboundRejected(400, f"unsupported method {method!r}: HBONE requires CONNECT")
    try:
        host, port = parse_authority(authority)
    except ValueError as e:
        raise InboundRejected(400, str(e)) from None
    local = pi.local.find()
    if local is None:
        raise InboundRejected(503, f"unknown local workload {pi.local.info}")
    requested_port = port
    candidates: list[Service]
    if isinstance(host, str):
        # A service hostname (double HBONE, waypoints): map the service port to the workload's target port. The
        # IP is the one dialled in any case; a hostname needs no destination check.
        svc, port = hostname_target(pi.state, host, port, local)
        candidates = [svc]
    else:
        if host != conn_dst and not is_destination_this_waypoint(pi, local, host, conn_dst):
            raise InboundRejected(400, f"ip mismatch: {host} != {conn_dst}")
        candidates = services_of(pi.state, local)
    port = upstream_port(local, port, pi.config.illegal_ports)
    tunnel = local.application_tunnel
    tunnel_target: tuple[IPAddress, int] | None = None
    if tunnel is not None:
        if isinstance(host, str):
            # PROXY carries no hostname: the service's VIP on our network (IPv4 first) with the requested port.
            tunnel_target = (_service_vip(candidates[0], pi.config.network, host), requested_port)
        else:
            tunnel_target = (host, requested_port)
    service = guess_inbound_service(candidates, parse_forwarded_host(headers.get(FORWARDED_HEADER, "")), port, local)
    # The target IP is always the one the client dialled (the pod's own address).
    return InboundRequest(
        upstream=(conn_dst, port),
        local=local,
        service=service,
        tunnel=tunnel.protocol if tunnel is not None else None,
        tunnel_target=tunnel_target,
    )


def _service_vip(svc: Service, network: str, host: str) -> IPAddress:
    """Upstream's choice of the VIP that stands for a hostname target in a PROXY header: one on our network, an
    IPv4 one first; else any. 503 if the service has none."""
    best: tuple[int, IPAddress] | None = None
    for vip in svc.vips:
        rank = (2 if vip.address.version == 4 else 1) if vip.network == network else 0
        if best is None or rank > best[0]:
            best = (rank, vip.address)
    if best is None:
        raise InboundRejected(503, f"no IP for service {host}: a PROXY header needs an address")
    return best[1]


def hostname_target(state: ProxyState, host: str, port: int, local: Workload) -> tuple[Service, int]:
    """For a CONNECT to ``<service hostname>:<port>`` (double HBONE, waypoints): the service and the local
    workload's target port (the endpoint's own map first, for named ports). Raises InboundRejected (503). Pure, so
    ``ztunnel explain`` runs it too."""
    svc = state.find_service_by_hostname(host, local.namespace)
    if svc is None:
        raise InboundRejected(503, f"unknown service hostname {host}")
    ep = svc.endpoints.get(local.uid)
    mapped = ep.port.get(port) if ep is not None else None
    if mapped is None:
        mapped = svc.ports.get(port, 0)
        if not mapped:
            raise InboundRejected(503, f"no port mapping for {svc.hostname}:{port} on workload {local.name}")
    return svc, mapped


def upstream_port(local: Workload, port: int, illegal_ports: Container[int]) -> int:
    """The port to connect to on the local workload for a CONNECT to ``port`` (after a service port mapping):
    refused (503) when it is one of ztunnel's own, else the workload's app tunnel port if it has one. Pure, so
    ``ztunnel explain`` runs it too."""
    # The port as resolved, before an app tunnel may replace it: a self-call must not hide behind the tunnel port.
    if port in illegal_ports:
        raise InboundRejected(503, "attempted recursive call to ourselves")
    if local.application_tunnel is not None and local.application_tunnel.port:
        return local.application_tunnel.port
    return port


def is_destination_this_waypoint(pi: ProxyInputs, local: Workload, target: IPAddress, conn_dst: IPAddress) -> bool:
    """Upstream's ``validate_destination`` for a target IP other than the one dialled (the "sandwich"): allowed
    when the local workload has an app tunnel (the target goes in its PROXY header), or when the target (a workload
    or service VIP) names a waypoint that is us: a waypoint service whose endpoints include this workload (whether
    referenced by hostname or by VIP), or a waypoint workload whose IPs include the dialled IP."""
    if local.application_tunnel is not None:
        return True
    found = pi.state.find_address(NetworkAddress(pi.config.network, target))
    gw = found.waypoint if found is not None else None
    if gw is None:
        return False
    dest = gw.destination
    waypoint = pi.state.find_address(dest) if isinstance(dest, NetworkAddress) else pi.state.find_hostname(dest)
    if isinstance(waypoint, Service):
        return local.uid in waypoint.endpoints
    return waypoint is not None and conn_dst in waypoint.workload_ips


def parse_forwarded_host(value: str) -> str | None:
    """The ``host=`` of a ``forwarded`` header, as upstream's ``parse_forwarded_host``: the first parameter written
    ``host=`` (exactly), its value without surrounding quotes; None if the header is not ASCII or the value empty."""
    if not value.isascii():
        return None
    for raw in value.split(";"):
        part = raw.strip()
        if part.startswith("host="):
            host = part[5:]
            host = host[1:] if host.startswith('"') else host
            host = host[:-1] if host.endswith('"') else host
            return host or None
    return None


def from_gateway(headers: Mapping[str, str], network: str) -> bool:
    """The request crossed a network gateway: ``x-forwarded-network`` names a network other than ours (compared
    without case, as upstream). Its source IP is then the gateway's, not the client's."""
    origin = headers.get(X_FORWARDED_NETWORK)
    return origin is not None and origin.lower() != network.lower()


def _naddr(pi: ProxyInputs, ip: IPAddress) -> NetworkAddress:
    return NetworkAddress(pi.config.network, ip)


class Inbound(Listener):
    """The 15008 listener of one proxy."""

    def __init__(self, pi: ProxyInputs, authorize: AuthorizeFn) -> None:
        super().__init__(pi, pi.config.inbound_addr)
        self.authorize = authorize
        self.connections: set[HboneTransport] = set()
        self.settings = http2_settings(pi.config, client_side=False)
        self._crl_tracked: dict[HboneTransport, Tracked | None] = {}  # CRL_PATH: open connections under enforcement

    def drain(self) -> None:
        """GOAWAY every connection: open streams finish, new ones go elsewhere."""
        for conn in list(self.connections):
            conn.goaway()

    def new_protocol(self) -> asyncio.BaseProtocol:
        balance = self.pi.balance
        if balance is not None:
            target = balance.pick()
            if target is not None:
                return _HandOff(balance, target)
            balance.opened()
        return self._accepted()

    async def adopt(self, sock: socket.socket) -> None:
        """Serve a connection another worker process accepted on 15008 and handed to this one (nothing was read from
        it): as one accepted here, and never handed on. The socket is the transport's from here on."""
        if self.pi.balance is not None:
            self.pi.balance.opened()
        conn = self._accepted()
        try:
            await running_loop().connect_accepted_socket(lambda: conn, sock)
        except BaseException:
            conn.abort("the handed-over socket could not be served")  # counted closed, like any connection
            sock.close()
            raise

    def _accepted(self) -> HboneTransport:
        conn = HboneTransport(
            HboneConnection(False, self.settings),
            None,
            on_handshake=self._verified,
            on_connect_request=self._on_request,
            on_closed=self._closed,
        )
        self.connections.add(conn)
        traffic = self.pi.connections.traffic
        if traffic is not None:
            traffic.socket_opened("destination")  # an accepted socket; taken off in _closed
        self.pi.tasks.spawn(self._start_tls(conn), "inbound tls")
        return conn

    async def _start_tls(self, conn: HboneTransport) -> None:
        """Serve the proxied workload's certificate (fetched on demand, waiting for xDS as upstream)."""
        try:
            local = await self.pi.local.get()
            cert = await self.pi.certs.fetch_certificate(local.identity)
        except Exception as e:
            if not conn.closed:  # a peer that left meanwhile has no address left to log, and nothing to be told
                self._early_fail(conn, f"no certificate for the local workload: {e}")
                conn.abort(str(e))
            return
        if conn.transport is None:
            await asyncio.sleep(0)
        if conn.closed:
            return  # the peer left while the certificate was on its way: nothing to start
        sock = conn.transport.get_extra_info("socket") if conn.transport is not None else None
        if sock is not None and sock.fileno() >= 0:
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
            conn.abort(CloseReason(CloseKind.PEER_REJECTED, str(e)))
            return
        conn.peer_identity = identity
        crl = self.pi.contexts.crl
        if crl is not None:
            self._crl_tracked[conn] = crl.track(
                tls.peer_chain(conn.ssl_object),
                REPORTER_INBOUND,
                f"{format_addr(*peer_addr_of(conn))} ({identity})",
                partial(self.pi.connections.revoke_tunnel, conn),
            )

    def _early_fail(self, conn: HboneTransport, error: str, flag: ResponseFlag | None = None) -> None:
        """A connection that failed before any stream: the WARN line, and with ``flag`` a failed-connection sample
        (reporter destination, the local workload as destination) so rejected peers show up in metrics too."""
        if conn.peer is None:
            return
        src, dst = peer_addr_of(conn), local_addr_of(conn)
        if flag is None:
            log_failed(Direction.INBOUND, src, dst, error)
            return
        # No source workload: the handshake failed, so nothing proves the peer is the workload at its IP.
        record = ConnectionRecord(direction=Direction.INBOUND, src=src, dst=dst, mtls=True)
        local = self.pi.local.find()
        if local is not None:
            record.dst_workload = local
            record.dst_identity = local.identity
        self.pi.connections.register(record)
        self.pi.connections.release(record, flag, error)

    def _closed(self, conn: HboneTransport) -> None:
        traffic = self.pi.connections.traffic
        if conn in self.connections and traffic is not None:
            traffic.socket_closed("destination")
        self.connections.discard(conn)
        if self._crl_tracked:
            crl = self.pi.contexts.crl
            if crl is not None:
                crl.untrack(self._crl_tracked.pop(conn, None))
        if self.pi.balance is not None:
            self.pi.balance.closed()
        reason = conn.close_reason
        if not conn.handshake_done and reason is not None and reason.tls_failure and conn.peer is not None:
            if reason.revoked and self.pi.contexts.crl is not None and self.pi.contexts.crl.metrics is not None:
                self.pi.contexts.crl.metrics.rejected(REPORTER_INBOUND)
            self._early_fail(conn, str(reason), ResponseFlag.TLS_FAILURE)

    def _on_request(self, conn: HboneTransport, stream: HboneStream, ev: ConnectRequested) -> None:
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
            tunnel=conn,
        )
        # This stream's task logs within upstream's inbound span: the client's trace id (its traceparent).
        enter_span("inbound", {"id": span_id(ev.headers.get(TRACEPARENT_HEADER)), "peer": Display(format_addr(*src))})
        if log.isEnabledFor(logging.DEBUG):
            log_fields(log, logging.DEBUG, "received request", authority=display(ev.authority), identity=str(identity))
        # Until the stream is up, the source is what its certificate proves. Nothing the peer wrote (baggage)
        # labels a refused stream: each invented value would be a metric series of its own (stricter than upstream).
        record.derived_source = DerivedWorkload.of_identity(identity)
        # Through a gateway the source IP is the gateway's; otherwise it is the source workload's only if the
        # certificate is that workload's identity (never attribute the IP's workload to someone else).
        if pi.on_demand is None:  # nothing to wait for: no coroutines (2 per stream) to look it up
            at_peer = None if from_gateway(ev.headers, pi.config.network) else NetworkAddress(pi.config.network, src[0])
            ip_workload = pi.state.workloads.find_address(at_peer) if at_peer is not None else None
        else:
            ip_workload = await self._workload_at_peer(src[0], ev.headers)
        if ip_workload is not None and ip_workload.identity == identity:
            record.src_workload = ip_workload
        try:
            if pi.on_demand is not None:
                await self._fetch_target(ev.authority, conn_dst[0])
            req = build_inbound_request(pi, ev.method, ev.authority, conn_dst[0], ev.headers)
            record.dst_workload = req.local
            record.dst_identity = req.local.identity
            record.dst_service = req.service
            if ip_workload is not None and record.src_workload is None and pi.config.verify_source_identity:
                _check_source_identity(ip_workload, identity, src[0])
        except InboundRejected as e:
            self._reject(conn, stream, record, e)
            return
        record.rbac = Connection(src[0], src[1], req.upstream[0], req.upstream[1], identity, pi.config.network)
        # Tracked from before the policy check until it closes (upstream's assert_rbac registers first): a policy
        # that arrives while the app is being connected to reaches this stream as well.
        pi.connections.register(record, established=False)
        try:
            denied = self.authorize(record.rbac, req.local)
            if denied is not None:
                raise InboundRejected(401, _deny_message(denied), ResponseFlag.DENY)
            upstream = await self._connect(record, req, src[0])
        except InboundRejected as e:
            self._reject(conn, stream, record, e)
            return
        except asyncio.CancelledError:
            # The peer reset the stream or lost the connection first (its setup task is cancelled), or shutdown.
            pi.connections.release(record, ResponseFlag.CONNECT, stream.error or STREAM_GONE)
            raise
        if stream.done or conn.closed:
            upstream.close()
            pi.connections.release(record, ResponseFlag.CONNECT, stream.error or STREAM_GONE)
            return
        if pi.config.enable_response_baggage:
            # Established: what the peer's baggage says labels it too (upstream's derived source).
            bag = baggage.parse(ev.headers.get(BAGGAGE_HEADER, ""))
            record.derived_source = DerivedWorkload.from_baggage(bag, identity)
        record.bytes_sent = stream.count_from_plain
        record.bytes_recv = stream.count_to_plain
        record.closer = stream.cancel
        pi.connections.established(record)
        headers: list[tuple[str, str]] = []
        if pi.config.enable_response_baggage:
            headers.append((BAGGAGE_HEADER, baggage.workload_baggage(req.local)))
        conn.respond(stream, 200, headers)
        if req.tunnel is AppTunnelProtocol.PROXY:
            # Before any byte of the stream: the app reads who called (the TCP peer, as upstream), what it asked
            # for and the peer's certificate identity from the header, not from the connection.
            assert req.tunnel_target is not None
            upstream.write(memoryview(app_tunnel_header(src, req.tunnel_target, str(identity) if identity else None)))
        stream.attach(upstream, on_done=lambda s: pi.connections.release(record, ResponseFlag.NONE, s.error))

    async def _connect(self, record: ConnectionRecord, req: InboundRequest, client_ip: IPAddress) -> PlainConnection:
        """Connect to the app (503 if it fails); a policy that denies the stream meanwhile makes it a 401.

        A PROXY app tunnel goes over loopback, from loopback, with ``LOCALHOST_APP_TUNNEL`` (default, as upstream):
        the tunnel port is then reachable only through ztunnel, and a loopback source passes the pod's RPF, iptables
        and routes where a spoofed client address might not; the client's address travels in the PROXY header."""
        dst = req.upstream
        transparent = self.transparent
        spoof = client_ip if transparent and client_ip != dst[0] else None
        if req.tunnel is AppTunnelProtocol.PROXY and self.pi.config.localhost_app_tunnel:
            loopback = _LOOPBACK_V4 if dst[0].version == 4 else _LOOPBACK_V6
            dst, spoof, transparent = (loopback, dst[1]), loopback, False
        try:
            upstream = await connect_interruptible(self.pi.sockets, record, dst, spoof, transparent)
        except ProxyError as e:
            raise InboundRejected(503, str(e), e.flag) from None
        if upstream is None:
            flag, reason = record.forced or (ResponseFlag.CONNECT, INTERRUPTED)
            raise InboundRejected(401 if flag is ResponseFlag.DENY else 503, reason, flag)
        return upstream

    async def _workload_at_peer(self, ip: IPAddress, headers: Mapping[str, str]) -> Workload | None:
        """The workload at the peer's IP (upstream ``fetch_workload_by_address``, on demand with XDS_ON_DEMAND);
        None through a gateway (``x-forwarded-network``), whose IP is the gateway's, never the source's."""
        pi = self.pi
        if from_gateway(headers, pi.config.network):
            return None
        await pi.fetch_workload_by_address(_naddr(pi, ip))
        return pi.state.workloads.find_address(_naddr(pi, ip))

    async def _fetch_target(self, authority: str, conn_dst: IPAddress) -> None:
        """On-demand xDS: a target IP other than the dialled one is looked up before the destination check (upstream
        fetches it when the state does not know it)."""
        try:
            host, _ = parse_authority(authority)
        except ValueError:
            return  # refused below, with the reason
        if not isinstance(host, str) and host != conn_dst:
            await self.pi.fetch_address(_naddr(self.pi, host))
            # The sandwich check resolves the target's waypoint too: ask for it when it is not known either.
            found = self.pi.state.find_address(_naddr(self.pi, host))
            if found is not None and found.waypoint is not None:
                await self.pi.fetch_destination(found.waypoint.destination)

    def _reject(self, conn: HboneTransport, stream: HboneStream, record: ConnectionRecord, e: InboundRejected) -> None:
        """Answer ``e.status`` and end the stream; the access log and metrics report it (never established)."""
        conn.reject(stream, e.status)
        pi = self.pi
        if not record.id:
            pi.connections.register(record, established=False)
        pi.connections.release(record, e.flag, str(e))


class _HandOff(asyncio.Protocol):
    """A connection accepted here that goes to worker ``target``: its socket is passed on as soon as the transport
    exists (before reading is started, so before a byte is read) and this process's copy is let go, which leaves the
    connection open (the copy on its way holds it)."""

    __slots__ = ("balance", "target")

    def __init__(self, balance: InboundBalance, target: int) -> None:
        self.balance = balance
        self.target = target

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        sock = transport.get_extra_info("socket")
        try:
            self.balance.hand_off(sock.fileno(), self.target)
        except Exception as e:  # the channel to the control process ended: this worker is exiting
            log.warning("inbound connection from %s could not be handed to worker %d: %s", _peer(sock), self.target, e)
        cast(asyncio.Transport, transport).abort()  # uvloop's transports do not subclass asyncio.Transport


def _peer(sock: socket.socket) -> str:
    try:
        return format_addr(*sock.getpeername()[:2])
    except OSError:
        return "a peer that left"


def _check_source_identity(source: Workload, identity: Identity | None, ip: IPAddress) -> None:
    """``ZTUNNEL_VERIFY_SOURCE_IDENTITY=true``: a peer on a known workload's IP must present that workload's identity.

    Stricter than upstream, which trusts the certificate alone (and which this project follows by default, then
    without attributing the IP's workload to the peer): a pod presenting another pod's certificate (a compromised
    node replaying a certificate it holds) is refused. Only ordinary pod-network workloads are checked: a
    host-network workload shares its node's IP with everything else on the node. Not called for requests through a
    gateway (``x-forwarded-network``), whose source IP is the gateway's.
    """
    if source.network_mode is not NetworkMode.STANDARD:
        return
    raise InboundRejected(
        401,
        f"identity mismatch: peer certificate is {identity} but source {ip} is workload "
        f"{source.namespace}/{source.name} ({source.identity})",
        ResponseFlag.IDENTITY_ERROR,
    )


def _deny_message(reason: str) -> str:
    return f"connection closed due to policy rejection: {reason}"


def peer_addr_of(conn: HboneTransport) -> tuple[IPAddress, int]:
    """The HBONE connection's peer, from the address its transport gave once at ``connection_made`` (a socket's, or
    an outer stream's for a tunnel inside a tunnel): no transport lookups per stream."""
    assert conn.peer is not None
    return parsed_address(conn.peer)


def local_addr_of(conn: HboneTransport) -> tuple[IPAddress, int]:
    """The address the peer dialled, as :func:`peer_addr_of`."""
    assert conn.local is not None
    return parsed_address(conn.local)


__all__ = ["Inbound", "InboundRejected", "build_inbound_request", "parse_authority", "upstream_port"]
