"""DNS proxy metrics, as upstream ``dns/metrics.rs``: requests, upstream (forwarded) requests, failures, latency.

All four are unstable upstream, so their HELP text says "(unstable)". Labels are upstream's ``DnsLabels``, in its
order: ``request_query_type`` (lowercase, ``a``), ``request_protocol`` (``udp``/``tcp``),
``source_canonical_service`` and ``source_canonical_revision`` (``unknown`` when empty or the client is unknown).
There is deliberately no hostname or destination label (upstream #932/#936: unbounded cardinality). For the same
reason a query type dnspython does not know (a client can send all 65,536 values) is reported as ``unknown``
rather than as ``type65280``.

The metrics register into a prometheus-client ``CollectorRegistry`` handed in by the caller, so the stats server
(15020) can expose them next to the proxy's. Label children are cached per label set: prometheus-client's
``labels(...)`` costs ~5 µs and a cached child's ``inc()`` ~0.3 µs, and the label sets are few (one client
workload per proxy, a handful of query types, two protocols).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import dns.rdatatype
from prometheus_client import CollectorRegistry, Counter, Histogram

from ztunnel.state.workload import Workload

LABELS = ("request_query_type", "request_protocol", "source_canonical_service", "source_canonical_revision")
# Upstream's buckets for the forwarding latency, in seconds.
DURATION_BUCKETS = (0.0005, 0.001, 0.01, 0.1, 1.0, 5.0)
UNKNOWN = "unknown"
_M = TypeVar("_M", Counter, Histogram)


def query_type_label(rdtype: int) -> str:
    """``a``, ``aaaa``, ``srv``...; ``unknown`` for types dnspython has no name for (bounded cardinality)."""
    try:
        text = dns.rdatatype.to_text(dns.rdatatype.RdataType(rdtype))
    except ValueError:
        return UNKNOWN
    return UNKNOWN if text.startswith("TYPE") else text.lower()


@dataclass(frozen=True, slots=True)
class DnsLabels:
    """One label set. Build with :meth:`of`; hashable, so it keys the child cache."""

    request_query_type: str
    request_protocol: str
    source_canonical_service: str = UNKNOWN
    source_canonical_revision: str = UNKNOWN

    @classmethod
    def of(cls, rdtype: int | None, protocol: str, source: Workload | None) -> DnsLabels:
        qtype = UNKNOWN if rdtype is None else query_type_label(rdtype)
        if source is None:
            return cls(qtype, protocol)
        return cls(qtype, protocol, source.canonical_name or UNKNOWN, source.canonical_revision or UNKNOWN)

    def values(self) -> tuple[str, str, str, str]:
        return (
            self.request_query_type,
            self.request_protocol,
            self.source_canonical_service,
            self.source_canonical_revision,
        )


class Metrics:
    """``istio_dns_requests_total``, ``istio_dns_upstream_requests_total``, ``istio_dns_upstream_failures_total``
    and ``istio_dns_upstream_request_duration_seconds``, registered into ``registry``."""

    # Label sets are bounded in practice; the cap only guards against a misbehaving caller.
    _MAX_CACHED = 4096

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        reg = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.registry = reg
        self.requests = Counter("istio_dns_requests", "Total number of DNS requests (unstable)", LABELS, registry=reg)
        self.forwarded_requests = Counter(
            "istio_dns_upstream_requests",
            "Total number of DNS requests forwarded to upstream (unstable)",
            LABELS,
            registry=reg,
        )
        self.forwarded_failures = Counter(
            "istio_dns_upstream_failures",
            "Total number of DNS requests that failed to forward upstream (unstable)",
            LABELS,
            registry=reg,
        )
        self.forwarded_duration = Histogram(
            "istio_dns_upstream_request_duration",
            "Total time in seconds Istio takes to get DNS response from upstream (unstable)",
            LABELS,
            unit="seconds",
            buckets=DURATION_BUCKETS,
            registry=reg,
        )
        # Children are created on first use, as upstream's families do: a label set that was only ever answered
        # locally has no upstream series at all (not a zero one).
        self._requests: dict[DnsLabels, Counter] = {}
        self._forwarded: dict[DnsLabels, Counter] = {}
        self._failures: dict[DnsLabels, Counter] = {}
        self._durations: dict[DnsLabels, Histogram] = {}

    def _child(self, cache: dict[DnsLabels, _M], family: _M, labels: DnsLabels) -> _M:
        c = cache.get(labels)
        if c is None:
            if len(cache) >= self._MAX_CACHED:
                cache.clear()
            c = cache[labels] = family.labels(*labels.values())
        return c

    def request(self, labels: DnsLabels) -> None:
        """A request answered here, forwarded, or refused for an unknown client."""
        self._child(self._requests, self.requests, labels).inc()

    def forwarded(self, labels: DnsLabels) -> None:
        self._child(self._forwarded, self.forwarded_requests, labels).inc()

    def forward_failed(self, labels: DnsLabels) -> None:
        self._child(self._failures, self.forwarded_failures, labels).inc()

    def forward_duration(self, labels: DnsLabels, seconds: float) -> None:
        self._child(self._durations, self.forwarded_duration, labels).observe(seconds)
