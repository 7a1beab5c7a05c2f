"""What a proxy's listeners are given (upstream ``ProxyInputs`` in ``proxy.rs``): config, state, certificates,
sockets, the proxied workload, the drain, the HBONE pool and the connection manager; and on-demand xDS lookups."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from ztunnel.config import Config, WorkloadInfo
from ztunnel.drain import Drain
from ztunnel.identity.manager import CertificateProvider
from ztunnel.proxy.common import ProxyError, TlsContextCache
from ztunnel.proxy.connection_manager import ConnectionManager
from ztunnel.proxy.pool import WorkloadHBONEPool
from ztunnel.sockets import SocketFactory
from ztunnel.state import ProxyState, StateChange
from ztunnel.state.workload import IPAddress, NamespacedHostname, NetworkAddress, Workload
from ztunnel.tasks import TaskGroup

log = logging.getLogger("ztunnel.proxy")

# Upstream waits this long for a workload to appear in xDS before giving up (proxy.rs wait_for_workload).
WORKLOAD_WAIT_TIMEOUT = 5.0
# How long a connection waits for the control plane to answer an on-demand lookup before deciding without it.
# Upstream (state.rs fetch_on_demand) waits for the answer with no bound: istiod always answers an explicit
# subscription, with a removal when nothing matches. A bound keeps a control-plane outage from holding connections
# forever; 5 s is upstream's other xDS wait (wait_for_workload).
ON_DEMAND_TIMEOUT = 5.0


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


# Asks the control plane for one Address resource by name (XDS_ON_DEMAND) and returns once it answered; the answer,
# if any, is in the state by then (upstream ``Demander``). Names as upstream's: "<network>/<ip>", "<namespace>/
# <hostname>", or a workload UID.
OnDemand = Callable[[str], Awaitable[None]]


class InboundBalance(Protocol):
    """Spreads the connections a worker process accepts on 15008 over the workers of its ztunnel (in a worker only;
    ``ztunnel/workers/balance.py`` implements it, docs/process-model.md describes it). The listener asks
    :meth:`pick` at every accept, before reading a byte."""

    def pick(self) -> int | None:
        """The worker to hand the connection just accepted to, or None to serve it here."""

    def opened(self) -> None:
        """A connection is served here (accepted and kept, or handed in)."""

    def closed(self) -> None:
        """A connection :meth:`opened` counted has closed."""

    def hand_off(self, fd: int, target: int) -> None:
        """Pass the accepted socket ``fd`` to worker ``target``; a copy is on its way when this returns (the caller
        closes ``fd``). Raises ``ConnectionError`` when it cannot be sent."""


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
    # Set in a worker process of a ztunnel with several: where the 15008 listener's connections are served.
    balance: InboundBalance | None = None
    # Resolves a hostname-only destination (on-demand DNS, ztunnel/dns/lookup.py); None: the system resolver.
    lookup_host: Callable[[str], Awaitable[list[IPAddress]]] | None = None

    async def fetch_address(self, addr: NetworkAddress, client_ns: str | None = None) -> None:
        """Upstream ``fetch_address``: if no service VIP or workload has ``addr``, ask for it on demand and wait
        for the answer (at most :data:`ON_DEMAND_TIMEOUT`). A no-op without on-demand xDS or on a hit."""
        if self.on_demand is None or self.state.find_address(addr, client_ns) is not None:
            return
        await self.demand(str(addr))

    async def fetch_workload_by_address(self, addr: NetworkAddress) -> None:
        """Upstream ``fetch_workload_by_address`` (an inbound peer): ask for ``addr`` when no workload has it."""
        if self.on_demand is None or self.state.workloads.find_address(addr) is not None:
            return
        await self.demand(str(addr))

    async def fetch_workload_by_uid(self, uid: str) -> None:
        """Upstream ``fetch_workload_by_uid``: ask for a workload by its UID when the state does not have it."""
        if self.on_demand is None or self.state.workloads.find_uid(uid) is not None:
            return
        await self.demand(uid)

    async def fetch_destination(self, dest: NetworkAddress | NamespacedHostname, client_ns: str | None = None) -> None:
        """Upstream ``fetch_destination``: a waypoint's or network gateway's address (``<network>/<ip>``) or
        hostname (``<namespace>/<hostname>``), asked for when neither a workload nor a service matches it."""
        if self.on_demand is None:
            return
        if isinstance(dest, NetworkAddress):
            await self.fetch_address(dest, client_ns)
        elif self.state.find_hostname(dest) is None:
            await self.demand(str(dest))

    async def demand(self, name: str) -> None:
        """Ask for ``name`` and wait for the answer, at most :data:`ON_DEMAND_TIMEOUT`; then decide without it."""
        if self.on_demand is None:
            return
        try:
            await asyncio.wait_for(self.on_demand(name), ON_DEMAND_TIMEOUT)
        except TimeoutError:
            log.warning(
                "on-demand xDS lookup of %s not answered within %gs; deciding without it", name, ON_DEMAND_TIMEOUT
            )
