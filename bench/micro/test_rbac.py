"""The inbound authorization check per connection: ``state.policies.plan`` (cached) + ``Plan.evaluate``.

Cases: the two-node example's two policies; 10,000 policies over 100 namespaces (100 apply to the destination);
10,000 policies in the destination's namespace (all apply, each on its own port: the plan's port index leaves ~10).
The allowing policy is always the last one in policy order. ``test_plan_compile`` is the cost after a policy change.
"""

from __future__ import annotations

import pytest
from pytest_benchmark.fixture import BenchmarkFixture

from bench.controlplane import rbac_state
from ztunnel.rbac import Plan


@pytest.mark.parametrize(
    ("n", "shape"),
    [(1, "spread"), (10_000, "spread"), (10_000, "one")],
    ids=["example", "10k-spread", "10k-one-namespace"],
)
def test_inbound_check(benchmark: BenchmarkFixture, n: int, shape: str) -> None:
    state, conn, ns = rbac_state(n, shape)

    def check() -> bool:
        return state.policies.plan(ns, ()).evaluate(conn).allowed

    benchmark.extra_info["policies_evaluated"] = len(state.policies.for_workload(ns, ()))
    assert benchmark(check)


@pytest.mark.parametrize(("n", "shape"), [(10_000, "spread"), (10_000, "one")], ids=["10k-spread", "10k-one-namespace"])
def test_plan_compile(benchmark: BenchmarkFixture, n: int, shape: str) -> None:
    state, conn, ns = rbac_state(n, shape)
    policies = state.policies.for_workload(ns, ())
    assert benchmark(lambda: Plan(policies)).evaluate(conn).allowed
