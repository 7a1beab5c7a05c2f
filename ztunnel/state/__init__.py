"""The control-plane store: workloads, services and policies, keyed the way the proxies look them up.

Only :meth:`ProxyState.apply` changes it, one :class:`StateUpdate` batch at a time. A batch is applied in one
synchronous step on the event loop, so no reader (a proxy handling a connection) ever sees half of it, and
subscribers are told once per batch what kinds of objects changed. The store is pure data: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ztunnel.rbac import Authorization
from ztunnel.state.policy import PolicyStore
from ztunnel.state.service import Endpoint, Service, ServiceStore
from ztunnel.state.workload import NamespacedHostname, NetworkAddress, Workload, WorkloadStore

__all__ = ["ProxyState", "StateChange", "StateUpdate"]


@dataclass(slots=True)
class StateUpdate:
    """One batch of changes. ``replace_all`` first removes everything not in the batch (local config reloads)."""

    workloads: list[Workload] = field(default_factory=list)
    services: list[Service] = field(default_factory=list)
    policies: list[Authorization] = field(default_factory=list)
    removed_workloads: list[str] = field(default_factory=list)
    removed_services: list[NamespacedHostname] = field(default_factory=list)
    removed_policies: list[str] = field(default_factory=list)
    replace_all: bool = False


@dataclass(frozen=True, slots=True)
class StateChange:
    """What a batch touched: subscribers use it to skip work (the policy watcher ignores workload-only batches)."""

    workloads: bool
    services: bool
    policies: bool


class ProxyState:
    """Workloads, services and policies, with the indexes the per-connection path needs."""

    def __init__(self, local_node: str | None = None) -> None:
        self.workloads = WorkloadStore(local_node)
        self.services = ServiceStore()
        self.policies = PolicyStore()
        self.version = 0
        self._subscribers: list[Callable[[StateChange], None]] = []
        self._observers: list[Callable[[StateUpdate, int], None]] = []

    def subscribe(self, callback: Callable[[StateChange], None]) -> Callable[[], None]:
        """Call ``callback`` after every applied batch; returns a function that unsubscribes."""
        self._subscribers.append(callback)
        return lambda: self._subscribers.remove(callback) if callback in self._subscribers else None

    def observe(self, callback: Callable[[StateUpdate, int], None]) -> None:
        """Call ``callback(update, version)`` with every batch once it is applied, in order (the control process
        forwards each to its worker processes, which apply the same batches)."""
        self._observers.append(callback)

    # -- lookups -------------------------------------------------------------------------------------------------

    def find_address(self, addr: NetworkAddress, client_ns: str | None = None) -> Workload | Service | None:
        """The workload at that address, else the service with that VIP (preferring the client's namespace), as
        upstream's ``find_address``."""
        workload = self.workloads.find_address(addr)
        if workload is not None:
            return workload
        return self.services.get_best_by_vip(addr, client_ns)

    def find_hostname(self, name: NamespacedHostname) -> Workload | Service | None:
        """The service ``namespace/hostname``, else a workload with that hostname (upstream's ``find_hostname``: the
        workload fallback is a scan, as upstream's, since it is rare: a waypoint referenced by a workload's name)."""
        svc = self.services.get(name)
        if svc is not None:
            return svc
        return next((w for w in self.workloads if w.hostname == name.hostname and w.namespace == name.namespace), None)

    def find_service_by_hostname(self, hostname: str, client_ns: str | None = None) -> Service | None:
        return self.services.get_best_by_host(hostname, client_ns)

    # -- updates -------------------------------------------------------------------------------------------------

    def apply(self, update: StateUpdate) -> StateChange:
        """Apply one batch atomically (no awaits inside) and notify subscribers once."""
        if update.replace_all:
            self._remove_absent(update)
        for uid in update.removed_workloads:
            self._remove_workload(uid)
        for key in update.removed_services:
            self.services.remove(key)
        for pkey in update.removed_policies:
            self.policies.remove(pkey)
        for svc in update.services:
            self.services.insert(svc)
        for w in update.workloads:
            self._insert_workload(w)
        for policy in update.policies:
            self.policies.insert(policy)
        change = StateChange(
            workloads=bool(update.workloads or update.removed_workloads or update.replace_all),
            services=bool(update.services or update.removed_services or update.replace_all),
            policies=bool(update.policies or update.removed_policies or update.replace_all),
        )
        self.version += 1
        for callback in list(self._subscribers):
            callback(change)
        for observer in self._observers:
            observer(update, self.version)
        return change

    def _remove_absent(self, update: StateUpdate) -> None:
        keep_w = {w.uid for w in update.workloads}
        keep_s = {s.key for s in update.services}
        keep_p = {p.key for p in update.policies}
        for uid in [u for u in self.workloads.by_uid if u not in keep_w]:
            self._remove_workload(uid)
        for key in [k for k in self.services.by_key if k not in keep_s]:
            self.services.remove(key)
        self.services.staged = {k: v for k, v in self.services.staged.items() if k in keep_s}
        for pkey in [k for k in self.policies.by_key if k not in keep_p]:
            self.policies.remove(pkey)

    def _insert_workload(self, w: Workload) -> None:
        old = self.workloads.insert(w)
        if old is not None:
            for key in old.services:
                if key not in w.services:
                    self.services.remove_endpoint(key, old.uid)
        for key, ports in w.services.items():
            self.services.insert_endpoint(key, Endpoint(w.uid, ports, w.status))

    def _remove_workload(self, uid: str) -> None:
        old = self.workloads.remove(uid)
        if old is not None:
            for key in old.services:
                self.services.remove_endpoint(key, uid)
