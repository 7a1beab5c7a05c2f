# mypy: disable-error-code="import-untyped"
"""Pin envoy.service.discovery.v3, envoy.config.core.v3 and istio.workload.zds against hand-encoded bytes."""

from __future__ import annotations

from google.protobuf import any_pb2, duration_pb2, struct_pb2
from google.rpc import status_pb2

from tests.xds.wire import assert_wire, ld, vint
from xds.envoy.config.core.v3 import base_pb2 as core
from xds.envoy.service.discovery.v3 import discovery_pb2 as disc
from xds.istio.workload import workload_pb2
from xds.istio.workload.zds import zds_pb2 as zds

ADDRESS_URL = "type.googleapis.com/istio.workload.Address"


def test_node_fields() -> None:
    metadata = struct_pb2.Struct()
    metadata["NAME"] = "ztunnel-abc"
    node = core.Node(
        id="ztunnel~10.0.0.1~ztunnel-abc.istio-system~istio-system.svc.cluster.local",
        cluster="c1",
        metadata=metadata,
        locality=core.Locality(region="r", zone="z", sub_zone="s"),
        user_agent_name="ztunnel",
        user_agent_version="1.0",
        client_features=["f1", "f2"],
    )
    expected = (
        ld(1, "ztunnel~10.0.0.1~ztunnel-abc.istio-system~istio-system.svc.cluster.local")
        + ld(2, "c1")
        + ld(3, ld(1, ld(1, "NAME") + ld(2, ld(3, "ztunnel-abc"))))
        + ld(4, ld(1, "r") + ld(2, "z") + ld(3, "s"))
        + ld(6, "ztunnel")
        + ld(7, "1.0")
        + ld(10, "f1")
        + ld(10, "f2")
    )
    assert_wire(node, expected)
    assert 5 not in core.Node.DESCRIPTOR.fields_by_number  # Envoy v3 reserves 5 (v2 build_version)


def test_delta_request_initial() -> None:
    msg = disc.DeltaDiscoveryRequest(
        node=core.Node(id="n"),
        type_url=ADDRESS_URL,
        resource_names_subscribe=["*"],
        resource_names_unsubscribe=["*"],
        initial_resource_versions={"cluster1//v1/Pod/default/b": "", "cluster1//v1/Pod/default/a": "v1"},
    )
    expected = (
        ld(1, ld(1, "n"))
        + ld(2, ADDRESS_URL)
        + ld(3, "*")
        + ld(4, "*")
        # map<string, string>: entry{key = 1; value = 2}, sorted by key when deterministic;
        # map entries always carry both fields, even an empty value
        + ld(5, ld(1, "cluster1//v1/Pod/default/a") + ld(2, "v1"))
        + ld(5, ld(1, "cluster1//v1/Pod/default/b") + ld(2, ""))
    )
    assert_wire(msg, expected)
    # A peer may omit an empty value inside the entry; it still decodes.
    terse = disc.DeltaDiscoveryRequest.FromString(ld(5, ld(1, "k")))
    assert dict(terse.initial_resource_versions) == {"k": ""}


def test_delta_request_nack() -> None:
    msg = disc.DeltaDiscoveryRequest(
        type_url="type.googleapis.com/istio.security.Authorization",
        response_nonce="nonce-7",
        error_detail=status_pb2.Status(code=13, message="ns/p: bad"),
    )
    expected = (
        ld(2, "type.googleapis.com/istio.security.Authorization")
        + ld(6, "nonce-7")
        + ld(7, vint(1, 13) + ld(2, "ns/p: bad"))  # google.rpc.Status{code = 1; message = 2}
    )
    assert_wire(msg, expected)
    # An ACK is a request with only the nonce: error_detail absent.
    ack = disc.DeltaDiscoveryRequest.FromString(ld(6, "nonce-7"))
    assert not ack.HasField("error_detail")


def test_delta_response_and_resource() -> None:
    payload = workload_pb2.Address(workload=workload_pb2.Workload(uid="u1")).SerializeToString()
    resource = disc.Resource(
        version="v3",
        resource=any_pb2.Any(type_url=ADDRESS_URL, value=payload),
        name="u1",
        aliases=["/10.0.0.5"],
        ttl=duration_pb2.Duration(seconds=30),
        cache_control=disc.Resource.CacheControl(do_not_cache=True),
    )
    resource_bytes = (
        ld(1, "v3")
        + ld(2, ld(1, ADDRESS_URL) + ld(2, payload))
        + ld(3, "u1")
        + ld(4, "/10.0.0.5")
        + ld(6, vint(1, 30))
        + ld(7, vint(1, 1))
    )
    assert_wire(resource, resource_bytes)
    msg = disc.DeltaDiscoveryResponse(
        system_version_info="sv",
        resources=[resource],
        type_url=ADDRESS_URL,
        nonce="n1",
        removed_resources=["gone"],
    )
    expected = ld(1, "sv") + ld(2, resource_bytes) + ld(4, ADDRESS_URL) + ld(5, "n1") + ld(6, "gone")
    assert_wire(msg, expected)
    # The embedded Any unpacks into the generated Address type.
    parsed = disc.DeltaDiscoveryResponse.FromString(expected)
    address = workload_pb2.Address()
    assert parsed.resources[0].resource.Unpack(address)
    assert address.workload.uid == "u1"


def test_sotw_request_and_response() -> None:
    req = disc.DiscoveryRequest(
        version_info="v1",
        node=core.Node(id="n"),
        resource_names=["a", "b"],
        type_url=ADDRESS_URL,
        response_nonce="x",
        error_detail=status_pb2.Status(message="m"),
    )
    assert_wire(
        req,
        ld(1, "v1") + ld(2, ld(1, "n")) + ld(3, "a") + ld(3, "b") + ld(4, ADDRESS_URL) + ld(5, "x") + ld(6, ld(2, "m")),
    )
    resp = disc.DiscoveryResponse(
        version_info="v2",
        resources=[any_pb2.Any(type_url=ADDRESS_URL, value=b"")],
        canary=True,
        type_url=ADDRESS_URL,
        nonce="y",
    )
    assert_wire(resp, ld(1, "v2") + ld(2, ld(1, ADDRESS_URL)) + vint(3, 1) + ld(4, ADDRESS_URL) + ld(5, "y"))


def test_newer_envoy_fields_are_skipped_not_fatal() -> None:
    """A server may send fields we do not model (e.g. DeltaDiscoveryResponse.control_plane = 7)."""
    data = ld(5, "n1") + ld(7, ld(1, "istiod-1"))
    msg = disc.DeltaDiscoveryResponse.FromString(data)
    assert msg.nonce == "n1"


def test_zds_hello() -> None:
    assert_wire(zds.ZdsHello(version=zds.V1), b"\x08\x01")
    assert zds.NOT_USED == 0


def test_zds_add() -> None:
    msg = zds.WorkloadRequest(
        add=zds.AddWorkload(
            uid="pod-uid-1",
            workload_info=zds.WorkloadInfo(name="app", namespace="default", service_account="sa"),
        )
    )
    expected = ld(1, ld(1, "pod-uid-1") + ld(2, ld(1, "app") + ld(2, "default") + ld(3, "sa")))
    assert_wire(msg, expected)
    assert msg.WhichOneof("payload") == "add"


def test_zds_keep_del_snapshot() -> None:
    keep = zds.WorkloadRequest(keep=zds.KeepWorkload(uid="k"))
    assert_wire(keep, ld(5, ld(1, "k")))
    # `del` is a Python keyword: the field exists at runtime but only via getattr (the .pyi omits it).
    delete = zds.WorkloadRequest()
    getattr(delete, "del").CopyFrom(zds.DelWorkload(uid="d"))
    assert_wire(delete, ld(2, ld(2, "d")))  # DelWorkload.uid is field 2
    parsed = zds.WorkloadRequest.FromString(ld(2, ld(2, "d")))
    assert parsed.WhichOneof("payload") == "del"
    assert getattr(parsed, "del").uid == "d"
    snap = zds.WorkloadRequest(snapshot_sent=zds.SnapshotSent())
    assert_wire(snap, b"\x1a\x00")
    assert zds.WorkloadRequest.FromString(b"\x1a\x00").WhichOneof("payload") == "snapshot_sent"


def test_zds_ack_nack() -> None:
    ack = zds.WorkloadResponse(ack=zds.Ack())
    assert_wire(ack, b"\x0a\x00")
    nack = zds.WorkloadResponse(ack=zds.Ack(error="failed to start proxy"))
    assert_wire(nack, ld(1, ld(1, "failed to start proxy")))
