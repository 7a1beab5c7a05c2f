"""The DNS proxy's metrics are the project's own families (no prometheus-client in a worker), written exactly as the
prometheus-client ``Counter`` and ``Histogram`` families they replace: prometheus-client is the oracle here."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter
from prometheus_client import Histogram as PromHistogram

from tests.dns.helpers import sample_value
from ztunnel.dns.metrics import DURATION_BUCKETS, LABELS, DnsLabels, Metrics
from ztunnel.metrics import Metric, Registry, Sample, encode, render

CLIENT = DnsLabels("a", "udp", "client", "v1")
OTHER = DnsLabels("aaaa", "tcp")


def oracle() -> tuple[list[Metric], Metrics]:
    """The same traffic counted by prometheus-client (what the DNS metrics were) and by :class:`Metrics`."""
    reg = CollectorRegistry(auto_describe=True)
    requests = Counter("istio_dns_requests", "Total number of DNS requests (unstable)", LABELS, registry=reg)
    forwarded = Counter(
        "istio_dns_upstream_requests",
        "Total number of DNS requests forwarded to upstream (unstable)",
        LABELS,
        registry=reg,
    )
    failures = Counter(
        "istio_dns_upstream_failures",
        "Total number of DNS requests that failed to forward upstream (unstable)",
        LABELS,
        registry=reg,
    )
    duration = PromHistogram(
        "istio_dns_upstream_request_duration",
        "Total time in seconds Istio takes to get DNS response from upstream (unstable)",
        LABELS,
        unit="seconds",
        buckets=DURATION_BUCKETS,
        registry=reg,
    )
    ours = Metrics()
    for labels in (CLIENT, CLIENT, OTHER):
        requests.labels(*(v for _, v in labels.values())).inc()
        ours.request(labels)
    forwarded.labels(*(v for _, v in OTHER.values())).inc()
    ours.forwarded(OTHER)
    failures.labels(*(v for _, v in OTHER.values())).inc()
    ours.forward_failed(OTHER)
    for seconds in (0.0002, 0.003, 0.7, 9.0):
        duration.labels(*(v for _, v in OTHER.values())).observe(seconds)
        ours.forward_duration(OTHER, seconds)
    theirs: list[Metric] = []
    for m in reg.collect():
        mine = Metric(m.name, m.documentation, m.type, m.unit)
        mine.samples = [
            Sample(s.name, s.labels, s.value) for s in m.samples if not s.name.endswith("_created")
        ]  # upstream exports none
        theirs.append(mine)
    return theirs, ours


def test_the_dns_families_are_written_as_prometheus_client_wrote_them() -> None:
    theirs, ours = oracle()
    expected = render(theirs)[0]
    assert b'istio_dns_upstream_request_duration_seconds_bucket{request_query_type="aaaa"' in expected
    assert render(ours.collect())[0] == expected


def test_a_registry_writes_them_after_its_own_families() -> None:
    theirs, ours = oracle()
    registry = Registry("1.0")
    registry.extra.append(ours)
    body = encode(registry)[0].decode()
    assert body.index("istio_build") < body.index("istio_dns_requests_total")
    assert render(theirs)[0].decode().removesuffix("# EOF\n") in body


def test_unused_families_are_left_out() -> None:
    m = Metrics()
    assert render(m.collect())[0] == b"# EOF\n"
    m.request(CLIENT)
    labels = dict(zip(LABELS, ("a", "udp", "client", "v1"), strict=True))
    assert sample_value(m, "istio_dns_requests_total", labels) == 1
    assert sample_value(m, "istio_dns_upstream_requests_total", labels) is None
