"""Istio's standard TCP metrics for proxied connections (upstream ``proxy/metrics.rs``).

``CommonTrafficLabels`` are computed once per connection, in upstream's order and with its values (``unknown`` for
what is not known; locality labels only when a source, derived source or destination is known), and the four
children (opened, closed, sent, received) are looked up once then. Bytes are plain ints on the relay, added to the
counters when the connection closes and by a periodic flush (every 5 s) for long-lived ones, so a scrape never
misses more than a few seconds of a long transfer and the data path never touches a metric.

Byte direction follows Istio (istio/istio#32399): ``received`` is client->server and ``sent`` server->client, for
both reporters.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from ztunnel.baggage import Baggage
from ztunnel.identity.spiffe import Identity
from ztunnel.metrics import Child, Labels, Registry
from ztunnel.proxy.common import ResponseFlag
from ztunnel.state.workload import Workload

UNKNOWN = "unknown"
FLUSH_INTERVAL = 5.0
# Label values are cut to these lengths, ending in "...": a peer supplies every derived-source label (the baggage
# header), and one request must not make a series of megabytes: 3,000 requests with distinct 4 KB baggage took
# /metrics to 14 MB. 253 is the longest
# Kubernetes object name and DNS hostname (a DNS subdomain; namespaces, label values and revisions are at most 63),
# so no legitimate value is cut. Principals are SPIFFE identities, at most 9 + 253 + 4 + 63 + 4 + 253 = 586
# characters ("spiffe://" trust domain, "/ns/" namespace, "/sa/" service account).
MAX_LABEL_CHARS = 253
MAX_PRINCIPAL_CHARS = 586
_CUT = "..."


@dataclass(frozen=True, slots=True)
class DerivedWorkload:
    """A source known only from the mTLS identity and the ``baggage`` header (not found in xDS by IP)."""

    workload_name: str | None = None
    app: str | None = None
    revision: str | None = None
    namespace: str | None = None
    identity: Identity | None = None
    cluster_id: str | None = None
    region: str | None = None
    zone: str | None = None

    @classmethod
    def of_identity(cls, identity: Identity | None) -> DerivedWorkload:
        """A source known by its mTLS identity alone (every HBONE connection, both sides): one object per identity
        object, so a connection neither builds one (a frozen dataclass: 8 ``object.__setattr__`` calls) nor
        compares a new one field by field in the label cache (a hit on the same object is decided by identity)."""
        hit = _BY_IDENTITY.get(id(identity))
        if hit is not None and hit[0] is identity:
            return hit[1]
        if len(_BY_IDENTITY) >= _DERIVED_CACHE_SIZE:
            _BY_IDENTITY.clear()
        derived = cls(identity=identity)
        _BY_IDENTITY[id(identity)] = (identity, derived)
        return derived

    @classmethod
    def from_baggage(cls, b: Baggage, identity: Identity | None) -> DerivedWorkload:
        """What the peer's baggage says, each value bounded to MAX_LABEL_CHARS (it is a label-cache key, labels and
        access-log fields). One object per (baggage, identity) object pair: ``baggage.parse`` hands out the same
        Baggage for the same header value, and a pooled connection's streams share their peer's identity."""
        key = (id(b), id(identity))
        hit = _BY_BAGGAGE.get(key)
        if hit is not None and hit[0] is b and hit[1] is identity:
            return hit[2]
        if len(_BY_BAGGAGE) >= _DERIVED_CACHE_SIZE:
            _BY_BAGGAGE.clear()
        derived = cls._from_baggage(b, identity)
        _BY_BAGGAGE[key] = (b, identity, derived)
        return derived

    @classmethod
    def _from_baggage(cls, b: Baggage, identity: Identity | None) -> DerivedWorkload:
        return cls(
            workload_name=_bounded(b.workload_name),
            app=_bounded(b.service_name),
            revision=_bounded(b.revision),
            namespace=_bounded(b.namespace),
            identity=identity,
            cluster_id=_bounded(b.cluster_id),
            region=_bounded(b.region),
            zone=_bounded(b.zone),
        )


# Derived sources of recent connections, keyed by the identities of the objects they are made from (each entry holds
# them, so an id is never reused while cached); emptied when full.
_DERIVED_CACHE_SIZE = 4096
_BY_IDENTITY: dict[int, tuple[Identity | None, DerivedWorkload]] = {}
_BY_BAGGAGE: dict[tuple[int, int], tuple[Baggage, Identity | None, DerivedWorkload]] = {}


def _bounded(value: str | None, limit: int = MAX_LABEL_CHARS) -> str | None:
    if value is None or len(value) <= limit:
        return value
    return value[: limit - len(_CUT)] + _CUT


def _v(value: str | None) -> str:
    return _bounded(value) or UNKNOWN


def _principal(identity: Identity) -> str:
    return _bounded(str(identity), MAX_PRINCIPAL_CHARS) or UNKNOWN


# Label sets of recent connections, keyed by what they are computed from. Workloads are compared by identity (they
# are immutable and replaced on every xDS update, so a changed workload is a new key); the entry holds the objects,
# so an id in a key is never reused while it is cached. Building the 27 labels costs ~25 µs per connection, a cache
# hit ~1 µs; 4,096 entries are plenty for the source/destination pairs one node sees, and the cache is simply
# emptied when full.
_LABEL_CACHE: dict[tuple[object, ...], tuple[Workload | None, Workload | None, Labels]] = {}
_LABEL_CACHE_SIZE = 4096


def traffic_labels(
    reporter: str,
    source: Workload | None,
    derived_source: DerivedWorkload | None,
    destination: Workload | None,
    service: tuple[str, str, str] | None,  # (hostname, name, namespace)
    mtls: bool,
    flag: ResponseFlag,
) -> Labels:
    """Upstream's ``CommonTrafficLabels``, in encoding order (cached per source, destination and the rest)."""
    key = (reporter, id(source), derived_source, id(destination), service, mtls, flag)
    hit = _LABEL_CACHE.get(key)
    if hit is not None and hit[0] is source and hit[1] is destination:
        return hit[2]
    labels = _build_traffic_labels(reporter, source, derived_source, destination, service, mtls, flag)
    if len(_LABEL_CACHE) >= _LABEL_CACHE_SIZE:
        _LABEL_CACHE.clear()
    _LABEL_CACHE[key] = (source, destination, labels)
    return labels


def _build_traffic_labels(
    reporter: str,
    source: Workload | None,
    derived_source: DerivedWorkload | None,
    destination: Workload | None,
    service: tuple[str, str, str] | None,  # (hostname, name, namespace)
    mtls: bool,
    flag: ResponseFlag,
) -> Labels:
    src = dict.fromkeys(
        (
            "source_workload",
            "source_canonical_service",
            "source_canonical_revision",
            "source_workload_namespace",
            "source_principal",
            "source_app",
            "source_version",
            "source_cluster",
        ),
        UNKNOWN,
    )
    locality: dict[str, str] | None = None
    # The derived source first: the xDS source, when known, is more reliable and overrides it.
    if derived_source is not None:
        d = derived_source
        src.update(
            source_workload=_v(d.workload_name),
            source_canonical_service=_v(d.app),
            source_canonical_revision=_v(d.revision),
            source_workload_namespace=_v(d.namespace),
            source_app=_v(d.workload_name),
            source_version=_v(d.revision),
            source_cluster=_v(d.cluster_id),
            source_principal=_principal(d.identity) if d.identity is not None else UNKNOWN,
        )
        locality = {"source_region": _v(d.region), "source_zone": _v(d.zone)}
    if source is not None:
        # source_principal is only ever the mTLS identity (set from the derived source), never from xDS.
        src.update(
            source_workload=_v(source.workload_name),
            source_canonical_service=_v(source.canonical_name),
            source_canonical_revision=_v(source.canonical_revision),
            source_workload_namespace=_v(source.namespace),
            source_app=_v(source.canonical_name),
            source_version=_v(source.canonical_revision),
            source_cluster=_v(source.cluster_id),
        )
        locality = {
            **(locality or {}),
            "source_region": _v(source.locality.region),
            "source_zone": _v(source.locality.zone),
        }
    dst = dict.fromkeys(
        (
            "destination_workload",
            "destination_canonical_service",
            "destination_canonical_revision",
            "destination_workload_namespace",
            "destination_principal",
            "destination_app",
            "destination_version",
            "destination_cluster",
        ),
        UNKNOWN,
    )
    if destination is not None:
        w = destination
        dst.update(
            destination_workload=_v(w.workload_name),
            destination_canonical_service=_v(w.canonical_name),
            destination_canonical_revision=_v(w.canonical_revision),
            destination_workload_namespace=_v(w.namespace),
            destination_principal=_principal(w.identity),
            destination_app=_v(w.canonical_name),
            destination_version=_v(w.canonical_revision),
            destination_cluster=_v(w.cluster_id),
        )
        locality = {
            **(locality or {}),
            "destination_region": _v(w.locality.region),
            "destination_zone": _v(w.locality.zone),
        }
    svc_host, svc_name, svc_ns = service if service is not None else (UNKNOWN, UNKNOWN, UNKNOWN)
    labels: list[tuple[str, str]] = [("reporter", reporter)]
    labels += src.items()
    labels += [
        ("destination_service", _v(svc_host)),
        ("destination_service_namespace", _v(svc_ns)),
        ("destination_service_name", _v(svc_name)),
    ]
    labels += dst.items()
    labels += [
        ("request_protocol", "tcp"),
        ("response_flags", flag.value),
        ("connection_security_policy", "mutual_tls" if mtls else UNKNOWN),
    ]
    if locality is not None:
        labels += [
            ("source_region", locality.get("source_region", UNKNOWN)),
            ("source_zone", locality.get("source_zone", UNKNOWN)),
            ("destination_region", locality.get("destination_region", UNKNOWN)),
            ("destination_zone", locality.get("destination_zone", UNKNOWN)),
        ]
    return tuple(labels)


class _Series:
    """The children of one label set: opened, sent and received made when the first connection opens with it,
    closed when the first one closes (a series is only exported once something was counted in it)."""

    __slots__ = ("closed", "labels", "opened", "received", "sent")

    def __init__(self, labels: Labels, opened: Child, sent: Child, received: Child) -> None:
        self.labels = labels
        self.opened = opened
        self.sent = sent
        self.received = received
        self.closed: Child | None = None


@dataclass(slots=True)
class ConnectionMetrics:
    """The children of one connection, and what has been counted so far."""

    labels: Labels
    sent: Child
    received: Child
    series: _Series | None = None  # its label set's children (the closed one is found there)
    counted_sent: int = 0
    counted_received: int = 0


class TrafficMetrics:
    """The ``istio_tcp_*`` families of one ztunnel."""

    def __init__(self, registry: Registry) -> None:
        self.opened = registry.family("istio_tcp_connections_opened", "The total number of TCP connections opened")
        self.closed = registry.family("istio_tcp_connections_closed", "The total number of TCP connections closed")
        self.received = registry.family(
            "istio_tcp_received_bytes", "The size of total bytes received during request in case of a TCP connection"
        )
        self.sent = registry.family(
            "istio_tcp_sent_bytes", "The size of total bytes sent during response in case of a TCP connection"
        )
        self.failed = registry.family(
            "istio_tcp_connections_failed", "The total number of TCP connections that failed to establish (unstable)"
        )
        self.sockets_open = registry.family(
            "istio_tcp_sockets_open", "The current number of open TCP sockets (unstable)", "gauge"
        )
        self.on_demand_dns_family = registry.family(
            "istio_on_demand_dns", "The total number of requests that used on-demand DNS (unstable)"
        )
        self._on_demand: dict[tuple[int, str], tuple[Workload, Child]] = {}
        # The four children (opened, closed, sent, received) of recent label sets, keyed by the identity of the
        # labels tuple (traffic_labels hands out the same tuple for the same connection shape; the entry holds it,
        # so an id is never reused while cached). A family's own lookup hashes the whole 27-pair tuple each time
        # (tuples do not cache their hash): four lookups and Python calls per connection and side before, one
        # dict probe now. Children are never removed from a family, so a cached one is always the live series.
        self._series: dict[int, _Series] = {}
        # istio_tcp_sockets_open's children by reporter ("source", "destination"): one per accepted socket.
        self._sockets: dict[str, Child] = {}

    def on_demand_dns(self, source: Workload, hostname: str) -> None:
        """A connection whose destination was known only by hostname, resolved on demand (upstream
        ``OnDemandDnsLabels``: the source's labels as upstream sets them, and the hostname)."""
        # Workloads are not hashable; keyed by identity as the label cache is (the entry keeps the object alive).
        key = (id(source), hostname)
        hit = self._on_demand.get(key)
        if hit is not None and hit[0] is source:
            hit[1].value += 1
            return
        if len(self._on_demand) >= _LABEL_CACHE_SIZE:
            self._on_demand.clear()
        labels = (
            ("source_workload", _v(source.workload_name)),
            ("source_canonical_service", _v(source.canonical_name)),
            ("source_canonical_revision", _v(source.canonical_revision)),
            ("source_workload_namespace", _v(source.namespace)),
            ("source_principal", _principal(source.identity)),
            ("source_app", _v(source.canonical_name)),
            ("source_version", _v(source.canonical_revision)),
            ("source_cluster", _v(source.cluster_id)),
            ("hostname", _v(hostname)),
        )
        child = self.on_demand_dns_family.child(labels)
        self._on_demand[key] = (source, child)
        child.value += 1

    def socket_opened(self, reporter: str) -> Child:
        """An accepted socket (upstream ``record_socket_open``): ``istio_tcp_sockets_open{reporter}`` counts the
        TCP sockets the listeners accepted and have not closed yet: one per HBONE connection however many streams
        it carries, including one still in its TLS handshake or waiting for xDS, and none for the sockets ztunnel
        opens itself. ``reporter`` is ``source`` (15001, SOCKS5) or ``destination`` (15006, 15008). Returns the
        child; the caller takes 1 off its ``value`` when the socket closes (:class:`OpenSocket`)."""
        child = self._sockets.get(reporter)
        if child is None:
            child = self._sockets[reporter] = self.sockets_open.child((("reporter", reporter),))
        child.value += 1
        return child

    def socket_closed(self, reporter: str) -> None:
        """An accepted socket counted by :meth:`socket_opened` closed."""
        child = self._sockets.get(reporter)
        if child is None:
            child = self._sockets[reporter] = self.sockets_open.child((("reporter", reporter),))
        child.value -= 1

    def open(self, labels: Labels) -> ConnectionMetrics:
        """A connection with ``labels`` opened: counted, and its children kept for its bytes and its close."""
        series = self._series.get(id(labels))
        if series is None or series.labels is not labels:
            if len(self._series) >= _LABEL_CACHE_SIZE:
                self._series.clear()
            series = self._series[id(labels)] = _Series(
                labels, self.opened.child(labels), self.sent.child(labels), self.received.child(labels)
            )
        series.opened.value += 1
        return ConnectionMetrics(labels, series.sent, series.received, series)

    def flush(self, m: ConnectionMetrics, sent: int, received: int) -> None:
        m.sent.value += sent - m.counted_sent
        m.received.value += received - m.counted_received
        m.counted_sent, m.counted_received = sent, received

    def close(self, m: ConnectionMetrics, sent: int, received: int, flag: ResponseFlag) -> None:
        m.sent.value += sent - m.counted_sent
        m.received.value += received - m.counted_received
        m.counted_sent, m.counted_received = sent, received
        series = m.series
        if flag is ResponseFlag.NONE and series is not None:
            closed = series.closed
            if closed is None:
                closed = series.closed = self.closed.child(m.labels)
            closed.value += 1
            return
        labels = m.labels
        if flag is not ResponseFlag.NONE:
            labels = tuple((k, flag.value) if k == "response_flags" else (k, v) for k, v in labels)
            self.failed.child(labels).value += 1
        self.closed.child(labels).value += 1


class OpenSocket:
    """One accepted socket counted in ``istio_tcp_sockets_open`` until :meth:`closed` (idempotent: upstream's
    ``SocketCloseGuard``)."""

    __slots__ = ("_child",)

    def __init__(self, metrics: TrafficMetrics | None, reporter: str) -> None:
        self._child = metrics.socket_opened(reporter) if metrics is not None else None

    def closed(self) -> None:
        child, self._child = self._child, None
        if child is not None:
            child.value -= 1


class CrlMetrics:
    """Upstream's two CRL families (``proxy/metrics.rs``), label ``reporter``; counted by :mod:`ztunnel.crl`."""

    def __init__(self, registry: Registry) -> None:
        self.rejections = registry.family(
            "istio_crl_policy_rejections",
            "The total number of connections rejected due to CRL certificate revocation (unstable)",
        )
        self.untracked = registry.family(
            "istio_crl_untracked_connections",
            "The total number of connections not tracked for CRL enforcement (unstable)",
        )

    def rejected(self, reporter: str) -> None:
        self.rejections.child((("reporter", reporter),)).value += 1

    def untracked_connection(self, reporter: str) -> None:
        self.untracked.child((("reporter", reporter),)).value += 1


class MeteredConnection(Protocol):
    """What the flusher reads of a tracked connection (a ``ConnectionRecord``)."""

    @property
    def metrics(self) -> ConnectionMetrics | None: ...
    @property
    def bytes_sent(self) -> Callable[[], int]: ...
    @property
    def bytes_recv(self) -> Callable[[], int]: ...


async def flush_periodically(
    connections: Callable[[], Iterable[MeteredConnection]], metrics: TrafficMetrics, interval: float | None = None
) -> None:
    """Add the bytes of long-lived connections to the counters every ``interval`` seconds (``FLUSH_INTERVAL``, read
    when the flusher starts, so tests can shorten it). ``connections`` is asked afresh each time: the open
    connections of every proxy of the process (one in dedicated mode, one per pod in-pod)."""
    period = FLUSH_INTERVAL if interval is None else interval
    while True:
        await asyncio.sleep(period)
        for record in connections():
            if record.metrics is not None:
                metrics.flush(record.metrics, record.bytes_sent(), record.bytes_recv())
