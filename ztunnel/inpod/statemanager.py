"""Which pods have a running proxy, and what ZDS messages do to that (upstream ``inpod/statemanager.rs``).

* ``add``: start the pod's proxies in its namespace. The same uid with the same namespace is a no-op (idempotent);
  with another namespace the old proxies are drained and new ones started. A start failure is NACKed and the pod
  waits in ``pending``, retried every 5 s.
* ``keep`` (only before the snapshot ends): the pod stays, though its namespace could not be sent.
* ``del``: drain the pod's proxies at once (the pod is gone, nobody is left to finish with). Before the snapshot
  ends it only forgets the uid.
* ``SnapshotSent``: reconcile: proxies of pods neither added nor kept on this connection are drained at once.

``keep`` after the snapshot, a second ``SnapshotSent`` and an ``add`` without workload info are protocol errors:
NACKed, then ztunnel exits 1 (upstream ``app.rs``), since it and the agent no longer agree on the state.

Pure bookkeeping plus an injected :class:`ProxyFactory`, so it is unit-tested without namespaces.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from ztunnel.config import WorkloadInfo
from ztunnel.drain import drain_together
from ztunnel.errors import ZtunnelError
from ztunnel.inpod.netns import Netns, NetnsId
from ztunnel.inpod.protocol import AddWorkload, DelWorkload, KeepWorkload, SnapshotSent, WorkloadMessage, close_fd

log = logging.getLogger("ztunnel.inpod")


class ProtocolError(ZtunnelError):
    """The agent broke the protocol: NACK, then exit 1."""


class ProxyStartError(ZtunnelError):
    """A pod's proxies could not start (e.g. a port in use): NACK, and retry later."""


class PodProxies(Protocol):
    """The running proxies of one pod."""

    netns_id: NetnsId

    async def stop(self, immediate: bool) -> None: ...


class ProxyFactory(Protocol):
    async def start(self, uid: str, info: WorkloadInfo, netns: Netns) -> PodProxies: ...


NetnsOpener = Callable[[int], Netns]


@dataclass
class PodState:
    uid: str
    info: WorkloadInfo
    proxies: PodProxies | None = None  # None while pending
    netns: Netns | None = None


@dataclass
class WorkloadProxyManagerState:
    factory: ProxyFactory
    open_netns: NetnsOpener
    pods: dict[str, PodState] = field(default_factory=dict)
    pending: dict[str, PodState] = field(default_factory=dict)
    snapshot_received: bool = False
    snapshot_names: set[str] = field(default_factory=set)
    started: int = 0
    stopped: int = 0
    on_change: Callable[[], None] = lambda: None

    @property
    def active(self) -> int:
        return len(self.pods)

    def reset_snapshot(self) -> None:
        """A new connection: the agent will send a fresh snapshot (running proxies stay until reconciliation)."""
        self.snapshot_names.clear()
        for p in self.pending.values():
            if p.netns is not None:
                p.netns.close()
        self.pending.clear()
        self.snapshot_received = False
        self.on_change()

    @property
    def ready(self) -> bool:
        """Upstream's readiness: the snapshot was processed and no proxy is pending."""
        return self.snapshot_received and not self.pending

    async def process(self, msg: WorkloadMessage) -> None:
        """Apply one message. Raises :class:`ProtocolError` or :class:`ProxyStartError` (both become NACKs)."""
        if isinstance(msg, AddWorkload):
            await self._add(msg)
        elif isinstance(msg, KeepWorkload):
            log.info("pod keep received, it will not be deleted when the snapshot is complete: %s", msg.uid)
            if self.snapshot_received:
                raise ProtocolError("pod keep received after snapshot")
            self.snapshot_names.add(msg.uid)
        elif isinstance(msg, DelWorkload):
            log.info("pod delete request, shutting down proxy: %s", msg.uid)
            if not self.snapshot_received:
                self.snapshot_names.discard(msg.uid)
                pending = self.pending.pop(msg.uid, None)
                if pending is not None and pending.netns is not None:
                    pending.netns.close()
                self.on_change()
                return
            await self._delete(msg.uid)
        elif isinstance(msg, SnapshotSent):
            log.info("received snapshot sent")
            if self.snapshot_received:
                raise ProtocolError("pod snapshot received already")
            await self._reconcile()
            self.snapshot_received = True
            self.on_change()

    async def _add(self, msg: AddWorkload) -> None:
        if msg.info is None:
            close_fd(msg.netns_fd)
            raise ProtocolError("workload_info is required but not present")
        info = msg.info
        log.info("pod received, starting proxy: %s (%s/%s)", msg.uid, info.namespace, info.name)
        if not self.snapshot_received:
            self.snapshot_names.add(msg.uid)
        try:
            netns = self.open_netns(msg.netns_fd)
        except OSError as e:
            close_fd(msg.netns_fd)
            raise ProxyStartError(f"{msg.uid}: invalid network namespace: {e}") from None
        existing = self.pods.get(msg.uid)
        if existing is not None and existing.proxies is not None:
            if existing.proxies.netns_id == netns.id:
                netns.close()  # idempotent: the same pod in the same namespace
                return
            log.info("pod %s moved to another network namespace: replacing its proxies", msg.uid)
            await self._delete(msg.uid)
        await self._start(PodState(msg.uid, info, netns=netns))

    async def _start(self, pod: PodState) -> None:
        assert pod.netns is not None
        try:
            pod.proxies = await self.factory.start(pod.uid, pod.info, pod.netns)
        except Exception as e:
            self.pending[pod.uid] = pod
            self.on_change()
            raise ProxyStartError(f"failed to start proxy for {pod.uid}: {e}") from e
        self.pending.pop(pod.uid, None)
        self.pods[pod.uid] = pod
        self.started += 1
        self.on_change()

    async def retry_pending(self) -> None:
        """Try the pending pods again (every 5 s, upstream)."""
        for uid, pod in list(self.pending.items()):
            if self.pending.get(uid) is not pod:
                continue
            try:
                await self._start(pod)
                log.info("pending proxy for %s started", uid)
            except ProxyStartError as e:
                log.warning("%s", e)

    async def _delete(self, uid: str) -> None:
        pod = self.pods.pop(uid, None)
        pending = self.pending.pop(uid, None)
        if pending is not None and pending.netns is not None:
            pending.netns.close()
        if pod is not None and pod.proxies is not None:
            self.stopped += 1
            await pod.proxies.stop(immediate=True)
            if pod.netns is not None:
                pod.netns.close()
        self.on_change()

    async def _reconcile(self) -> None:
        for uid in [u for u in self.pods if u not in self.snapshot_names]:
            log.info("pod %s not in the snapshot: shutting down its proxy", uid)
            await self._delete(uid)
        self.snapshot_names.clear()

    async def drain(self) -> None:
        """ztunnel is shutting down: drain every pod's proxies gracefully, all at once (one deadline, not N)."""
        pods = list(self.pods.values())
        self.pods.clear()
        self.stopped += sum(1 for p in pods if p.proxies is not None)
        await drain_together(
            [(f"the proxies of pod {p.uid}", p.proxies.stop(immediate=False)) for p in pods if p.proxies is not None]
        )
        for pod in pods:
            if pod.netns is not None:
                pod.netns.close()
        self.on_change()
