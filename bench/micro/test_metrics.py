"""Metrics per connection: the labels computed once (``traffic_labels``), then ``TrafficMetrics.open`` and
``close`` (the four ``istio_tcp_*`` children looked up, counters updated), as the connection manager does."""

from __future__ import annotations

from pytest_benchmark.fixture import BenchmarkFixture

from bench.controlplane import generated_workloads
from ztunnel.metrics import Registry
from ztunnel.proxy.common import ResponseFlag
from ztunnel.proxy.metrics import TrafficMetrics, traffic_labels


def test_metrics_per_connection(benchmark: BenchmarkFixture) -> None:
    update = generated_workloads(20)
    src, dst = update.workloads[0], update.workloads[1]
    svc = update.services[1]
    service = (svc.hostname, svc.name, svc.namespace)
    metrics = TrafficMetrics(Registry())

    def per_connection() -> None:
        labels = traffic_labels("destination", src, None, dst, service, True, ResponseFlag.NONE)
        m = metrics.open(labels)
        metrics.close(m, 4096, 1024, ResponseFlag.NONE)

    benchmark(per_connection)
    assert (
        metrics.closed.child(traffic_labels("destination", src, None, dst, service, True, ResponseFlag.NONE)).value > 0
    )
