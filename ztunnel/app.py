"""Wiring: builds every component from the :class:`~ztunnel.config.Config` and runs them until shutdown.

Mirrors upstream ``app.rs``: control-plane state first (local config or xDS), certificates, then the data-plane
listeners once state is ready; one :class:`~ztunnel.drain.Drain` shuts everything down in order.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ztunnel import thirdparty
from ztunnel.admin import AdminServer
from ztunnel.config import Config, ProxyMode
from ztunnel.crl import CrlError, CrlManager
from ztunnel.dns.metrics import Metrics as DnsMetrics
from ztunnel.drain import Drain, DrainMode, drain_together
from ztunnel.errors import ZtunnelError
from ztunnel.identity.ca import CaError, LocalCA
from ztunnel.identity.manager import CertificateProvider
from ztunnel.localconfig import LocalConfig, load_local_config, parse_local_config
from ztunnel.metrics import Metric, Registry, Sample, StatsServer
from ztunnel.proxy import Proxy
from ztunnel.proxy.common import TlsContextCache
from ztunnel.proxy.connection_manager import ConnectionRecord, connections_dump
from ztunnel.proxy.inputs import LocalWorkload, OnDemand
from ztunnel.proxy.metrics import CrlMetrics, TrafficMetrics, flush_periodically
from ztunnel.proxyfactory import PodProxies, ProxyFactory, SelfProxy, crl_manager, serve_after_sync
from ztunnel.readiness import BlockReady, Readiness, ReadinessServer
from ztunnel.state import ProxyState
from ztunnel.tasks import TaskGroup
from ztunnel.tls import check_crls
from ztunnel.workers.prefork import Preforked
from ztunnel.workers.supervisor import PodFanout, RemotePod, Supervisor, WorkerStartError

if TYPE_CHECKING:
    from ztunnel.inpod.statemanager import ProxyFactory as InpodFactory

log = logging.getLogger("ztunnel.app")


class StartupError(ZtunnelError):
    """ztunnel cannot start with this configuration; the message says what to fix."""


@dataclass
class App:
    """A running ztunnel. Create with :func:`build`, then ``await app.start()`` and ``await app.wait()``."""

    config: Config
    state: ProxyState
    readiness: Readiness = field(default_factory=Readiness)
    drain: Drain = field(default_factory=Drain)
    tasks: TaskGroup = field(default_factory=lambda: TaskGroup("app"))
    local_config: LocalConfig | None = None
    certs: CertificateProvider | None = None
    proxy: Proxy | None = None
    readiness_server: ReadinessServer | None = None
    stats_server: StatsServer | None = None
    admin_server: AdminServer | None = None
    registry: Registry = field(default_factory=Registry)
    xds_client: Any = None
    stopped: asyncio.Event = field(default_factory=asyncio.Event)

    _waiting: bool = False
    exit_code: int = 0
    inpod_state: Any = None
    dns_proxy: Any = None
    inpod_task: Any = None
    self_proxy: SelfProxy | None = None  # shared mode: ztunnel's own inbound (POD_NAME/...), inline data plane

    supervisor: Supervisor | None = None  # the worker processes (None: ZTUNNEL_INLINE_DATA_PLANE=true)
    prefork: Preforked | None = None  # the first workers, forked by the CLI before any thread existed

    def __post_init__(self) -> None:
        self.registry = Registry(self.config.istio_version)
        self.traffic = TrafficMetrics(self.registry)
        self.crl_metrics = CrlMetrics(self.registry)  # registered always, as upstream; counted where CRLs are checked
        self.registry.dynamic.append(self._xds_metrics)
        # The DNS metrics are a collector of their own, written out after ours on 15020; one set for the process,
        # shared by every DNS proxy (upstream creates dns::Metrics once in app.rs). With worker processes these
        # families stay empty here (the workers' are merged in at each scrape), and only give the merge upstream's
        # family order.
        self.dns_metrics = DnsMetrics()
        self.registry.extra.append(self.dns_metrics)

    async def start(self) -> None:
        """Load state and start every component. Raises :class:`StartupError` with a clear message."""
        try:
            thirdparty.apply()  # once per process, before any connection (the module says what and why)
        except thirdparty.PatchError as e:
            raise StartupError(str(e)) from None
        for warning in self.config.warnings:  # settings given that have no effect yet (config.SETTINGS)
            log.warning("%s", warning)
        state_ready = self.readiness.register("state manager")
        self.readiness_server = ReadinessServer(self.readiness)
        await self.readiness_server.start(self.config.readiness_addr)
        self.stats_server = StatsServer(self.registry)
        await self.stats_server.start(self.config.stats_addr)
        if self.local_config is not None:
            self.state.apply(self.local_config.update)
            log.info(
                "loaded local config: %d workloads, %d services, %d policies",
                len(self.state.workloads),
                len(self.state.services),
                len(self.state.policies),
            )
            state_ready.release()
        elif self.config.xds_address is None:
            # No control plane at all: upstream releases the state readiness at once.
            state_ready.release()
        else:
            # Delta ADS to istiod: the client releases "state manager" after the first ACK of both types. The
            # proxies bind meanwhile but accept only after it, as upstream's accept loops wait on the first sync
            # (app.rs: xds_rx.changed()): no connection is routed or authorized against a partial state.
            from ztunnel.control import ControlPlaneError, load_root_pem
            from ztunnel.xds.client import AdsClient
            from ztunnel.xds.updater import AddressHandler, AuthorizationHandler

            try:
                load_root_pem(self.config.xds_root_cert, "XDS_ROOT_CA")
                client = AdsClient(
                    self.config, [AddressHandler(self.state), AuthorizationHandler(self.state)], state_ready
                )
            except ControlPlaneError as e:
                raise StartupError(str(e)) from None
            log.info("connecting to xDS server %s", self.config.xds_address)
            self.xds_client = client
            self.tasks.spawn(client.run(), "xds client")
        self.certs = self._certificate_provider()
        checked_crls: CrlManager | None = None
        if self.config.crl_path is not None:
            try:  # checked here so a broken CRL_PATH fails the start with the file and block named
                checked_crls = CrlManager.start(self.config.crl_path, None, check_crls)
            except CrlError as e:
                raise StartupError(str(e)) from None
            log.info(
                "CRL_PATH=%s: %d CRL(s); revoked peer certificates are refused",
                self.config.crl_path,
                len(checked_crls.current.crls),
            )
        if not self.config.inline_data_plane:
            await self._start_workers(state_ready)
            await self._start_admin()
            return
        synced = state_ready.released.is_set()
        self.factory = ProxyFactory(
            self.config,
            self.state,
            self.certs,
            TlsContextCache(
                self.config.tls12_enabled,
                crl_manager(self.config, self.crl_metrics, self.tasks, loaded=checked_crls),
                own_record_layer=not self.config.openssl_record_layer,
            ),
            self.traffic,
            self.dns_metrics,
            on_demand=self._on_demand(),
        )
        if self.config.proxy_mode is ProxyMode.DEDICATED:
            info = self.config.proxy_workload_info
            assert info is not None
            self.dns_proxy = self.factory.dns(LocalWorkload(self.state, info), self.factory.host_sockets(), False)
            if self.dns_proxy is not None:
                dns_ready = self.readiness.register("dns proxy")
                await self.dns_proxy.start(synced)
                dns_ready.release()
            if self.config.enable_proxy:
                proxy_ready = self.readiness.register("proxy")
                self.proxy = self.factory.dedicated(info, self.drain)
                if self.proxy.socks5 is not None and self.dns_proxy is not None:
                    self.proxy.socks5.resolve = self.dns_proxy.resolve  # SOCKS5 names resolve here, as upstream
                await self.proxy.start(synced)
                proxy_ready.release()
        elif self.config.proxy_mode is ProxyMode.SHARED:
            self.self_proxy = self.factory.self_proxy(self.drain)
            if self.self_proxy is not None:
                await self.self_proxy.start(synced)
            self._start_inpod(state_ready, self.factory)
        if not synced:
            self.tasks.spawn(self._serve_after_sync(state_ready), "serve after the first xDS sync")
        # Bytes of long-lived connections reach the counters every 5 s, for every proxy (in-pod: every pod's).
        self.tasks.spawn(flush_periodically(self._all_connections, self.traffic), "metrics flush")
        await self._start_admin()

    async def _serve_after_sync(self, state_ready: BlockReady) -> None:
        """The inline proxies' listeners start accepting once the first xDS sync is in (see :meth:`start`)."""
        await state_ready.released.wait()
        await serve_after_sync(self.dns_proxy, self.proxy, self.self_proxy)
        log.debug("xDS synced: the proxies accept connections")

    async def _start_workers(self, state_ready: BlockReady) -> None:
        """The data plane in ``worker_threads`` worker processes (ztunnel/workers/): this process keeps the state,
        the certificates, ZDS and the admin, stats and readiness servers, and never carries a tunnel's bytes."""
        assert self.certs is not None and self.stats_server is not None
        supervisor = self.supervisor = Supervisor(
            self.config,
            self.state,
            self.certs,
            self.readiness,
            on_demand=self._on_demand(),
            prefork=self.prefork,
            synced=state_ready.released,
        )
        registry = self.registry

        async def collect() -> list[Metric]:
            return await supervisor.collect_metrics(registry)

        self.stats_server.collect = collect
        try:
            await supervisor.start()
        except WorkerStartError as e:
            raise StartupError(str(e)) from None
        if self.config.proxy_mode is ProxyMode.SHARED:
            self._start_inpod(state_ready, PodFanout(supervisor))

    async def _start_admin(self) -> None:
        cfg = self.config
        certs = self.certs
        states = getattr(certs, "states", None)

        async def quit_() -> None:
            # As upstream: the request only triggers the shutdown (its shutdown_now is a send on a channel with
            # room), so the answer comes at once and the drain carries on, up to its deadline, after it.
            self.shutdown()

        supervisor = self.supervisor
        self.admin_server = AdminServer(
            cfg,
            self.state,
            certificates=states if callable(states) else dict,
            connections=self._connections if supervisor is None else supervisor.connections,
            shutdown=quit_,
            local_config=self.local_config,
            workload_state=self._workload_state if cfg.proxy_mode is ProxyMode.SHARED else None,
            log_level=supervisor.set_log_level if supervisor is not None else None,
            profile_workers=supervisor.profile if supervisor is not None else None,
        )
        await self.admin_server.start(cfg.admin_addr)

    def _start_inpod(self, state_ready: BlockReady, factory: InpodFactory) -> None:
        """In-pod mode: per-pod proxies driven by istio-cni over ZDS, connected once xDS state is ready."""
        from ztunnel.inpod.netns import Netns, host_netns_fd
        from ztunnel.inpod.statemanager import WorkloadProxyManagerState
        from ztunnel.inpod.workloadmanager import WorkloadProxyManager

        host_fd = host_netns_fd()
        self.inpod_state = WorkloadProxyManagerState(factory, lambda fd: Netns(fd, host_fd))
        manager = WorkloadProxyManager(
            self.config.inpod_uds, self.inpod_state, self.readiness, self.registry, self._fatal
        )

        async def run() -> None:
            # Upstream starts the ZDS connection only after the first xDS sync (app.rs: xds_rx.changed()).
            await state_ready.released.wait()
            await manager.run()

        self.inpod_task = self.tasks.spawn(run(), "workload proxy manager")

    async def _drain_workers(self, supervisor: Supervisor, deadline: float) -> None:
        """Every worker drains its proxies (all pods' in-pod) within the deadline and exits; a second SIGINT meanwhile
        ends them at once."""
        if self.inpod_task is not None:
            self.inpod_task.cancel()  # stop talking ZDS first: no new pods during the drain

        async def force() -> None:
            await self.drain.wait_forced()
            supervisor.force()

        forcing = self.tasks.spawn(force(), "force workers")
        await supervisor.drain(graceful=not self.drain.forced, deadline=deadline)
        forcing.cancel()
        if self.inpod_state is not None:
            for pod in [*self.inpod_state.pods.values(), *self.inpod_state.pending.values()]:
                if pod.netns is not None:
                    pod.netns.close()
            self.inpod_state.pods.clear()

    async def _finish_proxy(self, proxy: Proxy, deadline: float) -> None:
        """The dedicated proxy's drain (started by ``proxy.drain()``): its connections until ``deadline``, then the
        rest closed."""
        if not await proxy.wait_idle(deadline):
            if not self.drain.forced:  # else a second SIGINT said so, and was logged
                log.warning("drain duration expired with pending connections, forcefully shutting down")
                self.drain.force()
            proxy.force_close()
        await proxy.pi.tasks.cancel_all(timeout=1.0)

    async def _force_pods(self, pods: list[PodProxies]) -> None:
        """Each pod drains on a drain of its own: a second SIGINT during the drain must reach them too."""
        await self.drain.wait_forced()
        for pp in pods:
            pp.proxy.pi.drain.force()

    def _fatal(self, reason: str) -> None:
        """A ZDS protocol error: ztunnel exits 1 (upstream), without a grace period."""
        self.exit_code = 1
        self.shutdown(DrainMode.IMMEDIATE)

    def _proxies(self) -> list[Proxy]:
        out = [self.proxy] if self.proxy is not None else []
        if self.inpod_state is not None:
            out += [p.proxies.proxy for p in self.inpod_state.pods.values() if isinstance(p.proxies, PodProxies)]
        return out

    def _all_connections(self) -> list[ConnectionRecord]:
        own = list(self.self_proxy.pi.connections) if self.self_proxy is not None else []
        return [r for p in self._proxies() for r in p.pi.connections] + own

    def _connections(self) -> list[dict[str, Any]]:
        """The admin ``/connections`` list: every proxy's open connections as JSON."""
        now = time.monotonic()
        return [r.to_json(now) for r in self._all_connections()]

    async def _workload_state(self) -> dict[str, Any]:
        """``workloadState`` of the config dump (in-pod): each pod's state, identity info and connections (with
        worker processes: over all of them)."""
        st = self.inpod_state
        if st is None:
            return {}
        remote = await self.supervisor.pod_connections() if self.supervisor is not None else {}
        out: dict[str, Any] = {}
        for uid, pod in [*st.pods.items(), *st.pending.items()]:
            info = pod.info
            entry: dict[str, Any] = {
                "state": "Up" if uid in st.pods else "Pending",
                "info": {"name": info.name, "namespace": info.namespace, "serviceAccount": info.service_account},
            }
            if isinstance(pod.proxies, PodProxies):
                entry["connections"] = connections_dump(pod.proxies.proxy.pi.connections)
            elif isinstance(pod.proxies, RemotePod):
                entry["connections"] = remote.get(uid, {"inbound": [], "outbound": []})
            out[uid] = entry
        return out

    def _on_demand(self) -> OnDemand | None:
        """With XDS_ON_DEMAND, the proxies ask the ADS client for addresses the state does not know."""
        client = self.xds_client
        if client is None or not self.config.xds_on_demand:
            return None
        from ztunnel.xds.types import ADDRESS_TYPE

        async def demand(name: str) -> None:
            await client.demand(ADDRESS_TYPE, name)  # "<network>/<ip>", "<ns>/<hostname>" or a UID, as upstream

        return demand

    def _xds_metrics(self) -> list[Metric]:
        """``istio_xds_*`` from the ADS client's counters, computed at scrape time."""
        client = self.xds_client
        if client is None:
            return []
        term = Metric(
            "istio_xds_connection_terminations",
            "The total number of completed connections to xds server (unstable)",
            "counter",
        )
        for reason, n in client.terminations.items():
            term.samples.append(Sample("istio_xds_connection_terminations_total", {"reason": reason.value}, float(n)))
        msgs = Metric("istio_xds_message", "Total number of messages received (unstable)", "counter")
        size = Metric("istio_xds_message_bytes", "Total number of bytes received (unstable)", "counter", "bytes")
        for url, (count, nbytes) in client.messages.items():
            msgs.samples.append(Sample("istio_xds_message_total", {"url": url}, float(count)))
            size.samples.append(Sample("istio_xds_message_bytes_total", {"url": url}, float(nbytes)))
        return [term, msgs, size]

    def _certificate_provider(self) -> CertificateProvider:
        cfg = self.config
        if not cfg.fake_ca:
            # The Istio CA behind upstream's SecretManager; in shared mode node-local workloads' certificates are
            # prefetched (upstream cert_fetcher.rs).
            from ztunnel.cert_fetcher import CertFetcher
            from ztunnel.control import ControlPlaneError, load_root_pem
            from ztunnel.identity.caclient import CaClient
            from ztunnel.identity.manager import SecretManager

            try:
                load_root_pem(cfg.ca_root_cert, "CA_ROOT_CA")
                client = CaClient.from_config(cfg)
            except ControlPlaneError as e:
                raise StartupError(str(e)) from None

            async def close_client_on_drain() -> None:
                try:
                    await asyncio.Event().wait()
                finally:
                    await client.close()

            self.tasks.spawn(close_client_on_drain(), "ca client")
            manager = SecretManager(client, tasks=self.tasks)
            if cfg.proxy_mode is ProxyMode.SHARED and cfg.node_name:
                CertFetcher(self.state, manager, cfg.node_name)
            return manager
        try:
            ca = LocalCA.load_or_create(Path(cfg.ca_dir), cfg.trust_domain)
        except (CaError, OSError) as e:
            raise StartupError(f"local CA in {cfg.ca_dir}: {e}") from None
        from ztunnel.cert_fetcher import CertFetcher
        from ztunnel.identity.manager import LocalCaClient, SecretManager

        local_manager = SecretManager(LocalCaClient(ca, timedelta(seconds=cfg.secret_ttl)), tasks=self.tasks)
        if cfg.proxy_mode is ProxyMode.SHARED and cfg.node_name:
            CertFetcher(self.state, local_manager, cfg.node_name)
        return local_manager

    def shutdown(self, mode: DrainMode = DrainMode.GRACEFUL) -> None:
        """Start draining (idempotent); :meth:`wait` returns once everything has closed."""
        self.readiness.draining = True
        self.drain.start(mode)

    async def wait(self) -> None:
        """Run until a drain starts, then give connections until the deadline and stop (once; later calls just
        wait for that)."""
        if self._waiting:
            await self.stopped.wait()
            return
        self._waiting = True
        await self.drain.wait_started()
        deadline = 0.0 if self.drain.forced else self.config.self_termination_deadline
        if self.supervisor is not None:
            await self._drain_workers(self.supervisor, deadline)
        # Every proxy drains at once, on one deadline, as upstream's (one drain signal for all): ztunnel's own inbound
        # and the pods' proxies side by side, not one after the other (which gave the pods a second deadline, past
        # the pod's grace period, while they kept accepting).
        proxy = self.proxy
        if proxy is not None:
            proxy.drain()  # stop accepting and GOAWAY before anything awaits
        drains: list[tuple[str, Awaitable[None]]] = []
        if self.dns_proxy is not None:
            drains.append(("the DNS proxy", self.dns_proxy.close()))  # upstream stops it as the drain starts
        if proxy is not None:
            drains.append(("the proxy", self._finish_proxy(proxy, deadline)))
        if self.self_proxy is not None:
            drains.append(("ztunnel's own inbound", self.self_proxy.stop(not self.drain.forced, deadline)))
        if self.inpod_state is not None:
            if self.inpod_task is not None:
                self.inpod_task.cancel()  # stop talking ZDS first: no new pods during the drain
            pods = [p.proxies for p in self.inpod_state.pods.values() if isinstance(p.proxies, PodProxies)]
            for pp in pods:
                pp.deadline = deadline
            self.tasks.spawn(self._force_pods(pods), "force pod drains")
            drains.append(("the pods' proxies", self.inpod_state.drain()))
        await drain_together(drains)
        await self.tasks.cancel_all(timeout=1.0)
        for server in (self.readiness_server, self.stats_server):
            if server is not None:
                await server.stop()
        # Set before stopping the admin server: a /quitquitquit being answered waits for it, then completes.
        self.stopped.set()
        if self.admin_server is not None:
            await self.admin_server.stop()
        log.info("shutdown complete")


def build(config: Config) -> App:
    """Build the app from its config. Reads the local config file (if any) so errors surface before binding."""
    local: LocalConfig | None = None
    if config.local_xds_path is not None:
        local = load_local_config(Path(config.local_xds_path), config.trust_domain)
    elif config.local_xds is not None:
        local = parse_local_config(config.local_xds, "LOCAL_XDS", config.trust_domain)
    return App(config=config, state=ProxyState(config.node_name), local_config=local)


def install_signal_handlers(app: App) -> None:
    """First SIGTERM/SIGINT drains gracefully; a second SIGINT exits at once (upstream ``signal.rs``)."""
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        if app.drain.draining and sig is signal.SIGINT:
            log.warning("received second SIGINT, exiting immediately")
            app.shutdown(DrainMode.IMMEDIATE)
            return
        log.info("received %s, starting drain", sig.name)
        app.shutdown(DrainMode.GRACEFUL)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)


async def run(config: Config, prefork: Preforked | None = None) -> int:
    """Build, start and run ztunnel until it is told to stop; returns the exit status. ``prefork``: worker processes
    forked before the loop started (:meth:`ztunnel.workers.prefork.Preforked.start`)."""
    app = build(config)
    app.prefork = prefork
    install_signal_handlers(app)
    await app.start()
    log.info("ztunnel started (mode %s)", config.proxy_mode.value)
    await app.wait()
    return app.exit_code
