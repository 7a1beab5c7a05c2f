"""What every listener shares (upstream ``proxy.rs``): inputs, errors with response flags, HBONE headers, the
proxied workload's identity and certificates, and the TLS context cache."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import random
import ssl
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ztunnel import tls
from ztunnel.config import Config, WorkloadInfo
from ztunnel.drain import Drain
from ztunnel.identity.certificate import WorkloadCertificate
from ztunnel.identity.manager import CertificateProvider
from ztunnel.identity.spiffe import Identity
from ztunnel.sockets import SocketFactory
from ztunnel.state import ProxyState, StateChange
from ztunnel.state.service import Service
from ztunnel.state.upstream import ServiceDescription
from ztunnel.state.workload import IPAddress, NetworkAddress, Workload
from ztunnel.tasks import TaskGroup

if TYPE_CHECKING:
    from ztunnel.proxy.connection_manager import ConnectionManager
    from ztunnel.proxy.pool import WorkloadHBONEPool

log = logging.getLogger("ztunnel.proxy")

BAGGAGE_HEADER = "baggage"
FORWARDED_HEADER = "forwarded"
TRACEPARENT_HEADER = "traceparent"
X_FORWARDED_NETWORK = "x-forwarded-network"
# Upstream waits this long for a workload to appear in xDS before giving up (proxy.rs wait_for_workload).
WORKLOAD_WAIT_TIMEOUT = 5.0
# How long a connection waits for the control plane to answer an on-demand lookup before deciding without it.
# Upstream (state.rs fetch_on_demand) waits for the answer with no bound: istiod always answers an explicit
# subscription, with a removal when nothing matches. A bound keeps a control-plane outage from holding connections
# forever; 5 s is upstream's other xDS wait (wait_for_workload).
ON_DEMAND_TIMEOUT = 5.0
CONNECTION_TIMEOUT = 10.0


class ResponseFlag(enum.Enum):
    """``response_flags`` metric label and access-log values (upstream ``proxy/metrics.rs``)."""

    NONE = "-"
    DENY = "DENY"
    CONNECT = "CONNECT"
    TLS_FAILURE = "TLS_FAILURE"
    H2_HANDSHAKE_FAILURE = "H2_HANDSHAKE_FAILURE"
    NETWORK_POLICY = "NETWORK_POLICY"
    IDENTITY_ERROR = "IDENTITY_ERROR"
    CERT_REVOKED = "CERT_REVOKED"


class ProxyError(Exception):
    """A connection could not be proxied. ``flag`` is the response flag; the message goes to the access log."""

    def __init__(self, message: str, flag: ResponseFlag = ResponseFlag.CONNECT) -> None:
        super().__init__(message)
        self.flag = flag


def os_error_reason(e: OSError) -> str:
    """The reason of a failed socket call as the operator knows it (``Connection refused``), not the event loop's
    wording (``Connect call failed ('10.0.0.1', 15008)``, which hides the errno)."""
    return os.strerror(e.errno) if e.errno else (e.strerror or str(e))


def format_addr(ip: IPAddress, port: int) -> str:
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


def forwarded_header(src: tuple[IPAddress, int], service_hostname: str | None) -> str:
    """``for="<src ip:port>"``, plus ``;host=<service hostname>`` when the traffic was service-addressed."""
    value = f'for="{format_addr(*src)}"'
    return f"{value};host={service_hostname}" if service_hostname else value


def services_of(state: ProxyState, workload: Workload) -> list[Service]:
    """The services that select ``workload``, in its xDS order (upstream ``get_services_by_workload``)."""
    found = (state.services.get(key) for key in workload.services)
    return [svc for svc in found if svc is not None]


def guess_inbound_service(
    candidates: Sequence[Service], forwarded_host: str | None, port: int, dest: Workload
) -> ServiceDescription | None:
    """``destination_service`` of an inbound connection (upstream ``proxy.rs::guess_inbound_service``).

    Only ``candidates`` (the services that select the destination, or the one a hostname authority named) can be
    reported, so a peer cannot invent a label value: the one the ``forwarded`` host names, else the first whose
    target port is ``port`` (the service's own number, or for a named port this endpoint's map), else None.
    """
    if forwarded_host is not None:
        for svc in candidates:
            if svc.hostname == forwarded_host:
                return ServiceDescription.of(svc)
    for svc in candidates:
        ep = svc.endpoints.get(dest.uid)
        for svc_port, target in svc.ports.items():
            if target == port or (ep is not None and ep.port.get(svc_port) == port):
                return ServiceDescription.of(svc)
    return None


_trace_rng = random.Random()


def new_traceparent() -> str:
    """A random W3C ``traceparent`` (``00-<32 hex>-<16 hex>-00``), one per connection as upstream.

    Trace ids need to be unique, not secret: a seeded PRNG costs no system call (``os.urandom`` was two
    ``getrandom`` calls per connection).
    """
    return f"00-{_trace_rng.getrandbits(128):032x}-{_trace_rng.getrandbits(64):016x}-00"


class TlsContextCache:
    """SSL contexts per certificate: building one loads the chain and key (~0.3 ms), so do it once per cert."""

    def __init__(self, tls12_enabled: bool = False) -> None:
        self.tls12_enabled = tls12_enabled
        self._client: dict[Identity, tuple[WorkloadCertificate, ssl.SSLContext]] = {}
        self._server: dict[Identity, tuple[WorkloadCertificate, ssl.SSLContext]] = {}

    def client(self, identity: Identity, cert: WorkloadCertificate) -> ssl.SSLContext:
        hit = self._client.get(identity)
        if hit is not None and hit[0] is cert:
            return hit[1]
        ctx = tls.client_context(cert, tls12_enabled=self.tls12_enabled)
        self._client[identity] = (cert, ctx)
        return ctx

    def server(self, identity: Identity, cert: WorkloadCertificate) -> ssl.SSLContext:
        hit = self._server.get(identity)
        if hit is not None and hit[0] is cert:
            return hit[1]
        ctx = tls.server_context(cert, tls12_enabled=self.tls12_enabled)
        self._server[identity] = (cert, ctx)
        return ctx


class LocalWorkload:
    """The workload a proxy serves (dedicated: ``PROXY_WORKLOAD_INFO``; in-pod: from ZDS), found in xDS state.

    Upstream waits up to 5 s for the workload to appear before failing the connection: xDS may lag the pod.
    """

    def __init__(self, state: ProxyState, info: WorkloadInfo) -> None:
        self.state = state
        self.info = info
        self._cached: Workload | None = None
        self._version = -1
        self._waiters: list[asyncio.Future[None]] = []
        self._unsubscribe = state.subscribe(self._on_change)

    def _on_change(self, change: StateChange) -> None:
        if change.workloads:
            self._version = -1
            for w in self._waiters:
                if not w.done():
                    w.set_result(None)
            self._waiters.clear()

    def find(self) -> Workload | None:
        if self._version == self.state.version and self._cached is not None:
            return self._cached
        info = self.info
        self._cached = self.state.workloads.find_local(info.namespace, info.name, info.service_account)
        self._version = self.state.version
        return self._cached

    async def get(self, timeout: float = WORKLOAD_WAIT_TIMEOUT) -> Workload:
        w = self.find()
        if w is not None:
            return w
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while w is None:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise ProxyError(f"failed to fetch information about local workload {self.info}: not found in xDS")
            fut: asyncio.Future[None] = loop.create_future()
            self._waiters.append(fut)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(fut, remaining)
            w = self.find()
        return w

    def close(self) -> None:
        self._unsubscribe()


# Asks the control plane for "<network>/<ip>" (XDS_ON_DEMAND) and returns once it answered; the answer, if any,
# is in the state by then (upstream ``Demander``).
OnDemand = Callable[[NetworkAddress], Awaitable[None]]


@dataclass
class ProxyInputs:
    """Everything a proxy's listeners share (upstream ``ProxyInputs``)."""

    config: Config
    state: ProxyState
    certs: CertificateProvider
    sockets: SocketFactory
    local: LocalWorkload
    drain: Drain
    contexts: TlsContextCache
    pool: WorkloadHBONEPool
    connections: ConnectionManager
    tasks: TaskGroup = field(default_factory=lambda: TaskGroup("proxy"))
    rng: random.Random = field(default_factory=random.Random)
    # Set when XDS_ON_DEMAND=true: addresses missing from the state are asked for before deciding.
    on_demand: OnDemand | None = None

    async def fetch_address(self, addr: NetworkAddress, client_ns: str | None = None) -> None:
        """Upstream ``fetch_address``: if no service VIP or workload has ``addr``, ask for it on demand and wait
        for the answer (at most :data:`ON_DEMAND_TIMEOUT`). A no-op without on-demand xDS or on a hit."""
        if self.on_demand is None or self.state.find_address(addr, client_ns) is not None:
            return
        try:
            await asyncio.wait_for(self.on_demand(addr), ON_DEMAND_TIMEOUT)
        except TimeoutError:
            log.warning(
                "on-demand xDS lookup of %s not answered within %gs; deciding without it", addr, ON_DEMAND_TIMEOUT
            )
