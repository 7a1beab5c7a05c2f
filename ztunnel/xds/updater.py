"""Handlers that apply xDS responses to the proxy state (upstream ``xds.rs`` ``ProxyStateUpdater``).

Each response becomes exactly one :class:`~ztunnel.state.StateUpdate`: every resource is converted first (a bad
one only rejects itself), then the good ones and the removals are applied in one synchronous
:meth:`ProxyState.apply`, so a proxy never sees half a push.

Removal names follow istiod's resource naming: an Address removal is a workload UID or a service
``<namespace>/<hostname>``. As upstream, a name that is a known workload UID removes that workload; otherwise it is
taken as a service key, unless its hostname part contains ``/`` (namespaces and hostnames never do, workload UIDs
such as ``cluster1//v1/Pod/ns/name`` always do).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from google.protobuf.message import Message

from xds.istio.security import authorization_pb2 as sec_pb
from xds.istio.workload import workload_pb2 as wl_pb
from ztunnel.rbac import Authorization
from ztunnel.state import ProxyState, StateUpdate
from ztunnel.state.service import Service
from ztunnel.state.workload import NamespacedHostname, Workload
from ztunnel.xds.client import RejectedConfig, ResourceRemoved, ResourceUpdated, XdsUpdate
from ztunnel.xds.types import (
    ADDRESS_TYPE,
    AUTHORIZATION_TYPE,
    ConversionError,
    address_from_xds,
    authorization_from_xds,
)

__all__ = ["AddressHandler", "AuthorizationHandler"]

log = logging.getLogger("ztunnel.xds")


class AddressHandler:
    """``istio.workload.Address`` (workloads and services) into :class:`ProxyState`."""

    type_url = ADDRESS_TYPE
    message_type: type[Message] = wl_pb.Address
    on_demand_capable = True

    def __init__(self, state: ProxyState) -> None:
        self.state = state

    def handle(self, updates: Sequence[XdsUpdate]) -> list[RejectedConfig]:
        """Convert every resource, apply the good ones and the removals in one batch, return the rejected."""
        batch = StateUpdate()
        rejected: list[RejectedConfig] = []
        for u in updates:
            if isinstance(u, ResourceUpdated):
                assert isinstance(u.resource, wl_pb.Address)
                try:
                    item = address_from_xds(u.resource)
                except ConversionError as e:
                    rejected.append(RejectedConfig(u.name, str(e)))
                    continue
                if isinstance(item, Workload):
                    batch.workloads.append(item)
                else:
                    assert isinstance(item, Service)
                    batch.services.append(item)
            else:
                self._removal(u, batch)
        if _has_changes(batch):
            self.state.apply(batch)
        return rejected

    def _removal(self, u: ResourceRemoved, batch: StateUpdate) -> None:
        name = u.name
        if self.state.workloads.find_uid(name) is not None:
            batch.removed_workloads.append(name)
            return
        namespace, sep, hostname = name.partition("/")
        if not sep:
            log.warning("tried to remove service %r but it did not have the expected namespace/hostname format", name)
            return
        if "/" in hostname:
            return  # an unknown workload UID, not a service
        key = NamespacedHostname(namespace, hostname)
        if self.state.services.get(key) is None:
            log.warning("tried to remove service %s, but it was not found", key)
            return
        batch.removed_services.append(key)


class AuthorizationHandler:
    """``istio.security.Authorization`` into :class:`ProxyState`.

    Upstream keys policies by resource name, which istiod makes ``<namespace>/<name>``, the model's key. A server
    that names them otherwise still works: the resource name -> policy key mapping is remembered for removals.
    """

    type_url = AUTHORIZATION_TYPE
    message_type: type[Message] = sec_pb.Authorization
    on_demand_capable = False

    def __init__(self, state: ProxyState) -> None:
        self.state = state
        self._keys: dict[str, str] = {}

    def handle(self, updates: Sequence[XdsUpdate]) -> list[RejectedConfig]:
        """Convert every policy, apply the good ones and the removals in one batch, return the rejected."""
        batch = StateUpdate()
        rejected: list[RejectedConfig] = []
        for u in updates:
            if isinstance(u, ResourceUpdated):
                assert isinstance(u.resource, sec_pb.Authorization)
                try:
                    policy: Authorization = authorization_from_xds(u.resource)
                except ConversionError as e:
                    rejected.append(RejectedConfig(u.name, str(e)))
                    continue
                log.info("handling RBAC update %s", policy.key)
                old_key = self._keys.get(u.name)
                if old_key is not None and old_key != policy.key:
                    batch.removed_policies.append(old_key)
                self._keys[u.name] = policy.key
                batch.policies.append(policy)
            else:
                log.info("handling RBAC delete %s", u.name)
                batch.removed_policies.append(self._keys.pop(u.name, u.name))
        if _has_changes(batch):
            self.state.apply(batch)
        return rejected


def _has_changes(batch: StateUpdate) -> bool:
    return bool(
        batch.workloads
        or batch.services
        or batch.policies
        or batch.removed_workloads
        or batch.removed_services
        or batch.removed_policies
    )
