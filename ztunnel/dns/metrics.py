"""DNS proxy metrics, as upstream ``dns/metrics.rs``: requests, upstream (forwarded) requests, failures, latency.

All four are unstable upstream, so their HELP text says "(unstable)". Labels are upstream's ``DnsLabels``, in its
order: ``request_query_type`` (lowercase, ``a``), ``request_protocol`` (``udp``/``tcp``),
``source_canonical_service`` and ``source_canonical_revision`` (``unknown`` when empty or the client is unknown).
There is deliberately no hostname or destination label (upstream #932/#936: unbounded cardinality). For the same
reason a query type dnspython does not know (a client can send all 65,536 values) is reported as ``unknown``
rather than as ``type65280``.

The families are the project's own (:class:`ztunnel.metrics.Family`, a bare number per label set), not
prometheus-client's: a data-plane worker runs the DNS proxy, and prometheus-client would be 2.1 MiB of objects in
every worker (docs/process-model.md, "A worker's idle memory"). They are written out by the stats server (15020)
next to the proxy's (the owner appends the :class:`Metrics` to its registry's ``extra`` collectors), with the
names, labels, HELP text and values prometheus-client's ``Counter`` and ``Histogram`` gave them, without the
``_created`` samples (upstream exports none). Children are cached per label set: the label sets are few (one client
workload per proxy, a handful of query types, two protocols).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import dns.rdatatype

from ztunnel.metrics import Child, Family, Histogram, Labels, Metric
from ztunnel.state.workload import Workload

LABELS = ("request_query_type", "request_protocol", "source_canonical_service", "source_canonical_revision")
# Upstream's buckets for the forwarding latency, in seconds.
DURATION_BUCKETS = (0.0005, 0.001, 0.01, 0.1, 1.0, 5.0)
UNKNOWN = "unknown"


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

    def values(self) -> Labels:
        """The label pairs, in upstream's order."""
        return (
            ("request_query_type", self.request_query_type),
            ("request_protocol", self.request_protocol),
            ("source_canonical_service", self.source_canonical_service),
            ("source_canonical_revision", self.source_canonical_revision),
        )


class Metrics:
    """``istio_dns_requests_total``, ``istio_dns_upstream_requests_total``, ``istio_dns_upstream_failures_total``
    and ``istio_dns_upstream_request_duration_seconds``: a collector (:meth:`collect`) for a registry's ``extra``."""

    # Label sets are bounded in practice; the cap only guards against a misbehaving caller.
    _MAX_CACHED = 4096

    def __init__(self) -> None:
        self.requests = Family("istio_dns_requests", "Total number of DNS requests (unstable)")
        self.forwarded_requests = Family(
            "istio_dns_upstream_requests", "Total number of DNS requests forwarded to upstream (unstable)"
        )
        self.forwarded_failures = Family(
            "istio_dns_upstream_failures", "Total number of DNS requests that failed to forward upstream (unstable)"
        )
        self.forwarded_duration = Histogram(
            "istio_dns_upstream_request_duration",
            "Total time in seconds Istio takes to get DNS response from upstream (unstable)",
            DURATION_BUCKETS,
            unit="seconds",
        )
        # Children are created on first use, as upstream's families do: a label set that was only ever answered
        # locally has no upstream series at all (not a zero one).
        self._requests: dict[DnsLabels, Child] = {}
        self._forwarded: dict[DnsLabels, Child] = {}
        self._failures: dict[DnsLabels, Child] = {}
        self._durations: dict[DnsLabels, Labels] = {}  # the histogram's key per label set, made once

    def collect(self) -> Iterator[Metric]:
        """The four families, in registration order (empty ones too: the writer leaves them out)."""
        for f in (self.requests, self.forwarded_requests, self.forwarded_failures, self.forwarded_duration):
            yield f.metric()

    def _child(self, cache: dict[DnsLabels, Child], family: Family, labels: DnsLabels) -> Child:
        c = cache.get(labels)
        if c is None:
            if len(cache) >= self._MAX_CACHED:
                cache.clear()
            c = cache[labels] = family.child(labels.values())
        return c

    def request(self, labels: DnsLabels) -> None:
        """A request answered here, forwarded, or refused for an unknown client."""
        self._child(self._requests, self.requests, labels).value += 1

    def forwarded(self, labels: DnsLabels) -> None:
        self._child(self._forwarded, self.forwarded_requests, labels).value += 1

    def forward_failed(self, labels: DnsLabels) -> None:
        self._child(self._failures, self.forwarded_failures, labels).value += 1

    def forward_duration(self, labels: DnsLabels, seconds: float) -> None:
        key = self._durations.get(labels)
        if key is None:
            if len(self._durations) >= self._MAX_CACHED:
                self._durations.clear()
            key = self._durations[labels] = labels.values()
        self.forwarded_duration.observe(key, seconds)
