"""The ``baggage`` header fuzzed (upstream fuzzes the same parser, ``fuzz/fuzz_targets/baggage.rs``).

Properties: any header value (or list of them) parses to a :class:`Baggage` without raising, the fields it takes
are stripped values of the items it recognises, the derived-source telemetry built from it never raises; and what
ztunnel encodes for a workload parses back to the same baggage.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from tests.fuzzing import fuzz_settings
from ztunnel import baggage
from ztunnel.baggage import Baggage
from ztunnel.identity.spiffe import Identity
from ztunnel.proxy.metrics import DerivedWorkload
from ztunnel.state.workload import Locality, Workload

KEYS = [
    "k8s.cluster.name",
    "k8s.namespace.name",
    "k8s.deployment.name",
    "k8s.cronjob.name",
    "k8s.pod.name",
    "k8s.job.name",
    "service.name",
    "service.version",
    "cloud.region",
    "cloud.availability_zone",
    "k8s.replicaset.name",
    "other",
]
items = st.one_of(
    st.builds(lambda k, v: f"{k}={v}", st.sampled_from(KEYS), st.text(max_size=12)),
    st.builds(lambda k, v, p: f" {k} = {v} ;{p}", st.sampled_from(KEYS), st.text(max_size=8), st.text(max_size=8)),
    st.text(max_size=16),
)
values = st.lists(items, max_size=8).map(",".join)


@fuzz_settings(1000)
@given(st.one_of(values, st.lists(values, max_size=3), st.text(max_size=100)))
def test_any_header_value_parses(value: str | list[str]) -> None:
    b = baggage.parse(value)
    for field in b.__slots__:
        v = getattr(b, field)
        assert v is None or (isinstance(v, str) and v == v.strip() and v)
    DerivedWorkload.from_baggage(b, Identity("cluster.local", "ns", "sa"))


# What a workload's own fields can hold without being cut by the format (upstream does not escape either).
safe = st.text("abcdefghijklmnopqrstuvwxyz0123456789-._/", min_size=0, max_size=12)


@fuzz_settings(1000)
@given(safe, safe, safe, safe, safe, safe, safe, st.sampled_from(["deployment", "cronjob", "pod", "job", ""]))
def test_encoded_workload_baggage_round_trips(
    cluster: str, ns: str, name: str, app: str, rev: str, region: str, zone: str, wtype: str
) -> None:
    w = Workload(
        uid="u",
        name="n",
        namespace=ns,
        cluster_id=cluster,
        workload_name=name,
        workload_type=wtype,
        canonical_name=app,
        canonical_revision=rev,
        locality=Locality(region=region, zone=zone),
    )
    header = baggage.workload_baggage(w)
    assert baggage.parse(header) == Baggage.of(w)
    assert baggage.parse([header, ""]) == Baggage.of(w)
