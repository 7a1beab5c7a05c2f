"""Builds the proxies of one workload (upstream ``proxyfactory.rs``): in dedicated mode the host's one proxy, in
in-pod mode one set per pod, its sockets created inside the pod's network namespace.

Each proxy set has its own connection pool (keyed by that pod's identity), connection manager and drain, and shares
the certificate provider, TLS context cache and metrics of the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

from ztunnel import tls
from ztunnel.config import Config, ProxyMode, WorkloadInfo
from ztunnel.crl import CrlCounters, CrlManager
from ztunnel.dns import DnsProxy
from ztunnel.dns.lookup import HostLookup
from ztunnel.dns.metrics import Metrics as DnsMetrics
from ztunnel.drain import Drain, DrainMode
from ztunnel.identity.manager import CertificateProvider
from ztunnel.inpod.netns import InPodSocketFactory, Netns, NetnsId
from ztunnel.net import format_addr
from ztunnel.proxy import Proxy
from ztunnel.proxy.common import TlsContextCache
from ztunnel.proxy.connection_manager import Authorizer, ConnectionManager, PolicyWatcher
from ztunnel.proxy.inbound import Inbound
from ztunnel.proxy.inputs import InboundBalance, LocalWorkload, OnDemand, ProxyInputs
from ztunnel.proxy.metrics import TrafficMetrics
from ztunnel.proxy.pool import WorkloadHBONEPool
from ztunnel.sockets import SocketConfig, SocketFactory
from ztunnel.state import ProxyState
from ztunnel.tasks import TaskGroup

log = logging.getLogger("ztunnel.proxyfactory")


def crl_manager(
    config: Config,
    metrics: CrlCounters | None,
    tasks: TaskGroup,
    *,
    strict: bool = True,
    loaded: CrlManager | None = None,
) -> CrlManager | None:
    """The process's CRL manager when ``CRL_PATH`` is set (upstream builds it in ``ProxyFactory::new``), watching
    the file in a task of ``tasks`` (cancelled with them at shutdown).

    ``strict``: raise :class:`ztunnel.crl.CrlError` when the file exists and does not parse (the start fails with
    the file and the block named; stricter than upstream, which then logs a warning and checks no revocation at
    all). A worker process, started after the control process checked the file, is not strict: should the file
    break in between, it logs the error and loads the file as soon as it parses again.

    ``loaded``: a manager that already loaded the file (the start-up check), watched from here instead of parsing
    the file a second time.
    """
    if config.crl_path is None:
        return None
    if loaded is not None:
        manager = loaded
        manager.metrics = metrics
    else:
        manager = (CrlManager.start if strict else CrlManager.lenient)(config.crl_path, metrics, tls.check_crls)
    tasks.spawn(manager.poll(), "crl watch")
    return manager


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
        self,
        info: WorkloadInfo,
        sockets: SocketFactory,
        drain: Drain,
        pod: tuple[str, NetnsId] | None = None,
        *,
        balanced: bool = True,
    ) -> ProxyInputs:
        connections = ConnectionManager(self.traffic)
        pool = WorkloadHBONEPool(self.config, self.certs, sockets, self.contexts)
        pool.on_revoked = connections.revoke_tunnel  # CRL_PATH: streams on a revoked connection end CERT_REVOKED
        return ProxyInputs(
            config=self.config,
            state=self.state,
            certs=self.certs,
            sockets=sockets,
            local=LocalWorkload(self.state, info),
            drain=drain,
            contexts=self.contexts,
            pool=pool,
            connections=connections,
            on_demand=self.on_demand,
            balance=self.balance(pod) if self.balance is not None and balanced else None,
            lookup_host=self.host_lookup().lookup_ip,
        )

    def socket_config(self) -> SocketConfig:
        cfg = SocketConfig.from_config(self.config)
        return dataclasses.replace(cfg, reuse_port=True) if self.shared_ports else cfg

    def host_sockets(self) -> SocketFactory:
        return SocketFactory(self.socket_config())

    def self_proxy(self, drain: Drain) -> SelfProxy | None:
        """ztunnel's own inbound (upstream ``create_ztunnel_self_proxy_listener``): in shared mode, when the downward
        API gave ztunnel its pod name, namespace and service account (``POD_NAME``, ``POD_NAMESPACE``,
        ``SERVICE_ACCOUNT``; identity in ``TRUST_DOMAIN``), an HBONE listener on ``inbound_addr`` in ztunnel's own
        network namespace that serves ztunnel's workload: a mesh client (a captured Prometheus) reaches ztunnel's own
        ports (15020 metrics) over mTLS, under the policies that select ztunnel's pod. None otherwise."""
        cfg = self.config
        if cfg.proxy_mode is not ProxyMode.SHARED or not cfg.enable_proxy or cfg.ztunnel_identity is None:
            return None
        assert cfg.pod_name and cfg.pod_namespace and cfg.service_account  # ztunnel_identity says so
        info = WorkloadInfo(cfg.pod_name, cfg.pod_namespace, cfg.service_account)
        # Not balanced over the workers (each worker's listener shares the port, and the kernel spreads them).
        pi = self.inputs(info, self.host_sockets(), drain, balanced=False)
        return SelfProxy(pi)

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


class SelfProxy:
    """ztunnel's own HBONE inbound (see :meth:`ProxyFactory.self_proxy`): the inbound listener alone, with its
    policy re-checks. Upstream's ``disable_inbound_freebind``: it is never transparent, so it connects to ztunnel's
    own servers from its own address, not the client's."""

    def __init__(self, pi: ProxyInputs) -> None:
        self.pi = pi
        authorize = Authorizer(pi.state, pi.config.authz_policy_info_logging)
        self.policy_watcher = PolicyWatcher(pi.state, pi.connections, authorize)
        self.inbound = Inbound(pi, authorize)
        # Not a captured listener: no IP_TRANSPARENT (never spoofs the client toward ztunnel's own ports).
        self.inbound.captured = False

    async def start(self, serve: bool = True) -> None:
        """Bind the listener; accept at once with ``serve``, else from :meth:`serve` on."""
        await self.inbound.start(serve)
        self.policy_watcher.start()
        log.info(
            "ztunnel self-proxy listener (identity %s) on %s",
            self.pi.config.ztunnel_identity,
            format_addr(*self.inbound.address),
        )

    async def serve(self) -> None:
        await self.inbound.serve()

    async def stop(self, graceful: bool, deadline: float) -> None:
        """Stop accepting; GOAWAY the open connections; close what is left at ``deadline`` (or now)."""
        pi = self.pi
        self.policy_watcher.stop()
        self.inbound.stop()
        self.inbound.drain()
        loop = asyncio.get_running_loop()
        end = loop.time() + (deadline if graceful else 0)
        while (len(pi.connections) or self.inbound.connections) and not pi.drain.forced:
            left = end - loop.time()
            if left <= 0:
                break
            # As Proxy.wait_idle: poll the cheap counts every 50 ms, but wake at once when the drain is forced.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(pi.drain.wait_forced(), min(left, 0.05))
        pi.connections.close_all()
        for conn in list(self.inbound.connections):
            conn.abort("ztunnel is shutting down")
        pi.local.close()
        await pi.tasks.cancel_all(timeout=1.0)


async def serve_after_sync(dns: DnsProxy | None, proxy: Proxy | None, self_proxy: SelfProxy | None) -> None:
    """Start accepting on the node-wide listeners bound before the first xDS sync (the dedicated proxy, its DNS
    proxy, ztunnel's own inbound), whichever this process has; a no-op for those that accept already."""
    for server in (dns, proxy, self_proxy):
        if server is not None:
            await server.serve()


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
        pi.drain.start(DrainMode.IMMEDIATE if immediate else DrainMode.GRACEFUL)
        self.proxy.drain()  # stop accepting and GOAWAY before anything awaits
        if self.dns is not None:
            await self.dns.close()
        if immediate or not await self.proxy.wait_idle(self.deadline):
            self.proxy.force_close()  # upstream logs these as closed by the drain, whatever the cause
        pi.local.close()
        await pi.tasks.cancel_all(timeout=1.0)
        log.info("proxy for %s/%s stopped", self.info.namespace, self.info.name)
