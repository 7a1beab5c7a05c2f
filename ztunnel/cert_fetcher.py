"""Certificate prefetch for node-local workloads (upstream ``cert_fetcher.rs``).

In shared (node proxy) mode ztunnel serves every workload on its node, so it fetches their certificates as soon as
xDS tells it about them instead of on the first connection. A workload qualifies when it runs on this node
(``workload.node == NODE_NAME``) and speaks HBONE or terminates tunnels itself (``native_tunnel``): a plain-TCP
workload probably never needs a certificate, and being wrong only costs the first connection some latency.

When the last such workload of an identity leaves the node, its certificate is forgotten. The fetcher subscribes to
:class:`~ztunnel.state.ProxyState` and diffs the node-local identities on each batch that touched workloads, which
costs one pass over this node's workloads (via the store's node-local index), not over the mesh.
"""

from __future__ import annotations

import logging

from ztunnel.identity.manager import Priority, SecretManager
from ztunnel.identity.spiffe import Identity
from ztunnel.state import ProxyState, StateChange
from ztunnel.state.workload import InboundProtocol, Workload

__all__ = ["CertFetcher", "should_prefetch"]

log = logging.getLogger("ztunnel.identity")


def should_prefetch(w: Workload, local_node: str) -> bool:
    """Whether ``w`` is a workload on this node that needs a certificate (upstream's rule)."""
    return w.node == local_node and (w.native_tunnel or w.protocol is InboundProtocol.HBONE)


class CertFetcher:
    """Keeps a :class:`SecretManager` warm for the identities of this node's HBONE workloads."""

    def __init__(self, state: ProxyState, manager: SecretManager, local_node: str) -> None:
        self.state = state
        self.manager = manager
        self.local_node = local_node
        self.identities: set[Identity] = set()
        self._unsubscribe = state.subscribe(self._on_change)
        self.sync()

    def _on_change(self, change: StateChange) -> None:
        if change.workloads:
            self.sync()

    def wanted(self) -> set[Identity]:
        """Identities of node-local workloads that should have a certificate now."""
        store = self.state.workloads
        out = set()
        for identity in store.node_local_identities():
            for uid in store.node_local_uids(identity):
                w = store.find_uid(uid)
                if w is not None and should_prefetch(w, self.local_node):
                    out.add(identity)
                    break
        return out

    def sync(self) -> None:
        """Prefetch new identities and forget those whose last workload left."""
        wanted = self.wanted()
        for identity in sorted(wanted - self.identities):
            log.debug("prefetching certificate for %s", identity)
            self.manager.prefetch(identity, Priority.WARMUP)
        for identity in sorted(self.identities - wanted):
            log.debug("forgetting certificate for %s: no workload on this node uses it", identity)
            self.manager.forget(identity)
        self.identities = wanted

    def close(self) -> None:
        """Stop following state changes."""
        self._unsubscribe()
