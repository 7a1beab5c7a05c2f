# mypy: disable-error-code="import-untyped"
"""Pin istio.workload field numbers and types against hand-encoded bytes (upstream proto/workload.proto)."""

from __future__ import annotations

import pytest
from google.protobuf import any_pb2, wrappers_pb2
from google.protobuf.message import Message

from tests.xds.wire import assert_wire, ld, packed, tag, varint, vint
from xds.istio.workload import workload_pb2 as w

IP4 = bytes([10, 0, 0, 5])
IP6 = bytes(15) + b"\x01"


def test_varint_helper_is_sane() -> None:
    assert varint(0) == b"\x00"
    assert varint(300) == b"\xac\x02"
    assert tag(20, 2) == b"\xa2\x01"
    assert varint(-1) == b"\xff" * 9 + b"\x01"


def test_workload_identity_and_addressing_fields() -> None:
    msg = w.Workload(
        uid="cluster1//v1/Pod/default/app",
        name="app",
        namespace="default",
        addresses=[IP4, IP6],
        hostname="",
        network="net1",
        tunnel_protocol=w.HBONE,
        trust_domain="td.local",
        service_account="sa1",
        node="node-a",
        cluster_id="cluster1",
    )
    expected = (
        ld(1, "app")
        + ld(2, "default")
        + ld(3, IP4)  # repeated bytes: one record per element, never packed
        + ld(3, IP6)
        + ld(4, "net1")
        + vint(5, 1)  # HBONE
        + ld(6, "td.local")
        + ld(7, "sa1")
        + ld(9, "node-a")
        + ld(18, "cluster1")
        + ld(20, "cluster1//v1/Pod/default/app")
    )
    assert expected.endswith(b"\xa2\x01\x1ccluster1//v1/Pod/default/app")  # uid is field 20 (two-byte tag)
    assert_wire(msg, expected)


def test_workload_hostname_and_tunnel_fields() -> None:
    msg = w.Workload(
        uid="u",
        hostname="db.example.com",
        tunnel_protocol=w.LEGACY_ISTIO_MTLS,
        native_tunnel=True,
        application_tunnel=w.ApplicationTunnel(protocol=w.ApplicationTunnel.PROXY, port=15088),
    )
    expected = vint(5, 2) + vint(14, 1) + ld(20, "u") + ld(21, "db.example.com") + ld(23, vint(1, 1) + vint(2, 15088))
    assert_wire(msg, expected)


def test_workload_gateways() -> None:
    waypoint = w.GatewayAddress(
        address=w.NetworkAddress(network="net1", address=IP4),
        hbone_mtls_port=15008,
    )
    gateway = w.GatewayAddress(
        hostname=w.NamespacedHostname(namespace="istio-system", hostname="eastwest.example.com"),
        hbone_mtls_port=15009,
    )
    msg = w.Workload(waypoint=waypoint, network_gateway=gateway)
    waypoint_bytes = ld(2, ld(1, "net1") + ld(2, IP4)) + vint(3, 15008)
    gateway_bytes = ld(1, ld(1, "istio-system") + ld(2, "eastwest.example.com")) + vint(3, 15009)
    assert_wire(msg, ld(8, waypoint_bytes) + ld(19, gateway_bytes))


def test_workload_telemetry_status_and_policy_fields() -> None:
    msg = w.Workload(
        canonical_name="reviews",
        canonical_revision="v2",
        workload_type=w.POD,
        workload_name="reviews-v2",
        authorization_policies=["default/allow-all", "default/deny-x"],
        status=w.UNHEALTHY,
        locality=w.Locality(region="r1", zone="z1", subzone="s1"),
        network_mode=w.HOST_NETWORK,
    )
    expected = (
        ld(10, "reviews")
        + ld(11, "v2")
        + vint(12, 2)  # POD
        + ld(13, "reviews-v2")
        + ld(16, "default/allow-all")
        + ld(16, "default/deny-x")
        + vint(17, 1)  # UNHEALTHY
        + ld(24, ld(1, "r1") + ld(2, "z1") + ld(3, "s1"))
        + vint(25, 1)  # HOST_NETWORK
    )
    assert_wire(msg, expected)


def test_workload_services_map_extensions_and_capacity() -> None:
    cfg = any_pb2.Any(type_url="type.googleapis.com/google.protobuf.StringValue", value=ld(1, "x"))
    msg = w.Workload(
        services={
            "default/reviews.default.svc.cluster.local": w.PortList(
                ports=[w.Port(service_port=9080, target_port=8080, app_protocol=w.HTTP2)]
            ),
            "default/a.default.svc.cluster.local": w.PortList(ports=[w.Port(service_port=80)]),
        },
        extensions=[w.Extension(name="ext", config=cfg)],
        capacity=wrappers_pb2.UInt32Value(value=3),
    )
    port_a = ld(1, vint(1, 80))
    port_reviews = ld(1, vint(1, 9080) + vint(2, 8080) + vint(3, 2))
    expected = (
        # map<string, PortList> = repeated entry{key = 1; value = 2}; deterministic output sorts keys
        ld(22, ld(1, "default/a.default.svc.cluster.local") + ld(2, port_a))
        + ld(22, ld(1, "default/reviews.default.svc.cluster.local") + ld(2, port_reviews))
        + ld(26, ld(1, "ext") + ld(2, ld(1, cfg.type_url) + ld(2, cfg.value)))
        + ld(27, vint(1, 3))
    )
    assert_wire(msg, expected)


def test_capacity_zero_is_distinguishable_from_unset() -> None:
    msg = w.Workload(capacity=wrappers_pb2.UInt32Value(value=0))
    assert_wire(msg, ld(27, b""))
    assert w.Workload.FromString(ld(27, b"")).HasField("capacity")
    assert not w.Workload.FromString(b"").HasField("capacity")


def test_service_fields() -> None:
    msg = w.Service(
        name="reviews",
        namespace="default",
        hostname="reviews.default.svc.cluster.local",
        addresses=[w.NetworkAddress(network="", address=IP4), w.NetworkAddress(network="n2", address=IP6)],
        ports=[w.Port(service_port=9080, target_port=9081, app_protocol=w.GRPC)],
        subject_alt_names=["spiffe://td/ns/default/sa/reviews"],
        waypoint=w.GatewayAddress(
            hostname=w.NamespacedHostname(namespace="default", hostname="waypoint.default.svc.cluster.local"),
            hbone_mtls_port=15008,
        ),
        load_balancing=w.LoadBalancing(
            routing_preference=[w.LoadBalancing.NETWORK, w.LoadBalancing.REGION, w.LoadBalancing.NODE],
            mode=w.LoadBalancing.FAILOVER,
            health_policy=w.LoadBalancing.ALLOW_ALL,
        ),
        ip_families=w.DUAL,
        canonical=True,
        ingress_use_waypoint=True,
        weighted_waypoints=[
            w.WeightedWaypoint(destination=w.GatewayAddress(hbone_mtls_port=15008), weight=90),
        ],
        visibility=w.Service.NAMESPACE,
    )
    expected = (
        ld(1, "reviews")
        + ld(2, "default")
        + ld(3, "reviews.default.svc.cluster.local")
        + ld(4, ld(2, IP4))
        + ld(4, ld(1, "n2") + ld(2, IP6))
        + ld(5, vint(1, 9080) + vint(2, 9081) + vint(3, 3))
        + ld(6, "spiffe://td/ns/default/sa/reviews")
        + ld(7, ld(1, ld(1, "default") + ld(2, "waypoint.default.svc.cluster.local")) + vint(3, 15008))
        + ld(8, packed(1, [6, 1, 4]) + vint(2, 2) + vint(3, 1))
        + vint(9, 3)
        + vint(11, 1)
        + vint(12, 1)
        + ld(13, ld(1, vint(3, 15008)) + vint(2, 90))
        + vint(14, 1)
    )
    assert_wire(msg, expected)


def test_network_address_length_has_presence() -> None:
    """``optional uint32 length = 3``: an explicit /0 is encoded, an unset length is not."""
    cidr0 = w.NetworkAddress(address=IP4, length=0)
    assert_wire(cidr0, ld(2, IP4) + vint(3, 0))
    assert w.NetworkAddress.FromString(ld(2, IP4) + vint(3, 0)).HasField("length")
    host = w.NetworkAddress(address=IP4)
    assert_wire(host, ld(2, IP4))
    assert not host.HasField("length")
    assert_wire(w.NetworkAddress(address=IP4, length=24), ld(2, IP4) + vint(3, 24))


def test_address_oneof() -> None:
    wl = w.Address(workload=w.Workload(uid="u1"))
    assert_wire(wl, ld(1, ld(20, "u1")))
    assert wl.WhichOneof("type") == "workload"
    svc = w.Address(service=w.Service(hostname="h"))
    assert_wire(svc, ld(2, ld(3, "h")))
    assert w.Address.FromString(ld(2, ld(3, "h"))).WhichOneof("type") == "service"
    # An empty workload is still "set" and encodes as a zero-length field 1.
    assert_wire(w.Address(workload=w.Workload()), ld(1, b""))


def test_reserved_numbers_are_declared() -> None:
    from google.protobuf import descriptor_pb2

    proto = descriptor_pb2.DescriptorProto()
    w.Workload.DESCRIPTOR.CopyToProto(proto)
    assert [(r.start, r.end) for r in proto.reserved_range] == [(15, 16)]
    assert 15 not in w.Workload.DESCRIPTOR.fields_by_number
    gw = descriptor_pb2.DescriptorProto()
    w.GatewayAddress.DESCRIPTOR.CopyToProto(gw)
    assert [(r.start, r.end) for r in gw.reserved_range] == [(4, 5)]
    assert list(gw.reserved_name) == ["hbone_single_tls_port"]


@pytest.mark.parametrize(
    ("message", "field", "number"),
    [
        (w.Port, "service_port", 1),
        (w.Port, "target_port", 2),
        (w.GatewayAddress, "hbone_mtls_port", 3),
        (w.ApplicationTunnel, "port", 2),
        (w.WeightedWaypoint, "weight", 2),
        (w.NetworkAddress, "length", 3),
    ],
)
def test_uint32_fields(message: type[Message], field: str, number: int) -> None:
    """uint32 exactly: 2**32-1 encodes as a plain 5-byte varint (int32 would reject it, sint32 would zigzag it)
    and 2**32 is out of range (uint64 would accept it)."""
    assert_wire(message(**{field: 0xFFFFFFFF}), vint(number, 0xFFFFFFFF))
    assert vint(number, 0xFFFFFFFF)[-5:] == b"\xff\xff\xff\xff\x0f"
    with pytest.raises(ValueError, match="out of range"):
        message(**{field: 1 << 32})
