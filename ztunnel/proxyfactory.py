"""Builds the proxies of one workload (upstream ``proxyfactory.rs``): in dedicated mode the host's one proxy, in
in-pod mode one set per pod, its sockets created inside the pod's network namespace.

Each proxy set has its own connection pool (keyed by that pod's identity), connection manager and drain, and shares
the certificate provider, TLS context cache and metrics of the process.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

from ztunnel.config import Config, WorkloadInfo
from ztunnel.dns import DnsProxy
from ztunnel.dns.lookup import HostLookup
from ztunnel.dns.metrics import Metrics as DnsMetrics
from ztunnel.drain import Drain, DrainMode
from ztunnel.identity.manager import CertificateProvider
from ztunnel.inpod.netns import InPodSocketFactory, Netns, NetnsId
from ztunnel.proxy import Proxy
from ztunnel.proxy.common import TlsContextCache
from ztunnel.proxy.connection_manager import ConnectionManager
from ztunnel.proxy.inputs import InboundBalance, LocalWorkload, OnDemand, ProxyInputs
from ztunnel.proxy.metrics import TrafficMetrics
from ztunnel.proxy.pool import WorkloadHBONEPool
from ztunnel.sockets import SocketConfig, SocketFactory
from ztunnel.state import ProxyState

log = logging.getLogger("ztunnel.proxyfactory")


@dataclass
class ProxyFactory:
    config: Config
    state: ProxyState
    certs: CertificateProvider
    contexts: TlsContextCache
    traffic: TrafficMetrics
    dns_metrics: DnsMetrics | None = None
    on_demand: OnDemand | None = None  # XDS_ON_DEMAND: the xDS client's demand, for every proxy
    # In a worker process: every listener is shared with the other workers (SO_REUSEPORT), in-pod too.
    shared_ports: bool = False
    # In a worker process of several: the balance of each proxy's 15008 listener, given the proxy's key in the other
    # workers (None: the dedicated proxy; in-pod: the pod's uid and network namespace).
    balance: Callable[[tuple[str, NetnsId] | None], InboundBalance] | None = None

    _host_lookup: HostLookup | None = None

    def host_lookup(self) -> HostLookup:
        """The process's on-demand DNS resolver (one for every proxy; ztunnel's nameservers and network namespace,
        as upstream's state resolver)."""
        if self._host_lookup is None:
            self._host_lookup = HostLookup.from_resolv_conf(self.host_sockets(), ipv6_enabled=self.config.ipv6_enabled)
        return self._host_lookup

    def dns(self, local: LocalWorkload, sockets: SocketFactory, reuse_port: bool) -> DnsProxy | None:
        """The DNS proxy of one workload (ISTIO_META_DNS_CAPTURE), or None when DNS capture is off."""
        if not self.config.dns_proxy:
            return None
        return DnsProxy.from_config(
            self.config,
            self.state,
            local.find,
            sockets,
            self.dns_metrics,
            # A query racing the workload's arrival in xDS waits for it (5 s), as upstream.
            wait_local_workload=local.get,
            reuse_port=reuse_port,
        )

    def inputs(
        self, info: WorkloadInfo, sockets: SocketFactory, drain: Drain, pod: tuple[str, NetnsId] | None = None
    ) -> ProxyInputs:
        return ProxyInputs(
            config=self.config,
            state=self.state,
            certs=self.certs,
            sockets=sockets,
            local=LocalWorkload(self.state, info),
            drain=drain,
            contexts=self.contexts,
            pool=WorkloadHBONEPool(self.config, self.certs, sockets, self.contexts),
            connections=ConnectionManager(self.traffic),
            on_demand=self.on_demand,
            balance=self.balance(pod) if self.balance is not None else None,
            lookup_host=self.host_lookup().lookup_ip,
        )

    def socket_config(self) -> SocketConfig:
        cfg = SocketConfig.from_config(self.config)
        return dataclasses.replace(cfg, reuse_port=True) if self.shared_ports else cfg

    def host_sockets(self) -> SocketFactory:
        return SocketFactory(self.socket_config())

    def dedicated(self, info: WorkloadInfo, drain: Drain) -> Proxy:
        return Proxy(self.inputs(info, self.host_sockets(), drain))

    async def start(self, uid: str, info: WorkloadInfo, netns: Netns) -> PodProxies:
        """Start a pod's listeners inside its namespace (the statemanager's ``ProxyFactory``)."""
        sockets = InPodSocketFactory(self.socket_config(), netns)
        proxy = Proxy(self.inputs(info, sockets, Drain(f"pod {uid}"), (uid, netns.id)))
        dns = self.dns(proxy.pi.local, sockets, reuse_port=self.config.inpod_port_reuse)
        if dns is not None:
            if proxy.socks5 is not None:
                proxy.socks5.resolve = dns.resolve
            await dns.start()
        try:
            if self.config.enable_proxy:
                await proxy.start()
            # ENABLE_PROXY=false (upstream's ProxyFactory without its proxy): the pod gets its DNS proxy only. The
            # proxy's inputs exist (an empty connection manager, a drain) but no listener is bound in the pod.
        except BaseException:
            if dns is not None:
                await dns.close()
            raise
        log.info("proxy for %s/%s started in %s", info.namespace, info.name, netns)
        return PodProxies(uid, info, netns.id, proxy, self.config.self_termination_deadline, dns)


@dataclass
class PodProxies:
    """One pod's running proxies (the statemanager's ``PodProxies``)."""

    uid: str
    info: WorkloadInfo
    netns_id: NetnsId
    proxy: Proxy
    deadline: float
    dns: DnsProxy | None = None

    async def stop(self, immediate: bool) -> None:
        """``immediate``: the pod is gone (ZDS del), close now; else drain up to the termination deadline."""
        pi = self.proxy.pi
        if self.dns is not None:
            await self.dns.close()
        pi.drain.start(DrainMode.IMMEDIATE if immediate else DrainMode.GRACEFUL)
        self.proxy.drain()
        if immediate or not await self.proxy.wait_idle(self.deadline):
            self.proxy.force_close()  # upstream logs these as closed by the drain, whatever the cause
        pi.local.close()
        await pi.tasks.cancel_all(timeout=1.0)
        log.info("proxy for %s/%s stopped", self.info.namespace, self.info.name)
