"""The inbound authorization check per connection: ``state.policies.for_workload`` + ``rbac.evaluate``.

Cases: the two-node example's two policies; 10,000 policies over 100 namespaces (100 apply to the destination);
10,000 policies in the destination's namespace (all apply). The allowing policy is always the last one evaluated.
"""

from __future__ import annotations

import pytest
from pytest_benchmark.fixture import BenchmarkFixture

from bench.controlplane import rbac_state
from ztunnel.rbac import evaluate


@pytest.mark.parametrize(
    ("n", "shape"),
    [(1, "spread"), (10_000, "spread"), (10_000, "one")],
    ids=["example", "10k-spread", "10k-one-namespace"],
)
def test_inbound_check(benchmark: BenchmarkFixture, n: int, shape: str) -> None:
    state, conn, ns = rbac_state(n, shape)

    def check() -> bool:
        return evaluate(state.policies.for_workload(ns, ()), conn).allowed

    benchmark.extra_info["policies_evaluated"] = len(state.policies.for_workload(ns, ()))
    assert benchmark(check)
