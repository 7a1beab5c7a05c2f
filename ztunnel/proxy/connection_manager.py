"""Tracks every proxied connection: for policy re-evaluation, the admin ``/connections`` view, metrics and the
access log (upstream ``proxy/connection_manager.rs`` and the access-log half of ``proxy/metrics.rs``).

A connection is registered when it is established and released when it closes; the release writes the access log
line (``connection complete``) with upstream's fields. Byte counts are read from the relay at that moment, never
per chunk.

An inbound connection is registered earlier, before its policy check and while it connects to the app (as
upstream's ``assert_rbac``), so a policy that arrives meanwhile reaches it: it is tracked but not yet counted, and
:meth:`ConnectionManager.established` counts it once the app accepted it. One that never gets there is counted
when it is released, with the labels it has by then.
"""

from __future__ import annotations

import enum
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from ztunnel.identity.spiffe import Identity
from ztunnel.metrics import Labels
from ztunnel.net import format_addr
from ztunnel.proxy.common import ResponseFlag
from ztunnel.proxy.hbone.reason import CloseKind, CloseReason
from ztunnel.proxy.metrics import ConnectionMetrics, DerivedWorkload, TrafficMetrics, traffic_labels
from ztunnel.rbac import Connection
from ztunnel.state import ProxyState, StateChange
from ztunnel.state.upstream import ServiceDescription
from ztunnel.state.workload import IPAddress, Workload
from ztunnel.telemetry import display
from ztunnel.telemetry import log as log_fields

access = logging.getLogger("access")

# Upstream's ``Error::ClosedFromDrain``: what the access log says of a connection the drain had to close.
CLOSED_FROM_DRAIN = "connection closed due to connection drain"


class Direction(enum.Enum):
    INBOUND = "inbound"
    OUTBOUND = "outbound"


class Abortable(Protocol):
    def abort(self, reason: CloseReason | str) -> None: ...


@dataclass(eq=False, slots=True)  # one per connection, held as long as it: no per-instance dict
class ConnectionRecord:
    """One proxied connection, as the access log, metrics and admin see it."""

    direction: Direction
    src: tuple[IPAddress, int]
    dst: tuple[IPAddress, int]  # the L4 next hop (inbound: the address dialled on 15008)
    hbone_target: str | None = None  # the :authority, when HBONE
    original_dst: tuple[IPAddress, int] | None = None  # outbound: where the client was going (before load balancing)
    src_identity: Identity | None = None
    dst_identity: Identity | None = None
    src_workload: Workload | None = None
    dst_workload: Workload | None = None
    dst_service: ServiceDescription | None = None
    derived_source: DerivedWorkload | None = None
    mtls: bool = False
    policy: str = ""
    started: float = field(default_factory=time.monotonic)
    id: int = 0
    # Live byte counters: callables reading the relay's ints (sent = upstream->downstream, recv = the other way).
    bytes_sent: Callable[[], int] = field(default=lambda: 0)
    bytes_recv: Callable[[], int] = field(default=lambda: 0)
    # Closes the connection now (policy change, drain); set by the listener that owns it.
    closer: Callable[[str], None] | None = None
    # What inbound policy saw (re-checked when policies change); None for outbound connections.
    rbac: Connection | None = None
    # Set when ztunnel closed the connection itself: the flag and error the access log reports.
    forced: tuple[ResponseFlag, str] | None = None
    metrics: ConnectionMetrics | None = None
    # The HBONE connection carrying it (inbound: the client's; outbound: the pooled one), to close its streams when
    # the connection itself must close (a CRL revoked the peer).
    tunnel: object | None = None

    def fields(self) -> dict[str, object]:
        """Upstream's access-log fields, in its order (``proxy/metrics.rs``)."""
        src, dst, derived = self.src_workload, self.dst_workload, self.derived_source
        # Addresses and the authority are Display (`%`) fields upstream: written bare in plain lines.
        out: dict[str, object] = {"src.addr": display(format_addr(*self.src))}
        # Workload name, else the canonical service (upstream's fallback), else what baggage said.
        src_name = (src.name or src.canonical_name) if src is not None else (derived.workload_name if derived else None)
        if src_name:
            out["src.workload"] = src_name
        src_ns = src.namespace if src is not None else (derived.namespace if derived else None)
        if src_ns:
            out["src.namespace"] = src_ns
        if self.mtls and self.src_identity is not None:
            out["src.identity"] = str(self.src_identity)
        src_cluster = src.cluster_id if src is not None else (derived.cluster_id if derived else None)
        if src_cluster:
            out["src.cluster"] = src_cluster
        out["dst.addr"] = display(format_addr(*self.dst))
        if self.hbone_target is not None:
            out["dst.hbone_addr"] = display(self.hbone_target)
        if self.dst_service is not None:
            out["dst.service"] = self.dst_service.hostname
        if dst is not None:
            out["dst.workload"] = dst.name or dst.canonical_name
            out["dst.namespace"] = dst.namespace
        if self.mtls and self.dst_identity is not None:
            out["dst.identity"] = str(self.dst_identity)
        if dst is not None and dst.cluster_id:
            out["dst.cluster"] = dst.cluster_id
        out["direction"] = self.direction.value
        return out

    def to_json(self, now: float) -> dict[str, Any]:
        """The admin ``/connections`` entry (this project's addition); ``now`` is ``time.monotonic()``."""
        return {
            "id": self.id,
            "direction": self.direction.value,
            "src": format_addr(*self.src),
            "dst": format_addr(*self.dst),
            "hboneTarget": self.hbone_target,
            "srcIdentity": str(self.src_identity) if self.src_identity is not None else None,
            "dstIdentity": str(self.dst_identity) if self.dst_identity is not None else None,
            "srcWorkload": self.src_workload.name if self.src_workload is not None else None,
            "dstWorkload": self.dst_workload.name if self.dst_workload is not None else None,
            "dstService": self.dst_service.hostname if self.dst_service is not None else None,
            "securityPolicy": "mutual_tls" if self.mtls else "unknown",
            "policyChecked": self.rbac is not None,
            "bytesSent": self.bytes_sent(),
            "bytesReceived": self.bytes_recv(),
            "ageSeconds": round(now - self.started, 3),
        }

    def labels(self, flag: ResponseFlag = ResponseFlag.NONE) -> Labels:
        svc = self.dst_service
        return traffic_labels(
            "source" if self.direction is Direction.OUTBOUND else "destination",  # the reporter label
            self.src_workload,
            self.derived_source,
            self.dst_workload,
            (svc.hostname, svc.name, svc.namespace) if svc is not None else None,
            self.mtls,
            flag,
        )


class ConnectionManager:
    """The set of open connections of one proxy; counts them in the Istio TCP metrics when given them."""

    def __init__(self, metrics: TrafficMetrics | None = None) -> None:
        self._open: dict[int, ConnectionRecord] = {}
        self._ids = itertools.count(1)
        self.traffic = metrics
        self.on_close: list[Callable[[ConnectionRecord, ResponseFlag, str | None], None]] = []

    def __len__(self) -> int:
        return len(self._open)

    def __iter__(self) -> Iterator[ConnectionRecord]:
        return iter(list(self._open.values()))

    def register(self, record: ConnectionRecord, *, established: bool = True) -> ConnectionRecord:
        """Track ``record``. ``established=False``: not connected yet (inbound, before its policy check and app
        connect): tracked, so policy changes reach it, but counted only by :meth:`established` or its release."""
        record.id = next(self._ids)
        self._open[record.id] = record
        if established:  # self.established(record), inline: one call fewer per connection
            if self.traffic is not None and record.metrics is None:
                record.metrics = self.traffic.open(record.labels())
            if access.isEnabledFor(logging.DEBUG):
                log_fields(access, logging.DEBUG, "connection opened", **record.fields())
        return record

    def established(self, record: ConnectionRecord) -> None:
        """The connection is up: count it as opened (with its labels as they are now) and log it at debug."""
        if self.traffic is not None and record.metrics is None:
            record.metrics = self.traffic.open(record.labels())
        if access.isEnabledFor(logging.DEBUG):
            log_fields(access, logging.DEBUG, "connection opened", **record.fields())

    def release(
        self, record: ConnectionRecord, flag: ResponseFlag = ResponseFlag.NONE, error: str | None = None
    ) -> None:
        """The connection closed: write the access log and tell listeners (metrics)."""
        if self._open.pop(record.id, None) is None:
            return
        if record.forced is not None:
            flag, error = record.forced
        sent, received = record.bytes_sent(), record.bytes_recv()
        if self.traffic is not None:
            if record.metrics is None:  # never established: opened and closed at once, as upstream counts it
                record.metrics = self.traffic.open(record.labels())
            self.traffic.close(record.metrics, sent, received, flag)
        for cb in self.on_close:
            cb(record, flag, error)
        level = logging.INFO if error is None else logging.ERROR
        if not access.isEnabledFor(level):
            return  # e.g. RUST_LOG=warn: building the ~20 fields was ~10 µs per connection for nothing
        fields = record.fields()
        # Metrics count client->server as "received" for both reporters (istio/istio#32399); the log does not.
        outbound = record.direction is Direction.OUTBOUND
        fields["bytes_sent"] = received if outbound else sent
        fields["bytes_recv"] = sent if outbound else received
        fields["duration"] = f"{int((time.monotonic() - record.started) * 1000)}ms"
        if error is not None:
            fields["error"] = error
        log_fields(access, level, "connection complete", **fields)

    def close(self, record: ConnectionRecord, flag: ResponseFlag, reason: str) -> None:
        """Close one connection now; its access log line reports ``flag`` and ``reason``."""
        record.forced = (flag, reason)
        if record.closer is not None:
            record.closer(reason)

    def close_tunnel(self, tunnel: object, flag: ResponseFlag, reason: str) -> int:
        """Close every connection carried by the HBONE connection ``tunnel`` (see :meth:`close`); how many."""
        records = [r for r in self._open.values() if r.tunnel is tunnel]
        for record in records:
            self.close(record, flag, reason)
        return len(records)

    def revoke_tunnel(self, tunnel: Abortable, reason: str) -> None:
        """A CRL update revoked the peer of the HBONE connection ``tunnel`` (either direction): its streams end with
        ``CERT_REVOKED`` and the connection closes at once, as upstream tears it down (a security event, not a
        drain)."""
        self.close_tunnel(tunnel, ResponseFlag.CERT_REVOKED, reason)
        tunnel.abort(CloseReason(CloseKind.PEER_REJECTED, reason))

    def close_all(self, reason: str = CLOSED_FROM_DRAIN) -> None:
        """Close every connection now (a drain that ran out of time, a deleted pod, a second SIGINT).

        Each access log line reports ``reason`` with no response flag, as upstream records a connection dropped by
        its drain (``ClosedFromDrain``); a connection already being closed for another reason keeps that one.
        """
        for record in list(self._open.values()):
            if record.forced is None:
                record.forced = (ResponseFlag.NONE, reason)
            if record.closer is not None:
                try:
                    record.closer(reason)
                except Exception:  # one connection failing to close must not stop the others
                    logging.getLogger("ztunnel.proxy").exception("closing connection %d failed", record.id)


def inbound_dump(c: ConnectionRecord) -> dict[str, Any]:
    """Upstream's ``InboundConnectionDump``: what policy saw (client -> pod ip:target port), the service named by
    the client if any, and HBONE (an mTLS peer) or TCP (15006)."""
    src, dst = c.src, c.dst
    if c.rbac is not None:
        src, dst = (c.rbac.src_ip, c.rbac.src_port), (c.rbac.dst_ip, c.rbac.dst_port)
    return {
        "src": format_addr(*src),
        "originalDst": c.dst_service.hostname if c.dst_service is not None else None,
        "actualDst": format_addr(*dst),
        "protocol": "HBONE" if c.src_identity is not None else "TCP",
    }


def outbound_dump(c: ConnectionRecord) -> dict[str, Any]:
    """Upstream's ``OutboundConnection``: where the client was going, and where (and how) ztunnel sent it."""
    return {
        "src": format_addr(*c.src),
        "originalDst": format_addr(*(c.original_dst or c.dst)),
        "actualDst": format_addr(*c.dst),
        "protocol": "HBONE" if c.mtls else "TCP",
    }


def connections_dump(records: Iterable[ConnectionRecord]) -> dict[str, list[dict[str, Any]]]:
    """One pod's ``connections`` in the config dump's ``workloadState``: inbound and outbound, upstream's shapes."""
    conns = list(records)
    return {
        "inbound": [inbound_dump(c) for c in conns if c.direction is Direction.INBOUND],
        "outbound": [outbound_dump(c) for c in conns if c.direction is Direction.OUTBOUND],
    }


def log_failed(direction: Direction, src: tuple[IPAddress, int], dst: tuple[IPAddress, int] | None, error: str) -> None:
    """An early failure (before a connection was established): upstream's WARN ``connection failed``."""
    fields: dict[str, object] = {"src.addr": display(format_addr(*src))}
    if dst is not None:
        fields["dst.addr"] = display(format_addr(*dst))
    fields["direction"] = direction.value
    fields["error"] = error
    log_fields(access, logging.WARNING, "connection failed", **fields)


POLICY_CHANGE = "connection closed due to policy change"


# Authorization hook: (connection, destination workload) -> None if allowed, else the denial reason.
# The proxy passes :class:`Authorizer` (policy evaluation); there is deliberately no default.
AuthorizeFn = Callable[[Connection, Workload], str | None]


class Authorizer:
    """Inbound authorization: the policies that apply to the destination workload, evaluated (``rbac.evaluate``).

    Returns None when allowed, else upstream's reason (``explicitly denied by: ns/name`` or
    ``allow policies exist, but none allowed``). Decisions log at debug, or info with AUTHZ_POLICY_INFO_LOGGING.
    """

    def __init__(self, state: ProxyState, info_logging: bool = False) -> None:
        self.state = state
        self.level = logging.INFO if info_logging else logging.DEBUG
        self.log = logging.getLogger("ztunnel.rbac")

    def __call__(self, conn: Connection, workload: Workload) -> str | None:
        plan = self.state.policies.plan(workload.namespace, workload.authorization_policies)
        decision = plan.evaluate(conn, self.log, self.level)
        return None if decision.allowed else decision.reason


class PolicyWatcher:
    """Re-checks every tracked inbound connection when policies change; closes the ones now denied.

    Upstream ``connection_manager.rs::PolicyWatcher``: covers policies that arrive after a connection started too.
    A state batch is applied synchronously, so the check runs right after it, well within a second.
    """

    def __init__(self, state: ProxyState, connections: ConnectionManager, authorize: Authorizer) -> None:
        self.state = state
        self.connections = connections
        self.authorize = authorize
        self._unsubscribe: Callable[[], None] | None = None

    def start(self) -> None:
        self._unsubscribe = self.state.subscribe(self._changed)

    def stop(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None

    def _changed(self, change: StateChange) -> None:
        # A workload's own policy list can change too, so workload batches are re-checked as well.
        if not (change.policies or change.workloads):
            return
        for record in self.connections:
            if record.rbac is None or record.dst_workload is None:
                continue
            workload = self.state.workloads.find_uid(record.dst_workload.uid) or record.dst_workload
            denied = self.authorize(record.rbac, workload)
            if denied is not None:
                logging.getLogger("ztunnel.proxy").info(
                    "closing connection %s: %s (%s)", record.rbac, POLICY_CHANGE, denied
                )
                self.connections.close(record, ResponseFlag.DENY, POLICY_CHANGE)
