"""The DNS proxy (port 15053, UDP and TCP): the I/O around :class:`~ztunnel.dns.handler.Handler`.

Upstream ``dns/server.rs``. Pods' DNS traffic is redirected here by the in-pod capture rules; names of mesh
services are answered from ztunnel's state, everything else is forwarded to ztunnel's resolv.conf nameservers.

Each datagram or TCP message goes through the handler synchronously; a local answer is sent before the callback
returns (no task per query). Only forwarding, and waiting for a proxied workload xDS does not know yet, create a
task, owned by the proxy's :class:`~ztunnel.tasks.TaskGroup` and capped at :data:`MAX_IN_FLIGHT_FORWARDS` (beyond
that, SERVFAIL at once) so a flood of unknown names cannot grow memory without bound.

TCP follows upstream's hickory settings: a connection may carry many queries (pipelined, answered as they complete,
which RFC 7766 allows), and is closed once :data:`TCP_REQUEST_TIMEOUT` (5 s) passes without a complete request and
with no answer pending.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import logging
import socket
import struct
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import cast

import dns.exception
import dns.message
import dns.name
import dns.rcode
import dns.rdatatype

from ztunnel.config import Config, SocketAddress
from ztunnel.dns.cache import CachingForwarder
from ztunnel.dns.forwarder import RESOLV_CONF, Forwarder, ForwardError, forwarder_for_mode
from ztunnel.dns.handler import Forward, Handler, Reply, Transport, encode, parse, response_for
from ztunnel.dns.metrics import Metrics
from ztunnel.dns.resolver import Store
from ztunnel.errors import ZtunnelError
from ztunnel.sockets import SocketFactory, set_accepted_options
from ztunnel.state import ProxyState
from ztunnel.state.workload import IPAddress, Workload, canonical_ip
from ztunnel.tasks import TaskGroup

log = logging.getLogger("ztunnel.dns")

TCP_REQUEST_TIMEOUT = 5.0  # upstream DEFAULT_TCP_REQUEST_TIMEOUT
# A query arriving before xDS knows the proxied workload waits this long for it (upstream get_workload: 5 s).
LOCAL_WORKLOAD_WAIT = 5.0
MAX_IN_FLIGHT_FORWARDS = 1024
# A TCP client pipelining faster than upstream answers is paused at this many pending answers.
MAX_PENDING_PER_TCP_CONNECTION = 64
_BIND_RETRIES = 10  # port 0: the TCP port may already be taken on UDP; pick another

LocalWorkloadFn = Callable[[], Workload | None]
LocalWorkloadWait = Callable[[], Awaitable[Workload | None]]
Send = Callable[[bytes], None]


class ResolveError(ZtunnelError, OSError):
    """A name could not be resolved (the upstream failed, or the proxied workload is unknown)."""


class DnsProxy:
    """The DNS proxy of one proxied workload: UDP and TCP listeners on one address, one resolver.

    ``local_workload`` returns the workload this proxy serves (dedicated: ``PROXY_WORKLOAD_INFO``; in-pod: the
    pod) or None while it is not in state. Without ``wait_local_workload`` such queries get SERVFAIL at once; with
    it, they wait for the workload up to ``local_workload_wait`` seconds first, as upstream does (a pod's first
    lookups can race its xDS update). Every socket, listeners and upstream queries alike, comes from ``sockets``.
    """

    def __init__(
        self,
        addr: SocketAddress,
        state: ProxyState,
        local_workload: LocalWorkloadFn,
        forwarder: Forwarder,
        sockets: SocketFactory,
        *,
        cluster_domain: str = "cluster.local",
        metrics: Metrics | None = None,
        preferred_service_namespace: str | None = None,
        ipv6_enabled: bool = True,
        reuse_port: bool = False,
        tcp_timeout: float = TCP_REQUEST_TIMEOUT,
        wait_local_workload: LocalWorkloadWait | None = None,
        local_workload_wait: float = LOCAL_WORKLOAD_WAIT,
    ) -> None:
        self.addr = addr
        self.local_workload = local_workload
        self.forwarder = forwarder
        self.sockets = sockets
        self.metrics = metrics if metrics is not None else Metrics()
        self.ipv6_enabled = ipv6_enabled
        self.reuse_port = reuse_port
        self.tcp_timeout = tcp_timeout
        self.wait_local_workload = wait_local_workload
        self.local_workload_wait = local_workload_wait
        self.store = Store(
            state,
            cluster_domain,
            forwarder.search_domains,
            preferred_service_namespace=preferred_service_namespace,
            ipv6_enabled=ipv6_enabled,
        )
        self.handler = Handler(self.store, self.metrics)
        self.tasks = TaskGroup("dns")
        self._servers: list[asyncio.Server] = []
        self._udp: list[asyncio.DatagramTransport] = []
        self._udp_waiting: list[socket.socket] = []  # bound UDP sockets not served yet (start(serve=False))
        self._tcp_connections: set[_TcpConnection] = set()
        self._in_flight = 0

    @classmethod
    def from_config(
        cls,
        cfg: Config,
        state: ProxyState,
        local_workload: LocalWorkloadFn,
        sockets: SocketFactory,
        metrics: Metrics | None = None,
        *,
        wait_local_workload: LocalWorkloadWait | None = None,
        reuse_port: bool = False,
        resolv_conf: str | Path = RESOLV_CONF,
    ) -> DnsProxy:
        """The proxy as upstream's ``ProxyFactory`` builds it: ``ISTIO_META_DNS_PROXY_ADDR``, the cluster domain,
        the mode's forwarder (resolv.conf nameservers; per-pod search domains in shared mode) behind an answer
        cache (:mod:`~ztunnel.dns.cache`)."""
        return cls(
            cfg.dns_proxy_addr,
            state,
            local_workload,
            CachingForwarder(forwarder_for_mode(cfg.proxy_mode, cfg.cluster_domain, sockets, resolv_conf)),
            sockets,
            cluster_domain=cfg.cluster_domain,
            metrics=metrics,
            preferred_service_namespace=cfg.prefered_service_namespace,
            ipv6_enabled=cfg.ipv6_enabled,
            reuse_port=reuse_port,
            wait_local_workload=wait_local_workload,
        )

    # -- lifecycle -----------------------------------------------------------------------------------------------

    async def start(self, serve: bool = True) -> None:
        """Bind TCP and UDP on the configured address (``localhost``: 127.0.0.1 and ::1), on the same port, and
        with ``serve`` answer at once; else queries wait in the sockets until :meth:`serve` (as upstream's DNS
        server waits for the first xDS sync)."""
        tcp, udp = self._bind()
        loop = asyncio.get_running_loop()
        try:
            for sock in tcp:
                server = await loop.create_server(lambda: _TcpConnection(self), sock=sock, start_serving=serve)
                self._servers.append(server)
            self._udp_waiting = udp
            if serve:
                await self.serve()
        except BaseException:
            for s in (*tcp, *udp):
                s.close()
            self.stop()
            raise
        log.info("starting local DNS server on %s (tcp %s, udp %s)", self.addr, self.tcp_address, self.udp_address)

    async def serve(self) -> None:
        """Start answering on the sockets :meth:`start` bound (a no-op where it already does)."""
        loop = asyncio.get_running_loop()
        for server in self._servers:
            if server.sockets and not server.is_serving():
                await server.start_serving()
        while self._udp_waiting:
            sock = self._udp_waiting[0]
            transport, _ = await loop.create_datagram_endpoint(lambda: _UdpProtocol(self), sock=sock)
            self._udp.append(transport)
            del self._udp_waiting[0]

    def _bind(self) -> tuple[list[socket.socket], list[socket.socket]]:
        addr = self.addr
        for attempt in range(_BIND_RETRIES):
            tcp = [s for s, _ in self.sockets.listeners(addr, reuse_port=self.reuse_port, ipv6=self.ipv6_enabled)]
            port = tcp[0].getsockname()[1]
            try:
                udp = self.sockets.udp_listeners(
                    SocketAddress(addr.host, port), reuse_port=self.reuse_port, ipv6=self.ipv6_enabled
                )
            except OSError as e:
                for s in tcp:
                    s.close()
                if addr.port == 0 and e.errno == errno.EADDRINUSE and attempt + 1 < _BIND_RETRIES:
                    continue
                raise OSError(e.errno, f"DNS proxy: cannot bind UDP {addr.host} port {port}: {e.strerror}") from e
            return tcp, udp
        raise AssertionError("unreachable")

    def stop(self) -> None:
        """Stop listening and close TCP connections. Forwards in flight finish (bounded by the forward lifetime)
        but their answers go nowhere; :meth:`close` also cancels them."""
        for server in self._servers:
            server.close()
        for transport in self._udp:
            transport.close()
        for sock in self._udp_waiting:
            sock.close()
        self._udp_waiting = []
        for conn in list(self._tcp_connections):
            conn.close()
        self._servers.clear()
        self._udp.clear()

    async def close(self) -> None:
        self.stop()
        await self.tasks.cancel_all(timeout=1.0)

    @property
    def tcp_addresses(self) -> list[tuple[str, int]]:
        return [_name(s) for server in self._servers for s in server.sockets]

    @property
    def udp_addresses(self) -> list[tuple[str, int]]:
        return [_name(t.get_extra_info("socket")) for t in self._udp] + [_name(s) for s in self._udp_waiting]

    @property
    def tcp_address(self) -> tuple[str, int]:
        return self.tcp_addresses[0]

    @property
    def udp_address(self) -> tuple[str, int]:
        return self.udp_addresses[0]

    # -- requests ------------------------------------------------------------------------------------------------

    def _client(self) -> Workload | None:
        try:
            return self.local_workload()
        except Exception:
            log.exception("DNS proxy: looking up the local workload failed")
            return None

    async def _wait_for_client(self) -> Workload | None:
        if self.wait_local_workload is None:
            return None
        try:
            return await asyncio.wait_for(self.wait_local_workload(), self.local_workload_wait)
        except Exception:  # not there in time (or the lookup broke): the caller answers SERVFAIL
            return None

    def on_request(self, wire: bytes, transport: Transport, send: Send) -> asyncio.Task[None] | None:
        """Handle one request; returns the task when the answer comes later (forwarded, or waiting for the
        proxied workload to appear)."""
        request = parse(wire)
        if not isinstance(request, dns.message.Message):
            if request is not None:
                send(request.wire)
            return None
        client = self._client()
        if client is None and self.wait_local_workload is not None and self._in_flight < MAX_IN_FLIGHT_FORWARDS:
            return self.tasks.spawn(self._handle_later(request, transport, send), "await local workload")
        command = self.handler.handle_request(request, transport, client)
        if isinstance(command, Reply):
            send(command.wire)
            return None
        if self._in_flight >= MAX_IN_FLIGHT_FORWARDS:
            log.debug("DNS proxy: %d requests in flight, refusing another", self._in_flight)
            self.metrics.forward_failed(command.labels)
            send(encode(response_for(command.request, dns.rcode.SERVFAIL), command.request, transport))
            return None
        return self.tasks.spawn(self._forward_and_send(command, send), "forward")

    async def _handle_later(self, request: dns.message.Message, transport: Transport, send: Send) -> None:
        self._in_flight += 1
        try:
            client = await self._wait_for_client()
        finally:
            self._in_flight -= 1
        command = self.handler.handle_request(request, transport, client)
        if isinstance(command, Reply):
            send(command.wire)
        else:
            await self._forward_and_send(command, send)

    async def _forward_and_send(self, fwd: Forward, send: Send) -> None:
        response = await self.forward(fwd)
        send(encode(response, fwd.request, fwd.transport))

    async def forward(self, fwd: Forward) -> dns.message.Message:
        """Ask upstream (timed and counted); the client's response, SERVFAIL when upstream failed."""
        self._in_flight += 1
        start = time.monotonic()
        upstream: dns.message.Message | None = None
        try:
            upstream = await self.forwarder.forward(fwd.request)
        except (ForwardError, OSError) as e:
            log.debug("DNS forward of %s failed: %s", fwd.request.question[0].name, e)
        finally:
            self._in_flight -= 1
            self.metrics.forward_duration(fwd.labels, time.monotonic() - start)
        # Upstream's failures are its resolver's errors, and hickory's lookup fails on NXDOMAIN and on an answer
        # without records (NoRecordsFound) as on SERVFAIL or a timeout: so every answer without records counts.
        if upstream is None or upstream.rcode() != dns.rcode.NOERROR or not upstream.answer:
            self.metrics.forward_failed(fwd.labels)
        return self.handler.forwarded(fwd, upstream)

    async def resolve(self, name: str) -> list[IPAddress]:
        """Addresses of ``name`` as the proxied workload would get them from this proxy (SOCKS5 domain names):
        A records first, then AAAA (when IPv6 is enabled). Raises :class:`ResolveError` (an ``OSError``) if the
        name is invalid or nothing could be asked; an unknown name gives ``[]``."""
        try:
            qname = dns.name.from_text(name)
        except (dns.exception.DNSException, UnicodeError, ValueError) as e:
            raise ResolveError(errno.EINVAL, f"invalid DNS name {name!r}: {e}") from None
        types = [dns.rdatatype.A, dns.rdatatype.AAAA] if self.ipv6_enabled else [dns.rdatatype.A]
        responses = await asyncio.gather(*(self._query(dns.message.make_query(qname, t)) for t in types))
        out: list[IPAddress] = []
        for resp in responses:
            for rrset in resp.answer:
                if rrset.rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA):
                    out.extend(canonical_ip(ipaddress.ip_address(rd.address)) for rd in rrset)
        if not out:
            failed = [r.rcode() for r in responses if r.rcode() not in (dns.rcode.NOERROR, dns.rcode.NXDOMAIN)]
            if failed:
                raise ResolveError(errno.EHOSTUNREACH, f"resolving {name}: {dns.rcode.to_text(failed[0])}")
        return out

    async def _query(self, request: dns.message.Message) -> dns.message.Message:
        # Upstream's SOCKS5 builds a UDP request and runs it through the same resolver.
        client = self._client()
        if client is None:
            client = await self._wait_for_client()
        out = self.handler.handle_message(request, Transport.UDP, client)
        if isinstance(out, Forward):
            return await self.forward(out)
        return out


def _name(sock: socket.socket | None) -> tuple[str, int]:
    assert sock is not None
    host, port = sock.getsockname()[:2]
    return str(host), int(port)


class _UdpProtocol(asyncio.DatagramProtocol):
    def __init__(self, proxy: DnsProxy) -> None:
        self.proxy = proxy
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str | int, ...]) -> None:
        transport = self.transport
        assert transport is not None

        def send(wire: bytes) -> None:
            if not transport.is_closing():
                transport.sendto(wire, addr)

        self.proxy.on_request(data, Transport.UDP, send)

    def error_received(self, exc: Exception) -> None:
        # ICMP errors for earlier replies (the client went away): nothing to do.
        log.debug("DNS UDP socket error: %s", exc)


class _TcpConnection(asyncio.Protocol):
    """One client connection: 2-byte length-prefixed messages (RFC 1035 §4.2.2), answered as they complete."""

    def __init__(self, proxy: DnsProxy) -> None:
        self.proxy = proxy
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.pending = 0
        self.timer: asyncio.TimerHandle | None = None
        self.write_paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            set_accepted_options(sock, self.proxy.sockets.cfg, keepalive=False)
        self.proxy._tcp_connections.add(self)
        self._arm()

    def _arm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer = asyncio.get_running_loop().call_later(self.proxy.tcp_timeout, self._timed_out)

    def _timed_out(self) -> None:
        self.timer = None
        if self.pending:
            self._arm()  # an answer is still coming; the client is waiting for it, not idle
            return
        log.debug("DNS TCP connection idle for %.0fs, closing", self.proxy.tcp_timeout)
        self.close()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while len(self.buf) >= 2 and self.transport is not None and not self.transport.is_closing():
            (length,) = struct.unpack_from("!H", self.buf)
            if len(self.buf) < 2 + length:
                break
            message = bytes(self.buf[2 : 2 + length])
            del self.buf[: 2 + length]
            self._arm()
            task = self.proxy.on_request(message, Transport.TCP, self._send)
            if task is not None:
                self.pending += 1
                task.add_done_callback(self._answered)
                self._update_reading()

    def _send(self, wire: bytes) -> None:
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.write(struct.pack("!H", len(wire)) + wire)

    def _answered(self, _: asyncio.Task[None]) -> None:
        self.pending -= 1
        self._update_reading()

    def _update_reading(self) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if self.write_paused or self.pending >= MAX_PENDING_PER_TCP_CONNECTION:
            transport.pause_reading()
        else:
            transport.resume_reading()

    def pause_writing(self) -> None:
        self.write_paused = True
        self._update_reading()

    def resume_writing(self) -> None:
        self.write_paused = False
        self._update_reading()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.proxy._tcp_connections.discard(self)
        self.buf.clear()
