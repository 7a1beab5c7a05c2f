"""The ``baggage`` header (upstream ``baggage.rs``): encoding for a workload and parsing, with exact formats."""

from __future__ import annotations

import pytest

from ztunnel import baggage
from ztunnel.baggage import Baggage
from ztunnel.state.workload import Locality, Workload

FULL = Baggage(
    cluster_id="Kubernetes",
    namespace="default",
    workload_name="server",
    service_name="echo",
    revision="v1",
    region="eu-west1",
    zone="eu-west1-b",
)


def test_encode_full_in_upstream_key_order() -> None:
    assert baggage.encode(FULL, "deployment") == (
        "k8s.cluster.name=Kubernetes,k8s.namespace.name=default,k8s.deployment.name=server,service.name=echo,"
        "service.version=v1,cloud.region=eu-west1,cloud.availability_zone=eu-west1-b"
    )


@pytest.mark.parametrize("kind", ["deployment", "cronjob", "pod", "job"])
def test_encode_workload_type_names_the_key(kind: str) -> None:
    assert baggage.encode(Baggage(workload_name="w"), kind) == f"k8s.{kind}.name=w"


def test_encode_empty_workload_type_is_deployment() -> None:
    # xDS's WorkloadType defaults to DEPLOYMENT; a local config may leave it empty.
    assert baggage.encode(Baggage(workload_name="w"), "") == "k8s.deployment.name=w"


def test_encode_omits_empty_items() -> None:
    b = Baggage(cluster_id="", namespace="ns", workload_name=None, service_name="app", revision="", zone="z")
    assert baggage.encode(b, "deployment") == "k8s.namespace.name=ns,service.name=app,cloud.availability_zone=z"
    assert baggage.encode(Baggage(), "deployment") == ""


def test_workload_baggage_from_xds_fields() -> None:
    w = Workload(
        uid="u",
        name="server-7f9",
        namespace="default",
        cluster_id="Kubernetes",
        workload_name="server",
        workload_type="deployment",
        canonical_name="echo",
        canonical_revision="v1",
        locality=Locality(region="r1", zone="z1"),
    )
    expected = (
        "k8s.cluster.name=Kubernetes,k8s.namespace.name=default,k8s.deployment.name=server,service.name=echo,"
        "service.version=v1,cloud.region=r1,cloud.availability_zone=z1"
    )
    assert baggage.workload_baggage(w) == expected
    assert baggage.workload_baggage(w) is baggage.workload_baggage(w)  # cached per workload object
    # A replaced workload (a new object, as an xDS update makes) is encoded afresh, never served stale.
    moved = Workload(uid="u", name="server-7f9", namespace="other", workload_name="server", workload_type="job")
    assert baggage.workload_baggage(moved) == "k8s.namespace.name=other,k8s.job.name=server"


def test_parse_upstream_example() -> None:
    # upstream baggage.rs `baggage_parser`
    b = baggage.parse(
        "k8s.cluster.name=K1,k8s.namespace.name=NS1,k8s.deployment.name=N1,service.name=N2,service.version=V1"
    )
    assert b == Baggage(cluster_id="K1", namespace="NS1", workload_name="N1", service_name="N2", revision="V1")


def test_parse_empty_values_are_none() -> None:
    # upstream `baggage_parser_empty_values`
    b = baggage.parse("k8s.cluster.name=,k8s.namespace.name=,k8s.deployment.name=,service.name=,service.version=")
    assert b == Baggage()


@pytest.mark.parametrize("key", ["k8s.deployment.name", "k8s.cronjob.name", "k8s.pod.name", "k8s.job.name"])
def test_parse_every_workload_key(key: str) -> None:
    assert baggage.parse(f"{key}=w").workload_name == "w"


def test_parse_ignores_unknown_and_malformed_items_and_joins_values() -> None:
    b = baggage.parse(["k8s.replicaset.name=rs,garbage,,k8s.namespace.name=ns", "cloud.region=r,cloud.zone=nope"])
    assert b == Baggage(namespace="ns", region="r")
    assert baggage.parse("") == Baggage()
    # A later item for the same key wins (upstream overwrites as it walks the items).
    assert baggage.parse("service.name=a,service.name=b").service_name == "b"


def test_encode_parse_round_trip() -> None:
    assert baggage.parse(baggage.encode(FULL, "cronjob")) == FULL
    assert baggage.parse(baggage.encode(Baggage(namespace="ns", zone="z"), "pod")) == Baggage(namespace="ns", zone="z")


def test_one_header_value_is_parsed_once() -> None:
    """Every connection from a workload carries the same header: the same (immutable) Baggage comes back without
    parsing again; a value longer than the cache takes (512 characters) is parsed each time, with the same result."""
    from ztunnel import baggage

    value = "k8s.cluster.name=c1,k8s.namespace.name=ns1,k8s.deployment.name=w1,service.name=s1,service.version=v1"
    first = baggage.parse(value)
    assert first.namespace == "ns1" and first.workload_name == "w1"
    assert baggage.parse(value) is first
    long_value = value + ",x=" + "y" * 600
    assert baggage.parse(long_value) == first and baggage.parse(long_value) is not baggage.parse(long_value)
    assert baggage.parse([value]) == first
