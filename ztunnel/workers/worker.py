"""One data-plane worker process: the proxies' listeners on a uvloop loop of its own, fed by the control process.

What it holds: a :class:`~ztunnel.state.ProxyState` that only the control process's batches change (a
:class:`~ztunnel.workers.protocol.Snapshot` at start, then every :class:`~ztunnel.workers.protocol.Delta` in
generation order); certificates asked of the control process and kept until it pushes a replacement
(:class:`RemoteCertificates`); the proxies (dedicated: the one workload's, every port shared with the other workers
through ``SO_REUSEPORT``; in-pod: every pod's, in the pod's namespace from the fd the control process passes), the
DNS proxy beside them, and its own metrics, which the control process asks for at each scrape.

It imports no gRPC, no aiohttp and none of the control-plane clients (xDS, CA, ZDS, admin): a worker costs the
proxy's modules (shared with the control process when it was forked at start, :mod:`ztunnel.workers.prefork`) and
its connections (tests/workers/test_worker_imports.py checks the imports).

It serves only after its snapshot, and exits when told to drain, when its channel ends (the control process went
away) or, through ``PR_SET_PDEATHSIG``, with its parent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from ztunnel import telemetry, thirdparty
from ztunnel.config import Config, LogFormat, ProxyMode
from ztunnel.dns import DnsProxy
from ztunnel.dns.metrics import Metrics as DnsMetrics
from ztunnel.drain import Drain, DrainMode, drain_together
from ztunnel.identity.certificate import WorkloadCertificate
from ztunnel.identity.manager import CertificateUnavailable
from ztunnel.identity.spiffe import Identity
from ztunnel.inpod.netns import Netns, host_netns_fd
from ztunnel.metrics import Registry
from ztunnel.metrics_merge import Snapshot, snapshot
from ztunnel.proxy import Proxy
from ztunnel.proxy.common import TlsContextCache
from ztunnel.proxy.connection_manager import ConnectionRecord, connections_dump
from ztunnel.proxy.inbound import Inbound
from ztunnel.proxy.inputs import LocalWorkload
from ztunnel.proxy.metrics import CrlMetrics, TrafficMetrics, flush_periodically
from ztunnel.proxyfactory import PodProxies, ProxyFactory, SelfProxy, crl_manager, serve_after_sync
from ztunnel.state import ProxyState
from ztunnel.tasks import TaskGroup
from ztunnel.workers import protocol as p
from ztunnel.workers.balance import LoadBoard, WorkerBalance
from ztunnel.workers.channel import Channel, ChannelClosed, Handler
from ztunnel.workers.process import set_cmdline, set_name

log = logging.getLogger("ztunnel.workers")

# Makes the worker's channel, given the handler of its messages and what to call when it ends.
ChannelFactory = Callable[[Handler, Callable[[str], None]], Channel]


class RemoteCertificates:
    """The :class:`~ztunnel.identity.manager.CertificateProvider` of a worker: asks the control process's secret
    manager (one CSR per identity for the whole ztunnel, however many workers) and keeps the answer until the
    control process pushes a replacement (a rotation) or it expires by the wall clock. Concurrent asks for one
    identity share one request."""

    def __init__(self, channel: Channel) -> None:
        self._channel = channel
        self._certs: dict[Identity, WorkloadCertificate] = {}
        self._asking: dict[Identity, asyncio.Future[WorkloadCertificate]] = {}
        self._tasks = TaskGroup("worker certificates")

    async def fetch_certificate(self, identity: Identity) -> WorkloadCertificate:
        cert = self._certs.get(identity)
        if cert is not None and datetime.now(UTC) < cert.not_after:
            return cert
        fut = self._asking.get(identity)
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
            self._asking[identity] = fut
            self._tasks.spawn(self._ask(identity, fut), f"certificate {identity}")
        # Shielded: one caller giving up (its connection closed) must not cancel the others' request.
        return await asyncio.shield(fut)

    async def _ask(self, identity: Identity, fut: asyncio.Future[WorkloadCertificate]) -> None:
        try:
            reply = await self._channel.call(p.CertificateRequest(identity), response=p.CertificateReply)
            if reply.data is None:
                raise CertificateUnavailable(reply.error or f"no certificate for {identity}", reply.reason)
            cert = reply.data.certificate()
            self._certs[identity] = cert
            fut.set_result(cert)
        except Exception as e:  # the waiters get it (a closed channel, an unavailable certificate)
            fut.set_exception(e)
            fut.exception()  # retrieved: a fetch nobody waits for any more must not log "never retrieved"
        finally:
            self._asking.pop(identity, None)

    def push(self, identity: Identity, data: p.CertificateData | None) -> None:
        """The control process rotated (or forgot) ``identity``'s certificate."""
        if data is None:
            self._certs.pop(identity, None)
        else:
            self._certs[identity] = data.certificate()

    def forget(self, identity: Identity) -> None:
        self._certs.pop(identity, None)

    def identities(self) -> list[Identity]:
        return list(self._certs)


@dataclass
class _Pod:
    netns: Netns
    proxies: PodProxies


class Worker:
    """The worker's side of the channel, and everything it runs. :meth:`run` returns the exit status."""

    def __init__(self, channel_factory: ChannelFactory) -> None:
        self._channel_factory = channel_factory
        self.channel: Channel | None = None
        self.index = -1
        self.config: Config | None = None
        self.state = ProxyState()
        self.registry = Registry()
        self.tasks = TaskGroup("worker")
        self.drain = Drain("worker")
        self.generation: int | None = None
        self.serving = False
        self.may_accept = False  # the control process said Serve: the first xDS sync is in
        self.proxy: Proxy | None = None
        self.dns_proxy: DnsProxy | None = None
        self.self_proxy: SelfProxy | None = None  # shared mode: ztunnel's own inbound (POD_NAME/...)
        self.pods: dict[str, _Pod] = {}
        self._pod_ops: asyncio.Queue[tuple[p.Message, list[int]]] = asyncio.Queue()
        self._host_fd: int | None = None
        self._done: asyncio.Future[int] | None = None
        self.balance: WorkerBalance | None = None  # with other workers: the spread of inbound HBONE connections
        self._draining: asyncio.Task[None] | None = None

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        self._done = loop.create_future()
        self.channel = self._channel_factory(self._handle, self._closed)
        return await self._done

    def _exit(self, code: int) -> None:
        if self._done is not None and not self._done.done():
            self._done.set_result(code)

    # -- messages ------------------------------------------------------------------------------------------------

    def _handle(self, msg: p.Message, fds: list[int]) -> None:
        match msg:
            case p.Start():
                self._start(msg, fds)
                return
            case p.Snapshot():
                first = self.generation is None and not self.serving
                p.apply_snapshot(self.state, msg)
                self.generation = msg.generation
                if first:
                    self.tasks.spawn(self._serve(), "serve")
            case p.Serve():
                self.may_accept = True
                if self.serving:  # bound already: accept from now on (else _serve binds accepting)
                    self.tasks.spawn(serve_after_sync(self.dns_proxy, self.proxy, self.self_proxy), "accept")
            case p.Delta():
                self._delta(msg)
            case p.CertificatePush():
                self.certs.push(msg.identity, msg.data)
            case p.AddPod() | p.DelPod():
                self._pod_ops.put_nowait((msg, fds))
                return
            case p.HandIn():
                self._hand_in(msg, fds)
                return
            case p.Query():
                self._send(p.Reply(msg.request_id, self._answer(msg.what)))
            case p.Profile():
                self.tasks.spawn(self._profile(msg), "profile")
            case p.Drain():
                self._drain(msg)
            case p.SetLogLevel():
                try:
                    telemetry.set_level(msg.reset, msg.spec)
                except ValueError as e:  # the admin validated it; a worker never fails on it
                    log.warning("worker %d: log filter %r not applied: %s", self.index, msg.spec, e)
            case _:
                log.warning("worker %d: unexpected %s from the control process", self.index, p.describe(msg))
        _close(fds)  # the messages that carry fds took them above

    def _send(self, msg: p.Message) -> None:
        assert self.channel is not None
        self.channel.send(msg)

    def _closed(self, reason: str) -> None:
        if self.config is None:  # never started (a preforked worker ztunnel did not need): nothing to say
            self._exit(0)
            return
        if self._draining is None:
            log.warning("worker %d: channel to the control process ended (%s); exiting", self.index, reason)
        self._exit(0 if self._draining is not None else 1)

    def _start(self, msg: p.Start, fds: list[int]) -> None:
        cfg = self.config = msg.config
        self.index = msg.index
        # How ps, top and the benchmark tell the workers apart: the name, and "--index <i>" on the command line.
        set_name(f"zt-worker-{self.index}")
        set_cmdline(["ztunnel-worker", "--index", str(self.index)])
        telemetry.setup_logging(cfg.log_level, json_format=cfg.log_format is LogFormat.JSON)
        thirdparty.apply(http_servers=False)
        self.state = ProxyState(cfg.node_name)
        self.drain = Drain(f"worker {self.index}")
        self.registry = Registry(cfg.istio_version)
        self.traffic = TrafficMetrics(self.registry)
        dns_metrics = DnsMetrics()
        self.registry.extra.append(dns_metrics)
        assert self.channel is not None
        self.certs = RemoteCertificates(self.channel)
        if msg.load_board and fds:
            self.balance = WorkerBalance(self.index, LoadBoard.attach(fds.pop(0)), self.channel)
        _close(fds)
        self.factory = ProxyFactory(
            cfg,
            self.state,
            self.certs,
            # Each worker watches CRL_PATH itself (ztunnel/crl.py says why); the control process checked it parses.
            TlsContextCache(
                cfg.tls12_enabled,
                crl_manager(cfg, CrlMetrics(self.registry), self.tasks, strict=False),
                own_record_layer=not cfg.openssl_record_layer,
            ),
            self.traffic,
            dns_metrics,
            on_demand=self._on_demand if msg.on_demand else None,
            shared_ports=True,
            balance=self.balance.bind if self.balance is not None else None,
        )
        if cfg.proxy_mode is ProxyMode.SHARED:
            self._host_fd = host_netns_fd()
        self.tasks.spawn(self._run_pod_ops(), "pods")
        self.tasks.spawn(flush_periodically(self._connections, self.traffic), "metrics flush")

    def _delta(self, msg: p.Delta) -> None:
        if self.generation is None:
            return  # waiting for a fresh snapshot (asked for below): this batch is in it
        if msg.generation != self.generation + 1:
            # A gap or a repeat would leave this worker's state different from the control's: a bug, so say it
            # loudly, and start again from a full copy.
            log.error(
                "worker %d: state batch %d does not follow %d; asking for a fresh snapshot",
                self.index,
                msg.generation,
                self.generation,
            )
            self._send(p.Resync(self.generation, msg.generation))
            self.generation = None
            return
        self.state.apply(msg.update)
        self.generation = msg.generation

    # -- inbound connections handed over by another worker ----------------------------------------------------------

    def _hand_in(self, msg: p.HandIn, fds: list[int]) -> None:
        """Serve the connection that came with ``msg`` on the proxy it names, or say why not (the control process
        then gives it to another worker). The Ack goes out before a byte of it is read: once the control process
        has it, the connection is this worker's."""
        fd = fds.pop(0) if fds else None
        _close(fds)
        inbound = self._inbound(msg.key)
        if fd is None:
            error = "no socket came with it"
        elif self._draining is not None:
            error = "draining"
        elif not self.serving:
            error = "not serving yet"
        elif inbound is None:
            error = f"no proxy for pod {msg.key[0]}" if msg.key is not None else "no inbound listener"
        else:
            try:
                sock = socket.socket(fileno=fd)
            except OSError as e:
                error = f"not a socket: {e}"
            else:
                self._send(p.Ack(msg.request_id))
                self.tasks.spawn(self._adopt(inbound, sock), "inbound handed in")
                return
        _close([fd] if fd is not None else [])
        self._send(p.Ack(msg.request_id, error))

    async def _adopt(self, inbound: Inbound, sock: socket.socket) -> None:
        assert self.channel is not None
        # Read nothing before the Ack has left (it may wait behind a large reply): a worker that died with the Ack
        # unsent must leave an untouched socket to the control process, which then gives it to another worker.
        await self.channel.drained()
        if self.channel.closed:
            sock.close()
            return
        try:
            await inbound.adopt(sock)
        except OSError as e:  # the peer left meanwhile
            log.debug("worker %d: a handed-in inbound connection could not be served: %s", self.index, e)

    def _inbound(self, key: p.ProxyKey | None) -> Inbound | None:
        if key is None:
            return self.proxy.inbound if self.proxy is not None else None
        pod = self.pods.get(key[0])
        return pod.proxies.proxy.inbound if pod is not None and pod.netns.id == key[1] else None

    async def _on_demand(self, name: str) -> None:
        assert self.channel is not None
        await self.channel.call(p.OnDemandRequest(name), response=p.OnDemandDone)

    # -- serving -------------------------------------------------------------------------------------------------

    async def _serve(self) -> None:
        """After the first snapshot: start the dedicated proxy (in-pod, the pods come as AddPod), then Ready."""
        cfg = self.config
        assert cfg is not None
        try:
            if cfg.proxy_mode is ProxyMode.DEDICATED:
                info = cfg.proxy_workload_info
                assert info is not None
                self.dns_proxy = self.factory.dns(LocalWorkload(self.state, info), self.factory.host_sockets(), True)
                if self.dns_proxy is not None:
                    await self.dns_proxy.start(self.may_accept)
                if cfg.enable_proxy:
                    self.proxy = self.factory.dedicated(info, self.drain)
                    if self.proxy.socks5 is not None and self.dns_proxy is not None:
                        self.proxy.socks5.resolve = self.dns_proxy.resolve
                    await self.proxy.start(self.may_accept)
            elif cfg.proxy_mode is ProxyMode.SHARED:
                self.self_proxy = self.factory.self_proxy(self.drain)
                if self.self_proxy is not None:
                    await self.self_proxy.start(self.may_accept)
        except Exception as e:
            # A port in use, a missing capability: the control process logs it (and at startup exits with it).
            log.error("worker %d cannot serve: %s", self.index, e)
            self._send(p.Failed(str(e)))
            assert self.channel is not None
            await self.channel.drained()
            self._exit(1)
            return
        self.serving = True
        if self.may_accept:  # Serve may have come while binding: a no-op for listeners that accept already
            await serve_after_sync(self.dns_proxy, self.proxy, self.self_proxy)
        self._send(p.Ready(self.generation if self.generation is not None else -1))

    async def _run_pod_ops(self) -> None:
        """AddPod and DelPod, one at a time in the order they came (an add then a del of one pod must not race)."""
        while True:
            msg, fds = await self._pod_ops.get()
            if isinstance(msg, p.AddPod):
                error = await self._add_pod(msg, fds[0] if fds else None)
            else:
                assert isinstance(msg, p.DelPod)
                error = await self._del_pod(msg.uid)
            with contextlib.suppress(Exception):  # the channel may be gone: nothing to answer then
                self._send(p.Ack(msg.request_id, error))

    async def _add_pod(self, msg: p.AddPod, fd: int | None) -> str | None:
        if fd is None:
            return f"{msg.uid}: no network namespace fd came with AddPod"
        if self._draining is not None:
            os.close(fd)
            return "draining"
        assert self._host_fd is not None
        try:
            netns = Netns(fd, self._host_fd)
        except OSError as e:
            os.close(fd)
            return f"{msg.uid}: invalid network namespace: {e}"
        existing = self.pods.get(msg.uid)
        if existing is not None:
            if existing.netns.id == netns.id:
                netns.close()  # the same pod again (a restarted worker's catch-up racing a ZDS add)
                return None
            await self._del_pod(msg.uid)
        try:
            proxies = await self.factory.start(msg.uid, msg.info, netns)
        except Exception as e:
            netns.close()
            return f"failed to start proxy for {msg.uid}: {e}"
        self.pods[msg.uid] = _Pod(netns, proxies)
        return None

    async def _del_pod(self, uid: str) -> str | None:
        pod = self.pods.pop(uid, None)
        if pod is not None:
            await pod.proxies.stop(immediate=True)
            pod.netns.close()
        return None

    # -- queries -------------------------------------------------------------------------------------------------

    def _proxies(self) -> list[Proxy]:
        out = [self.proxy] if self.proxy is not None else []
        return out + [pod.proxies.proxy for pod in self.pods.values()]

    def _connections(self) -> list[ConnectionRecord]:
        own = list(self.self_proxy.pi.connections) if self.self_proxy is not None else []
        return [r for proxy in self._proxies() for r in proxy.pi.connections] + own

    def _answer(self, what: str) -> Any:
        if what == "connections":
            now = time.monotonic()
            return [{**r.to_json(now), "worker": self.index} for r in self._connections()]
        if what == "pods":
            return {uid: connections_dump(pod.proxies.proxy.pi.connections) for uid, pod in self.pods.items()}
        if what == "metrics":
            return self._metrics()
        raise ValueError(f"unknown query {what!r}")

    async def _profile(self, msg: p.Profile) -> None:
        """Answer the admin's profiling request; the sampling and the heap snapshot run on a thread."""
        # Imported on the first request: profiling is rare, and its module (with tracemalloc) would otherwise be in
        # every worker's memory from the start.
        from ztunnel import profiling

        name = f"worker-{self.index}"
        value: Any
        try:
            if msg.kind == "cpu":
                value = await asyncio.to_thread(profiling.cpu_profile, msg.seconds, msg.frequency, name)
            elif msg.kind == "heap":
                value = await asyncio.to_thread(profiling.heap_snapshot, name)
            elif msg.kind == "heap-profiling":
                value = profiling.set_heap_profiling(msg.activate)
            else:
                value = profiling.ProfileFailed(f"unknown profile kind {msg.kind!r}")
        except profiling.ProfileError as e:
            value = profiling.ProfileFailed(str(e))
        with contextlib.suppress(ChannelClosed):
            self._send(p.Reply(msg.request_id, value))

    def _metrics(self) -> Snapshot:
        """Every family of this worker, with the bytes of open connections counted up to now."""
        for record in self._connections():
            if record.metrics is not None:
                self.traffic.flush(record.metrics, record.bytes_sent(), record.bytes_recv())
        return snapshot(self.registry)

    # -- drain ---------------------------------------------------------------------------------------------------

    def _drain(self, msg: p.Drain) -> None:
        if self._draining is not None:
            if not msg.graceful:  # a second SIGINT: whatever is still open closes now
                self.drain.start(DrainMode.IMMEDIATE)
                for pod in self.pods.values():
                    pod.proxies.proxy.pi.drain.force()
            return
        self.drain.start(DrainMode.GRACEFUL if msg.graceful else DrainMode.IMMEDIATE)
        self._draining = self.tasks.spawn(self._drain_all(msg.graceful, msg.deadline), "drain")

    async def _drain_all(self, graceful: bool, deadline: float) -> None:
        proxy = self.proxy
        if proxy is not None:
            proxy.drain()  # stop accepting and GOAWAY before anything awaits
        waits: list[tuple[str, Awaitable[None]]] = []
        if self.dns_proxy is not None:
            waits.append(("the DNS proxy", self.dns_proxy.close()))
        if proxy is not None:

            async def dedicated() -> None:
                if not graceful or not await proxy.wait_idle(deadline):
                    if not self.drain.forced:  # else a second SIGINT said so (the control process logged it)
                        log.warning("drain duration expired with pending connections, forcefully shutting down")
                        self.drain.force()
                    proxy.force_close()
                await proxy.pi.tasks.cancel_all(timeout=1.0)

            waits.append(("the proxy", dedicated()))
        if self.self_proxy is not None:
            waits.append(("ztunnel's own inbound", self.self_proxy.stop(graceful, deadline)))
        for uid, pod in self.pods.items():
            pod.proxies.deadline = deadline
            if not graceful:
                pod.proxies.proxy.pi.drain.force()
            waits.append((f"the proxies of pod {uid}", pod.proxies.stop(immediate=not graceful)))
        await drain_together(waits)
        for pod in self.pods.values():
            pod.netns.close()
        self.pods.clear()
        log.info("worker %d drained", self.index)
        self._exit(0)


def _close(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


__all__ = ["ChannelFactory", "RemoteCertificates", "Worker"]
